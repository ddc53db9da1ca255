"""Meshes and sharding in types: which mesh axes an array is typed on (Explicit, Auto),
and running a function with Explicit axes switched to Auto. Public JAX APIs only
(``jax.typeof``, ``jax.sharding``): the internals stay in compat."""

from __future__ import annotations

import jax


def explicit_mesh_axes(arrays):
    """(abstract mesh, axes) of the Explicit-mode axes of the mesh the arrays are typed on
    (sharded over them or not), else of the mesh in context (``jax.set_mesh``), or None.
    Every Explicit axis of the mesh, not only those the arrays are split over: the loss may
    annotate values with any of them (explicit.py)."""
    meshes = [abstract_mesh_of(x) for x in arrays]
    meshes.append(_context_mesh())
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    for mesh in meshes:
        if mesh is None:
            continue
        axes = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == explicit)
        if axes:
            return mesh, axes
    return None


def _context_mesh():
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    if not getattr(mesh, "axis_names", ()) or not hasattr(mesh, "axis_types"):
        return None
    return mesh


def in_auto_mode(fn, args, mesh, axes):
    """Runs ``fn(*args)`` with the Explicit mesh ``axes`` switched to Auto; outputs replicated."""
    from jax.sharding import PartitionSpec

    with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
        return jax.sharding.auto_axes(fn, axes=axes, out_sharding=PartitionSpec())(*args)


def abstract_mesh_of(x):
    """The (abstract) mesh ``x`` is typed on, or None (no mesh, or an empty one)."""
    try:
        mesh = jax.typeof(x).sharding.mesh
    except Exception:  # noqa: BLE001
        return None
    if not getattr(mesh, "axis_names", ()) or not hasattr(mesh, "axis_types"):
        return None
    return mesh


def is_auto(axis_type) -> bool:
    """An axis type XLA's partitioner decides (Auto: not Explicit, not Manual)."""
    return axis_type == getattr(jax.sharding.AxisType, "Auto", None)

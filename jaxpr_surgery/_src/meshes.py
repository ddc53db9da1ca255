"""Meshes and sharding in types: which mesh axes an array is typed on (Explicit, Auto),
and running a function with Explicit axes switched to Auto. Public JAX APIs only
(``jax.typeof``, ``jax.sharding``): the internals stay in compat."""

from __future__ import annotations

import jax


def explicit_axes(x) -> tuple:
    """Mesh axes of ``x``'s sharding that are in Explicit mode (sharding-in-types)."""
    try:
        sharding = jax.typeof(x).sharding
    except Exception:  # noqa: BLE001
        return ()
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or not hasattr(mesh, "axis_types"):
        return ()
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    out = []
    for entry in spec:
        for a in entry if isinstance(entry, tuple) else (entry,):
            if a is not None and types.get(a) == explicit:
                out.append(a)
    return tuple(out)


def explicit_mesh_axes(arrays):
    """(abstract mesh, axes) of the Explicit-mode mesh axes the arrays are sharded over, or None."""
    axes, mesh = set(), None
    for x in arrays:
        ax = explicit_axes(x)
        if ax:
            axes.update(ax)
            mesh = jax.typeof(x).sharding.mesh
    return (mesh, tuple(sorted(axes))) if axes else None


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

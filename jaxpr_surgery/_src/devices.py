"""The batch split by device under XLA's partitioner (``jax.jit`` with shardings).

Under ``jax.jit`` with sharded inputs the program is one global computation that
XLA partitions. Loops over examples (tiles of per-example gradients, chunks of
the batch) slice the batch axis, which XLA cannot slice where it is sharded: it
gathers the whole batch onto every device instead, and the statistic moves many
times grad's bytes (docs/howto/sharded.md). Here the batch ``[B, ...]`` is seen as
``[D, B/D, ...]``, ``D`` a multiple of the number of devices it can be sharded over,
and the call runs under ``jax.vmap`` over ``D`` with a private axis name, as under
``shard_map`` with ``axis_name``: every loop runs within one device's examples (a
chunk or tile takes examples from every device at once) and the reductions are
combined across ``D`` (`Reduction.combine_axis`: sums by ``psum``, centred moments
merged), which XLA lowers to grad's own reduce-scatter or all-reduce. Per-example
values come back in the batch's order. Loops over blocks of a weight's features
are strided over the devices while the split is traced (`cuts.split_over`), so
that a block takes a share of every device's piece of an axis XLA splits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, cuts, meshes, segments, walker

AXIS = "jaxpr_surgery:devices"  # the vmap axis of the split (never a user's axis name)


class BatchConstraints(NamedTuple):
    """What the sharding constraints of a per-example jaxpr name (`release_unit_constraints`):
    ``unit_axes``, the mesh axes named on an example's axis of size one (a tuple per
    constraint and axis); ``other_axes``, those named on other axes; ``sizes``, each mesh
    axis's size."""

    unit_axes: frozenset = frozenset()
    other_axes: frozenset = frozenset()
    sizes: tuple = ()


def release_unit_constraints(closed, examples=None):
    """``(closed', found)``: ``closed`` (a per-example ``ClosedJaxpr``) with every sharding
    constraint's axes of size one that name mesh axes left unconstrained, at any depth
    (`compat.constraint_unit_release`; a unit axis holds one value however it is placed),
    and what the constraints named (`BatchConstraints`). ``examples``: the positions of
    the jaxpr's inputs that hold the example; only a constraint on a value computed from
    them names the batch's axes in ``found.unit_axes`` (inside a call or loop that reads
    one, every constraint does); None: every constraint."""
    unit, other, sizes = set(), set(), {}

    def walk(jaxpr, dep):  # dep: the variables computed from the example, or True: all
        def step(eqn):
            on = dep is True or any(v in dep for v in eqn.invars
                                    if not isinstance(v, compat.Literal))
            if on and dep is not True:
                dep.update(eqn.outvars)
            r = compat.constraint_unit_release(eqn)
            if r is None:
                return compat.map_subjaxprs(eqn, lambda j: walk(j, True if on else set()))
            if on:
                unit.update(r.unit_axes)
            other.update(r.other_axes)
            sizes.update(r.sizes)
            return eqn if r.params is None else eqn.replace(params=r.params)

        return walker.rewrite(jaxpr, step)

    invars = closed.jaxpr.invars
    new = walk(closed.jaxpr, True if examples is None else {invars[i] for i in examples})
    found = BatchConstraints(frozenset(unit), frozenset(other), tuple(sorted(sizes.items())))
    return (closed if new is closed.jaxpr else compat.ClosedJaxpr(new, closed.consts)), found


def spmd_axes(found: BatchConstraints | None, D: int):
    """The mesh axes the split's ``D`` parts go on (``vmap``'s ``spmd_axis_name``): those
    the per-example jaxpr's sharding constraints name on an example's unit axis, where
    they all name the same ones, none names them on another axis, and their devices
    divide ``D``; else None (the parts are placed by XLA's propagation alone)."""
    if found is None or len(found.unit_axes) != 1:
        return None
    (axes,) = found.unit_axes
    if set(axes) & found.other_axes:
        return None
    sizes = dict(found.sizes)
    if any(a not in sizes for a in axes) or D % math.prod(sizes[a] for a in axes):
        return None
    return tuple(axes)


def part_options(opts, D: int):
    """``opts`` for one of ``D`` parts: combined across the split's axis, ``chunk_size``
    (examples at once over the whole batch) divided among the parts, the examples'
    independence proved once on the whole batch (`split_call`'s caller)."""
    cs = opts.chunk_size
    if isinstance(cs, (int, np.integer)) and not isinstance(cs, bool):
        cs = max(1, int(cs) // D)
    return dataclasses.replace(opts, axis_name=AXIS, chunk_size=cs, check=False)


def _auto_sizes(x) -> dict:
    """``{axis name: size}`` of the Auto axes of the mesh ``x`` is typed on ({} without a
    mesh, inside ``shard_map`` or for Explicit axes)."""
    mesh = meshes.abstract_mesh_of(x)
    if mesh is None:
        return {}
    return {n: s for n, s, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
            if meshes.is_auto(t)}


def auto_mesh_size(arrays) -> int:
    """The number of devices of the mesh that ``arrays`` are typed on whose axes XLA
    partitions (Auto; 1 without a mesh, inside ``shard_map`` or for Explicit axes)."""
    return max([1] + [math.prod(_auto_sizes(x).values()) for x in arrays])


def auto_axes(arrays) -> tuple:
    """The Auto axes of more than one device of the meshes ``arrays`` are typed on."""
    out = []
    for x in arrays:
        out += [n for n, s in _auto_sizes(x).items() if s > 1 and n not in out]
    return tuple(out)


def split_count(prep, opts) -> int:
    """``D`` for this call (1: no split): under an Auto mesh of more than one device,
    without ``axis_name``, outside ``shard_map`` and without Explicit axes (a call on
    Explicit axes decides inside Auto mode, on its arguments switched there: api.py),
    the largest divisor of the batch size that divides the mesh's size. `explain`
    reports the call's parts by this."""
    if opts.axis_name is not None or prep.data_axes or prep.B < 2 or prep.explicit:
        return 1
    n = auto_mesh_size([*prep.ex_leaves, *prep.diff_leaves])
    return math.gcd(prep.B, n) if n > 1 else 1


def recomputes(prep, D: int) -> bool:
    """Whether a clipped sum under this split recomputes its scan layers' inner values
    (segments.py): unless the model's sharding constraints put its examples on every
    mesh axis (FSDP, where the recompute would gather the weights once more and no axis
    holds an example's values whole). Without constraints the placement is XLA's, unseen
    while tracing: recomputed (tensor parallelism's memory bounded; under FSDP the
    weights gathered once more)."""
    axes = spmd_axes(prep.batch_constraints(), D)
    return axes is None or not set(auto_axes([*prep.ex_leaves, *prep.diff_leaves])) <= set(axes)


def split_run(prep, call, args, spec, D: int):
    """`split_call` of ``call`` for the `arguments.Prepared` call ``prep`` over ``D``
    parts: one example traced first (the parts' ``call`` reuses it: `Prepared.traces`;
    no leaf is traced varying, there being no ``shard_map`` axes under a split),
    the parts on the mesh axes its sharding constraints put the examples on
    (`spmd_axes`). A constraint traced later, in a custom_vjp's backward rule, that names
    those axes too (jax refuses it under ``spmd_axis_name``) runs the split again with
    the parts placed by XLA's propagation alone."""
    axes = spmd_axes(prep.batch_constraints(), D)
    worth = recomputes(prep, D)

    def run(axes):
        with segments.worth_it(worth):
            return split_call(call, args, spec, prep.batch_argnums, prep.B, D, axes)

    if axes is None:
        return run(None)
    try:
        return run(axes)
    except ValueError as e:
        if not compat.is_spmd_axis_conflict(e):
            raise
        return run(None)


def split_call(call, args, spec, batch_argnums, B: int, D: int, axes=None):
    """``call(args, spec)`` (an entry point's body on a `Prepared` of ``args``) over
    ``D`` parts of the batch under ``jax.vmap`` with axis name `AXIS`; values combined
    across the parts (the same for every part) come back once, per-example ones (a
    part's own) in the batch's order. ``axes``: the mesh axes the model's sharding
    constraints put the parts on (`spmd_axes`), or None."""
    args = list(args)
    split = lambda x: jnp.reshape(x, (D, B // D) + jnp.shape(x)[1:])  # noqa: E731
    parts = [jax.tree.map(split, args[i]) for i in batch_argnums]
    w = None if spec is None else split(jnp.asarray(spec[1]))
    mapped = []

    def one(parts, w):
        a = list(args)
        for i, p in zip(batch_argnums, parts):
            a[i] = p
        out = call(tuple(a), None if spec is None else (spec[0], w))
        mapped[:] = [compat.mapped_over(x, AXIS) for x in jax.tree.leaves(out)]
        return out

    with cuts.split_over(D, AXIS):  # (feature blocks strided: cuts.py)
        spmd = {} if axes is None else {"spmd_axis_name": axes}
        out = jax.vmap(one, in_axes=(0, None if w is None else 0), axis_name=AXIS,
                       **spmd)(parts, w)
    leaves, tree = jax.tree.flatten(out)
    leaves = [x.reshape((B,) + x.shape[2:]) if m else x[0] for x, m in zip(leaves, mapped)]
    return jax.tree.unflatten(tree, leaves)

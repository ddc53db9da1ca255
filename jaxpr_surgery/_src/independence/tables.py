"""The independence proof's rule tables, keyed by primitive objects, and the rules that
line values up with the batch (`tags.Lined`).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpr_surgery._src import compat, walker
from jaxpr_surgery._src.independence.control import (
    _collective,
    _cond,
    _conv,
    _dot_general,
    _gather,
    _moving,
    _once,
    _reduce_window,
    _scan,
    _scatter,
    _shard_map,
    _while,
)
from jaxpr_surgery._src.independence.layout import (
    _batched_core,
    _broadcast,
    _concatenate,
    _cumulative,
    _dynamic_slice,
    _dynamic_update_slice,
    _elementwise,
    _identity,
    _pad,
    _reduce,
    _reshape,
    _rev,
    _slice,
    _sort,
    _split,
    _squeeze,
    _stack,
    _tile,
    _top_k,
    _transpose,
    _unstack,
)
from jaxpr_surgery._src.independence.tags import Ex, Lined, P, _shape, reshape_axis


# --------------------------------------------------------------------------- #
# Tables (keyed by primitive objects; names absent from this jax are skipped)
# --------------------------------------------------------------------------- #
def _table(entries):
    out = {}
    for prims_, rule in entries:
        for p in prims_:
            if p is not None:
                out[p] = rule
    return out


# the proof's hooks for the structured equations (`walker.Walker.ENTER`)
_STRUCTURED = {
    walker.Nest.CALL: _once,
    walker.Nest.REMAT: _once,
    walker.Nest.CUSTOM: _once,
    walker.Nest.SCAN: _scan,
    walker.Nest.WHILE: _while,
    walker.Nest.COND: _cond,
    walker.Nest.SHARD_MAP: _shard_map,
}


_IDENTITY = (
    compat.copy_p, compat.copy_p2, compat.sharding_constraint_p, *compat.vma_cast_prims,
    P.stop_gradient, P.name, P.optimization_barrier, P.reshard,
)


_RULES = _table([
    (_IDENTITY, _identity),
    ((P.reduce_sum,), _reduce(True)),
    ((P.reduce_max, P.reduce_min, P.reduce_prod, P.reduce_and, P.reduce_or, P.reduce_xor,
      P.argmax, P.argmin), _reduce(False)),
    ((P.cumsum,), _cumulative(True)),
    ((P.cumprod, P.cummax, P.cummin, P.cumlogsumexp), _cumulative(False)),
    ((P.sort,), _sort),
    ((P.top_k,), _top_k),
    ((P.transpose,), _transpose),
    ((P.broadcast_in_dim,), _broadcast),
    ((P.reshape,), _reshape),
    ((P.squeeze,), _squeeze),
    ((P.rev,), _rev),
    ((P.slice,), _slice),
    ((P.dynamic_slice,), _dynamic_slice),
    ((P.dynamic_update_slice,), _dynamic_update_slice),
    ((P.pad,), _pad),
    ((P.concatenate,), _concatenate),
    ((P.split,), _split),
    ((P.tile,), _tile),
    ((P.dot_general,), _dot_general),
    ((compat.conv_p,), _conv),
    ((P.reduce_window_sum, P.reduce_window_max, P.reduce_window_min, P.reduce_window),
     _reduce_window),
    ((P.gather,), _gather),
    ((P.scatter, P.scatter_add, P.scatter_sub, P.scatter_mul, P.scatter_min, P.scatter_max),
     _scatter),
    ((P.psum, P.psum_invariant), _collective(True)),
    ((P.pmax, P.pmin), _collective(False)),
    ((P.all_gather,), _moving("gathers", "brings in other devices' examples",
                              "all_gather_dimension", True)),
    ((P.reduce_scatter,), _moving("reduce-scatters", "adds up other devices' examples",
                                  "scatter_dimension", False)),
    ((P.select_n, P.clamp, P.random_wrap, P.convert_element_type, P.reduce_precision,
      P.add_jaxvals, P.real, P.imag, P.conj), _elementwise),
    ((compat.stack_p,), _stack),
    ((compat.unstack_p,), _unstack),
    # applied along the leading axes independently: the trailing axes of each operand
    ((P.fft,), _batched_core(lambda eqn: (len(eqn.params["fft_lengths"]),))),
    ((P.cholesky, P.eig, P.eigh, P.lu, P.qr, P.svd, P.schur, P.hessenberg, P.tridiagonal,
      P.geqrf), _batched_core(lambda eqn: (2,))),
    ((P.householder_product, P.geqp3, P.cholesky_update), _batched_core(lambda eqn: (2, 1))),
    ((P.triangular_solve, P.symmetric_product), _batched_core(lambda eqn: (2, 2))),
    ((P.ormqr,), _batched_core(lambda eqn: (2, 1, 2))),
    ((P.lu_pivots_to_permutation,), _batched_core(lambda eqn: (1,))),
    ((P.tridiagonal_solve,), _batched_core(lambda eqn: (1, 1, 1, 2))),
])


# elementwise ops through which a sum over the batch stays one
_LINEAR = frozenset(
    p for p in (
        P.add, P.sub, P.add_jaxvals, P.neg, P.convert_element_type, P.reduce_precision,
        P.real, P.imag, P.conj, *_IDENTITY,
    ) if p is not None
)


# scalar ops on literals that `_Interp.constant` evaluates
_FOLD = {p: f for p, f in (
    (P.add, np.add), (P.sub, np.subtract), (P.mul, np.multiply), (P.neg, np.negative),
    (P.max, np.maximum), (P.min, np.minimum), (P.lt, np.less), (P.le, np.less_equal),
    (P.gt, np.greater), (P.ge, np.greater_equal), (P.eq, np.equal), (P.ne, np.not_equal),
) if p is not None}


# identities that leave a value as it is (stop_gradient changes its gradient)
_TRANSPARENT = frozenset(p for p in _IDENTITY if p is not None and p is not P.stop_gradient)


# elementwise ops that add up the terms of a partial sum (`_Interp.added`)
_ADDING = frozenset(p for p in (P.add, P.sub, P.add_jaxvals) if p is not None)


# reductions over named axes: they see values of one example (`Cur`, `One`) themselves
_COLLECTIVES = frozenset(p for p in (P.psum, P.psum_invariant, P.pmax, P.pmin, P.all_gather,
                                    P.reduce_scatter) if p is not None)


# rules that see values of single examples taken out of the batch (`One`) next to other
# values of the examples; any other rule combining them gets `_Interp.picked`
_SIDE_BY_SIDE = (_elementwise, _identity, _concatenate, _stack)


# elementwise ops through which the running sum of a loop over the examples stays one
_ACCUMULATING = frozenset(
    p for p in (P.add, P.sub, P.add_jaxvals, P.convert_element_type, P.reduce_precision)
    if p is not None
)


_TRACKED = frozenset(
    p for p in (
        P.iota, P.convert_element_type, P.copy, P.broadcast_in_dim, P.reshape, P.lt,
        P.select_n, P.concatenate,
    ) if p is not None
)


# --------------------------------------------------------------------------- #
# Values lined up with the batch (`Lined`): where they come from, how they move
# --------------------------------------------------------------------------- #
_ONE_KEY_FIX = (
    "pass one key per example in the batch (jax.random.split(key, B) as a batch leaf) and "
    "draw each example's randomness from its own key with jax.vmap"
)


def _lined_iota(it, eqn, ins):
    d = eqn.params["dimension"]
    if _shape(eqn.outvars[0])[d] != it.B:
        return None
    return [{d: Lined(
        "an index over the batch (jnp.arange of the batch size: each example alone is at "
        "position 0)", "pass per-example values (weights, positions) in the batch instead of "
        "computing them from the batch size; weigh examples with example_weights=", eqn,
        position=True)}]


def _lined_random(what):
    """Random bits or keys of the shape ``key.shape + shape``: the new axes of size B
    hold other values at every position."""

    def rule(it, eqn, ins):
        out = _shape(eqn.outvars[0])
        got = dict(ins[0] or {})
        for j in range(len(_shape(eqn.invars[0])), len(out)):
            if out[j] == it.B:
                got.setdefault(j, Lined(what, _ONE_KEY_FIX, eqn))
        return [got]

    return rule


def _lined_elementwise(it, eqn, ins):
    outs = []
    for o in eqn.outvars:
        oshape, got = _shape(o), {}
        for v, d in zip(eqn.invars, ins):
            vshape = _shape(v)
            for a, src in (d or {}).items():
                if a < len(oshape) and a < len(vshape) and vshape[a] == oshape[a] == it.B:
                    got.setdefault(a, src)
        outs.append(got)
    return outs


def _lined_moved(axis_of):
    """Ops that move the first operand's axis ``a`` to ``axis_of(eqn, a)`` (None: gone)."""

    def rule(it, eqn, ins):
        outs = []
        for o in eqn.outvars:
            oshape, got = _shape(o), {}
            for a, src in (ins[0] or {}).items():
                b = axis_of(eqn, a)
                if b is not None and b < len(oshape) and oshape[b] == it.B:
                    got[b] = src
            outs.append(got)
        return outs

    return rule


def _lined_reshape(eqn, a):
    if eqn.params.get("dimensions") is not None:
        return None
    shape = _shape(eqn.invars[0])
    t = reshape_axis(shape, _shape(eqn.outvars[0]), Ex(a), shape[a])
    return t.axis if t is not None and (t.outer, t.inner) == (1, 1) else None


def _lined_squeeze(eqn, a):
    nd = len(_shape(eqn.invars[0]))
    dims = [d % nd for d in eqn.params["dimensions"]]
    return None if a in dims else a - sum(d < a for d in dims)


def _lined_reduced(eqn, a):
    axes = tuple(eqn.params["axes"])
    return None if a in axes else a - sum(x < a for x in axes)


def _lined_concatenate(it, eqn, ins):
    dim, oshape, got = eqn.params["dimension"], _shape(eqn.outvars[0]), {}
    for v, d in zip(eqn.invars, ins):
        if v in it.iota:  # the position component of an index array (x[jnp.arange(B), j])
            continue
        for a, src in (d or {}).items():
            if a != dim and oshape[a] == it.B:
                got.setdefault(a, src)
    return [got]


def _same_axis(eqn, a):
    return a


_LINED_SOURCES = _table([
    ((P.iota,), _lined_iota),
    ((P.random_bits,), _lined_random(
        "random bits drawn from one key for the whole batch (each example alone draws its "
        "own, other, bits from that key)")),
    ((P.random_split,), _lined_random(
        "keys split from one key into one per position (each example alone splits it into "
        "one key, another)")),
])


_LINED_RULES = _table([
    ((P.broadcast_in_dim,),
     _lined_moved(lambda eqn, a: eqn.params["broadcast_dimensions"][a])),
    ((P.transpose,), _lined_moved(lambda eqn, a: tuple(eqn.params["permutation"]).index(a))),
    ((P.reshape,), _lined_moved(_lined_reshape)),
    ((P.squeeze,), _lined_moved(_lined_squeeze)),
    ((P.reduce_sum, P.reduce_max, P.reduce_min, P.reduce_prod, P.reduce_and, P.reduce_or,
      P.reduce_xor, P.argmax, P.argmin), _lined_moved(_lined_reduced)),
    ((*_IDENTITY, P.rev, P.slice, P.dynamic_slice, P.pad, P.split, P.cumsum, P.cumprod,
      P.cummax, P.cummin), _lined_moved(_same_axis)),
    ((compat.stack_p,), _lined_moved(lambda eqn, a: a + (a >= eqn.params["axis"]))),
    ((compat.unstack_p,), _lined_moved(
        lambda eqn, a: None if a == eqn.params["axis"] else a - (a > eqn.params["axis"]))),
    ((P.concatenate,), _lined_concatenate),
    ((P.random_unwrap, P.random_wrap, P.random_seed, P.random_fold_in), _lined_elementwise),
])


def _leaf_lined(prep, B):
    """`Lined` per axis of size B of each input of the batch loss's jaxpr (the
    differentiated leaves, the batch's, the other arguments'); the batch's are None."""

    def axes(x, what, fix):
        src = Lined(what, fix)
        return {a: src for a, n in enumerate(np.shape(x)) if n == B}

    out = []
    for path, x in zip(prep.diff_paths, prep.diff_leaves):
        out.append(axes(x, f"the parameter{' ' + path if path else ''} (argnums="
                           f"{prep.opts.argnums!r}, shape {list(np.shape(x))})",
                        "a parameter cannot hold one entry per example: pass per-example "
                        "values in the batch (batch_argnums)"))
    out += [None] * len(prep.ex_leaves)
    other = jax.tree.unflatten(prep.other_tree, list(range(len(prep.other_is_arr))))
    located = {}
    for path, k in jax.tree_util.tree_flatten_with_path(other)[0]:
        arg = prep.other_idx[path[0].idx]
        located[k] = (arg, jax.tree_util.keystr(path[1:]))
    arrays = [k for k, a in enumerate(prep.other_is_arr) if a]
    for j, x in enumerate(prep.other_leaves):
        if j < prep.n_other:
            arg, sub = located[arrays[j]]
            shape = list(np.shape(x))
            nums = tuple(sorted({*prep.batch_argnums, arg}))
            out.append(axes(
                x, f"argument {arg}{sub} (shape {shape}), which is not in batch_argnums="
                f"{prep.opts.batch_argnums!r}",
                f"if it holds one entry per example, pass batch_argnums={nums!r} so that it "
                "is split into examples with the batch"))
        else:
            _, path, _ = prep.skipped[j - prep.n_other]
            out.append(axes(x, f"the non-float leaf {path} of the differentiated argument(s)",
                            "a parameter cannot hold one entry per example: pass per-example "
                            "values in the batch (batch_argnums)"))
    return out

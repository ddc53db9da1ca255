"""Rules of the independence proof for elementwise operations, reductions and the
operations that move data (transpose, reshape, slices, padding, concatenation).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpr_surgery._src.independence.tags import (
    _ONE_BY_ONE_FIX,
    Cross,
    Cur,
    Ex,
    One,
    P,
    Sum,
    Unknown,
    _alike,
    _cross_sum,
    _equal_weights,
    _is_literal,
    _moved,
    _positions,
    _reordered,
    _shape,
    _single,
    reshape_axis,
)


# --------------------------------------------------------------------------- #
# Rules
# --------------------------------------------------------------------------- #
def _elementwise(it, eqn, tags):
    return it.elementwise(eqn, tags)


def _identity(it, eqn, tags):
    return list(tags[: len(eqn.outvars)])


def _reduce_tag(it, eqn, t, axes, summing):
    """The tag of ``t`` reduced over ``axes`` (by a sum, or another reduction)."""
    if isinstance(t, Sum):
        return t if summing else _cross_sum(eqn, f"applies {eqn.primitive} to", t)
    if t.axis in axes:
        if _single(t) is not None:  # over a slice of the batch holding one example
            return One(_single(t), t.by)
        if not summing:
            return Cross(eqn, "reduces over the batch axis (across examples)")
        return _summed(it, eqn, t)
    return dataclasses.replace(t, axis=t.axis - sum(a < t.axis for a in axes))


def _summed(it, eqn, t: Ex):
    """A sum along ``t``'s batch axis: `Sum` where it counts every example equally, `One`
    where it holds one example (``loss(x[i:i + 1])``)."""
    if _single(t) is not None:
        return One(_single(t), t.by)
    if _equal_weights(t, it.B):
        return Sum(eqn)
    return Cross(eqn, "sums the examples with unequal weights (leaves some out or counts "
                      "some more often than others)", t.by, how="reordered by",
                 fix=_ONE_BY_ONE_FIX)


def _reduce(summing):
    def rule(it, eqn, tags):
        return [_reduce_tag(it, eqn, tags[0], tuple(eqn.params["axes"]), summing)] * len(
            eqn.outvars)

    return rule


def _cumulative(linear):
    def rule(it, eqn, tags):
        (t,) = tags
        if isinstance(t, Sum):
            return [t if linear else _cross_sum(eqn, f"applies {eqn.primitive} to", t)]
        if t.axis == eqn.params["axis"] and _single(t) is None:
            return [Cross(eqn, "accumulates along the batch axis (across examples)")]
        return [t]

    return rule


def _sort(it, eqn, tags):
    n = len(eqn.outvars)
    t = it.meet(eqn, tags)
    if isinstance(t, Cross):
        return [t] * n
    if t is None:
        s = next(u for u in tags if isinstance(u, Sum))
        return [_cross_sum(eqn, "sorts", s)] * n
    if t.axis == eqn.params["dimension"]:
        return [Cross(eqn, "sorts along the batch axis (across examples)")] * n
    return [t] * n


def _top_k(it, eqn, tags):
    (t,) = tags
    if isinstance(t, Sum):
        return [_cross_sum(eqn, "takes the top k of", t)] * 2
    axis = eqn.params.get("axis", -1)
    if t.axis == axis % len(_shape(eqn.invars[0])):
        return [Cross(eqn, "takes the top k along the batch axis (across examples)")] * 2
    return [t] * 2


def _transpose(it, eqn, tags):
    (t,) = tags
    if isinstance(t, Sum):
        return [t]
    return [dataclasses.replace(t, axis=tuple(eqn.params["permutation"]).index(t.axis))]


def _broadcast(it, eqn, tags):
    t = tags[0]
    if any(u is not None for u in tags[1:]):  # dynamic shapes
        return it.unknown(eqn, tags, "has a shape that depends on the examples")
    if isinstance(t, Sum):
        return [t]
    axis = eqn.params["broadcast_dimensions"][t.axis]
    out = dataclasses.replace(t, axis=axis)
    n = _shape(eqn.outvars[0])[axis]
    if t.perm is not None and len(t.perm) != n:  # one example's values, at every position
        out = _reordered(out, t.perm * n, it.B, t.by)
    return [out]


def _reshape(it, eqn, tags):
    t = tags[0]
    if any(u is not None for u in tags[1:]):
        return it.unknown(eqn, tags, "has a shape that depends on the examples")
    if isinstance(t, Sum):
        return [t]
    shp = _shape(eqn.invars[0])
    dims = eqn.params.get("dimensions")
    if dims is not None:  # transposes first
        t = dataclasses.replace(t, axis=tuple(dims).index(t.axis))
        shp = tuple(shp[d] for d in dims)
    n = it.B if t.perm is None else len(t.perm)
    out = reshape_axis(shp, _shape(eqn.outvars[0]), t, n)
    if out is None:
        return [Unknown(eqn, "splits the batch axis across several axes")]
    if t.perm is not None:
        if (out.outer, out.inner) != (1, 1):
            return [Unknown(eqn, "merges reordered examples with other axes")]
        out = dataclasses.replace(out, perm=t.perm, by=t.by)
    return [out]


def _squeeze(it, eqn, tags):
    (t,) = tags
    if isinstance(t, Sum):
        return [t]
    nd = len(_shape(eqn.invars[0]))
    dims = [d % nd for d in eqn.params["dimensions"]]
    if t.axis in dims:  # x[i]: the batch axis sliced to one example
        if isinstance(t, Ex) and (t.outer, t.inner) == (1, 1) and t.perm is not None:
            return [One(t.perm[0], t.by) if t.perm[0] >= 0 else None]
        return [Unknown(eqn, "takes a single example out of the batch")]
    return [dataclasses.replace(t, axis=t.axis - sum(d < t.axis for d in dims))]


def _whole_axis(it, eqn, t, ok, what):
    """An op that keeps the batch axis whole when ``ok``."""
    if isinstance(t, Sum) or ok:
        return t
    return Unknown(eqn, what)


def _along(t, what, eqn):
    """Whether an op that moves elements along one axis of ``t`` can follow the examples
    there (an `Ex` with one example per position), else the `Unknown` to return."""
    if isinstance(t, Ex) and t.outer == 1 and t.inner == 1:
        return None
    return Unknown(eqn, what)


def _rev(it, eqn, tags):
    (t,) = tags
    if isinstance(t, Sum) or t.axis not in eqn.params["dimensions"]:
        return [t]
    bad = _along(t, "reverses the batch axis", eqn)
    if bad is not None:
        return [bad]
    return [_moved(t, _positions(t, it.B)[::-1], it.B, eqn)]


def _slice(it, eqn, tags):
    (t,) = tags
    if isinstance(t, Sum):
        return [t]
    a = t.axis
    strides = eqn.params.get("strides") or (1,) * len(_shape(eqn.invars[0]))
    start, limit = eqn.params["start_indices"][a], eqn.params["limit_indices"][a]
    if start == 0 and strides[a] == 1 and limit == _shape(eqn.invars[0])[a]:
        return [t]
    bad = _along(t, "slices the batch axis (keeps some examples)", eqn)
    if bad is not None:
        return [bad]
    return [_moved(t, _positions(t, it.B)[start:limit:strides[a]], it.B, eqn)]


def _index_operands(eqn, tags, first):
    """A `Cross` or `Unknown` when start indices (operands from ``first``) depend on the
    examples, else None."""
    for t in tags[first:]:
        if isinstance(t, Sum):
            return _cross_sum(eqn, "indexes by", t)
        if t is not None:
            return Unknown(eqn, "indexes by a value that depends on the examples")
    return None


def _dynamic_slice(it, eqn, tags):
    bad = _index_operands(eqn, tags, 1)
    if bad is not None:
        return [bad]
    t = tags[0]
    if isinstance(t, Sum):
        return [t]
    index = eqn.invars[1 + t.axis]
    level = None if _is_literal(index) else it.counter.get(index)
    if (level is not None and (t.outer, t.inner, t.perm) == (1, 1, None)
            and eqn.params["slice_sizes"][t.axis] == 1):
        return [Cur(level)]  # x[i] in a loop whose counter i runs over the examples
    size, whole = eqn.params["slice_sizes"][t.axis], _shape(eqn.invars[0])[t.axis]
    start = it.constant(index) if size != whole and _along(t, "", eqn) is None else None
    if start is not None:  # x[i] at an index known from the jaxpr
        start = min(max(int(start), 0), whole - size)  # dynamic_slice clamps
        return [_moved(t, _positions(t, it.B)[start : start + size], it.B, eqn)]
    return [_whole_axis(it, eqn, t, size == whole, "slices the batch axis (keeps some examples)")]


def _dynamic_update_slice(it, eqn, tags):
    bad = _index_operands(eqn, tags, 2)
    if bad is not None:
        return [bad]
    t = it.meet(eqn, tags[:2])
    if isinstance(t, Cross):
        return [t]
    if t is None:
        return [next(u for u in tags[:2] if isinstance(u, Sum))]
    ok = _shape(eqn.invars[1])[t.axis] == _shape(eqn.invars[0])[t.axis]
    return [_whole_axis(it, eqn, t, ok, "updates part of the batch axis")]


def _pad(it, eqn, tags):
    t, pv = tags
    if pv is not None and t is None:
        return [pv if isinstance(pv, Sum) else Unknown(eqn, "pads with per-example values")]
    m = it.meet(eqn, tags)
    if isinstance(m, Cross):
        return [m]
    if isinstance(t, Sum):
        return [t]
    lo, hi, interior = eqn.params["padding_config"][t.axis]
    if (lo, hi, interior) == (0, 0, 0):
        return [t]
    bad = _along(t, "pads the batch axis", eqn)
    if bad is not None or lo < 0 or hi < 0 or interior != 0:
        return [bad or Unknown(eqn, "pads the batch axis")]
    return [_moved(t, (-1,) * lo + _positions(t, it.B) + (-1,) * hi, it.B, eqn)]


def _alike_parts(it, parts) -> bool:
    """Whether values of the examples put side by side along the batch axis, ``parts``
    (variable, the example at each of its positions), treat every example alike: for each
    key of what computed a part (`_Interp.key`), every example at as many positions (the
    parts of a batch split and computed alike, or the whole batch computed two ways)."""
    counts: dict = {}
    for v, pos in parts:
        c = counts.setdefault(it.key(v), np.zeros(it.B))
        np.add.at(c, [i for i in pos if i >= 0], 1)
    return all(_alike(c) for c in counts.values())


def _side_by_side(it, eqn, tags, dim, stacking):
    """Values of single examples taken out of the batch (`One`) put side by side along
    ``dim`` (``jnp.stack`` of per-example terms), with constants and, concatenating, with
    slices of the batch along it: an `Ex` along ``dim`` naming each position's example,
    where the examples are computed alike (`_alike_parts`)."""
    pos, parts, by = [], [], None
    for v, u in zip(eqn.invars, tags):
        n = 1 if stacking else _shape(v)[dim]
        if u is None:
            pos.extend((-1,) * n)
            continue
        if isinstance(u, One):
            mine = (u.example,) * n
            by = by or u.by
        elif not stacking and isinstance(u, Ex) and u.axis == dim and _along(u, "", eqn) is None:
            mine = _positions(u, it.B)
        else:
            return Unknown(eqn, "puts values of examples taken out of the batch one by one "
                                "beside other values of the examples")
        pos.extend(mine)
        parts.append((v, mine))
    if not _alike_parts(it, parts):
        return Cross(eqn, "puts side by side the values of examples taken out of the batch one "
                          "by one (x[i], jnp.unstack, a Python loop over the batch) that are not "
                          "computed alike (by the same operations on each example's own "
                          "values)", by, how="an example taken out by", fix=_ONE_BY_ONE_FIX)
    return _moved(Ex(dim), pos, it.B, eqn)


def _concatenate(it, eqn, tags):
    dim = eqn.params["dimension"]
    if any(isinstance(u, One) for u in tags):
        return [_side_by_side(it, eqn, tags, dim, False)]
    ex = [u for u in tags if isinstance(u, Ex)]
    if ex and all(u.axis == dim for u in ex) and not any(isinstance(u, Sum) for u in tags):
        # along the batch axis: each operand brings its examples (constants: none)
        for u in ex:
            bad = _along(u, "concatenates along the batch axis", eqn)
            if bad is not None:
                return [bad]
        parts = [(v, _positions(u, it.B)) for v, u in zip(eqn.invars, tags) if u is not None]
        if len(parts) > 1 and not _alike_parts(it, parts):
            # jnp.concatenate([f(x[:k]), g(x[k:])]): the examples' terms differ by position
            return [Unknown(eqn, "concatenates along the batch axis values of the examples "
                                 "that are not computed alike (by the same operations on each "
                                 "example's own values)")]
        pos = []
        for v, u in zip(eqn.invars, tags):
            n = _shape(v)[dim]
            pos.extend((-1,) * n if u is None else _positions(u, it.B))
        return [_moved(ex[0], pos, it.B, eqn)]
    t = it.meet(eqn, tags)
    if isinstance(t, Cross):
        return [t]
    if t is None:
        return [next(u for u in tags if isinstance(u, Sum))]
    ok = dim != t.axis
    return [_whole_axis(it, eqn, t, ok, "concatenates along the batch axis")]


def _split(it, eqn, tags):
    (t,) = tags
    n = len(eqn.outvars)
    if isinstance(t, Sum) or eqn.params["axis"] != t.axis:
        return [t] * n
    bad = _along(t, "splits the batch axis", eqn)
    if bad is not None:
        return [bad] * n
    pos, outs, k = _positions(t, it.B), [], 0
    for size in eqn.params["sizes"]:
        outs.append(_moved(t, pos[k : k + size], it.B, eqn))
        k += size
    return outs


def _stack(it, eqn, tags):
    if any(isinstance(u, One) for u in tags):
        axis = eqn.params["axis"] % len(_shape(eqn.outvars[0]))
        return [_side_by_side(it, eqn, tags, axis, True)]
    t = it.meet(eqn, tags)
    if isinstance(t, Cross):
        return [t]
    if t is None:
        return [next(u for u in tags if isinstance(u, Sum))]
    axis = eqn.params["axis"] % len(_shape(eqn.outvars[0]))
    return [dataclasses.replace(t, axis=t.axis + (t.axis >= axis))]


def _unstack(it, eqn, tags):
    (t,) = tags
    n = len(eqn.outvars)
    if isinstance(t, Sum):
        return [t] * n
    axis = eqn.params["axis"] % len(_shape(eqn.invars[0]))
    if t.axis == axis:  # for x in jnp.unstack(batch): single examples
        bad = _along(t, "splits the batch axis into single examples", eqn)
        if bad is not None:
            return [bad] * n
        return [One(i, eqn) if i >= 0 else None for i in _positions(t, it.B)]
    return [dataclasses.replace(t, axis=t.axis - (t.axis > axis))] * n


def _batched_core(cores):
    """Ops applied independently along the leading axes of their operands (fft; the
    linear algebra of jnp.linalg): ``cores(eqn)`` gives each operand's number of
    trailing core axes; the results keep the leading axes in place."""

    def rule(it, eqn, tags):
        n = len(eqn.outvars)
        t = it.meet(eqn, tags)
        if isinstance(t, Cross):
            return [t] * n
        if t is None:
            s = next(u for u in tags if isinstance(u, Sum))
            linear = eqn.primitive is P.fft
            return [s if linear else _cross_sum(eqn, f"applies {eqn.primitive} to", s)] * n
        for v, u, c in zip(eqn.invars, tags, cores(eqn)):
            if u is not None and u.axis >= len(_shape(v)) - c:
                return [Cross(eqn, f"applies {eqn.primitive} along the batch axis "
                                   "(across examples)")] * n
        return [t] * n

    return rule


def _tile(it, eqn, tags):
    (t,) = tags
    ok = isinstance(t, Ex) and eqn.params["reps"][t.axis] == 1
    return [_whole_axis(it, eqn, t, ok, "repeats the batch axis")]

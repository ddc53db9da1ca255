"""Is the batch loss a mean of per-example terms? Proved from its jaxpr at trace time.

`per_example_stat` defines per-example gradients by the batch-of-one convention,
``l_b = fn(params, batch[b:b+1])``. That describes the model being trained only when the
batch loss is a (weighted) sum of per-example terms: a loss that divides by the batch's
token count, batch norm in training mode, in-batch negatives or a softmax over the batch
make the examples interact, and every statistic would silently describe each example
alone in a batch of one. This module traces the *batch* loss once (``jax.make_jaxpr``:
nothing runs) and proves the property by abstract interpretation, following the batch
axis through the jaxpr. Every variable gets a tag:

* ``None`` -- does not depend on the examples (parameters, other arguments, constants,
  iota, keys);
* `Ex` ``(axis, outer, inner)`` -- along ``axis`` (of size ``outer * B * inner``: the
  batch axis, possibly merged with its neighbours by reshapes) element ``i`` depends on
  example ``(i // inner) % B`` only; the other axes are free;
* `Cur` -- inside the body of a scan over the batch axis (``lax.map`` over examples): it
  depends on the current example only;
* `Sum` -- a sum over examples of per-example terms (``reduce_sum`` over the batch axis,
  a contraction of it with a constant or with another example-aligned value), closed
  under the linear operations (+, -, multiplication or division by a constant, layout);
* `Cross` -- the examples interact: where it arose (an equation, and the reduction over
  the batch it combined with per-example values or used non-linearly);
* `Unknown` -- the jaxpr cannot decide (a gather or scatter across the batch axis by
  data, as in graph batching; a primitive without a rule).

The loss must come out ``None`` or `Sum`: `Cross` raises `CrossExampleError`, `Unknown`
warns with `CrossExampleWarning`. Rules are keyed by primitive objects; an unknown
primitive touching the examples gives `Unknown`, never a false alarm.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import warnings
from typing import Any

import jax
import numpy as np

from jaxpr_surgery._src import compat

P = compat.prims


class CrossExampleError(ValueError):
    """The examples of the batch loss interact, so per-example gradients are not defined.

    Raised by `per_example_stat` and `value_and_per_example_stat` at trace time when the
    jaxpr of the batch loss reduces across examples other than by the final (weighted)
    mean: a token count of the whole batch in a denominator, batch norm in training mode,
    in-batch negatives, a softmax over the batch. The message names the operation and
    its source line. Normalise per example, or pass ``check=False`` to opt out.
    """


class CrossExampleWarning(UserWarning):
    """The jaxpr could not prove that the batch loss is a mean of per-example terms.

    Emitted once per trace where the check cannot decide, e.g. a gather or scatter across
    the batch axis by data (graph batching, where the examples live on a node axis).
    Run `check_per_example` once on a real batch to check numerically; pass
    ``check=False`` to silence it.
    """


# --------------------------------------------------------------------------- #
# Tags
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class Ex:
    axis: int
    outer: int = 1
    inner: int = 1


@dataclasses.dataclass(frozen=True)
class Cur:
    level: int


@dataclasses.dataclass(frozen=True)
class Sum:
    origin: Any = dataclasses.field(default=None, compare=False)  # the eqn summing examples


@dataclasses.dataclass(frozen=True)
class Cross:
    eqn: Any = dataclasses.field(compare=False)
    why: str = dataclasses.field(compare=False)
    via: Any = dataclasses.field(default=None, compare=False)  # the Sum's eqn it combined


@dataclasses.dataclass(frozen=True)
class Unknown:
    eqn: Any = dataclasses.field(compare=False)
    why: str = dataclasses.field(compare=False)


_MAX_ROUNDS = 8  # fixpoint of loop carries (the lattice is 3 high)


def _shape(v):
    return tuple(getattr(v.aval, "shape", ()))


def _is_literal(v):
    return isinstance(v, compat.Literal)


_ELEMENTWISE: dict = {}  # primitive -> whether jax batches it as an elementwise op


def _is_elementwise(prim):
    out = _ELEMENTWISE.get(prim)
    if out is None:
        out = _ELEMENTWISE[prim] = compat.elementwise_batching(prim) is not None
    return out


def _cross_sum(eqn, what, s):
    return Cross(eqn, f"{what} a sum over the batch", s.origin)


# --------------------------------------------------------------------------- #
# Reshapes: where the batch structure goes
# --------------------------------------------------------------------------- #
def reshape_axis(in_shape, out_shape, t: Ex, B: int):
    """The `Ex` of a row-major reshape's output, or None when the batch axis is split
    across output axes (each element still belongs to one example, but not along one
    axis)."""
    pre = math.prod(in_shape[: t.axis]) * t.outer
    post = t.inner * math.prod(in_shape[t.axis + 1 :])
    for j, n in enumerate(out_shape):
        p, s = math.prod(out_shape[:j]), math.prod(out_shape[j + 1 :])
        if pre % p == 0 and post % s == 0 and (pre // p) * B * (post // s) == n:
            return Ex(j, pre // p, post // s)
    return None


# --------------------------------------------------------------------------- #
# The interpreter
# --------------------------------------------------------------------------- #
class _Interp:
    def __init__(self, B: int, data_axes: frozenset):
        self.B = B
        self.data_axes = data_axes
        self.levels = itertools.count()
        # integer index arrays equal to their index along one axis (jnp.arange, iota),
        # followed through broadcasts and jnp's negative-index normalisation
        self.iota: dict = {}
        self.neg_test: dict = {}  # bool var -> the var it tests for < 0
        self.comps: dict = {}  # index array concatenated on its last axis -> iota dims

    def run(self, jaxpr, in_tags, env=None):
        """The tags of ``jaxpr``'s outputs; ``env`` (a dict) receives every variable's."""
        env = {} if env is None else env
        for v, t in zip(jaxpr.invars, in_tags):
            env[v] = t

        def read(v):
            return None if _is_literal(v) else env.get(v)

        for eqn in jaxpr.eqns:
            tags = [read(v) for v in eqn.invars]
            if eqn.primitive in _TRACKED:
                self.track(eqn)
            if all(t is None for t in tags):
                outs = [None] * len(eqn.outvars)  # a function of constants only
            else:
                outs = self.eqn(eqn, tags)
            for v, t in zip(eqn.outvars, outs):
                env[v] = t
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, tags):
        prim, n = eqn.primitive, len(eqn.outvars)
        structured = _STRUCTURED.get(prim)
        if structured is not None:  # recurses: sees Cross and Unknown operands itself
            return structured(self, eqn, tags)
        for t in tags:
            if isinstance(t, Cross):
                return [t] * n
        for t in tags:
            if isinstance(t, Unknown):
                return [t] * n
        live = [t for t in tags if t is not None]
        if isinstance(live[0], Cur) and all(t == live[0] for t in live):
            return [live[0]] * n  # any function of one example and constants
        rule = _RULES.get(prim)
        if rule is None and _is_elementwise(prim):
            rule = _elementwise
        if rule is None:
            return self.unknown(eqn, tags, "has no rule here (a primitive the check does not know)")
        if rule is not _elementwise and any(isinstance(t, Cur) for t in live):
            return [Unknown(eqn, "combines the current example of a loop over the examples "
                                 "with other values")] * n
        return rule(self, eqn, tags)

    @staticmethod
    def unknown(eqn, tags, why):
        for t in tags:
            if isinstance(t, Cross):
                return [t] * len(eqn.outvars)
        return [Unknown(eqn, why)] * len(eqn.outvars)

    # -- combining operands ------------------------------------------------ #
    @staticmethod
    def meet(eqn, tags):
        """Operands combined element by element: their common `Ex`/`Cur`, a `Cross`, or
        None when no operand depends on individual examples."""
        ex = [t for t in tags if isinstance(t, (Ex, Cur))]
        sums = [t for t in tags if isinstance(t, Sum)]
        if ex and sums:
            return _cross_sum(eqn, "combines per-example values with", sums[0])
        if ex and any(t != ex[0] for t in ex):
            return Cross(eqn, "combines values of different examples")
        return ex[0] if ex else None

    def elementwise(self, eqn, tags):
        t = self.meet(eqn, tags)
        n = len(eqn.outvars)
        if isinstance(t, Cross):
            return [t] * n
        if t is None:  # sums (and constants) only
            return [self.linear(eqn, tags)] * n
        if isinstance(t, Cur):
            return [t] * n
        # shape-changing vectorized ops (random_bits, bitcast_convert_type) keep the
        # leading axes up to the batch axis
        src = next(_shape(v) for v, u in zip(eqn.invars, tags) if u == t)
        outs = []
        for v in eqn.outvars:
            o = _shape(v)
            ok = len(o) > t.axis and o[: t.axis + 1] == src[: t.axis + 1]
            outs.append(t if ok else Unknown(eqn, "changes the shape around the batch axis"))
        return outs

    @staticmethod
    def linear(eqn, tags):
        """An elementwise op on sums over the batch and constants."""
        prim = eqn.primitive
        sums = [t for t in tags if isinstance(t, Sum)]
        if prim in _LINEAR:
            return sums[0]
        if prim is P.mul:
            return sums[0] if len(sums) == 1 else _cross_sum(eqn, "multiplies", sums[1])
        if prim is P.div:
            if tags[1] is None:
                return sums[0]
            return _cross_sum(eqn, "divides by", tags[1])
        if prim is P.select_n:
            if tags[0] is None:
                return sums[0]
            return _cross_sum(eqn, "selects by", tags[0])
        return _cross_sum(eqn, f"applies {prim} to", sums[0])

    # -- loops and branches ------------------------------------------------- #
    @staticmethod
    def join(eqn, a, b, level=None):
        """The tag of a loop carry (or a branch output) that is ``a`` or ``b``."""
        if isinstance(b, Cur) and b.level == level:
            return Unknown(eqn, "carries a value of one example into the next iteration "
                                "of a loop over the examples")
        if a == b:
            return a
        for t in (a, b):
            if isinstance(t, Cross):
                return t
        for t in (a, b):
            if isinstance(t, Unknown):
                return t
        if a is None:
            return b
        if b is None:
            return a
        return Unknown(eqn, "holds values that depend on the examples in different ways "
                            "(in different iterations or branches)")

    def fixpoint(self, eqn, body, consts, carry, xs, level=None):
        carry = list(carry)
        for _ in range(_MAX_ROUNDS):
            outs = self.run(body, list(consts) + carry + list(xs))
            new = [self.join(eqn, c, o, level) for c, o in zip(carry, outs)]
            if new == carry:
                return carry, outs[len(carry) :]
            carry = new
        raise AssertionError("no fixpoint of the loop carries")  # pragma: no cover

    # -- index arrays equal to their own position ---------------------------- #
    def track(self, eqn):
        prim, ins = eqn.primitive, eqn.invars
        if len(eqn.outvars) != 1:
            return
        out = eqn.outvars[0]
        first = ins[0] if ins and not _is_literal(ins[0]) else None
        if prim is P.iota:
            if _shape(out):
                self.iota[out] = eqn.params["dimension"]
        elif prim in (P.convert_element_type, P.copy) and first in self.iota:
            self.iota[out] = self.iota[first]
        elif prim is P.broadcast_in_dim and first in self.iota:
            self.iota[out] = eqn.params["broadcast_dimensions"][self.iota[first]]
        elif prim is P.reshape and first in self.iota and eqn.params.get("dimensions") is None:
            d, shp, o = self.iota[first], _shape(first), _shape(out)
            for j in range(len(o)):
                if math.prod(o[:j]) == math.prod(shp[:d]) and o[j] == shp[d]:
                    self.iota[out] = j
                    break
        elif prim is P.lt and first in self.iota and _is_literal(ins[1]):
            if getattr(ins[1], "val", None) == 0:
                self.neg_test[out] = first
        elif prim is P.select_n and len(ins) == 3 and not _is_literal(ins[0]):
            a = ins[1]
            if not _is_literal(a) and a in self.iota and self.neg_test.get(ins[0]) is a:
                self.iota[out] = self.iota[a]  # a >= 0: the normalised index is a itself
        elif prim is P.concatenate and eqn.params["dimension"] == len(_shape(out)) - 1:
            comps = []
            for v in ins:
                k = _shape(v)[-1]
                comps.extend(self.components(v) if not _is_literal(v) else [None] * k)
            if any(c is not None for c in comps):
                self.comps[out] = tuple(comps)

    def components(self, v):
        """Per component of an index array's last axis: the axis along which it equals
        its index, or None."""
        k = _shape(v)[-1]
        d = self.iota.get(v)
        if d is not None and d != len(_shape(v)) - 1:
            return [d] * k
        return list(self.comps.get(v, [None] * k))


# --------------------------------------------------------------------------- #
# Rules
# --------------------------------------------------------------------------- #
def _elementwise(it, eqn, tags):
    return it.elementwise(eqn, tags)


def _identity(it, eqn, tags):
    return list(tags[: len(eqn.outvars)])


def _reduce(summing):
    def rule(it, eqn, tags):
        t, axes = tags[0], tuple(eqn.params["axes"])
        n = len(eqn.outvars)
        if isinstance(t, Sum):
            return [t if summing else _cross_sum(eqn, f"applies {eqn.primitive} to", t)] * n
        if t.axis in axes:
            if summing:
                return [Sum(eqn)] * n
            return [Cross(eqn, "reduces over the batch axis (across examples)")] * n
        return [Ex(t.axis - sum(a < t.axis for a in axes), t.outer, t.inner)] * n

    return rule


def _cumulative(linear):
    def rule(it, eqn, tags):
        (t,) = tags
        if isinstance(t, Sum):
            return [t if linear else _cross_sum(eqn, f"applies {eqn.primitive} to", t)]
        if t.axis == eqn.params["axis"]:
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
    return [dataclasses.replace(t, axis=eqn.params["broadcast_dimensions"][t.axis])]


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
    out = reshape_axis(shp, _shape(eqn.outvars[0]), t, it.B)
    if out is None:
        return [Unknown(eqn, "splits the batch axis across several axes")]
    return [out]


def _squeeze(it, eqn, tags):
    (t,) = tags
    if isinstance(t, Sum):
        return [t]
    nd = len(_shape(eqn.invars[0]))
    dims = [d % nd for d in eqn.params["dimensions"]]
    return [dataclasses.replace(t, axis=t.axis - sum(d < t.axis for d in dims))]


def _whole_axis(it, eqn, t, ok, what):
    """An op that keeps the batch axis whole when ``ok``."""
    if isinstance(t, Sum) or ok:
        return t
    return Unknown(eqn, what)


def _rev(it, eqn, tags):
    (t,) = tags
    ok = isinstance(t, Ex) and t.axis not in eqn.params["dimensions"]
    return [_whole_axis(it, eqn, t, ok, "reverses the batch axis")]


def _slice(it, eqn, tags):
    (t,) = tags
    if isinstance(t, Sum):
        return [t]
    a = t.axis
    strides = eqn.params.get("strides") or (1,) * len(_shape(eqn.invars[0]))
    ok = (eqn.params["start_indices"][a] == 0 and strides[a] == 1
          and eqn.params["limit_indices"][a] == _shape(eqn.invars[0])[a])
    return [_whole_axis(it, eqn, t, ok, "slices the batch axis (keeps some examples)")]


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
    ok = eqn.params["slice_sizes"][t.axis] == _shape(eqn.invars[0])[t.axis]
    return [_whole_axis(it, eqn, t, ok, "slices the batch axis (keeps some examples)")]


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
    ok = tuple(eqn.params["padding_config"][t.axis]) == (0, 0, 0)
    return [_whole_axis(it, eqn, t, ok, "pads the batch axis")]


def _concatenate(it, eqn, tags):
    t = it.meet(eqn, tags)
    if isinstance(t, Cross):
        return [t]
    if t is None:
        return [next(u for u in tags if isinstance(u, Sum))]
    ok = eqn.params["dimension"] != t.axis
    return [_whole_axis(it, eqn, t, ok, "concatenates along the batch axis")]


def _split(it, eqn, tags):
    (t,) = tags
    n = len(eqn.outvars)
    ok = isinstance(t, Ex) and eqn.params["axis"] != t.axis
    return [_whole_axis(it, eqn, t, ok, "splits the batch axis")] * n


def _tile(it, eqn, tags):
    (t,) = tags
    ok = isinstance(t, Ex) and eqn.params["reps"][t.axis] == 1
    return [_whole_axis(it, eqn, t, ok, "repeats the batch axis")]


def _dot_general(it, eqn, tags):
    tl, tr = tags[:2]
    if any(u is not None for u in tags[2:]):
        return it.unknown(eqn, tags, "has an operand the check does not know")
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    nl, nr = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lfree = [d for d in range(nl) if d not in lc and d not in lb]
    rfree = [d for d in range(nr) if d not in rc and d not in rb]

    def place(t, contract, batch, free, offset):
        """('c', i) contracted as the i-th pair, ('b', i) a dot batch dim, ('f', out pos)."""
        if t.axis in contract:
            return "c", tuple(contract).index(t.axis)
        if t.axis in batch:
            return "b", tuple(batch).index(t.axis)
        return "f", offset + free.index(t.axis)

    sums = [t for t in (tl, tr) if isinstance(t, Sum)]
    if sums:
        if tl is None or tr is None:
            return [sums[0]]  # a sum over the batch times a constant
        if len(sums) == 2:
            return [_cross_sum(eqn, "multiplies", sums[1])]
        return [_cross_sum(eqn, "combines per-example values with", sums[0])]
    if tl is None or tr is None:
        t = tl if tl is not None else tr
        kind, i = (place(t, lc, lb, lfree, len(lb)) if tl is not None
                   else place(t, rc, rb, rfree, len(lb) + len(lfree)))
        if kind == "c":
            return [Sum(eqn)]  # a weighted sum over examples
        return [dataclasses.replace(t, axis=i)]
    pl, pr = place(tl, lc, lb, lfree, len(lb)), place(tr, rc, rb, rfree, len(lb) + len(lfree))
    same = (tl.outer, tl.inner) == (tr.outer, tr.inner)
    if same and pl == pr and pl[0] == "c":
        return [Sum(eqn)]  # sum over examples of x_b . y_b
    if same and pl == pr and pl[0] == "b":
        return [dataclasses.replace(tl, axis=pl[1])]
    return [Cross(eqn, "pairs different examples (an in-batch product such as q @ k.T)")]


def _conv(it, eqn, tags):
    tl, tr = tags[:2]
    dn = eqn.params["dimension_numbers"]
    if isinstance(tl, Sum) and tr is None:
        return [tl]
    if isinstance(tl, Ex) and tr is None and eqn.params.get("batch_group_count", 1) == 1:
        lhs_spec, _, out_spec = dn
        if tl.axis == lhs_spec[0]:
            return [dataclasses.replace(tl, axis=out_spec[0])]
    if isinstance(tl, Sum) or isinstance(tr, Sum):
        s = tl if isinstance(tl, Sum) else tr
        return [_cross_sum(eqn, "convolves", s)]
    return [Unknown(eqn, "convolves along the batch axis or with per-example kernels")]


def _reduce_window(it, eqn, tags):
    n = len(eqn.outvars)
    ops = tags[: len(tags) // 2] if eqn.primitive is P.reduce_window else tags
    t = it.meet(eqn, ops)
    if isinstance(t, Cross):
        return [t] * n
    if t is None:
        s = next(u for u in ops if isinstance(u, Sum))
        if eqn.primitive is P.reduce_window_sum:
            return [s] * n
        return [_cross_sum(eqn, f"applies {eqn.primitive} to", s)] * n
    a = t.axis
    p = eqn.params
    if p["window_dimensions"][a] > 1:
        return [Cross(eqn, "pools across the batch axis (across examples)")] * n
    ok = (p["window_strides"][a] == 1 and tuple(p["padding"][a]) == (0, 0)
          and p.get("base_dilation", (1,) * (a + 1))[a] == 1)
    return [_whole_axis(it, eqn, t, ok, "strides or pads the batch axis")] * n


def _gather(it, eqn, tags):
    to, ti = tags[:2]
    operand, indices = eqn.invars[:2]
    if isinstance(ti, Sum):
        return [_cross_sum(eqn, "indexes by", ti)]
    if isinstance(to, Sum):
        if ti is None:
            return [to]
        return [_cross_sum(eqn, "indexes, by per-example values,", to)]
    dn = eqn.params["dimension_numbers"]
    offset = tuple(dn.offset_dims)
    collapsed = tuple(dn.collapsed_slice_dims)
    smap = tuple(dn.start_index_map)
    obatch = tuple(getattr(dn, "operand_batching_dims", ()))
    ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    sizes = eqn.params["slice_sizes"]
    oshape, ishape, out_rank = _shape(operand), _shape(indices), len(_shape(eqn.outvars[0]))
    out_batch = [d for d in range(out_rank) if d not in offset]  # <-> indices' dims but last
    op_offset = [d for d in range(len(oshape)) if d not in collapsed and d not in obatch]

    def unknown(why):
        return [Unknown(eqn, why)]

    cand = None
    if ti is not None:
        if ti.axis == len(ishape) - 1:
            return unknown("gathers with per-example index vectors")
        cand = dataclasses.replace(ti, axis=out_batch[ti.axis])
    if to is not None:
        k = to.axis
        if k in obatch:  # gather batching dims: row b of the operand for index row b
            jb = ibatch[obatch.index(k)]
            mine = dataclasses.replace(to, axis=out_batch[jb])
            if ti is not None and ti.axis != jb:
                return unknown("gathers from one example by the indices of another")
        elif k in smap:
            comp = it.components(indices)[smap.index(k)] if not _is_literal(indices) else None
            lined_up = comp is not None and comp < len(ishape) - 1 and ishape[comp] == oshape[k]
            if not lined_up or sizes[k] != 1:
                return unknown("gathers along the batch axis by data (the examples are "
                               "indexed by values, as in graph batching)")
            mine = dataclasses.replace(to, axis=out_batch[comp])  # x[jnp.arange(B), ...]
            if ti is not None and ti.axis != comp:
                return unknown("gathers from one example by the indices of another")
        elif k not in collapsed and sizes[k] == oshape[k]:
            mine = dataclasses.replace(to, axis=offset[op_offset.index(k)])
            if ti is not None:
                return unknown("gathers from per-example rows by the indices of other examples")
        else:
            return unknown("slices the batch axis (keeps some examples)")
        if cand is not None and cand != mine:
            return unknown("gathers from one example by the indices of another")
        cand = mine
    return [cand]


def _scatter(it, eqn, tags):
    to, ti, tu = tags[:3]
    operand, indices, updates = eqn.invars[:3]
    if isinstance(ti, Sum):
        return [_cross_sum(eqn, "indexes by", ti)]
    sums = [t for t in (to, tu) if isinstance(t, Sum)]
    if sums:
        linear = eqn.primitive in (P.scatter_add, P.scatter_sub, P.scatter)
        if ti is None and all(t is None or isinstance(t, Sum) for t in (to, tu)) and linear:
            return [sums[0]]
        return [_cross_sum(eqn, f"applies {eqn.primitive} to", sums[0])]
    dn = eqn.params["dimension_numbers"]
    uwin = tuple(dn.update_window_dims)
    inserted = tuple(dn.inserted_window_dims)
    sdims = tuple(dn.scatter_dims_to_operand_dims)
    obatch = tuple(getattr(dn, "operand_batching_dims", ()))
    ibatch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    oshape, ishape, ushape = _shape(operand), _shape(indices), _shape(updates)
    uscatter = [d for d in range(len(ushape)) if d not in uwin]  # <-> indices' dims but last
    op_win = [d for d in range(len(oshape)) if d not in inserted and d not in obatch]

    def unknown():
        return [Unknown(eqn, "scatters across the batch axis by data (the examples are "
                             "indexed by values, as in graph batching)")]

    comps = it.components(indices) if not _is_literal(indices) else [None] * len(sdims)

    def operand_axis(j):
        """The operand axis that indices' axis ``j`` scatters along, one to one: a
        batching dim, or an index component equal to its position along ``j``
        (``x.at[jnp.arange(B), labels]``); else None."""
        if j in ibatch:
            return obatch[ibatch.index(j)]
        for c, d in enumerate(comps):
            k = sdims[c]
            if d == j and ishape[j] == oshape[k] and (k in inserted or k in obatch):
                return k
        return None

    if ti is not None and ti.axis == len(ishape) - 1:
        return unknown()
    # where the batch axis lies in the operand, as seen from each operand that has it
    want = []
    if to is not None:
        want.append(to)
    if tu is not None:
        u = tu.axis
        if u in uwin:
            k = op_win[uwin.index(u)]
            if k in sdims or ushape[u] != oshape[k] or ti is not None:
                return unknown()
        else:
            k = operand_axis(uscatter.index(u))
            if k is None:
                return unknown()
        want.append(dataclasses.replace(tu, axis=k))
    if ti is not None:
        k = operand_axis(ti.axis)
        if k is None:
            return unknown()
        want.append(dataclasses.replace(ti, axis=k))
    if any(w != want[0] for w in want):
        return unknown()
    k = want[0].axis
    scattered = k in sdims or k in obatch
    if scattered and k not in (operand_axis(j) for j in range(len(ishape) - 1)):
        return unknown()
    if not scattered and k in inserted:
        return unknown()
    return [want[0]]


def _collective(it, eqn, tags):
    """psum/pmax/pmin over mesh axes the examples do not vary over (tensor parallelism)
    add up parts of the same examples."""
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    axes = axes if isinstance(axes, (tuple, list)) else (axes,)
    if all(isinstance(a, str) and a not in it.data_axes for a in axes):
        return list(tags[: len(eqn.outvars)])
    return it.unknown(eqn, tags, "reduces across the devices holding other examples")


# -- structured primitives: they recurse, and see Cross and Unknown operands -- #
def _call(it, eqn, tags):
    jaxpr, _ = compat.call_parts(eqn)
    return it.run(jaxpr, tags)


def _custom(it, eqn, tags):
    jaxpr, _ = compat.custom_call_parts(eqn)
    return it.run(jaxpr, tags)


def _remat(it, eqn, tags):
    return it.run(compat.remat_params(eqn).jaxpr, tags)


def _scan(it, eqn, tags):
    prm = compat.scan_params(eqn)
    nc, ncar = prm.num_consts, prm.num_carry
    level, xs = None, []
    for t in tags[nc + ncar :]:
        if isinstance(t, Ex):
            if t.axis > 0:
                t = dataclasses.replace(t, axis=t.axis - 1)
            elif t.outer == 1 and t.inner == 1:
                level = next(it.levels) if level is None else level
                t = Cur(level)  # lax.map over the examples
            else:
                t = Unknown(eqn, "scans along the batch axis in steps that are not examples")
        xs.append(t)
    carry, ys = it.fixpoint(eqn, prm.jaxpr, tags[:nc], tags[nc : nc + ncar], xs, level)
    out = []
    for t in ys:
        if isinstance(t, Ex):
            t = dataclasses.replace(t, axis=t.axis + 1)
        elif isinstance(t, Cur) and t.level == level:
            t = Ex(0)
        out.append(t)
    return carry + out


def _while(it, eqn, tags):
    wp = compat.while_params(eqn)
    cn, bn = wp.cond_nconsts, wp.body_nconsts
    carry, _ = it.fixpoint(eqn, wp.body, tags[cn : cn + bn], tags[cn + bn :], [])
    seen = {}
    (pred,) = it.run(wp.cond, list(tags[:cn]) + carry, seen)
    if pred is None:
        return carry
    if isinstance(pred, (Ex, Cur)):
        # a batched predicate (jax.vmap of a while_loop): each element of the leading axes
        # stops on its own, so every carry follows the predicate's examples
        return [it.join(eqn, c, pred) for c in carry]
    # a loop that runs until the last example is done: the values of the examples that
    # a batch of one would have stopped earlier are right if the body leaves them alone
    masked = _masked_loop(eqn, wp, carry, seen)
    why = "loops a number of times that depends on the examples"
    return [c if isinstance(c, Cross) or (masked and isinstance(c, Ex)) else Unknown(eqn, why)
            for c in carry]


def _masked_loop(eqn, wp, carry, cond_tags):
    """A loop that runs while any example is unfinished, ``while jnp.any(q)`` with ``q``
    one flag per example, and leaves every finished example unchanged: each carry that
    depends on the examples comes out of the body as ``select_n(q', carry, new)``
    (``jnp.where(q', new, carry)``) with ``q'`` computed like ``q`` (`_Numbering`).
    Extra iterations then change no example that a batch of one would have stopped, and
    the others see the same iterations as alone (examples stop, they never pause)."""
    out = wp.cond.outvars[0]
    red = next((e for e in wp.cond.eqns if out in e.outvars), None)
    if red is None or red.primitive is not P.reduce_or or _is_literal(red.invars[0]):
        return False
    q = red.invars[0]
    if len(_shape(q)) != 1 or cond_tags.get(q) != Ex(0):
        return False
    ex = [isinstance(c, Ex) for c in carry]
    if not any(ex) or any(isinstance(c, Ex) and c != Ex(0) for c in carry):
        return False
    num = _Numbering()
    outer = [num.operand(v) for v in eqn.invars]
    carry_keys = [num.intern(("carry", k)) for k in range(len(carry))]
    cn = wp.cond_nconsts
    num.run(wp.cond, outer[:cn] + carry_keys)
    qkey = num.strip(num.env_of(wp.cond)[q])
    outs = num.run(wp.body, outer[cn : cn + wp.body_nconsts] + carry_keys)
    for k, o in enumerate(outs):
        if not ex[k] or o == carry_keys[k]:
            continue
        node = num.nodes[o]
        if not (node[0] is P.select_n and len(node[2]) == 3 and node[2][1] == carry_keys[k]
                and num.strip(node[2][0]) == qkey):
            return False
    return True


class _Numbering:
    """Value numbering of a loop's cond and body: equal numbers, equal computations.
    Broadcasts along trailing axes (``keepdims``, ``jnp.where``'s broadcast of a
    predicate) are seen through where an elementwise op consumes them (`strip`):
    elementwise ops commute with them."""

    def __init__(self):
        self.ids, self.nodes, self.envs = {}, [], {}

    def intern(self, node):
        i = self.ids.get(node)
        if i is None:
            i = self.ids[node] = len(self.nodes)
            self.nodes.append(node)
        return i

    def operand(self, v):
        """The number of a loop's operand (a variable or literal of the enclosing jaxpr)."""
        if _is_literal(v):
            return self.literal(v)
        return self.intern(("operand", v))

    def literal(self, v):
        val = np.asarray(v.val)
        return self.intern(("literal", str(val.dtype), val.shape, val.tobytes()))

    def env_of(self, jaxpr):
        return self.envs[id(jaxpr)]

    def strip(self, k):
        node = self.nodes[k]
        while node[0] == "trailing":
            k = node[1]
            node = self.nodes[k]
        return k

    def run(self, jaxpr, in_keys):
        env = self.envs[id(jaxpr)] = dict(zip(jaxpr.invars, in_keys))

        def key(v):
            if _is_literal(v):
                return self.literal(v)
            if v not in env:
                env[v] = self.intern(("free", id(v)))
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [key(v) for v in eqn.invars]
            prim = eqn.primitive
            if prim in _CALLS:
                outs = self.run(compat.call_parts(eqn)[0], ins)
            elif _trailing_broadcast(eqn):
                outs = [self.intern(("trailing", ins[0], _shape(eqn.outvars[0])))]
            elif compat.subjaxprs(eqn) or len(eqn.outvars) != 1:
                outs = [self.intern(("opaque", id(eqn), k)) for k in range(len(eqn.outvars))]
            else:
                elementwise = _RULES.get(prim) is _elementwise or _is_elementwise(prim)
                args = tuple(self.strip(k) for k in ins) if elementwise else tuple(ins)
                outs = [self.intern((prim, _freeze(eqn.params), args))]
            env.update(zip(eqn.outvars, outs))
        return [key(v) for v in jaxpr.outvars]


def _trailing_broadcast(eqn):
    """A broadcast that keeps the leading axes in place and adds or expands trailing ones."""
    prim = eqn.primitive
    if len(eqn.invars) != 1 or len(eqn.outvars) != 1:
        return False
    i, o = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if prim is P.broadcast_in_dim:
        return tuple(eqn.params["broadcast_dimensions"]) == tuple(range(len(i)))
    if prim is P.squeeze or (prim is P.reshape and eqn.params.get("dimensions") is None):

        def strip(s):
            s = list(s)
            while s and s[-1] == 1:
                s.pop()
            return s

        return strip(i) == strip(o)
    return False


def _freeze(params):
    out = []
    for k in sorted(params):
        v = params[k]
        try:
            hash(v)
        except TypeError:
            v = ("unhashable", id(v))
        out.append((k, v))
    return tuple(out)


def _cond(it, eqn, tags):
    idx, ops = tags[0], tags[1:]
    outs = None
    for br in compat.cond_branches(eqn):
        o = it.run(br, ops)
        outs = o if outs is None else [it.join(eqn, a, b) for a, b in zip(outs, o)]
    if idx is None:
        return outs
    n = len(outs)
    if isinstance(idx, (Cross, Unknown)):
        return [idx] * n
    if isinstance(idx, Sum):
        return [_cross_sum(eqn, "branches on", idx)] * n
    return [it.join(eqn, idx, o) for o in outs]


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


_CALLS = tuple(p for p in (compat.jit_p, compat.closed_call_p, compat.call_p) if p is not None)

_STRUCTURED = _table([
    (_CALLS, _call),
    (compat.custom_prims, _custom),
    ((compat.remat_p,), _remat),
    ((compat.scan_p,), _scan),
    ((compat.while_p,), _while),
    ((compat.cond_p,), _cond),
])

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
    ((P.psum, P.pmax, P.pmin, P.psum_invariant), _collective),
    ((P.select_n, P.clamp, P.random_wrap, P.convert_element_type, P.reduce_precision,
      P.add_jaxvals, P.real, P.imag, P.conj), _elementwise),
])

# elementwise ops through which a sum over the batch stays one
_LINEAR = frozenset(
    p for p in (
        P.add, P.sub, P.add_jaxvals, P.neg, P.convert_element_type, P.reduce_precision,
        P.real, P.imag, P.conj, *_IDENTITY,
    ) if p is not None
)

_TRACKED = frozenset(
    p for p in (
        P.iota, P.convert_element_type, P.copy, P.broadcast_in_dim, P.reshape, P.lt,
        P.select_n, P.concatenate,
    ) if p is not None
)


# --------------------------------------------------------------------------- #
# The verdict
# --------------------------------------------------------------------------- #
INDEPENDENT = "independent"
CROSS = "cross-example"
UNDECIDED = "undecided"
SKIPPED = "not checked"

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _path_to(jaxpr, target):
    """The equations from ``jaxpr``'s down to ``target`` (found by identity), or None."""
    for eqn in jaxpr.eqns:
        if eqn is target:
            return [eqn]
        for sub in compat.subjaxprs(eqn):
            inner = _path_to(getattr(sub, "jaxpr", sub), target)
            if inner is not None:
                return [eqn, *inner]
    return None


def _where(eqn, root):
    """``prim`` at the innermost user line, and the line in the user's function calling it.
    Equations traced inside a library's ``jit`` (``jnp.nanmean``) record no user frame:
    they are placed at the nearest enclosing call that does."""
    path = _path_to(root, eqn) or [eqn]
    what = f"`{eqn.primitive}`"
    for outer in reversed(path):
        frames = compat.user_frames(outer, _PACKAGE_DIR)
        if frames:
            name = outer.params.get("name") if outer is not eqn else None
            if isinstance(name, str):
                what += f" (in {name})"
            break
    if not frames:
        return what
    where = f"{what} at {frames[0]}"
    if len(frames) > 1:
        where += f", called from {frames[-1]}"
    return where


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the check found: ``kind`` is ``"independent"``, ``"cross-example"``,
    ``"undecided"`` or ``"not checked"``; ``detail`` says where and why."""

    kind: str
    detail: str = ""

    def __str__(self):
        return self.kind + (f": {self.detail}" if self.detail else "")


def _describe(tag, root):
    text = f"{_where(tag.eqn, root)} {tag.why}"
    via = getattr(tag, "via", None)
    if via is not None:
        text += f", computed by {_where(via, root)}"
    return text


def batch_loss_jaxpr(prep):
    """The jaxpr of the batch loss (the first output of ``fn``) on the call's arguments."""

    def loss_of(diff_leaves, ex_leaves, other_leaves):
        out = prep.fn(*prep.rebuild(diff_leaves, ex_leaves, other_leaves, one_example=False))
        return prep.split_out(out)[0]

    try:
        return jax.make_jaxpr(loss_of)(prep.diff_leaves, prep.ex_leaves, prep.other_leaves)
    except Exception as e:
        e.add_note(
            f"jaxpr_surgery: raised tracing fn on the whole batch (B={prep.B}), which the "
            "cross-example check of the loss does; fn must accept the batch, or pass "
            "check=False."
        )
        raise


def verdict(prep, data_axes=frozenset()) -> Verdict:
    """Traces the batch loss of ``prep`` (an api._Prepared) and decides whether it is a
    (weighted) mean of per-example terms."""
    if not prep.opts.keep_batch_dim:
        return Verdict(SKIPPED, "keep_batch_dim=False: fn is written for one example")
    if prep.B == 1:
        return Verdict(INDEPENDENT, "a batch of one example")
    closed = batch_loss_jaxpr(prep)
    tags = ([None] * len(prep.diff_leaves) + [Ex(0)] * len(prep.ex_leaves)
            + [None] * len(prep.other_leaves))
    (out,) = _Interp(prep.B, frozenset(data_axes)).run(closed.jaxpr, tags)[:1]
    if out is None or isinstance(out, Sum):
        return Verdict(INDEPENDENT, "")
    if isinstance(out, Cross):
        return Verdict(CROSS, _describe(out, closed.jaxpr))
    if isinstance(out, Unknown):
        return Verdict(UNDECIDED, _describe(out, closed.jaxpr))
    # a scalar loss cannot keep the batch axis; anything else is a bug of this module
    return Verdict(UNDECIDED, f"the loss has an unexpected tag {out}")  # pragma: no cover


def check(prep, name, data_axes=frozenset()):
    """Raises `CrossExampleError` when the examples of the batch loss interact, warns
    `CrossExampleWarning` when the jaxpr cannot decide."""
    v = verdict(prep, data_axes)
    if v.kind == CROSS:
        raise CrossExampleError(
            f"{name}: the loss is not a mean of per-example terms: {v.detail}. The examples "
            "of the batch interact, so per-example gradients of this loss are not defined: "
            "every statistic would describe each example alone in a batch of one, and "
            "mean() would differ from jax.grad. Fix: normalise per example (e.g. divide each "
            "example's token sum by its own token count, take the mean over examples, and "
            "pass example_weights=<each example's token count> to the returned function: "
            "mean() is then jax.grad of the loss normalised by the batch's token count; run "
            "batch norm in inference mode; take negatives from outside the batch), or pass "
            "check=False to compute the statistics of the batch-of-one losses anyway."
        )
    if v.kind == UNDECIDED:
        warnings.warn(
            f"{name}: could not prove from the jaxpr that the loss is a mean of per-example "
            f"terms: {v.detail}. If the examples interact, every statistic describes each "
            "example alone in a batch of one. Run js.check_per_example(fn)(*args) once on "
            "a real batch to check numerically, and pass check=False to silence this warning.",
            CrossExampleWarning,
            stacklevel=_user_stacklevel(),
        )
    return v


def _user_stacklevel():
    """The stack level of the first frame outside this package and jax (the user's call)."""
    jax_dir = os.path.dirname(os.path.abspath(jax.__file__))
    f, level = sys._getframe(1), 1
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not (path.startswith(_PACKAGE_DIR) or path.startswith(jax_dir)):
            return level
        f, level = f.f_back, level + 1
    return 2

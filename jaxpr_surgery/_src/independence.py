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
* `Ex` ``(axis, outer, inner, perm)`` -- along ``axis`` (of size ``outer * B * inner``:
  the batch axis, possibly merged with its neighbours by reshapes) element ``i`` depends
  on example ``(i // inner) % B`` only; the other axes are free. Slices, ``rev``, ``pad``,
  ``concatenate`` and ``split`` along the batch axis move the examples: ``perm`` then
  names the example at each position (-1: none), so that ``jnp.roll(k, 1, axis=0)`` or
  ``x[::-1]`` meeting ``x`` pairs different examples, and a sum counting some examples
  more often than others (``losses[:k]``) is told from one counting each once;
* `Cur` -- inside the body of a scan over the batch axis (``lax.map`` over examples, or
  a ``fori_loop`` from 0 to B that reads ``x[i]``): it depends on the current example;
* `One` -- a single example taken out of the batch (``x[i]``, ``jnp.unstack``, a Python
  loop over the batch): every element depends on that example only;
* `Sum` -- a sum over examples of per-example terms (``reduce_sum`` over the batch axis,
  a contraction of it with a constant or with another example-aligned value), closed
  under the linear operations (+, -, multiplication or division by a constant, layout);
  `Acc` is the carry of such a loop that adds each example's term to it. Terms of
  examples taken out one by one (``sum(loss(x[i]) for i in range(B))``) make a *partial*
  sum: per term the weight of each example and a key of what computed it (`_Interp.key`:
  the same operations on each example's own values, the example's position left out).
  The loss is a mean of per-example terms when every term weighs all examples alike;
* `Cross` -- the examples interact: where it arose (an equation, and the reduction over
  the batch it combined with per-example values or used non-linearly);
* `Unknown` -- the jaxpr cannot decide (a gather or scatter across the batch axis by
  data, as in graph batching; a primitive without a rule; a psum over a named axis the
  call does not know, which is at least its operand: `Unknown.under`).

Beside the tags, values tagged None may be *lined up* with the batch (`Lined`): an axis
of size B whose entries differ by position (an argument outside ``batch_argnums``,
``jnp.arange(B)``, random bits of one key with the batch's shape). Where such an axis
meets the batch axis element by element, in a contraction or as the indices (or updates)
of a gather or scatter along it, example b meets entry b in the batch loss, but example b
alone in a batch of one meets all B entries: `Cross`, naming the value and its fix. A
value that merely has an axis of size B (a ``[d, B]`` weight) is never a signal; only its
meeting the batch axis is.

The loss must come out ``None`` or `Sum` (a partial one weighing every example alike):
`Cross` raises `CrossExampleError`, `Unknown` warns with `CrossExampleWarning`. Rules are
keyed by primitive objects; an unknown primitive touching the examples gives `Unknown`,
never a false alarm.
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

from jaxpr_surgery._src import compat, fingerprint

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
    # where the examples are not in batch order along ``axis`` (outer = inner = 1 only):
    # the example at each position, -1 for none (padding); None: position i is example i
    perm: tuple | None = None
    by: Any = dataclasses.field(default=None, compare=False)  # the eqn that reordered them


@dataclasses.dataclass(frozen=True)
class Cur:
    level: int


@dataclasses.dataclass(frozen=True)
class One:
    """A value of one example taken out of the batch (``x[i]``, ``jnp.unstack``, a
    Python loop over the batch): every element depends on example ``example`` only."""

    example: int
    by: Any = dataclasses.field(default=None, compare=False)  # the eqn that took it out


@dataclasses.dataclass(frozen=True)
class Sum:
    origin: Any = dataclasses.field(default=None, compare=False)  # the eqn summing examples
    # a partial sum of the terms of examples taken out one by one (`One`): pairs (key of
    # what computed the term, the weight of each example); empty: all examples alike
    terms: frozenset = frozenset()
    by: Any = dataclasses.field(default=None, compare=False)  # an eqn taking one out


@dataclasses.dataclass(frozen=True)
class Acc(Sum):
    """The carry of a loop over the examples (`Cur` of ``level``) that adds up their
    terms: each iteration adds the current example's; a `Sum` once the loop is done."""

    level: int = -1


@dataclasses.dataclass(frozen=True)
class Lined:
    """A value that does not depend on the examples but has an axis of size B whose
    entries differ by position (a non-batch argument, ``jnp.arange(B)``, random bits of
    one key): where it meets the batch axis element by element, example b meets entry b,
    but example b alone (a batch of one) meets all B entries."""

    what: str
    fix: str = ""
    eqn: Any = None  # the equation that computed it, if any
    # the position itself (iota): also how a loss addresses each example's own rows
    # (graph batching offsets node ids by the graph's position), so only its use as a
    # value (a float result) lines it up
    position: bool = False


@dataclasses.dataclass(frozen=True)
class Cross:
    eqn: Any = dataclasses.field(compare=False)
    why: str = dataclasses.field(compare=False)
    via: Any = dataclasses.field(default=None, compare=False)  # the Sum's eqn it combined
    how: str = dataclasses.field(default="computed by", compare=False)  # words before `via`
    fix: str = dataclasses.field(default="", compare=False)  # the fix, where not the usual


@dataclasses.dataclass(frozen=True)
class Unknown:
    eqn: Any = dataclasses.field(compare=False)
    why: str = dataclasses.field(compare=False)
    # where known, the tag the value has at least (a psum over an axis that may hold
    # other examples is at least its operand): what it meets is `Cross` where that is
    under: Any = dataclasses.field(default=None, compare=False)


_MAX_ROUNDS = 8  # fixpoint of loop carries (the lattice is 4 high)


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


_ACC_WHY = ("carries the examples' values from one iteration of a loop over the examples "
            "into the next other than as a running sum of their terms (it weighs or combines "
            "the examples)")


def _paired(eqn, i, other):
    """Example ``i`` combined with another example (``other``, a `One`), each taken out of
    the batch."""
    return Cross(eqn, f"combines example {i} with example {other.example}, each taken out "
                      "of the batch", other.by, how=f"example {other.example} taken out by",
                 fix=_PAIRED_FIX)


def _cross_sum(eqn, what, s):
    return Cross(eqn, f"{what} a sum over the batch", s.origin)


def _alike(w) -> bool:
    """Whether the weights ``w`` of a partial sum's term count every example alike."""
    w = np.asarray(w, float)
    return bool(np.allclose(w, w[0], rtol=1e-9, atol=1e-9 * max(1.0, float(np.abs(w).max()))))


def _partial(eqn, terms: dict, by) -> Sum:
    """The sum of ``terms`` (key -> the weight of each example): a plain `Sum` where every
    term weighs the examples alike."""
    if all(_alike(w) for w in terms.values()):
        return Sum(eqn)
    return Sum(eqn, frozenset((k, tuple(float(x) for x in w)) for k, w in terms.items()), by)


def _scaled(s: Sum, c: float) -> Sum:
    """The partial sum ``s`` times the constant ``c``."""
    return _partial(s.origin, {k: c * np.asarray(w) for k, w in s.terms}, s.by)


def _literal_scalar(v):
    """The value of ``v`` where it is a real scalar literal, else None."""
    if not _is_literal(v) or np.ndim(v.val) != 0 or np.iscomplexobj(v.val):
        return None
    return float(v.val)


_ONE_BY_ONE_FIX = (
    "compute the terms of all examples at once, as one array along the batch axis "
    "(vectorised code, or jax.vmap / lax.map of the loss of one example), and take their "
    "mean or sum; to weigh the examples, pass example_weights= to the returned function"
)


_PAIRED_FIX = (
    "compute each example's term from that example alone (x[i] with x[i], never with x[j]: "
    "a term that pairs examples, or normalises one by others, has no per-example gradient), "
    "as one array along the batch axis (vectorised code, or jax.vmap / lax.map of the loss "
    "of one example)"
)


def _examples(bs) -> str:
    shown = ", ".join(str(b) for b in bs[:6]) + (f", ... ({len(bs)} in all)" if len(bs) > 6
                                                  else "")
    return f"example{'s' if len(bs) > 1 else ''} {shown}"


def _uneven(s: Sum) -> str:
    """Why the partial sum ``s`` is not a mean of per-example terms."""
    if len(s.terms) > 1:
        return ("adds up the terms of examples taken out of the batch one by one (x[i], "
                "jnp.unstack, a Python loop over the batch) that are not computed alike (by "
                "the same operations on each example's own values), so they are not one "
                "per-example loss")
    ((_, w),) = s.terms
    groups: dict = {}
    for b, x in enumerate(w):  # relative to the least counted (a sum of every example's
        groups.setdefault(float(f"{x - min(w):.12g}"), []).append(b)  # term adds to all)
    least = groups.pop(0.0)
    more = "; ".join(f"{_examples(bs)} {'count' if len(bs) > 1 else 'counts'} {x:g}"
                     for x, bs in sorted(groups.items(), key=lambda kv: kv[1][0]))
    return ("weighs the examples taken out of the batch one by one (x[i], jnp.unstack, a "
            f"Python loop over the batch) unequally: {more} more than {_examples(least)}")


def _positions(t: Ex, n: int) -> tuple:
    """The example at each position along ``t``'s axis (of size ``n``)."""
    return t.perm if t.perm is not None else tuple(range(n))


def _single(t):
    """The one example at every position of ``t``'s axis (padding aside), or None."""
    if not isinstance(t, Ex) or t.perm is None:
        return None
    got = {i for i in t.perm if i >= 0}
    return got.pop() if len(got) == 1 else None


def _reordered(t: Ex, perm, B: int, eqn) -> Ex:
    """``t`` with the examples at ``perm`` along its axis (batch order: no perm)."""
    perm = tuple(int(i) for i in perm)
    if perm == tuple(range(B)):
        return dataclasses.replace(t, perm=None, by=None)
    return dataclasses.replace(t, perm=perm, by=eqn)


def _moved(t: Ex, perm, B: int, eqn):
    """`_reordered`, or `One` where the positions hold one example (``x[i:i + 1]``: every
    element depends on it alone, wherever later layout changes move that axis)."""
    t = _reordered(t, perm, B, eqn)
    i = _single(t)
    return t if i is None else One(i, eqn)


def _equal_weights(t: Ex, B: int) -> bool:
    """Whether a sum along ``t``'s axis counts every example equally often."""
    if t.perm is None:
        return True
    counts = np.bincount([i for i in t.perm if i >= 0], minlength=B)
    return bool(counts.min() > 0 and (counts == counts[0]).all())


def _merge_positions(a: tuple, b: tuple):
    """Position by position the one example of ``a`` and ``b`` (-1 meets anything), or
    None where two different examples meet."""
    out = []
    for i, j in zip(a, b):
        if i >= 0 and j >= 0 and i != j:
            return None
        out.append(i if i >= 0 else j)
    return tuple(out)


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
class _Frame:
    """One run of a jaxpr by `_Interp`: its variables' tags (``env``), the enclosing
    jaxpr's atoms bound to its inputs (``outer``, in ``parent``), and the keys of its
    variables (`_Interp.key`) numbered so far (its first ``done`` equations)."""

    def __init__(self, jaxpr, env, outer, parent, serial):
        self.jaxpr, self.env, self.outer, self.parent = jaxpr, env, outer, parent
        self.serial = serial
        self.keys: dict = {}
        self.defs: dict = {}  # variable -> the equation computing it, once numbered
        self.calls: dict = {}  # id of a call-like equation -> the frame that ran its body
        self.done = 0
        self.inputs = None


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
        # the counter of a loop over the examples (fori_loop from 0 to B) -> its level
        self.counter: dict = {}
        # values that do not depend on the examples (tag None), per axis of size B whose
        # entries differ by position: axis -> `Lined`
        self.lined: dict = {}
        # the jaxprs being run, innermost last, and the keys of what computed a value
        # (`key`): interned nodes, jaxprs' keys by id, objects whose id is in a key
        self.frames: list = []
        self.serials = itertools.count()
        self.nodes: dict = {}
        self.jaxpr_keys: dict = {}
        self.pinned: list = []

    def run(self, jaxpr, in_tags, env=None, outer=None, call=None):
        """The tags of ``jaxpr``'s outputs; ``env`` (a dict) receives every variable's.
        ``outer``: the enclosing jaxpr's atoms bound to (some of) ``jaxpr``'s inputs;
        ``call``: the enclosing call-like equation whose body ``jaxpr`` is."""
        env = {} if env is None else env
        for v, t in zip(jaxpr.invars, in_tags):
            env[v] = t

        def read(v):
            return None if _is_literal(v) else env.get(v)

        parent = self.frames[-1] if self.frames else None
        frame = _Frame(jaxpr, env, outer, parent, next(self.serials))
        if call is not None and parent is not None:
            parent.calls[id(call)] = frame  # its results' keys are its body's (`number`)
        self.frames.append(frame)
        try:
            for eqn in jaxpr.eqns:
                tags = [read(v) for v in eqn.invars]
                if eqn.primitive in _TRACKED:
                    self.track(eqn)
                if all(t is None for t in tags):
                    outs = [None] * len(eqn.outvars)  # a function of constants only
                    self.follow_lined(eqn)
                else:
                    for v in eqn.outvars:  # tagged by the rules; calls pass theirs out
                        self.lined.pop(v, None)
                    outs = self.eqn(eqn, tags)
                for v, t in zip(eqn.outvars, outs):
                    env[v] = t
        finally:
            self.frames.pop()
        return [read(v) for v in jaxpr.outvars]

    # -- what computed a value: keys ------------------------------------------ #
    def intern(self, node) -> int:
        k = self.nodes.get(node)
        if k is None:
            k = self.nodes[node] = len(self.nodes)
        return k

    def pin(self, obj) -> int:
        """``id(obj)``, valid as long as this interpreter (which keeps ``obj`` alive)."""
        self.pinned.append(obj)
        return id(obj)

    def key(self, v, frame=None) -> int:
        """A key of what computed ``v`` (in the innermost jaxpr being run, or ``frame``):
        equal keys, equal operations on equal inputs (the enclosing jaxprs' inputs, by
        variable, and literals, by value), where the position of the example taken out
        of the batch axis is left out: ``f(x[0])`` and ``f(x[1])`` have one key, so the
        terms of a loop over the examples can be told to be one per-example function.
        Computed on demand, equation by equation up to ``v``'s."""
        frame = self.frames[-1] if frame is None else frame
        if _is_literal(v):
            val = np.asarray(v.val)
            return self.intern(("literal", str(val.dtype), val.shape, val.tobytes()))
        got = frame.keys.get(v)
        if got is not None:
            return got
        if frame.inputs is None:
            frame.inputs = {*frame.jaxpr.invars, *frame.jaxpr.constvars}
        if v in frame.inputs:
            src = frame.outer.get(v) if frame.outer else None
            got = (self.key(src, frame.parent) if src is not None
                   else self.intern(("input", frame.serial, self.pin(v))))
            frame.keys[v] = got
            return got
        eqns = frame.jaxpr.eqns
        while v not in frame.keys and frame.done < len(eqns):
            frame.done += 1
            self.number(eqns[frame.done - 1], frame)
        if v not in frame.keys:  # pragma: no cover - every variable is an input or defined
            frame.keys[v] = self.intern(("input", frame.serial, self.pin(v)))
        return frame.keys[v]

    def number(self, eqn, frame):
        """The keys of ``eqn``'s results (`key`); a call's are its body's."""
        body = frame.calls.get(id(eqn))
        if body is not None and len(body.jaxpr.outvars) == len(eqn.outvars):
            for o, b in zip(eqn.outvars, body.jaxpr.outvars):
                frame.keys[o] = self.key(b, body)
                frame.defs[o] = eqn
            return
        prim, params = eqn.primitive, dict(eqn.params)
        ins = [self.key(v, frame) for v in eqn.invars]
        tags = [None if _is_literal(v) else frame.env.get(v) for v in eqn.invars]
        same = False  # every result has one key (the examples' positions left out)
        t = tags[0] if tags else None
        if isinstance(t, Ex):  # moves the examples along the batch axis: say not where
            a, nd = t.axis, len(_shape(eqn.invars[0]))
            if prim is P.slice:
                for name in ("start_indices", "limit_indices", "strides"):
                    if params.get(name) is not None:
                        params[name] = tuple(None if j == a else x
                                             for j, x in enumerate(params[name]))
            elif prim is P.dynamic_slice:
                ins[1 + a] = -1
            elif prim is P.pad:
                params["padding_config"] = tuple(
                    None if j == a else tuple(c) for j, c in enumerate(params["padding_config"]))
            elif prim in (P.split, compat.unstack_p) and params["axis"] % nd == a:
                params.pop("sizes", None)
                same = True
        if prim in (P.concatenate, compat.stack_p) and any(
                isinstance(u, One) or (isinstance(u, Ex) and u.axis == params.get("dimension"))
                for u in tags):  # examples side by side along the batch axis: their order
            ins = sorted(set(ins))  # is in the tags
        node = (prim, self.params_key(eqn.primitive, params), tuple(ins))
        for k, o in enumerate(eqn.outvars):
            frame.keys[o] = self.intern((node, 0 if same else k))
            frame.defs[o] = eqn

    def constant(self, v, frame=None, depth=0):
        """The value of a scalar ``v`` computed from literals alone (the index of
        ``lax.dynamic_index_in_dim(x, i)`` after jnp's wrap-around of negative indices),
        else None."""
        frame = self.frames[-1] if frame is None else frame
        if _is_literal(v):
            return np.asarray(v.val) if np.ndim(v.val) == 0 else None
        if _shape(v) or depth > 16:
            return None
        self.key(v, frame)  # numbers the equations up to v's
        e = frame.defs.get(v)
        if e is None:
            src = frame.outer.get(v) if frame.outer else None
            return None if src is None else self.constant(src, frame.parent, depth + 1)
        if frame.calls.get(id(e)) is not None or len(e.outvars) != 1:
            return None
        ins = [self.constant(u, frame, depth + 1) for u in e.invars]
        if any(x is None for x in ins):
            return None
        if e.primitive is P.select_n:
            return ins[1 + int(ins[0])]
        if e.primitive is P.convert_element_type:
            return ins[0].astype(e.params["new_dtype"])
        fold = _FOLD.get(e.primitive)
        return None if fold is None else np.asarray(fold(*ins))

    def term_key(self, v) -> int:
        """The `key` of ``v``, a term of a partial sum, less the values added to it that
        do not depend on the examples (a sum over the batch plus a constant is one, and
        Python's ``sum`` starts from 0)."""
        frame = self.frames[-1]
        self.key(v)
        e = frame.defs.get(v)
        while e is not None and e.primitive in _ADDING:
            a, b = e.invars
            ta, tb = (None if _is_literal(u) else frame.env.get(u) for u in (a, b))
            if tb is None and isinstance(ta, One):
                v = a
            elif ta is None and isinstance(tb, One) and e.primitive is not P.sub:
                v = b
            else:
                break
            self.key(v)
            e = frame.defs.get(v)
        return self.key(v)

    def params_key(self, prim, params):
        custom = prim in _CUSTOM  # their rules' callables: the primal is in the jaxpr
        return tuple((name, self.param_key(params[name], custom)) for name in sorted(params))

    def param_key(self, value, custom):
        if isinstance(value, compat.ClosedJaxpr):
            return ("closed", self.jaxpr_key(value.jaxpr),
                    tuple(self.pin(c) for c in value.consts))
        if isinstance(value, compat.Jaxpr):
            return ("open", self.jaxpr_key(value))
        if isinstance(value, (tuple, list)):
            return tuple(self.param_key(x, custom) for x in value)
        if custom and callable(value):
            return "rule"
        try:
            return fingerprint.value_key(value)
        except fingerprint.Unkeyable:
            return ("object", self.pin(value))

    def jaxpr_key(self, jaxpr) -> int:
        """A key of ``jaxpr`` as a function of its inputs (`key`, by position)."""
        got = self.jaxpr_keys.get(id(jaxpr))
        if got is not None and got[0] is jaxpr:
            return got[1]
        frame = _Frame(jaxpr, {}, None, None, next(self.serials))
        for i, v in enumerate(jaxpr.invars):
            frame.keys[v] = self.intern(("argument", i))
        for i, v in enumerate(jaxpr.constvars):
            frame.keys[v] = self.intern(("constant", i))
        for eqn in jaxpr.eqns:
            self.number(eqn, frame)
        frame.done = len(jaxpr.eqns)
        k = self.intern(("jaxpr", tuple(self.key(o, frame) for o in jaxpr.outvars)))
        self.jaxpr_keys[id(jaxpr)] = (jaxpr, k)
        return k

    def eqn(self, eqn, tags):
        prim, n = eqn.primitive, len(eqn.outvars)
        structured = _STRUCTURED.get(prim)
        if structured is not None:  # recurses: sees Cross and Unknown operands itself
            return structured(self, eqn, tags)
        for t in tags:
            if isinstance(t, Cross):
                return [t] * n
        doubt = next((t for t in tags if isinstance(t, Unknown)), None)
        if doubt is not None:
            if any(isinstance(t, Unknown) and t.under is None for t in tags):
                return [doubt] * n
            outs = self.eqn(eqn, [t.under if isinstance(t, Unknown) else t for t in tags])
            return [o if o is None or isinstance(o, (Cross, Unknown))
                    else dataclasses.replace(doubt, under=o) for o in outs]
        live = [t for t in tags if t is not None]
        collective = prim in _COLLECTIVES  # a named axis may hold other examples
        if (not collective and isinstance(live[0], (Cur, One))
                and all(t == live[0] for t in live)):
            return [live[0]] * n  # any function of one example and constants
        rule = _RULES.get(prim)
        if rule is None and _is_elementwise(prim):
            rule = _elementwise
        if rule is None:
            return self.unknown(eqn, tags, "has no rule here (a primitive the check does not know)")
        one = next((t for t in live if isinstance(t, One)), None)
        if one is not None and not collective and rule not in _SIDE_BY_SIDE:
            return [self.picked(eqn, live, one)] * n
        parts = any(isinstance(t, Sum) and t.terms for t in live)
        if parts and rule is not _elementwise and sum(
                isinstance(t, (Sum, One)) for t in live) > 1:
            return [Unknown(eqn, "combines sums of examples taken out of the batch one by one "
                                 "in a way the check does not follow")] * n
        if rule is not _elementwise and not collective and any(isinstance(t, Cur) for t in live):
            return [Unknown(eqn, "combines the current example of a loop over the examples "
                                 "with other values")] * n
        acc = next((t for t in live if isinstance(t, Acc)), None)
        if acc is not None and rule is not _elementwise and rule is not _identity:
            return [Cross(eqn, _ACC_WHY, acc.origin, how="in the loop")] * n
        outs = rule(self, eqn, tags)
        if parts and rule is not _elementwise and prim not in _TRANSPARENT:
            outs = self.rekeyed(eqn, tags, outs)
        return outs

    def picked(self, eqn, live, one: One):
        """An operation (other than elementwise, or putting values side by side) on a value
        of one example taken out of the batch and on other values of the examples."""
        i = one.example
        for t in live:
            if isinstance(t, One) and t.example != i:
                return _paired(eqn, i, t)
            if isinstance(t, Sum):
                return _cross_sum(eqn, f"combines example {i}, taken out of the batch, with", t)
            if isinstance(t, (Ex, Cur)) and _single(t) != i:
                return Cross(eqn, f"combines example {i}, taken out of the batch, with the "
                                  "values of other examples", one.by,
                             how=f"example {i} taken out by", fix=_PAIRED_FIX)
        return Unknown(eqn, f"combines example {i}, taken out of the batch, with a slice of "
                            "the batch that holds it")

    def rekeyed(self, eqn, tags, outs):
        """The results of an operation other than + and - on a partial sum (`Sum.terms`)
        and constants: the keys of its terms record the operation and the constants."""
        pos = next(j for j, t in enumerate(tags) if isinstance(t, Sum) and t.terms)
        node = (eqn.primitive, self.params_key(eqn.primitive, eqn.params), pos,
                tuple(-1 if j == pos else self.key(v) for j, v in enumerate(eqn.invars)))
        res = []
        for k, o in enumerate(outs):
            if isinstance(o, Sum) and o.terms:
                o = dataclasses.replace(o, terms=frozenset(
                    (self.intern(("through", node, k, key)), w) for key, w in o.terms))
            res.append(o)
        return res

    @staticmethod
    def unknown(eqn, tags, why):
        for t in tags:
            if isinstance(t, Cross):
                return [t] * len(eqn.outvars)
        return [Unknown(eqn, why)] * len(eqn.outvars)

    # -- combining operands ------------------------------------------------ #
    def meet(self, eqn, tags):
        """Operands combined element by element: their common `Ex`/`Cur`/`One`, a
        `Cross`, or None when no operand depends on individual examples."""
        ex = [t for t in tags if isinstance(t, (Ex, Cur, One))]
        sums = [t for t in tags if isinstance(t, Sum)]
        if ex and sums:
            return _cross_sum(eqn, "combines per-example values with", sums[0])
        one = next((t for t in ex if isinstance(t, One)), None)
        if one is not None and any(t != one for t in ex):
            return self.meet_one(eqn, ex, one)
        if ex and any(t != ex[0] for t in ex):
            merged = self.merge(ex)
            if merged is not None:
                return merged
            by = next((t.by for t in ex if isinstance(t, Ex) and t.by is not None), None)
            return Cross(eqn, "combines values of different examples", by, how="reordered by")
        return ex[0] if ex else None

    def meet_one(self, eqn, ex, one: One):
        """A value of one example taken out of the batch met element by element by other
        values of the examples: a slice of the batch holding that example alone (a
        ``x[i:i + 1]``) keeps it, anything else combines examples."""
        i = one.example
        for t in ex:
            if isinstance(t, One) and t.example != i:
                return _paired(eqn, i, t)
        grid = [t for t in ex if isinstance(t, Ex)]
        if grid and len(grid) + sum(isinstance(t, One) for t in ex) == len(ex):
            merged = self.merge([dataclasses.replace(grid[0], perm=(i,), by=one.by), *grid])
            if merged is not None:
                return merged
        return Cross(eqn, f"combines example {i}, taken out of the batch, with the values of "
                          "other examples", one.by, how=f"example {i} taken out by",
                     fix=_PAIRED_FIX)

    def added(self, eqn, tags):
        """Values of single examples (`One`) and sums added or subtracted: the terms of
        a (partial) sum."""
        terms: dict = {}
        by = None
        for j, (v, t) in enumerate(zip(eqn.invars, tags)):
            sign = -1.0 if eqn.primitive is P.sub and j == 1 else 1.0
            if isinstance(t, One):
                w = np.zeros(self.B)
                w[t.example] = sign
                got = [(self.term_key(v), w)]
            elif isinstance(t, Sum):
                got = [(k, sign * np.asarray(w)) for k, w in t.terms]
            else:
                continue
            by = by or t.by
            for k, w in got:
                terms[k] = terms.get(k, 0.0) + w
        return _partial(eqn, terms, by)

    def merge(self, ex):
        """`Ex` tags along one axis whose examples agree position by position (where one
        has padding, -1, the other's example; one example alone at a size-1 axis meets
        every position): their common tag, else None."""
        first = ex[0]
        if not all(isinstance(t, Ex) and (t.axis, t.outer, t.inner) == (first.axis, 1, 1)
                   for t in ex):
            return None
        n = max(self.B if t.perm is None else len(t.perm) for t in ex)
        pos = None
        for t in ex:
            mine = _positions(t, self.B)
            if len(mine) == 1:
                mine = mine * n
            elif len(mine) != n:
                return None
            pos = mine if pos is None else _merge_positions(pos, mine)
            if pos is None:
                return None
        by = next((t.by for t in ex if t.by is not None), None)
        return _reordered(first, pos, self.B, by)

    def elementwise(self, eqn, tags):
        n = len(eqn.outvars)
        acc = next((t for t in tags if isinstance(t, Acc)), None)
        if acc is not None:
            return [self.accumulate(eqn, tags, acc)] * n
        if (eqn.primitive in _ADDING and any(isinstance(t, One) for t in tags)
                and all(t is None or isinstance(t, (One, Sum)) for t in tags)):
            return [self.added(eqn, tags)] * n  # sum(loss(x[i]) for i in range(B))
        t = self.meet(eqn, tags)
        if isinstance(t, Cross):
            return [t] * n
        if t is None:  # sums (and constants) only
            return [self.linear(eqn, tags)] * n
        if isinstance(t, Cur):
            return [t] * n
        lined = self.lined_up(eqn, tags, t)
        if lined is not None:
            return [lined] * n
        # shape-changing vectorized ops (random_bits, bitcast_convert_type) keep the
        # leading axes up to the batch axis
        src = next(_shape(v) for v, u in zip(eqn.invars, tags) if u == t)
        outs = []
        for v in eqn.outvars:
            o = _shape(v)
            ok = len(o) > t.axis and o[: t.axis + 1] == src[: t.axis + 1]
            outs.append(t if ok else Unknown(eqn, "changes the shape around the batch axis"))
        return outs

    def lined_up(self, eqn, tags, t: Ex, pairs=None, index=False):
        """A `Cross` where an operand that does not depend on the examples has, at the
        batch axis of ``t``, an axis of size B whose entries differ by position
        (`Lined`). ``pairs``: (operand, its axis that meets the batch axis), default
        every operand tagged None at ``t.axis`` (element by element). ``index``: the
        operands are indices that pick the examples (a position from ``jnp.arange`` is
        how a loss addresses its examples there, not a value)."""
        if t.outer != 1 or t.inner != 1:
            return None
        if pairs is None:
            pairs = [(v, t.axis) for v, u in zip(eqn.invars, tags) if u is None]
        for v, a in pairs:
            if _is_literal(v):
                continue
            src = self.lined.get(v, {}).get(a)
            if src is None or _shape(v)[a] != self.B:
                continue
            if src.position and (index or not jax.numpy.issubdtype(
                    eqn.outvars[0].aval.dtype, jax.numpy.inexact)):
                continue
            return Cross(
                eqn, f"lines up each example with the entry at its position along an axis of "
                f"size B={self.B} (alone in a batch of one, an example meets all {self.B} "
                f"entries) of {src.what}", src.eqn, fix=src.fix)
        return None

    def linear(self, eqn, tags):
        """An elementwise op on sums over the batch and constants. On a partial sum
        (`Sum.terms`) + and - add up the terms, a literal factor scales their weights, and
        any other linear op is recorded in their keys (`rekeyed`)."""
        prim = eqn.primitive
        sums = [t for t in tags if isinstance(t, Sum)]
        partial = any(t.terms for t in sums)
        if prim in _ADDING:
            return self.added(eqn, tags) if partial else sums[0]
        if prim in _LINEAR:
            if partial and prim is P.neg:
                return _scaled(sums[0], -1.0)
            return self.rekeyed(eqn, tags, [sums[0]])[0] if partial else sums[0]
        if prim is P.mul:
            if len(sums) > 1:
                return _cross_sum(eqn, "multiplies", sums[1])
            c = _literal_scalar(eqn.invars[1 - tags.index(sums[0])])
        elif prim is P.div:
            if tags[1] is not None:
                return _cross_sum(eqn, "divides by", tags[1])
            c = _literal_scalar(eqn.invars[1])
            c = None if not c else 1.0 / c
        elif prim is P.select_n:
            if tags[0] is not None:
                return _cross_sum(eqn, "selects by", tags[0])
            if partial and len(sums) > 1:
                return Unknown(eqn, "selects between sums of examples taken out of the batch "
                                    "one by one")
            c = None
        else:
            return _cross_sum(eqn, f"applies {prim} to", sums[0])
        if not partial:
            return sums[0]
        return _scaled(sums[0], c) if c is not None else self.rekeyed(eqn, tags, [sums[0]])[0]

    @staticmethod
    def accumulate(eqn, tags, acc):
        """An elementwise op on the running sum of a loop over the examples: it stays
        one where the op adds the current example's term (or a constant) to it."""
        prim = eqn.primitive
        ok = all(u is None or u == acc or u == Cur(acc.level) for u in tags)
        if ok and prim in _ACCUMULATING:
            if prim is not P.sub or (tags[0] == acc and tags[1] != acc):
                return acc
        return Cross(eqn, _ACC_WHY, acc.origin, how="in the loop")

    # -- loops and branches ------------------------------------------------- #
    @staticmethod
    def join(eqn, a, b, level=None):
        """The tag of a loop carry (or a branch output) that is ``a`` or ``b``."""
        if isinstance(b, Cur) and b.level == level:
            if a is None:  # maybe a running sum over the examples: the loop runs again
                return Acc(eqn, level=level)
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

    def fixpoint(self, eqn, body, consts, carry, xs, level=None, outer=None):
        carry = list(carry)
        for _ in range(_MAX_ROUNDS):
            outs = self.run(body, list(consts) + carry + list(xs), outer=outer)
            new = [self.join(eqn, c, o, level) for c, o in zip(carry, outs)]
            if new == carry:
                return carry, outs[len(carry) :]
            carry = new
        raise AssertionError("no fixpoint of the loop carries")  # pragma: no cover

    # -- values lined up with the batch (`Lined`) ---------------------------- #
    def enter(self, outer, inner):
        """Passes the `Lined` axes of a call's operands ``outer`` to its body's ``inner``
        variables (and back, for its results)."""
        for o, i in zip(outer, inner):
            if _is_literal(i):
                continue
            got = None if _is_literal(o) else self.lined.get(o)
            if got:
                self.lined[i] = got
            else:
                self.lined.pop(i, None)

    def follow_lined(self, eqn):
        """The `Lined` axes of the results of an equation on constants only."""
        prim = eqn.primitive
        if prim in _CALLS or prim in _CUSTOM or prim is compat.remat_p:
            body = (compat.remat_params(eqn).jaxpr if prim is compat.remat_p
                    else compat.call_parts(eqn)[0] if prim in _CALLS
                    else compat.custom_call_parts(eqn)[0])
            self.enter(eqn.invars, body.invars)
            self.run(body, [None] * len(body.invars), outer=dict(zip(body.invars, eqn.invars)),
                     call=eqn)
            self.enter(body.outvars, eqn.outvars)
            return
        ins = [None if _is_literal(v) else self.lined.get(v) for v in eqn.invars]
        rule = _LINED_SOURCES.get(prim)
        if rule is None and not any(ins):
            return
        if rule is None:
            rule = _LINED_RULES.get(prim)
            if rule is None and (_RULES.get(prim) is _elementwise or _is_elementwise(prim)):
                rule = _lined_elementwise
        outs = rule(self, eqn, ins) if rule is not None else None
        for v, d in zip(eqn.outvars, outs or [None] * len(eqn.outvars)):
            if d:
                self.lined[v] = d
            else:
                self.lined.pop(v, None)

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
        elif prim in (P.convert_element_type, P.copy) and first in self.counter:
            self.counter[out] = self.counter[first]
        elif prim is P.broadcast_in_dim and first in self.iota:
            self.iota[out] = eqn.params["broadcast_dimensions"][self.iota[first]]
        elif prim is P.reshape and first in self.iota and eqn.params.get("dimensions") is None:
            d, shp, o = self.iota[first], _shape(first), _shape(out)
            for j in range(len(o)):
                if math.prod(o[:j]) == math.prod(shp[:d]) and o[j] == shp[d]:
                    self.iota[out] = j
                    break
        elif (prim is P.lt and (first in self.iota or first in self.counter)
              and _is_literal(ins[1])):
            if getattr(ins[1], "val", None) == 0:
                self.neg_test[out] = first
        elif prim is P.select_n and len(ins) == 3 and not _is_literal(ins[0]):
            a = ins[1]
            if not _is_literal(a) and self.neg_test.get(ins[0]) is a:
                # a >= 0: the normalised index is a itself
                if a in self.iota:
                    self.iota[out] = self.iota[a]
                elif a in self.counter:
                    self.counter[out] = self.counter[a]
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
        if kind != "f":  # the constant's axis that meets the batch axis
            other = eqn.invars[1] if tl is not None else eqn.invars[0]
            mine, theirs = ((lc, rc) if kind == "c" else (lb, rb)) if tl is not None else (
                (rc, lc) if kind == "c" else (rb, lb))
            lined = it.lined_up(eqn, tags, t, [(other, theirs[tuple(mine).index(t.axis)])])
            if lined is not None:
                return [lined]
        if kind == "c":
            return [_summed(it, eqn, t)]  # a weighted sum over examples
        return [dataclasses.replace(t, axis=i)]
    pl, pr = place(tl, lc, lb, lfree, len(lb)), place(tr, rc, rb, rfree, len(lb) + len(lfree))
    if pl == pr and pl[0] in "cb":  # the batch axes meet (each operand has it elsewhere)
        tl, tr = dataclasses.replace(tl, axis=0), dataclasses.replace(tr, axis=0)
        both = tl if tl == tr else it.merge([tl, tr])
        if both is not None and pl[0] == "c":
            return [_summed(it, eqn, both)]  # sum over examples of x_b . y_b
        if both is not None:
            return [dataclasses.replace(both, axis=pl[1])]
        if tl.by is not None or tr.by is not None:
            return [Cross(eqn, "combines values of different examples", tl.by or tr.by,
                          how="reordered by")]
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

    out_batch_axes = range(len(ishape) - 1)  # the indices' axes but the index vectors'
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
            if ti is None:  # take_along_axis(x, labels) with labels outside the batch
                lined = it.lined_up(eqn, tags, to, [(indices, jb)])
                if lined is not None:
                    return [lined]
        elif k in smap:
            comp = it.components(indices)[smap.index(k)] if not _is_literal(indices) else None
            lined_up = comp is not None and comp < len(ishape) - 1 and ishape[comp] == oshape[k]
            if not lined_up or sizes[k] != 1:
                if ti is None:  # x[order] with an order outside the batch
                    lined = it.lined_up(eqn, tags, to, [(indices, j) for j in out_batch_axes],
                                        index=True)
                    if lined is not None:
                        return [lined]
                return unknown("gathers along the batch axis by data (the examples are "
                               "indexed by values, as in graph batching)")
            mine = dataclasses.replace(to, axis=out_batch[comp])  # x[jnp.arange(B), ...]
            if ti is not None and ti.axis != comp:
                return unknown("gathers from one example by the indices of another")
            if ti is None and indices not in it.iota:  # x[jnp.arange(B)]: the examples
                # x[jnp.arange(B), labels] with labels outside the batch
                lined = it.lined_up(eqn, tags, to, [(indices, comp)])
                if lined is not None:
                    return [lined]
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

    def unknown(t=None):
        if t is not None and ti is None and not _is_literal(indices):
            # zeros(B).at[order].set(losses) with an order outside the batch
            lined = it.lined_up(eqn, tags, t, [(indices, j) for j in range(len(ishape) - 1)],
                                index=True)
            if lined is not None:
                return [lined]
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
                return unknown(tu)
        want.append(dataclasses.replace(tu, axis=k))
    if ti is not None:
        k = operand_axis(ti.axis)
        if k is None:
            return unknown()
        want.append(dataclasses.replace(ti, axis=k))
    if any(w != want[0] for w in want):
        return unknown()
    t = want[0]
    k = t.axis
    scattered = k in sdims or k in obatch
    if scattered and k not in (operand_axis(j) for j in range(len(ishape) - 1)):
        return unknown(t)
    if not scattered and k in inserted:
        return unknown()
    # x.at[jnp.arange(B), labels] with labels (or the updates) outside the batch
    pairs = []
    if ti is None and not _is_literal(indices) and indices not in it.iota:
        pairs += [(indices, j) for j in range(len(ishape) - 1) if operand_axis(j) == k]
    if tu is None:
        pairs += [(updates, u) for j, u in enumerate(uscatter) if operand_axis(j) == k]
        pairs += [(updates, u) for u in uwin if op_win[uwin.index(u)] == k]
    lined = it.lined_up(eqn, tags, t, pairs) if pairs else None
    return [lined or t]


def _collective(summing):
    """psum/pmax/pmin. Integer axes are positional: ``vmap(..., axis_name=...)`` turns a
    collective over its axis into a reduction over the mapped axis (batch norm written
    per example with ``lax.pmean``). Named axes the examples do not vary over (tensor
    parallelism: in a typed ``shard_map`` the operand varies over them, the batch does
    not) add up parts of the same examples; those the batch is split over
    (``axis_name``, or the axes the batch varies over in ``shard_map``) add up other
    devices' examples. A named axis the call knows neither way (``pmap`` or ``shard_map``
    with ``check_vma=False`` without ``axis_name``, whose types say nothing) is undecided."""

    def rule(it, eqn, tags):
        axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        positional = tuple(int(a) for a in axes if isinstance(a, (int, np.integer)))
        named = [a for a in axes if not isinstance(a, (int, np.integer))]
        data = [a for a in named if a in it.data_axes]
        outs = []
        for v, t in zip(eqn.invars, tags[: len(eqn.outvars)]):
            if t is not None and positional and not isinstance(t, (Cur, One)):
                t = _reduce_tag(it, eqn, t, positional, summing)
            varying = compat._aval_vma(v.aval) or frozenset()
            unknown = [a for a in named if a not in it.data_axes and a not in varying]
            if t is not None and unknown and not data and not isinstance(t, (Cross, Unknown)):
                names = ", ".join(repr(a) for a in unknown)
                t = Unknown(
                    eqn, f"reduces over the named axis {names}, which the call does not know "
                    "(no axis_name, and no types that say what varies over it): if the batch "
                    f"is split over it, pass axis_name={unknown[0]!r} and do not reduce the loss "
                    "over it in fn (per_example_stat combines the devices' examples itself); "
                    "if it splits the model (tensor parallelism), run under shard_map with "
                    "check_vma=True, whose types tell the check", under=t)
            if t is not None and data and not isinstance(t, Cross):
                names = ", ".join(repr(a) for a in data)
                t = Cross(
                    eqn, f"reduces across the devices, over {names}: the mesh axis the batch "
                    "is split over, so it combines other devices' examples",
                    fix=f"do not reduce the loss over {names} in fn: per_example_stat with "
                    f"axis_name={data[0]!r} combines the devices' examples itself, and fn "
                    "is the loss of each device's own examples (their mean)")
            outs.append(t)
        return outs

    return rule


# -- structured primitives: they recurse, and see Cross and Unknown operands -- #
def _enter_run(it, eqn, jaxpr, tags):
    """``jaxpr`` (the body of a call-like ``eqn``) run on ``tags``; the values lined up
    with the batch (`Lined`) pass in and out."""
    it.enter(eqn.invars, jaxpr.invars)
    outs = it.run(jaxpr, tags, outer=dict(zip(jaxpr.invars, eqn.invars)), call=eqn)
    it.enter(jaxpr.outvars, eqn.outvars)
    return outs


def _call(it, eqn, tags):
    return _enter_run(it, eqn, compat.call_parts(eqn)[0], tags)


def _custom(it, eqn, tags):
    return _enter_run(it, eqn, compat.custom_call_parts(eqn)[0], tags)


def _remat(it, eqn, tags):
    return _enter_run(it, eqn, compat.remat_params(eqn).jaxpr, tags)


def _counters(prm, nc, ncar, outer):
    """The carries of a scan that count its iterations from 0 by 1 (``fori_loop``)."""
    body, found = prm.jaxpr, []
    made = {o: e for e in body.eqns for o in e.outvars}
    for k in range(ncar):
        init = outer[nc + k]
        if not (_is_literal(init) and np.ndim(init.val) == 0 and init.val == 0
                and np.issubdtype(np.asarray(init.val).dtype, np.integer)):
            continue
        out = body.outvars[k]
        e = None if _is_literal(out) else made.get(out)
        if e is None or e.primitive is not P.add:
            continue
        a, b = e.invars
        one = [x for x in (a, b) if _is_literal(x) and np.ndim(x.val) == 0 and x.val == 1]
        if one and body.invars[nc + k] in (a, b):
            found.append(k)
    return found


def _scan(it, eqn, tags):
    prm = compat.scan_params(eqn)
    nc, ncar = prm.num_consts, prm.num_carry
    level, xs = None, []
    for t in tags[nc + ncar :]:
        if isinstance(t, Ex):
            if t.axis > 0:
                t = dataclasses.replace(t, axis=t.axis - 1)
            elif (t.outer, t.inner, t.perm) == (1, 1, None):
                level = next(it.levels) if level is None else level
                t = Cur(level)  # lax.map over the examples
            else:
                t = Unknown(eqn, "scans along the batch axis in steps that are not examples")
        xs.append(t)
    body = prm.jaxpr
    it.enter(eqn.invars[:nc], body.invars[:nc])  # loop-invariant
    it.enter([], body.invars[nc : nc + ncar])
    for o, i in zip(eqn.invars[nc + ncar :], body.invars[nc + ncar :]):  # one step of xs
        got = None if _is_literal(o) else it.lined.get(o)
        it.lined.pop(i, None)
        if got and any(a > 0 for a in got):
            it.lined[i] = {a - 1: src for a, src in got.items() if a > 0}
    if prm.length == it.B and not prm.reverse:
        # fori_loop(0, B, ...): its counter indexes the examples (`_dynamic_slice`)
        for k in _counters(prm, nc, ncar, eqn.invars):
            level = next(it.levels) if level is None else level
            it.counter[body.invars[nc + k]] = level
    carry, ys = it.fixpoint(eqn, body, tags[:nc], tags[nc : nc + ncar], xs, level,
                            outer=dict(zip(body.invars[:nc], eqn.invars[:nc])))
    done = []
    for t in carry:
        if isinstance(t, Acc) and t.level == level:
            t = Sum(eqn)  # the loop added up the examples' terms
        done.append(t)
    out = []
    for t in ys:
        if isinstance(t, Ex):
            t = dataclasses.replace(t, axis=t.axis + 1)
        elif isinstance(t, Cur) and t.level == level:
            t = Ex(0)
        elif isinstance(t, Acc) and t.level == level:
            t = Cross(eqn, "accumulates along the batch axis (across examples): its outputs "
                           "are running sums over the examples")
        out.append(t)
    return done + out


def _while(it, eqn, tags):
    wp = compat.while_params(eqn)
    cn, bn = wp.cond_nconsts, wp.body_nconsts
    it.enter(eqn.invars[:cn], wp.cond.invars[:cn])
    it.enter([], wp.cond.invars[cn:])
    it.enter(eqn.invars[cn : cn + bn], wp.body.invars[:bn])
    it.enter([], wp.body.invars[bn:])
    carry, _ = it.fixpoint(eqn, wp.body, tags[cn : cn + bn], tags[cn + bn :], [],
                           outer=dict(zip(wp.body.invars[:bn], eqn.invars[cn : cn + bn])))
    seen = {}
    (pred,) = it.run(wp.cond, list(tags[:cn]) + carry, seen,
                     outer=dict(zip(wp.cond.invars[:cn], eqn.invars[:cn])))
    if pred is None:
        return carry
    if isinstance(pred, (Ex, Cur, One)):
        # a batched predicate (jax.vmap of a while_loop): each element of the leading axes
        # stops on its own, so every carry follows the predicate's examples; a loop on
        # one example taken out of the batch runs as often as on that example alone
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
        it.enter(eqn.invars[1:], br.invars)
        o = it.run(br, ops, outer=dict(zip(br.invars, eqn.invars[1:])))
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
_CUSTOM = tuple(compat.custom_prims)

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
    ((P.psum, P.psum_invariant), _collective(True)),
    ((P.pmax, P.pmin), _collective(False)),
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
_COLLECTIVES = frozenset(p for p in (P.psum, P.psum_invariant, P.pmax, P.pmin) if p is not None)

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
    fix: str = ""  # for "cross-example": the fix, where not the usual one

    def __str__(self):
        return self.kind + (f": {self.detail}" if self.detail else "")


def _describe(tag, root):
    text = f"{_where(tag.eqn, root)} {tag.why}"
    via = getattr(tag, "via", None)
    if via is not None:
        text += f", {getattr(tag, 'how', 'computed by')} {_where(via, root)}"
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
    it = _Interp(prep.B, frozenset(data_axes))
    for v, lined in zip(closed.jaxpr.invars, _leaf_lined(prep, prep.B)):
        if lined:
            it.lined[v] = lined
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        src = Lined(f"an array closed over by fn (shape {list(np.shape(c))})",
                    "pass it in the batch (batch_argnums) if it holds one entry per example")
        lined = {a: src for a, n in enumerate(np.shape(c)) if n == prep.B}
        if lined:
            it.lined[v] = lined
    (out,) = it.run(closed.jaxpr, tags)[:1]
    if isinstance(out, One):  # the loss of one example taken out of the batch
        weights = np.zeros(prep.B)
        weights[out.example] = 1.0
        out = Sum(out.by, frozenset({(-1, tuple(weights))}))
    if out is None or (isinstance(out, Sum) and not out.terms):
        return Verdict(INDEPENDENT, "")
    if isinstance(out, Sum):
        cross = Cross(out.origin, _uneven(out), out.by, how="an example taken out by")
        return Verdict(CROSS, _describe(cross, closed.jaxpr), _ONE_BY_ONE_FIX)
    if isinstance(out, Cross):
        return Verdict(CROSS, _describe(out, closed.jaxpr), out.fix)
    if isinstance(out, Unknown):
        return Verdict(UNDECIDED, _describe(out, closed.jaxpr))
    # a scalar loss cannot keep the batch axis; anything else is a bug of this module
    return Verdict(UNDECIDED, f"the loss has an unexpected tag {out}")  # pragma: no cover


def check(prep, name, data_axes=frozenset()):
    """Raises `CrossExampleError` when the examples of the batch loss interact, warns
    `CrossExampleWarning` when the jaxpr cannot decide."""
    v = verdict(prep, data_axes)
    if v.kind == CROSS and v.fix:
        raise CrossExampleError(
            f"{name}: the loss is not a mean of per-example terms: {v.detail}. Per-example "
            "gradients are those of each example alone in a batch of one, whose loss is then "
            "not its term of the batch loss: every statistic would describe another loss, "
            f"and mean() would differ from jax.grad. Fix: {v.fix}; or pass check=False to "
            "compute the statistics of the batch-of-one losses anyway."
        )
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

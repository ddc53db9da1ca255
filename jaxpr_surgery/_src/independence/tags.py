"""The tags of the independence proof (`__init__`'s docstring): what a value of the
batch loss depends on, and the helpers that combine them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxpr_surgery._src import compat

P = compat.prims


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



"""Example weights inside a reduction (`Weighted`: the reduction over the weighted
examples) and the running values of a chunk loop (`Carry`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src.reductions import Reduction, combined_share


# --------------------------------------------------------------------------- #
# Example weights
# --------------------------------------------------------------------------- #
def weighs(r) -> bool:
    """Whether ``example_weights`` enter ``r`` through `Weighted` (not a per-example
    value, masked afterwards, nor a clipped sum, whose clip factors the engine weighs)."""
    return not (r.per_example or r.weighted_by_norm)


class Weighted(Reduction):
    """``inner`` over examples weighted by ``w_b >= 0`` (``example_weights``), run by the
    same tile loops, chunks and devices as any reduction: those speak in counts of
    examples, which this wrapper turns into sums of weights for ``inner`` (whose
    ``*_weighted`` methods take the weights themselves).

    The examples are those of one chunk, ``w`` their weights; a count ``n`` is a number
    of examples from an origin: ``n0`` examples of total weight ``W0`` came before the
    chunk (its tile loops continue a carry of them) or, with ``n0 = W0 = 0``, the
    chunk's own examples are counted from its first. ``W(n) = W0 + sum(w[:n - n0])``.
    An example of weight 0 is removed exactly: its gradient is read as zero (a padded
    example's NaN never enters).
    """

    def __init__(self, inner, w, n0=0, W0=0.0):
        self.inner, self.w, self.n0, self.W0 = inner, w, n0, W0

    # (reductions that compare equal are computed once: wrappers of one call's weights)
    def __eq__(self, other):
        return (isinstance(other, Weighted) and self.inner == other.inner
                and self.w is other.w and self.n0 is other.n0 and self.W0 is other.W0)

    def __hash__(self):
        return hash((Weighted, self.inner, id(self.w)))

    def __repr__(self):
        return f"Weighted({self.inner!r})"

    per_example = property(lambda self: self.inner.per_example)
    carries = property(lambda self: self.inner.carries)
    feature_blocks = property(lambda self: self.inner.feature_blocks)
    shift_bounded = property(lambda self: self.inner.shift_bounded)
    linear = property(lambda self: self.inner.linear)
    weighted_by_norm = property(lambda self: self.inner.weighted_by_norm)
    knows_total = property(lambda self: self.inner.knows_total)

    def at(self, n0, W0):
        """The same weights counted from ``n0`` examples of weight ``W0`` before."""
        return Weighted(self.inner, self.w, n0, W0)

    def W(self, n):
        """The weight of the examples counted by ``n``. (Not cached: a cache filled
        while tracing a loop's body would leak its tracer to the next use.)"""
        w = self.w
        cw = jnp.concatenate([jnp.zeros((1,), w.dtype), jnp.cumsum(w)])
        return self.W0 + cw[jnp.clip(self._index(n), 0, w.shape[0])]

    def _index(self, n):
        """The position in the chunk of the example counted by ``n`` (counts may come
        as floats: a site's sink holds them in its accumulation dtype)."""
        return jnp.round(jnp.asarray(n) - self.n0).astype(jnp.int32)

    def _tile(self, n, G):
        """The weights of the examples ``G`` holds (from count ``n``) and ``G`` with the
        examples of weight 0 read as zero."""
        b = G.shape[0]
        w = self.w if b == self.w.shape[0] else compat.slice_at(
            self.w, self._index(n), b)
        keep = ew.kept(w, (G,)).reshape((-1,) + (1,) * (G.ndim - 1))
        return w, jnp.where(keep, G, jnp.zeros((), G.dtype))

    def weighted_parts(self):
        return self.inner, self.w

    def scaled(self):
        d = self.inner.weight_degree
        if not d or (d != 1 and ew.is_open()):  # (w^(1/d): no derivative at w = 0)
            return None
        w = self.w
        return self.inner, (w if d == 1 else jnp.sqrt(w) if d == 2 else w ** (1.0 / d))

    def aval(self, shape, dtype, B):
        return self.inner.aval(shape, dtype, B)

    def from_examples(self, G):  # every example of the chunk
        w, G = self._tile(self.n0, G)
        return self.inner.from_weighted(G, w)

    def merge(self, a, na, b, nb):  # (a: the first na examples, b the nb after them)
        return self.inner.merge(a, self.W(na), b, self.W(na + nb) - self.W(na))

    def empty(self, shape, dtype):
        return self.inner.empty(shape, dtype)

    def accumulate(self, acc, n, value, m):
        Wn = self.W(n)
        return self.inner.accumulate(acc, Wn, value, self.W(n + m) - Wn)

    def add_examples(self, acc, n, G):
        w, G = self._tile(n, G)
        return self.inner.add_weighted(acc, self.W(n), G, w)

    def start_examples(self, acc, n, G):
        w, G = self._tile(n, G)
        return self.inner.start_weighted(acc, self.W(n), G, w)

    def finish(self, acc, n):
        return self.inner.finish(acc, self.W(n))

    def recentre(self, acc, n):
        return self.inner.recentre(acc, self.W(n))

    def total(self, acc, n):
        return self.inner.total(acc, self.W(n))

    def block(self, cut):
        return Weighted(self.inner.block(cut), self.w, self.n0, self.W0)

    def zeros(self, shape, dtype, B):  # the chunk's examples, all of gradient zero
        del B
        W = jnp.sum(self.w).astype(dtype)
        return self.inner.from_weighted(jnp.zeros((1,) + tuple(shape), dtype), W[None])

    def combined_share(self, value, n_local, axis_name, parts):  # (as `combine_axis`)
        del n_local
        with ew.opened():
            return combined_share(self.inner, value, jnp.sum(self.w), axis_name, parts)

    def combine_axis(self, value, n_local, N, axis_name, **totals):  # (the local batch)
        del n_local, N
        W = jnp.sum(self.w)
        # (a device's examples may weigh 0 in all: its value holds their raw sums, which
        # the merges keep, so that the derivatives in their weights are exact; ``totals``:
        # a gathered leaf's, `gathers.combine`)
        with ew.opened():
            return self.inner.combine_axis(value, W, jax.lax.psum(W, axis_name), axis_name,
                                           **totals)

    def to_leaf(self, value, site, B):
        if type(self.inner).to_leaf is not Reduction.to_leaf:
            return self.inner.to_leaf(value, site, B)
        return Reduction.to_leaf(self, value, site, B)  # (fills with `zeros` above)

    def from_leaf(self, value, site):
        return self.inner.from_leaf(value, site)

    def direct_ok(self, site):
        return self.inner.direct_ok(site)

    def combine_shards(self, value, axes):
        return self.inner.combine_shards(value, axes)

    def describe(self):
        return self.inner.describe()


def unweighted(r):
    """The reduction ``r`` computes, past any `Weighted` wrapping it."""
    while isinstance(r, Weighted):
        r = r.inner
    return r


class Carry(NamedTuple):
    """The running accumulators a chunk's statistics continue (chunking.py).

    Attributes:
      values: per reduction (a list aligned with the reductions, or a dict keyed like
        them), its accumulator over the ``n`` examples of the chunks before, or None
        where the callee returns the chunk's own value (merged by the caller).
      n: the number of those examples (may be traced; 0 for the first chunk, whose
        accumulators are `Reduction.empty`).
    """

    values: Any
    n: Any

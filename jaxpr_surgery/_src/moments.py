"""Moments of per-example values and their merges: counts, means and sums of powers about
the mean (`Moments`), or about a shift (`Shifted`), merged across chunks and devices
without cancellation (Chan et al.'s update).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat
from jaxpr_surgery._src import example_weights as ew


# --------------------------------------------------------------------------- #
# Centred moments: values, running sums, merges
# --------------------------------------------------------------------------- #
class Moments(NamedTuple):
    """Value of `Centered` for one leaf: mean and centered sum of squares."""

    mean: jax.Array
    m2: jax.Array


class Totals(NamedTuple):
    """How moments about the whole batch's mean total a leaf-shaped sum over the
    devices (`Centered.combine_axis`): ``sums`` totals each device's value to the part
    the device keeps (by default ``psum``: all of it), ``spread`` takes a kept total
    to the whole value on every device (by default as it is), ``keep`` a whole value
    to the kept part (as it is). A leaf gathered in ``shard_map`` keeps its shard
    (`gathers.combine`)."""

    sums: Any
    spread: Any
    keep: Any

    @classmethod
    def psum(cls, axis_name):
        same = lambda x: x  # noqa: E731
        return cls(lambda x: jax.lax.psum(x, axis_name), same, same)


def nonneg(x):
    """``x``, a sum of squares (or fourth powers) whose rounding may take it below 0, with
    those values set to 0 and the derivative of ``x`` kept: a clamp's derivative is 0
    there, but a true value of 0 (one example's centred sums) has a derivative, e.g. in
    the weight of another example of weight 0. NaN stays NaN."""
    return x + jax.lax.stop_gradient(jnp.where(x < 0, -x, jnp.zeros_like(x)))


def merge_moments(a: Moments, na, b: Moments, nb) -> Moments:
    """The moments of the union of two disjoint sets of ``na`` and ``nb`` examples
    (Chan et al.: ``m2 = m2_a + m2_b + delta^2 n_a n_b / n``, exact, no cancellation).

    Counts may be traced integers (a chunk loop's index times the chunk size): the
    weights are formed without their product (``na * nb`` overflows int32 from about
    46341 examples on each side) and in the moments' dtype (a quotient of int64 counts
    is float64 under ``jax_enable_x64``).
    """
    dt = jnp.result_type(a.mean)
    tot = na + nb  # (0 only for weighted examples of weight 0: nothing to merge)
    w = jnp.asarray(nb / jnp.where(jnp.asarray(tot) > 0, tot, 1), dt)
    delta = b.mean - a.mean
    out = Moments(a.mean + delta * w, a.m2 + b.m2 + jnp.square(delta) * (jnp.asarray(na, dt) * w))
    if not ew.is_open():
        return out
    # within derivatives in the weights, a side of weight 0 holds its raw sums
    # (see `reshift`): the union's moments from them, exact in value and derivative
    na, nb = jnp.asarray(na, dt), jnp.asarray(nb, dt)
    safe = jnp.where(na + nb > 0, na + nb, 1)

    def with_raw(m, n, p, q, n0):  # moments m of weight n > 0 and raw sums of weight n0
        M = (n * m.mean + p) / safe
        return Moments(M, m.m2 + n * jnp.square(m.mean - M) + q - 2 * M * p + jnp.square(M) * n0)

    pick = lambda c, x, y: jax.tree.map(lambda u, v: jnp.where(c, u, v), x, y)  # noqa: E731
    raw = Moments(a.mean + b.mean, a.m2 + b.m2)  # (both of weight 0)
    out = pick((na > 0) & (nb > 0), out, raw)
    out = pick((na > 0) & (nb == 0), with_raw(a, na, b.mean, b.m2, nb), out)
    return pick((na == 0) & (nb > 0), with_raw(b, nb, a.mean, a.m2, na), out)


class Shifted(NamedTuple):
    """Running centred moments of ``n`` examples against a shift ``K`` (carried across
    tiles and chunks of the batch): ``s1 = sum_b (g_b - K)``, ``s2 = sum_b (g_b - K)^2``,
    so ``mean = K + s1/n`` and ``m2 = s2 - s1^2/n``. The subtraction of the final
    ``s1^2/n`` cancels at most ``1 + m/n_K`` fold where ``K`` is the exact mean of the
    first ``n_K`` examples and ``m`` came after (the between-group part of ``m2`` bounds
    it); callers re-centre (`recentre`) before that exceeds `MAX_SHIFT_AMPLIFICATION`.
    ``s1`` is None where the shift is the examples' own mean (`Centered` outside
    derivatives in the weights: ``s1 = 0``, not carried)."""

    shift: jax.Array
    s1: jax.Array | None
    s2: jax.Array


def shifted_moments(s: Shifted, n) -> Moments:
    """The `Moments` of ``n`` examples from their `Shifted` sums."""
    n = jnp.asarray(n, jnp.result_type(s.s1))
    d = s.s1 / jnp.where(n > 0, n, 1)  # (n = 0: weighted examples of weight 0, s1 = 0)
    m2 = s.s2 - s.s1 * d
    out = Moments(s.shift + d, nonneg(m2))
    if not ew.is_open():
        return out
    K = s.shift  # (weight 0 within derivatives in the weights: raw sums, see `reshift`)
    raw = Moments(s.s1 + K * n, s.s2 + 2 * K * s.s1 + jnp.square(K) * n)
    return Moments(*(jnp.where(n > 0, u, v) for u, v in zip(out, raw)))


# Within derivatives in the example weights (`example_weights.is_open`) the examples of
# weight 0 are read as they are, so a tile, group or chunk may weigh 0 in all: its
# `Moments` are then its raw sums ``(sum_b w_b g_b, sum_b w_b g_b^2)``, zero but with the
# derivatives of those sums (``from_weighted`` gives them: the mean divides by 1 there), and
# the merges and shifts below keep them (a mean of no weight would lose them). Elsewhere
# nothing changes.
def reshift(s: Shifted, n, K) -> Shifted:
    """The same sums of ``n`` examples against the shift ``K``."""
    d = s.shift - K
    n = jnp.asarray(n, jnp.result_type(s.s1))
    return Shifted(K, s.s1 + d * n, s.s2 + 2 * d * s.s1 + jnp.square(d) * n)


def recentre(s: Shifted, n) -> Shifted:
    """The same moments of ``n`` examples against their mean (``s1 = 0``)."""
    m = shifted_moments(s, n)
    out = Shifted(m.mean, compat.zeros_like_varying(s.s1), m.m2)
    if not ew.is_open():
        return out
    return Shifted(*(jnp.where(jnp.asarray(n) > 0, u, v) for u, v in zip(out, s)))


def chan_update(a: Shifted, na, mean_b, m2_b, nb) -> Moments:
    """The `Moments` of ``na`` examples (their `Shifted` sums ``a``) followed by ``nb``
    more of mean ``mean_b`` and centred sum of squares ``m2_b`` (Chan et al.: exact, no
    cancellation). Counts may be traced, and are total weights with
    ``example_weights``; with none before, the new ones' moments exactly. ``a.s1``
    None: ``a`` is about its own mean (`about_the_mean`)."""
    dt = jnp.result_type(a.shift)
    na, nb = jnp.asarray(na, dt), jnp.asarray(nb, dt)
    before = na > 0
    if a.s1 is None:
        mean_a, m2_a = a.shift, a.s2
    else:
        d1 = a.s1 / jnp.where(before, na, 1)
        mean_a, m2_a = a.shift + d1, a.s2 - a.s1 * d1
    tot = na + nb
    f = nb / jnp.where(tot > 0, tot, 1)
    delta = mean_b - mean_a
    return Moments(jnp.where(before, mean_a + delta * f, mean_b),
                   jnp.where(before, m2_a + m2_b + jnp.square(delta) * (na * f), m2_b))


def about_the_mean(m: Moments) -> Shifted:
    """`Moments` as `Shifted` sums against their own mean: ``s1 = 0``, left out (None), so
    that no program carries or reads it (`Centered` outside derivatives in the weights)."""
    return Shifted(m.mean, None, m.m2)


def moments_of(G) -> Moments:
    """The exact two-pass `Moments` of the examples of ``G [b, ...]`` (one example: its
    own mean, zero about it)."""
    if G.shape[0] == 1:
        g = G[0]
        return Moments(g, compat.zeros_like_varying(g))
    m = jnp.mean(G, axis=0)
    return Moments(m, jnp.sum(jnp.square(G - m), axis=0))


def weighted_moments(G, wb):
    """``(W, Moments)``: the total weight and the exact two-pass `Moments` of the examples
    of ``G [b, ...]`` weighted by ``wb`` (broadcast against ``G``)."""
    W = jnp.sum(wb, axis=0)
    m = jnp.sum(wb * G, axis=0) / jnp.where(W > 0, W, 1)
    return W, Moments(m, jnp.sum(wb * jnp.square(G - m), axis=0))


def merge_shifted(a: Shifted, na, b: Moments, nb) -> Shifted:
    """`Shifted` sums of ``na`` examples and the `Moments` of ``nb`` more (with no
    examples before, the new ones' mean becomes the shift)."""
    dt = jnp.result_type(a.s1)
    K = jnp.where(jnp.asarray(na) > 0, a.shift, b.mean.astype(dt))
    if ew.is_open():  # (`reshift`: ``a`` may weigh 0; so may ``b``, holding raw sums)
        K = jnp.where((jnp.asarray(na) == 0) & (jnp.asarray(nb) == 0), a.shift, K)
        a = reshift(a, na, K)
        nb = jnp.asarray(nb, dt)
        d = b.mean - K
        s1 = jnp.where(nb > 0, nb * d, b.mean - nb * K)
        s2 = jnp.where(nb > 0, b.m2 + nb * jnp.square(d),
                       b.m2 - 2 * K * b.mean + jnp.square(K) * nb)
        return Shifted(K, a.s1 + s1, a.s2 + s2)
    d = b.mean - K
    nb = jnp.asarray(nb, dt)
    return Shifted(K, a.s1 + nb * d, a.s2 + b.m2 + nb * jnp.square(d))

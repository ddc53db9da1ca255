"""Statistics researchers ask for: higher moments, gradient diversity, norm quantiles.

Each is a `Statistic` over the reductions of the built-ins (so it costs what they
cost and composes with every option), except `kurtosis`, whose `CentralMoments` (sums
of centred powers up to the fourth) is defined here on the same protocol; exported from
`jaxpr_surgery.stats`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.moments import Totals
from jaxpr_surgery._src.norms import combine_norms
from jaxpr_surgery._src.statistic import safe_ratio, tree_div

FOURTH = S.PhiSum(lambda g: jnp.square(jnp.square(g)), multiplicative=True, name="fourth",
                  _builtin=True, _degree=4)

_is_central = lambda x: isinstance(x, CentralSums)  # noqa: E731


class _Fourth(S.Statistic):
    _name = "fourth_moment"

    def reductions(self):
        return {"p4": FOURTH}

    def finalize(self, values, count):
        return tree_div(values["p4"], count)


class CentralSums(NamedTuple):
    """Value of `CentralMoments` for one leaf: the mean and the sums of the centred
    second, third and fourth powers, ``sum_b (g_b - mean)^p``."""

    mean: jax.Array
    m2: jax.Array
    m3: jax.Array
    m4: jax.Array


class ShiftedSums(NamedTuple):
    """Running `CentralMoments` of ``n`` examples against a shift ``K`` (as
    `stats.Shifted` for the variance): ``s_p = sum_b (g_b - K)^p``, ``p = 1..4``."""

    shift: jax.Array
    s1: jax.Array
    s2: jax.Array
    s3: jax.Array
    s4: jax.Array


def _per_example(w, G):
    """Weights ``w [b]`` broadcast against ``G [b, ...]`` in its dtype."""
    return w.astype(G.dtype).reshape((-1,) + (1,) * (G.ndim - 1))


def _as(n, like):
    return jnp.asarray(n, jnp.result_type(like))


# Within derivatives in the example weights (`example_weights.is_open`), a tile, group or
# chunk of examples may weigh 0 in all: its `CentralSums` are then its raw power sums
# ``sum_b w_b g_b^p`` (zero, with their derivatives; ``from_weighted`` gives them), and
# shifts and merges keep them (as `stats.Centered`'s, reductions.py).
def _shifted(s, n, D):
    """Power sums ``sum_b w_b (y_b + D)^p`` from ``s = (sum y, sum y^2, sum y^3, sum y^4)``
    of examples of weight ``n``."""
    s1, s2, s3, s4 = s
    D2 = jnp.square(D)
    return (s1 + D * n, s2 + 2 * D * s1 + D2 * n, s3 + 3 * D * s2 + 3 * D2 * s1 + D2 * D * n,
            s4 + 4 * D * s3 + 6 * D2 * s2 + 4 * D2 * D * s1 + jnp.square(D2) * n)


def _about(c, n):
    """``(P, sums about P)`` of a `CentralSums` of weight ``n`` (raw sums about 0 if 0)."""
    z = jnp.zeros_like(c.m2)
    central = (c.mean, (z, c.m2, c.m3, c.m4))
    raw = (z, (c.mean, c.m2, c.m3, c.m4))
    return jax.tree.map(lambda u, v: jnp.where(n > 0, u, v), central, raw)


@dataclasses.dataclass(frozen=True)
class CentralMoments(S.ElementwiseReduction):
    """Centred sums up to the fourth power, a `CentralSums`: the central fourth moment
    without raw moments (which cancel where the mean dominates the spread: in float32
    from ``|mean|/std`` about 5). Run as `ShiftedSums` against the first tile's mean,
    re-centred like `stats.Centered` (`stats.MAX_SHIFT_AMPLIFICATION`), and merged by
    Pébay's rule (exact: no cancellation). Fast rules: rank-one dense sites take raw
    power sums in groups where they cannot have cancelled, else exact tiles
    (`sites.dense_rules.central_value`), embeddings exact sums over the rows each example
    touches (`EmbeddingKernel.central_sums`); elsewhere tiles of per-example gradients."""

    shift_bounded: ClassVar[bool] = True
    knows_total: ClassVar[bool] = True
    cache_blocks: ClassVar[bool] = True  # (four power sums per block)
    blocks_under_split: ClassVar[bool] = True

    def aval(self, shape, dtype, B):
        v = jax.ShapeDtypeStruct(tuple(shape), dtype)
        return CentralSums(v, v, v, v)

    def empty(self, shape, dtype):
        z = jnp.zeros(tuple(shape), dtype)
        return ShiftedSums(z, z, z, z, z)

    def from_examples(self, G):
        if G.shape[0] == 1:  # (one example: its own mean, nothing about it)
            g = G[0]
            z = compat.zeros_like_varying(g)
            return CentralSums(g, z, z, z)
        # (sums against the rounded mean, corrected by their first: `finish`)
        m = jnp.mean(G, axis=0)
        return self.finish(self._add(ShiftedSums(m, None, None, None, None), G), G.shape[0])

    def from_weighted(self, G, w):
        wb = _per_example(w, G)
        W = jnp.sum(wb, axis=0)
        m = jnp.sum(wb * G, axis=0) / jnp.where(W > 0, W, 1)
        return self.finish(self._add(ShiftedSums(m, None, None, None, None), G, wb), W)

    @fp.traced_once
    def merge(self, a, na, b, nb):
        """Pébay (2008): the central sums of the union of two disjoint sets."""
        dt = jnp.result_type(a.mean)
        n = _as(na, a.mean) + _as(nb, a.mean)
        safe = jnp.where(n > 0, n, 1)
        wa, wb = jnp.asarray(na / safe, dt), jnp.asarray(nb / safe, dt)
        d = b.mean - a.mean
        d2 = jnp.square(d)
        m2 = a.m2 + b.m2 + d2 * n * wa * wb
        m3 = (a.m3 + b.m3 + d2 * d * n * wa * wb * (wa - wb)
              + 3 * d * (wa * b.m2 - wb * a.m2))
        m4 = (a.m4 + b.m4 + jnp.square(d2) * n * wa * wb * (wa * wa - wa * wb + wb * wb)
              + 6 * d2 * (wa * wa * b.m2 + wb * wb * a.m2) + 4 * d * (wa * b.m3 - wb * a.m3))
        out = CentralSums(a.mean + d * wb, m2, m3, m4)
        if not ew.is_open():
            return out
        # (a side of weight 0: both as sums about one shift, then finished)
        na, nb = _as(na, a.mean), _as(nb, a.mean)
        (pa, sa), (pb, sb) = _about(a, na), _about(b, nb)
        K = jnp.where(na > 0, pa, pb)
        s = [u + v for u, v in zip(_shifted(sa, na, pa - K), _shifted(sb, nb, pb - K))]
        other = self.finish(ShiftedSums(K, *s), na + nb)
        return jax.tree.map(lambda u, v: jnp.where((na > 0) & (nb > 0), u, v), out, other)

    def combine_axis(self, value, n_local, N, axis_name, totals=None):
        """Every device's central sums about the whole batch's mean (one ``psum`` of the
        mean, then of each power: ``_shifted`` moves a device's sums from its own mean by
        ``d = mean_d - mean``, the terms of Pébay's merge, without gathering every
        device's sums). Within derivatives in the weights: the default merge.
        ``totals``: a `moments.Totals`, how those sums are totalled (``psum``); for a
        leaf gathered in shard_map (`gathers.combine`) each device keeps its shard."""
        t = totals or Totals.psum(axis_name)
        if ew.is_open():
            return jax.tree.map(t.keep, super().combine_axis(value, n_local, N, axis_name))
        n = _as(n_local, value.mean)
        kept = t.sums(value.mean * n) / _as(N, value.mean)
        z = jnp.zeros_like(value.m2)
        _, *s = _shifted((z, value.m2, value.m3, value.m4), n, value.mean - t.spread(kept))
        s2, s3, s4 = t.sums(tuple(s))
        return CentralSums(kept, S.nonneg(s2), s3, S.nonneg(s4))

    def combined_share(self, value, n_local, axis_name, parts):
        return S.centred_share(self, value, n_local, axis_name, parts)

    def combine_copies(self, value, parts):
        return S.centred_copies(value, parts)

    @fp.traced_once
    def accumulate(self, acc, n, value, m):
        """``acc``'s sums and ``value``'s ``m`` examples about ``acc``'s shift (with no
        examples before, ``value``'s mean becomes the shift)."""
        K = jnp.where(jnp.asarray(n) > 0, acc.shift, value.mean.astype(acc.s1.dtype))
        if ew.is_open():  # (either side may weigh 0: `_about`)
            n, m = _as(n, acc.s1), _as(m, acc.s1)
            K = jnp.where((n == 0) & (m == 0), acc.shift, K)
            P, sv = _about(value, m)
            s = [u + v for u, v in zip(_shifted(acc[1:], n, acc.shift - K), _shifted(sv, m, P - K))]
            return ShiftedSums(K, *s)
        d = value.mean - K
        d2 = jnp.square(d)
        if isinstance(m, int) and m == 1:  # one example: no central sums about its mean
            return ShiftedSums(K, acc.s1 + d, acc.s2 + d2, acc.s3 + d2 * d,
                               acc.s4 + jnp.square(d2))
        m = _as(m, acc.s1)
        return ShiftedSums(
            K, acc.s1 + m * d, acc.s2 + value.m2 + m * d2,
            acc.s3 + value.m3 + 3 * d * value.m2 + m * d2 * d,
            acc.s4 + value.m4 + 4 * d * value.m3 + 6 * d2 * value.m2 + m * jnp.square(d2))

    @staticmethod
    def _add(acc, G, wb=None):
        y = G - acc.shift
        y2 = jnp.square(y)
        ws = (lambda a: jnp.sum(a, axis=0)) if wb is None else (lambda a: jnp.sum(wb * a, axis=0))
        s = (ws(y), ws(y2), ws(y2 * y), ws(jnp.square(y2)))
        if acc.s1 is None:
            return ShiftedSums(acc.shift, *s)
        return ShiftedSums(acc.shift, *(u + v for u, v in zip(acc[1:], s)))

    def start_examples(self, acc, n, G):
        """The first tile of a loop: sums against the tile's mean, or against a
        carried shift once there are examples before (`stats.Centered`'s)."""
        mu = jnp.mean(G, axis=0) if G.shape[0] > 1 else G[0]
        if acc is None:
            return self._add(ShiftedSums(mu, None, None, None, None), G)
        return self._add(acc._replace(shift=jnp.where(jnp.asarray(n) > 0, acc.shift, mu)), G)

    def add_examples(self, acc, n, G):
        if acc is None:
            return self.start_examples(None, 0, G)
        return self._add(acc, G)

    def start_weighted(self, acc, W, G, w):
        wb = _per_example(w, G)
        Wt = jnp.sum(wb, axis=0)
        mu = jnp.sum(wb * G, axis=0) / jnp.where(Wt > 0, Wt, 1)
        if acc is None:
            return self._add(ShiftedSums(mu, None, None, None, None), G, wb)
        K = jnp.where(jnp.asarray(W) > 0, acc.shift, mu)
        if ew.is_open():  # (the sums so far, of weight 0, moved to the new shift)
            acc = ShiftedSums(K, *_shifted(acc[1:], _as(W, acc.s1), acc.shift - K))
        return self._add(acc._replace(shift=K), G, wb)

    def add_weighted(self, acc, W, G, w):
        if acc is None:
            return self.start_weighted(None, W, G, w)
        return self._add(acc, G, _per_example(w, G))

    @fp.traced_once
    def finish(self, acc, n):
        """Central sums from the shifted ones: ``d = s1/n`` is the mean's distance from
        the shift (small: the shift is a mean of earlier examples), so the terms in
        ``d`` correct without cancelling."""
        n = _as(n, acc.s1)
        d = acc.s1 / jnp.where(n > 0, n, 1)
        d2 = jnp.square(d)
        m2 = acc.s2 - acc.s1 * d
        m2 = S.nonneg(m2)
        m3 = acc.s3 - 3 * d * acc.s2 + 2 * n * d2 * d
        m4 = acc.s4 - 4 * d * acc.s3 + 6 * d2 * acc.s2 - 3 * n * jnp.square(d2)
        m4 = S.nonneg(m4)
        out = CentralSums(acc.shift + d, m2, m3, m4)
        if not ew.is_open():
            return out
        raw = CentralSums(*_shifted(acc[1:], n, acc.shift))  # (weight 0: raw sums, `_about`)
        return jax.tree.map(lambda u, v: jnp.where(n > 0, u, v), out, raw)

    @fp.traced_once
    def recentre(self, acc, n):
        c = self.finish(acc, n)
        z = compat.zeros_like_varying(acc.s1)
        out = ShiftedSums(c.mean, z, c.m2, c.m3, c.m4)
        if not ew.is_open():
            return out
        return jax.tree.map(lambda u, v: jnp.where(jnp.asarray(n) > 0, u, v), out, acc)

    def total(self, acc, n):
        return _as(n, acc.shift) * acc.shift + acc.s1

    def describe(self):
        return "central moments"


@fp.traced_once
def _kurtosis(c, count):
    var = c.m2 / count  # population moments
    kurt = (c.m4 / count) / jnp.where(var > 0, jnp.square(var), 1)
    return jnp.where(var > 0, kurt, jnp.nan)


class _Kurtosis(S.Statistic):
    _name = "kurtosis"
    ddof = 1  # (needs more than one example: checked against concrete weights)

    def reductions(self):
        return {"c": CentralMoments()}

    def finalize(self, values, count):
        S.check_count(count, 1, "kurtosis")
        return jax.tree.map(lambda c: _kurtosis(c, count), values["c"], is_leaf=_is_central)


class _Diversity(S.Statistic):
    _name = "gradient_diversity"
    whole_batch = True  # sums the per-example norms over the batch
    uses_weights = True  # (weighted: sum_b w_b |g_b|^2 / |sum_b w_b g_b|^2)

    def reductions(self):
        return {"n": S.SqNorms(), "s": S.SUM}

    def finalize(self, values, count, weights=None):
        leaves = jax.tree.leaves(values["n"])
        dt = jnp.result_type(jnp.float32, *[x.dtype for x in leaves])
        w = 1 if weights is None else weights.astype(dt)
        num = sum(jnp.sum(w * x.astype(dt)) for x in leaves)
        den = sum(jnp.sum(jnp.square(x.astype(dt))) for x in jax.tree.leaves(values["s"]))
        return safe_ratio(num, den)


class _NormQuantiles(S.Statistic):
    _name = "norm_quantiles"
    whole_batch = True  # quantiles over the batch of the per-example norms
    uses_weights = True  # (over the examples of positive weight)

    def __init__(self, q, per_leaf):
        self.q = q  # a float (scalar results) or a tuple of floats
        self.per_leaf = per_leaf

    def reductions(self):
        return {"n": S.Norms()}

    def finalize(self, values, count, weights=None):
        q = jnp.asarray(self.q)
        if weights is None:
            quantile = jnp.quantile
        else:  # the examples of weight 0 left out (each other one counted once)
            def quantile(n, q):
                return jnp.nanquantile(jnp.where(weights > 0, n, jnp.nan), q)
        if self.per_leaf:
            return jax.tree.map(lambda n: quantile(n, q), values["n"])
        leaves = jax.tree.leaves(values["n"])
        dt = jnp.result_type(*leaves)
        return quantile(combine_norms(jnp.stack([x.astype(dt) for x in leaves])), q)


def fourth_moment() -> S.Statistic:
    r"""Elementwise fourth moment \(\frac1B\sum_b g_b^4\).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.fourth_moment())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(2))
      [437.33 517.33]
    """
    return _Fourth()


def kurtosis() -> S.Statistic:
    r"""Per-coordinate kurtosis \(E[(g-\mu)^4]/\sigma^4\) of the per-example gradients
    (population moments, not excess: 3 for a Gaussian).

    The central moments are sums of centred powers (`CentralMoments`: one pass over
    tiles of the per-example gradients, against a shift as for the variance, merged
    across tiles, chunks and devices by Pébay's rule), so they do not cancel where the
    mean dominates the spread: in float32 they hold to ``|mean|/std`` of 1e4 and beyond,
    as far as the per-example gradients themselves resolve the spread. NaN where the
    variance is 0.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> out = js.per_example_stat(loss, js.stats.kurtosis())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [1.5 1.5]
    """
    return _Kurtosis()


def gradient_diversity() -> S.Statistic:
    r"""Gradient diversity \(\sum_b\|g_b\|^2 / \|\sum_b g_b\|^2\) (Yin et al., 2018), a scalar.

    It is \(1/B\) when all per-example gradients agree and grows as they
    disagree; the speed-up of a larger batch saturates once \(B\) exceeds
    about \(B\times\) the diversity. Where the summed gradient is zero it is
    ``inf`` (the per-example gradients cancel), and 0 where every per-example
    gradient is zero.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> out = js.per_example_stat(loss, js.stats.gradient_diversity())(jnp.zeros(2), batch)
      >>> print(round(float(out), 4))
      0.561
    """
    return _Diversity()


def norm_quantiles(
    q: float | Sequence[float] = (0.1, 0.5, 0.9), per_leaf: bool = True
) -> S.Statistic:
    r"""Quantiles of the per-example gradient norms \(\|g_b\|\) over the batch.

    Quantiles interpolate linearly, as ``jnp.quantile``. With ``axis_name`` (``pmap``,
    ``shard_map``) they are quantiles of the whole batch: every device gets the same
    value.

    Args:
      q: a quantile level in ``[0, 1]``, or a sequence of them. Like ``jnp.quantile``,
        a scalar level gives a scalar (shape ``()``) result per leaf, a sequence an
        array ``[len(q)]``.
      per_leaf: a pytree like params of per-leaf results (the norms of each leaf's
        gradient), or one result of the global norms over all leaves.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> st = js.stats.norm_quantiles((0.0, 0.5, 1.0), per_leaf=False)
      >>> print(np.asarray(js.per_example_stat(loss, st)(jnp.zeros(2), batch)).round(4))
      [2.     4.     8.4853]
      >>> med = js.stats.norm_quantiles(0.5, per_leaf=False)
      >>> print(np.asarray(js.per_example_stat(loss, med)(jnp.zeros(2), batch)).round(4))
      4.0
    """
    return _NormQuantiles(_levels(q), bool(per_leaf))


def _levels(q):
    """``q`` as a float (a scalar level) or a tuple of floats; raises on anything else."""
    bad = (
        "norm_quantiles(q=...): expected a level in [0, 1] or a sequence of them "
        "(e.g. 0.5 or (0.1, 0.5, 0.9)), got {!r}."
    )
    if isinstance(q, jax.core.Tracer):
        raise TypeError(bad.format(q) + " The levels must be concrete (not traced): build "
                        "the statistic outside jit.")
    try:
        arr = np.asarray(q)
    except Exception as e:  # noqa: BLE001 - ragged or unconvertible: reported below
        raise TypeError(bad.format(q)) from e
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number) or arr.ndim > 1:
        raise TypeError(bad.format(q))
    if np.iscomplexobj(arr):
        raise TypeError(bad.format(q))
    levels = arr.astype(np.float64)
    if levels.size == 0 or not np.all((levels >= 0.0) & (levels <= 1.0)):  # NaN fails too
        raise ValueError(f"norm_quantiles(q=...): levels must lie in [0, 1], got {q!r}.")
    return float(levels) if arr.ndim == 0 else tuple(float(x) for x in levels)

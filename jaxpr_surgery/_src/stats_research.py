"""Statistics researchers ask for: higher moments, gradient diversity, norm quantiles.

Each is a `Statistic` over the same reductions as the built-ins (so it costs what
they cost and composes with every option); exported from `jaxpr_surgery.stats`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.norms import combine_norms

CUBE = S.PhiSum(lambda g: g * g * g, multiplicative=True, name="cube", _builtin=True,
               _degree=3)
ABS_CUBE = S.PhiSum(lambda g: jnp.abs(g) ** 3, multiplicative=True, name="abs cube",
                    _builtin=True, _degree=3)
FOURTH = S.PhiSum(lambda g: jnp.square(jnp.square(g)), multiplicative=True, name="fourth",
                  _builtin=True, _degree=4)

_is_moments = lambda x: isinstance(x, S.Moments)  # noqa: E731


class _Fourth(S.Statistic):
    _name = "fourth_moment"

    def reductions(self):
        return {"p4": FOURTH}

    def finalize(self, values, count):
        return jax.tree.map(lambda s: s / count, values["p4"])


class _Kurtosis(S.Statistic):
    _name = "kurtosis"
    ddof = 1  # (needs more than one example: checked against concrete weights)

    def reductions(self):
        return {"s": S.SUM, "c": S.Centered(), "p3": CUBE, "a3": ABS_CUBE, "p4": FOURTH}

    def finalize(self, values, count):
        S.check_count(count, 1, "kurtosis")

        def one(s, c, p3, a3, p4):
            mu = c.mean
            e3, ea3, e4 = p3 / count, a3 / count, p4 / count
            var = c.m2 / count  # population variance (exact, centred)
            mu2, mu4 = jnp.square(mu), jnp.square(jnp.square(mu))
            e2 = var + mu2
            m4 = e4 - 4 * mu * e3 + 6 * mu2 * e2 - 3 * mu4
            # the raw-moment expansion cancels where |mean| >> spread: NaN there,
            # never a silently wrong number
            scale = e4 + 4 * jnp.abs(mu) * ea3 + 6 * mu2 * e2 + 3 * mu4
            eps = jnp.finfo(m4.dtype).eps
            ok = m4 > 1e3 * eps * scale
            kurt = m4 / jnp.where(var > 0, jnp.square(var), 1)
            return jnp.where(var > 0, jnp.where(ok, kurt, jnp.nan), jnp.nan)

        return jax.tree.map(one, values["s"], values["c"], values["p3"], values["a3"],
                            values["p4"], is_leaf=_is_moments)


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
        return S._safe_ratio(num, den)


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

    The central fourth moment comes from raw moments (one pass, no per-example
    gradients); where those cancel, because the mean dominates the spread, the
    result is NaN rather than a wrong number, and so is it where the variance is 0.

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
    about \(B\times\) the diversity.

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

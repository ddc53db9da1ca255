r"""Tracking gradient statistics for logging: signal-to-noise ratio and noise scale.

`track_gradient_statistics` is an identity transform (``updates`` pass
through unchanged) whose state keeps exponential moving averages of the squared
batch mean \(\bar g^2\) and of the per-example variance \(\hat\sigma^2\),
per coordinate and summed over all parameters. Put it first in a chain and read
``state.snr`` / ``state.noise_scale`` for logging.

The ratios are formed from averaged numerators and denominators (McCandlish et
al., 2018, App. A), not averaged per step: one step's ratio is noisy, and
infinite wherever a coordinate's variance vanishes. The numerators are the
unbiased \(\bar g^2 - \hat\sigma^2/B\) (per coordinate) and
\(\|\bar g\|^2 - \mathrm{tr}\hat\Sigma/B\) (in total): the plain squared mean
includes the noise of the batch mean, which would cap the noise scale near \(B\).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpr_surgery._src.optim.requests import (
    PerExampleTransformation,
    build_request,
    register_request,
    require,
    require_like,
)

__all__ = ["TrackGradientStatisticsState", "track_gradient_statistics"]


def _total(tree):
    """Sum of every element of every leaf, in float32."""
    return sum(
        (jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(tree)), jnp.zeros([], jnp.float32)
    )


def _ratio(num, den):
    """``num / den``; a non-positive denominator gives ``inf`` (0 where ``num`` is 0)."""
    safe = jnp.where(den > 0, den, 1)
    return jnp.where(den > 0, num / safe, jnp.where(num > 0, jnp.inf, 0.0)).astype(num.dtype)


class TrackGradientStatisticsState(NamedTuple):
    r"""State of `track_gradient_statistics`.

    Each average starts at the first observation (no bias correction needed).

    Attributes:
      count: number of updates so far (int32 scalar).
      mean_sq: per-coordinate EMA of \(\bar g^2 - \hat\sigma^2/B\) (unbiased for
        \(\mu^2\)), a pytree like params (``None`` with ``per_coordinate=False``).
      variance: per-coordinate EMA of \(\hat\sigma^2\), like ``mean_sq``.
      sq_norm: EMA of \(\|\bar g\|^2 - \mathrm{tr}\hat\Sigma/B\) (unbiased for
        \(|G|^2\)) over all parameters (float32 scalar).
      trace_variance: EMA of \(\mathrm{tr}\,\hat\Sigma = \sum \hat\sigma^2\)
        over all parameters (float32 scalar).
    """

    count: jax.Array
    mean_sq: optax.Updates | None
    variance: optax.Updates | None
    sq_norm: jax.Array
    trace_variance: jax.Array

    @property
    def snr(self) -> optax.Updates | None:
        r"""Per-coordinate SNR \(\mathrm{EMA}[\bar g^2]/\mathrm{EMA}[\hat\sigma^2]\)."""
        if self.mean_sq is None:
            return None
        return jax.tree.map(_ratio, self.mean_sq, self.variance)

    @property
    def noise_scale(self) -> jax.Array:
        r"""Noise scale \(\mathrm{EMA}[\mathrm{tr}\,\hat\Sigma]/\mathrm{EMA}[|G|^2]\)
        (``inf`` while the averaged \(|G|^2\) estimate is not positive)."""
        return _ratio(self.trace_variance, self.sq_norm)

    @property
    def critical_batch_size(self) -> jax.Array:
        r"""The critical batch size estimate \(B_\mathrm{crit}\approx B_\mathrm{simple}\)
        of McCandlish et al. (the batch size beyond which larger batches stop paying
        off in steps): the same value as `noise_scale`."""
        return self.noise_scale


def track_gradient_statistics(
    decay: float = 0.99, per_coordinate: bool = True
) -> PerExampleTransformation:
    r"""Passes updates through unchanged; tracks the gradient SNR and noise scale.

    \[
      \mathrm{SNR}_i = \frac{\mathrm{EMA}_t[\bar g_{t,i}^2 - \hat\sigma_{t,i}^2/B_t]}
      {\mathrm{EMA}_t[\hat\sigma_{t,i}^2]},
      \qquad
      B_{\mathrm{noise}} = \frac{\mathrm{EMA}_t[\sum_i \hat\sigma_{t,i}^2]}
      {\mathrm{EMA}_t[\|\bar g_t\|^2 - \sum_i \hat\sigma_{t,i}^2/B_t]}
    \]

    with \(\hat\sigma^2\) the per-example variance (``ddof=1``) and
    \(\mathrm{EMA}_t[x] = \beta\,\mathrm{EMA}_{t-1}[x] + (1-\beta)x_t\)
    started at \(x_1\). These are the EMA'd forms of
    ``jaxpr_surgery.stats.snr(bias_corrected=True)`` and
    `jaxpr_surgery.stats.gradient_noise_scale`: the squared mean is
    corrected for the noise \(\sigma^2/B\) of the batch mean, so the noise
    scale is not capped near \(B\). ``update`` takes the keyword-only extra
    args ``variance`` (statistic `jaxpr_surgery.stats.variance`) and
    ``batch_size`` (`example_count`), and optionally ``mean`` (the raw batch
    mean; defaults to ``updates``). Read ``state.snr`` (a pytree like params),
    ``state.noise_scale`` and ``state.critical_batch_size`` (scalars).

    Args:
      decay: \(\beta\), the EMA decay over steps, in ``[0, 1)``.
      per_coordinate: keep per-coordinate averages (two buffers like params);
        ``False`` keeps only the scalar totals (``state.snr`` is ``None``).

    Returns:
      A `PerExampleTransformation` requesting ``mean, variance, batch_size``,
      with state `TrackGradientStatisticsState`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.chain(jso.track_gradient_statistics(0.9), optax.sgd(0.1))
      >>> params = jnp.array([1.0, -2.0])
      >>> state = opt.init(params)
      >>> g = jnp.array([[1.0, 0.0], [3.0, -4.0]])  # per-example gradients [B=2, 2]
      >>> stats = {"mean": g.mean(0), "variance": g.var(0, ddof=1), "batch_size": 2}
      >>> updates, state = opt.update(stats["mean"], state, params,
      ...                             **jso.update_kwargs(stats))
      >>> print(state[0].snr, state[0].noise_scale)
      [1.5 0. ] 3.3333333

    References:
      McCandlish et al., An Empirical Model of Large-Batch Training
      <https://arxiv.org/abs/1812.06162>, 2018

      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    if isinstance(decay, (int, float)) and not 0 <= decay < 1:
        raise ValueError(f"track_gradient_statistics(decay=...): must be in [0, 1), got {decay!r}.")
    owner = "track_gradient_statistics"

    def init_fn(params):
        if per_coordinate:
            mean_sq = optax.tree.zeros_like(params)
            variance = optax.tree.zeros_like(params)
        else:
            mean_sq = variance = None
        # one array per field: a state whose fields share a buffer cannot be donated
        return TrackGradientStatisticsState(
            count=jnp.zeros([], jnp.int32),
            mean_sq=mean_sq,
            variance=variance,
            sq_norm=jnp.zeros([], jnp.float32),
            trace_variance=jnp.zeros([], jnp.float32),
        )

    def update_fn(
        updates, state, params=None, *, variance=None, batch_size=None, mean=None, **extra_args
    ):
        del params, extra_args
        variance = require_like(variance, updates, "variance", owner)
        B = jnp.asarray(require(batch_size, "batch_size", owner), jnp.float32)
        mean = updates if mean is None else require_like(mean, updates, "mean", owner)
        first = state.count == 0

        def ema(old, new):
            new = jnp.asarray(new).astype(old.dtype)
            return jnp.where(first, new, decay * old + (1 - decay) * new)

        # unbiased: E[mean^2] = mu^2 + sigma^2 / B
        mean_sq = jax.tree.map(
            lambda m, v: jnp.square(m.astype(jnp.float32)) - v.astype(jnp.float32) / B,
            mean,
            variance,
        )
        per_coord = state.mean_sq is not None
        new_state = TrackGradientStatisticsState(
            count=optax.safe_increment(state.count),
            mean_sq=jax.tree.map(ema, state.mean_sq, mean_sq) if per_coord else None,
            variance=jax.tree.map(ema, state.variance, variance) if per_coord else None,
            sq_norm=ema(state.sq_norm, _total(mean_sq)),
            trace_variance=ema(state.trace_variance, _total(variance)),
        )
        return updates, new_state

    return PerExampleTransformation(init_fn, update_fn, build_request("variance", "batch_size"))


register_request("track_gradient_statistics", ("variance", "batch_size"))

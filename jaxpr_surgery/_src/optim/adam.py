r"""Adam and its per-example preconditioner variants (MicroAdam, -Var, -MSQ).

All four keep Adam's first moment, an EMA of the batch-mean gradient
\(\bar g\), and differ only in what the second moment \(v\) averages.
With per-example gradients of mean \(\mu\) and variance \(\sigma^2\)
over the data, and a batch of \(B\) examples:

=================  ==========================================  ==========================
optimizer          EMA input of \(v\)                      expectation
=================  ==========================================  ==========================
``adam``           \(\bar g^2\)                            \(\mu^2+\sigma^2/B\)
``micro_adam``     \(\frac1B\sum_b g_b^2\)                 \(\mu^2+\sigma^2\)
``micro_adam_var`` \(\hat\sigma^2\) (per-example variance)  \(\sigma^2\)
``micro_adam_msq`` \(\max(\bar g^2-\hat\sigma^2/B,\ \kappa\hat\sigma^2/B)\)  \(\mu^2\) (above floor)
=================  ==========================================  ==========================

Roulet & Agarwala (2025) find training best when the preconditioner is
dominated by \(\mu^2\) rather than \(\sigma^2\).
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
from jaxpr_surgery._src.optim.wrappers import chain

__all__ = [
    "ScaleByMicroAdamState",
    "scale_by_adam",
    "scale_by_micro_adam",
    "scale_by_micro_adam_var",
    "scale_by_micro_adam_msq",
    "adam",
    "micro_adam",
    "micro_adam_var",
    "micro_adam_msq",
]


class ScaleByMicroAdamState(NamedTuple):
    """State of the per-example Adam variants (same fields as ``optax.ScaleByAdamState``).

    Attributes:
      count: number of updates so far (int32 scalar).
      mu: EMA of the batch-mean gradient.
      nu: EMA of the variant's second-moment input.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def _adam_core(b1, b2, eps, eps_root, mu_dtype, state_cls):
    """``init`` and ``step(updates, state, v_in)``; ``v_in=None`` squares ``updates``."""
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)

    def init_fn(params):
        mu = optax.tree.zeros_like(params, dtype=mu_dtype)
        nu = optax.tree.zeros_like(params)
        return state_cls(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def step(updates, state, v_in):
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        if v_in is None:  # exactly optax.scale_by_adam
            nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        else:
            v_in = optax.tree.cast_like(v_in, state.nu)
            nu = optax.tree.update_moment(v_in, state.nu, b2, 1)
        count_inc = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
        nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
        updates = jax.tree.map(
            lambda m, v: None if m is None else m / (jnp.sqrt(v + eps_root) + eps),
            mu_hat,
            nu_hat,
            is_leaf=lambda x: x is None,
        )
        mu = optax.tree.cast(mu, mu_dtype)
        nu = optax.tree.cast_like(nu, state.nu)
        return updates, state_cls(count=count_inc, mu=mu, nu=nu)

    return init_fn, step


def _check(b1, b2, eps, eps_root, owner):
    for name, value in (("b1", b1), ("b2", b2)):
        if isinstance(value, (int, float)) and not 0 <= value < 1:
            raise ValueError(f"{owner}({name}=...): must be in [0, 1), got {value!r}.")
    for name, value in (("eps", eps), ("eps_root", eps_root)):
        if isinstance(value, (int, float)) and not value >= 0:
            raise ValueError(f"{owner}({name}=...): must be >= 0, got {value!r}.")


# --------------------------------------------------------------------------- #
# Transforms
# --------------------------------------------------------------------------- #
def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
) -> PerExampleTransformation:
    r"""Rescales updates by Adam: \(v\) is an EMA of the squared batch mean.

    \[
      m_t = \beta_1 m_{t-1} + (1-\beta_1)\bar g_t,\qquad
      v_t = \beta_2 v_{t-1} + (1-\beta_2)\bar g_t^2,\qquad
      u_t = \frac{\hat m_t}{\sqrt{\hat v_t + \bar\varepsilon} + \varepsilon}
    \]

    with \(\hat m_t = m_t/(1-\beta_1^t)\), \(\hat v_t = v_t/(1-\beta_2^t)\).
    Identical to `optax.scale_by_adam` (same state type): the baseline of
    the family, whose \(v\) estimates \(\mu^2+\sigma^2/B\).

    Args:
      b1: decay of the EMA of the batch-mean gradient (first moment).
      b2: decay of the EMA of the second-moment input.
      eps: added to the denominator outside the square root.
      eps_root: added to the denominator inside the square root.
      mu_dtype: optional dtype of the first-moment accumulator.

    Returns:
      A `PerExampleTransformation` requesting ``mean``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> tx = jso.scale_by_adam()
      >>> state = tx.init(jnp.zeros(2))
      >>> u, state = tx.update(jnp.array([0.5, -2.0]), state)
      >>> print(np.asarray(u).round(4))
      [ 1. -1.]

    References:
      Kingma & Ba, Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>, 2014
    """
    _check(b1, b2, eps, eps_root, "scale_by_adam")
    init_fn, step = _adam_core(b1, b2, eps, eps_root, mu_dtype, optax.ScaleByAdamState)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return step(updates, state, None)

    return PerExampleTransformation(init_fn, update_fn, build_request("mean"))


def scale_by_micro_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
) -> PerExampleTransformation:
    r"""Rescales updates by MicroAdam: \(v\) is an EMA of \(E_b[g_b^2]\).

    \[
      v_t = \beta_2 v_{t-1} + (1-\beta_2)\,\frac1B\sum_b g_{t,b}^2,\qquad
      u_t = \frac{\hat m_t}{\sqrt{\hat v_t + \bar\varepsilon} + \varepsilon}
    \]

    with \(m_t\) and the bias corrections as in Adam. The input estimates
    \(\mu^2+\sigma^2\) whatever the batch size; with one example per batch
    this is Adam. ``update`` takes the keyword-only extra arg ``second_moment``
    (statistic `jaxpr_surgery.stats.second_moment`).

    Args:
      b1: decay of the EMA of the batch-mean gradient (first moment).
      b2: decay of the EMA of the second-moment input.
      eps: added to the denominator outside the square root.
      eps_root: added to the denominator inside the square root.
      mu_dtype: optional dtype of the first-moment accumulator.

    Returns:
      A `PerExampleTransformation` requesting ``mean, second_moment``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> g = jnp.array([[1.0, 2.0], [-1.0, 2.0]])  # per-example gradients [B=2, 2]
      >>> tx = jso.scale_by_micro_adam()
      >>> state = tx.init(jnp.zeros(2))
      >>> u, state = tx.update(g.mean(0), state, second_moment=(g**2).mean(0))
      >>> print(np.asarray(u).round(4))
      [0. 1.]

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    _check(b1, b2, eps, eps_root, "scale_by_micro_adam")
    init_fn, step = _adam_core(b1, b2, eps, eps_root, mu_dtype, ScaleByMicroAdamState)

    def update_fn(updates, state, params=None, *, second_moment=None, **extra_args):
        del params, extra_args
        second_moment = require_like(second_moment, updates, "second_moment", "scale_by_micro_adam")
        return step(updates, state, second_moment)

    return PerExampleTransformation(init_fn, update_fn, build_request("second_moment"))


def scale_by_micro_adam_var(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
) -> PerExampleTransformation:
    r"""Rescales updates by MicroAdamVar: \(v\) averages the per-example variance.

    \[
      v_t = \beta_2 v_{t-1} + (1-\beta_2)\,\hat\sigma_t^2,\qquad
      \hat\sigma_t^2 = \frac{1}{B-1}\sum_b (g_{t,b}-\bar g_t)^2
    \]

    with \(m_t\), bias corrections and \(u_t\) as in Adam: the pure
    "variance adaptation" reading of Adam. Where the examples agree,
    \(\hat\sigma^2\approx 0\) and steps are large; pair it with gradient
    clipping. ``update`` takes the keyword-only extra arg ``variance``
    (statistic `jaxpr_surgery.stats.variance`; needs ``B >= 2``).

    Args:
      b1: decay of the EMA of the batch-mean gradient (first moment).
      b2: decay of the EMA of the second-moment input.
      eps: added to the denominator outside the square root.
      eps_root: added to the denominator inside the square root.
      mu_dtype: optional dtype of the first-moment accumulator.

    Returns:
      A `PerExampleTransformation` requesting ``mean, variance``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> g = jnp.array([[1.0, 2.0], [3.0, 0.0]])  # per-example gradients [B=2, 2]
      >>> tx = jso.scale_by_micro_adam_var()
      >>> state = tx.init(jnp.zeros(2))
      >>> u, state = tx.update(g.mean(0), state, variance=g.var(0, ddof=1))
      >>> print(np.asarray(u).round(4))
      [1.4142 0.7071]

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    _check(b1, b2, eps, eps_root, "scale_by_micro_adam_var")
    init_fn, step = _adam_core(b1, b2, eps, eps_root, mu_dtype, ScaleByMicroAdamState)

    def update_fn(updates, state, params=None, *, variance=None, **extra_args):
        del params, extra_args
        variance = require_like(variance, updates, "variance", "scale_by_micro_adam_var")
        return step(updates, state, variance)

    return PerExampleTransformation(init_fn, update_fn, build_request("variance"))


def scale_by_micro_adam_msq(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    kappa: float = 1.0,
) -> PerExampleTransformation:
    r"""Rescales updates by MicroAdamMSQ: \(v\) averages the unbiased squared mean.

    \[
      v_t = \beta_2 v_{t-1} + (1-\beta_2)\,\max\!\Big(\bar g_t^2 - \frac{\hat\sigma_t^2}{B},\
      \kappa\frac{\hat\sigma_t^2}{B}\Big)
    \]

    with \(m_t\), bias corrections and \(u_t\) as in Adam. Since
    \(E[\bar g^2] = \mu^2 + \sigma^2/B\) and \(\hat\sigma^2\)
    (``ddof=1``) is unbiased, the first term estimates \(\mu^2\). Where the
    batch mean is within noise of 0 that estimate is negative or tiny; the
    floor \(\kappa\hat\sigma^2/B\) (the noise of the batch mean, scaled by
    ``kappa``) keeps \(\hat m/\sqrt{\hat v}\) bounded there, so the step never
    becomes \(\hat m/\varepsilon\). With ``kappa=1`` the input lies between
    half of Adam's \(\bar g^2\) and Adam's: the paper predicts it then trains
    like Adam. ``kappa=0`` is the unfloored estimator (unbounded steps where it
    floors at 0). ``update`` takes the keyword-only extra args ``variance``
    (statistic `jaxpr_surgery.stats.variance`) and ``batch_size`` (\(B\);
    statistic `example_count`), and optionally ``mean`` (the raw batch
    mean \(\bar g\); defaults to ``updates``). A batch of one has no variance:
    a concrete ``batch_size < 2`` raises ``ValueError``.

    Args:
      b1: decay of the EMA of the batch-mean gradient (first moment).
      b2: decay of the EMA of the second-moment input.
      eps: added to the denominator outside the square root.
      eps_root: added to the denominator inside the square root.
      mu_dtype: optional dtype of the first-moment accumulator.
      kappa: the floor \(\kappa\hat\sigma^2/B\), in units of the noise of the
        batch mean (``>= 0``).

    Returns:
      A `PerExampleTransformation` requesting ``mean, variance, batch_size``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxpr_surgery.optim as jso
      >>> g = jnp.array([[1.0, 2.0], [-1.0, 2.0]])  # per-example gradients [B=2, 2]
      >>> tx = jso.scale_by_micro_adam_msq()
      >>> state = tx.init(jnp.zeros(2))
      >>> u, state = tx.update(g.mean(0), state, variance=g.var(0, ddof=1), batch_size=2)
      >>> print(state.nu)  # coordinate 0 at the floor: max(0**2 - 2/2, 1 * 2/2) = 1
      [0.001 0.004]

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    owner = "scale_by_micro_adam_msq"
    _check(b1, b2, eps, eps_root, owner)
    if isinstance(kappa, (int, float)) and not kappa >= 0:  # also rejects NaN
        raise ValueError(f"{owner}(kappa=...): must be >= 0, got {kappa!r}.")
    init_fn, step = _adam_core(b1, b2, eps, eps_root, mu_dtype, ScaleByMicroAdamState)

    def update_fn(
        updates, state, params=None, *, variance=None, batch_size=None, mean=None, **extra_args
    ):
        del params, extra_args
        variance = require_like(variance, updates, "variance", owner)
        batch_size = require(batch_size, "batch_size", owner)
        if not isinstance(batch_size, jax.core.Tracer) and int(batch_size) < 2:
            raise ValueError(
                f"{owner}: batch_size={int(batch_size)}; the per-example variance needs B >= 2."
            )
        mean = updates if mean is None else require_like(mean, updates, "mean", owner)

        def msq(m, var):
            b = jnp.asarray(batch_size).astype(var.dtype)
            noise = var / b
            return jnp.maximum(jnp.square(m) - noise, kappa * noise).astype(var.dtype)

        return step(updates, state, jax.tree.map(msq, mean, variance))

    return PerExampleTransformation(init_fn, update_fn, build_request("variance", "batch_size"))


# --------------------------------------------------------------------------- #
# Optimizers
# --------------------------------------------------------------------------- #
def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
) -> PerExampleTransformation:
    r"""The Adam optimizer, as `optax.adam`, with its statistic request.

    \[
      \theta_{t+1} = \theta_t - \alpha_t \frac{\hat m_t}{\sqrt{\hat v_t + \bar\varepsilon}
      + \varepsilon},\qquad v_t \text{ an EMA of } \bar g_t^2
    \]

    The baseline against which the per-example variants compare; numerically
    identical to ``optax.adam`` (see `scale_by_adam`).

    Args:
      learning_rate: a float or an optax schedule.
      b1: decay of the EMA of the batch-mean gradient (first moment).
      b2: decay of the EMA of the second-moment input.
      eps: added to the denominator outside the square root.
      eps_root: added to the denominator inside the square root.
      mu_dtype: optional dtype of the first-moment accumulator.

    Returns:
      A `PerExampleTransformation` requesting ``mean``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.adam(learning_rate=0.1)
      >>> params = jnp.array([1.0, -2.0])
      >>> state = opt.init(params)
      >>> updates, state = opt.update(2 * params, state, params)
      >>> print(np.asarray(optax.apply_updates(params, updates)).round(4))
      [ 0.9 -1.9]

    References:
      Kingma & Ba, Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>, 2014
    """
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype),
        optax.scale_by_learning_rate(learning_rate),
    )


def micro_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
) -> PerExampleTransformation:
    r"""MicroAdam: Adam whose second moment averages the per-example squares.

    \[
      \theta_{t+1} = \theta_t - \alpha_t \frac{\hat m_t}{\sqrt{\hat v_t + \bar\varepsilon}
      + \varepsilon},\qquad v_t \text{ an EMA of } \frac1B\sum_b g_{t,b}^2
    \]

    ``update`` takes the extra arg ``second_moment`` (see `scale_by_micro_adam`).

    Args:
      learning_rate: a float or an optax schedule.
      b1: decay of the EMA of the batch-mean gradient (first moment).
      b2: decay of the EMA of the second-moment input.
      eps: added to the denominator outside the square root.
      eps_root: added to the denominator inside the square root.
      mu_dtype: optional dtype of the first-moment accumulator.

    Returns:
      A `PerExampleTransformation` requesting ``mean, second_moment``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.micro_adam(learning_rate=0.1)
      >>> params = jnp.array([1.0, -2.0])
      >>> state = opt.init(params)
      >>> g = jnp.array([[1.0, 1.0], [3.0, 3.0]]) * params  # per-example gradients
      >>> stats = {"mean": g.mean(0), "second_moment": (g**2).mean(0)}
      >>> updates, state = opt.update(stats["mean"], state, params,
      ...                             **jso.update_kwargs(stats))
      >>> print(np.asarray(optax.apply_updates(params, updates)).round(4))
      [ 0.9106 -1.9106]

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    return chain(
        scale_by_micro_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype),
        optax.scale_by_learning_rate(learning_rate),
    )


def micro_adam_var(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
) -> PerExampleTransformation:
    r"""MicroAdamVar: Adam whose second moment averages the per-example variance.

    \[
      \theta_{t+1} = \theta_t - \alpha_t \frac{\hat m_t}{\sqrt{\hat v_t + \bar\varepsilon}
      + \varepsilon},\qquad v_t \text{ an EMA of } \hat\sigma_t^2
    \]

    ``update`` takes the extra arg ``variance`` (see `scale_by_micro_adam_var`).
    Less stable than Adam (Roulet & Agarwala): combine with gradient clipping,
    e.g. ``js.optim.chain(optax.clip_by_global_norm(1.0), micro_adam_var(lr))``.

    Args:
      learning_rate: a float or an optax schedule.
      b1: decay of the EMA of the batch-mean gradient (first moment).
      b2: decay of the EMA of the second-moment input.
      eps: added to the denominator outside the square root.
      eps_root: added to the denominator inside the square root.
      mu_dtype: optional dtype of the first-moment accumulator.

    Returns:
      A `PerExampleTransformation` requesting ``mean, variance``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.micro_adam_var(learning_rate=0.1)
      >>> params = jnp.array([1.0, -2.0])
      >>> state = opt.init(params)
      >>> g = jnp.array([[1.0, 1.0], [3.0, 3.0]]) * params  # per-example gradients
      >>> stats = {"mean": g.mean(0), "variance": g.var(0, ddof=1)}
      >>> updates, state = opt.update(stats["mean"], state, params,
      ...                             **jso.update_kwargs(stats))
      >>> print(np.asarray(optax.apply_updates(params, updates)).round(4))
      [ 0.8586 -1.8586]

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    return chain(
        scale_by_micro_adam_var(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype),
        optax.scale_by_learning_rate(learning_rate),
    )


def micro_adam_msq(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    kappa: float = 1.0,
) -> PerExampleTransformation:
    r"""MicroAdamMSQ: Adam whose second moment averages the unbiased squared mean.

    \[
      \theta_{t+1} = \theta_t - \alpha_t \frac{\hat m_t}{\sqrt{\hat v_t + \bar\varepsilon}
      + \varepsilon},\qquad v_t \text{ an EMA of }
      \max(\bar g_t^2 - \hat\sigma_t^2/B,\ \kappa\hat\sigma_t^2/B)
    \]

    ``update`` takes the extra args ``variance`` and ``batch_size`` (see
    `scale_by_micro_adam_msq` for the floor ``kappa``).

    Args:
      learning_rate: a float or an optax schedule.
      b1: decay of the EMA of the batch-mean gradient (first moment).
      b2: decay of the EMA of the second-moment input.
      eps: added to the denominator outside the square root.
      eps_root: added to the denominator inside the square root.
      mu_dtype: optional dtype of the first-moment accumulator.
      kappa: the floor \(\kappa\hat\sigma^2/B\) (see `scale_by_micro_adam_msq`).

    Returns:
      A `PerExampleTransformation` requesting ``mean, variance, batch_size``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.micro_adam_msq(learning_rate=0.1)
      >>> params = jnp.array([1.0, -2.0])
      >>> state = opt.init(params)
      >>> g = jnp.array([[1.0, 1.0], [3.0, 3.0]]) * params  # per-example gradients
      >>> stats = {"mean": g.mean(0), "variance": g.var(0, ddof=1), "batch_size": 2}
      >>> updates, state = opt.update(stats["mean"], state, params,
      ...                             **jso.update_kwargs(stats))
      >>> print(np.asarray(optax.apply_updates(params, updates)).round(4))
      [ 0.8845 -1.8845]

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    return chain(
        scale_by_micro_adam_msq(
            b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, kappa=kappa
        ),
        optax.scale_by_learning_rate(learning_rate),
    )


register_request("adam", ("mean",))
register_request("scale_by_adam", ("mean",))
register_request("micro_adam", ("second_moment",))
register_request("scale_by_micro_adam", ("second_moment",))
register_request("micro_adam_var", ("variance",))
register_request("scale_by_micro_adam_var", ("variance",))
register_request("micro_adam_msq", ("variance", "batch_size"))
register_request("scale_by_micro_adam_msq", ("variance", "batch_size"))

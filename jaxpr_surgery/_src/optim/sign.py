r"""Sign-based optimizers, by where the sign sits in the processing chain.

Per-example gradients \(g_b\) go through batch mean, then an EMA over
steps, then the update. ``sign`` can be applied at any of these points:

=========================  =================================================
optimizer                  update direction
=========================  =================================================
``per_example_sign_sgd``   \(\frac1B\sum_b \mathrm{sign}(g_b)\) (optionally EMA'd)
``sign_sgd``               \(\mathrm{sign}(\bar g)\)
``ema_of_sign``            \(\mathrm{EMA}_t[\mathrm{sign}(\bar g_t)]\)
``sign_ema``               \(\mathrm{sign}(\mathrm{EMA}_t[\bar g_t])\) (Signum)
=========================  =================================================

The signal-to-noise argument of Roulet & Agarwala (2025): averaging raises the
SNR of a coordinate, and ``sign`` destroys the most information where the SNR
is lowest, so it is best applied as late as possible -- ``sign_ema``.
``sign(0) = 0`` throughout, as in `jnp.sign` and
`jaxpr_surgery.stats.sign_mean`.
"""

from __future__ import annotations

import optax

from jaxpr_surgery._src.optim.requests import (
    PerExampleTransformation,
    build_request,
    register_request,
    require_like,
)
from jaxpr_surgery._src.optim.wrappers import chain

__all__ = [
    "scale_by_per_example_sign",
    "per_example_sign_sgd",
    "sign_sgd",
    "ema_of_sign",
    "sign_ema",
]


def _check_decay(b1, owner, allow_none=False):
    if b1 is None and allow_none:
        return
    if isinstance(b1, (int, float)) and not 0 <= b1 < 1:
        raise ValueError(f"{owner}(b1=...): must be in [0, 1), got {b1!r}.")


def scale_by_per_example_sign() -> PerExampleTransformation:
    r"""Replaces updates by the mean of per-example signs.

    \[
      u = \frac1B \sum_b \mathrm{sign}(g_b)
    \]

    ``updates`` (the batch mean) is ignored; ``update`` takes the keyword-only
    extra arg ``sign_mean`` (statistic `jaxpr_surgery.stats.sign_mean`).

    Returns:
      A stateless `PerExampleTransformation` requesting ``mean, sign_mean``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> g = jnp.array([[1.0, -2.0], [3.0, 4.0]])  # per-example gradients [B=2, 2]
      >>> tx = jso.scale_by_per_example_sign()
      >>> u, _ = tx.update(g.mean(0), tx.init(None), sign_mean=jnp.sign(g).mean(0))
      >>> print(np.asarray(u).round(4))
      [1. 0.]

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """

    def update_fn(updates, state, params=None, *, sign_mean=None, **extra_args):
        del params, extra_args
        sign_mean = require_like(sign_mean, updates, "sign_mean", "scale_by_per_example_sign")
        return sign_mean, state

    return PerExampleTransformation(optax.init_empty_state, update_fn, build_request("sign_mean"))


def per_example_sign_sgd(
    learning_rate: optax.ScalarOrSchedule,
    b1: float | None = None,
    debias: bool = True,
) -> PerExampleTransformation:
    r"""SGD on the mean of per-example gradient signs: the earliest sign placement.

    \[
      s_t = \frac1B\sum_b \mathrm{sign}(g_{t,b}),\quad
      m_t = \beta_1 m_{t-1} + (1-\beta_1) s_t,\quad
      \theta_{t+1} = \theta_t - \alpha_t\, m_t
    \]

    (with ``b1=None``, \(m_t = s_t\)). ``update`` takes the extra arg
    ``sign_mean`` (statistic `jaxpr_surgery.stats.sign_mean`).

    Args:
      learning_rate: a float or an optax schedule.
      b1: decay of an optional EMA of the sign mean over steps; ``None``: none.
      debias: divide the EMA by \(1-\beta_1^t\) (as Adam's first moment).

    Returns:
      A `PerExampleTransformation` requesting ``mean, sign_mean``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.per_example_sign_sgd(learning_rate=0.1)
      >>> params = jnp.array([1.0, -2.0, 3.0])
      >>> state = opt.init(params)
      >>> g = jnp.array([[1.0, 1.0, -1.0], [3.0, 3.0, 2.0]]) * params  # per-example
      >>> stats = {"mean": g.mean(0), "sign_mean": jnp.sign(g).mean(0)}
      >>> updates, state = opt.update(stats["mean"], state, params,
      ...                             **jso.update_kwargs(stats))
      >>> print(updates)  # the examples disagree on the last coordinate: no step
      [-0.1  0.1 -0. ]

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    _check_decay(b1, "per_example_sign_sgd", allow_none=True)
    parts = [scale_by_per_example_sign()]
    if b1 is not None:
        parts.append(optax.ema(b1, debias=debias))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return chain(*parts)


def sign_sgd(learning_rate: optax.ScalarOrSchedule) -> PerExampleTransformation:
    r"""signSGD: SGD on the sign of the batch-mean gradient.

    \[
      \theta_{t+1} = \theta_t - \alpha_t\, \mathrm{sign}(\bar g_t)
    \]

    Args:
      learning_rate: a float or an optax schedule.

    Returns:
      A `PerExampleTransformation` requesting ``mean``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.sign_sgd(learning_rate=0.1)
      >>> params = jnp.array([1.0, -2.0])
      >>> updates, _ = opt.update(jnp.array([0.3, -5.0]), opt.init(params), params)
      >>> print(updates)
      [-0.1  0.1]

    References:
      Bernstein et al., signSGD: Compressed Optimisation for Non-Convex Problems
      <https://arxiv.org/abs/1802.04434>, 2018
    """
    return chain(optax.scale_by_sign(), optax.scale_by_learning_rate(learning_rate))


def ema_of_sign(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    debias: bool = True,
) -> PerExampleTransformation:
    r"""SGD on an EMA over steps of the sign of the batch-mean gradient.

    \[
      m_t = \beta_1 m_{t-1} + (1-\beta_1)\,\mathrm{sign}(\bar g_t),\quad
      \theta_{t+1} = \theta_t - \alpha_t\, m_t
    \]

    (with ``debias``, \(m_t\) is divided by \(1-\beta_1^t\)).

    Args:
      learning_rate: a float or an optax schedule.
      b1: decay of the EMA of signs.
      debias: divide the EMA by \(1-\beta_1^t\) (as Adam's first moment).

    Returns:
      A `PerExampleTransformation` requesting ``mean``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.ema_of_sign(learning_rate=0.1, b1=0.5)
      >>> params = jnp.array([1.0, -2.0])
      >>> state = opt.init(params)
      >>> _, state = opt.update(jnp.array([0.3, -5.0]), state, params)
      >>> updates, state = opt.update(jnp.array([0.3, 5.0]), state, params)
      >>> print(np.asarray(updates).round(4))  # -0.1 * (0.25 * s1 + 0.5 * s2) / (1 - 0.5**2)
      [-0.1    -0.0333]

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    _check_decay(b1, "ema_of_sign")
    return chain(
        optax.scale_by_sign(),
        optax.ema(b1, debias=debias),
        optax.scale_by_learning_rate(learning_rate),
    )


def sign_ema(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9) -> PerExampleTransformation:
    r"""SignEMA (Signum): SGD on the sign of an EMA of batch-mean gradients.

    \[
      m_t = \beta_1 m_{t-1} + (1-\beta_1)\,\bar g_t,\quad
      \theta_{t+1} = \theta_t - \alpha_t\, \mathrm{sign}(m_t)
    \]

    The latest sign placement, and the best one by the SNR argument of Roulet &
    Agarwala. Numerically identical to ``optax.signum(learning_rate, beta=b1)``
    (the EMA is not debiased: the sign ignores its scale).

    Args:
      learning_rate: a float or an optax schedule.
      b1: decay of the EMA of batch-mean gradients.

    Returns:
      A `PerExampleTransformation` requesting ``mean``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.sign_ema(learning_rate=0.1, b1=0.5)
      >>> params = jnp.array([1.0, -2.0])
      >>> state = opt.init(params)
      >>> _, state = opt.update(jnp.array([0.3, -5.0]), state, params)
      >>> updates, state = opt.update(jnp.array([0.3, 1.0]), state, params)
      >>> print(updates)  # sign of 0.25 * [0.3, -5] + 0.5 * [0.3, 1]
      [-0.1  0.1]

    References:
      Bernstein et al., signSGD: Compressed Optimisation for Non-Convex Problems
      <https://arxiv.org/abs/1802.04434>, 2018

      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025
    """
    _check_decay(b1, "sign_ema")
    return chain(
        optax.ema(b1, debias=False),
        optax.scale_by_sign(),
        optax.scale_by_learning_rate(learning_rate),
    )


register_request("scale_by_per_example_sign", ("sign_mean",))
register_request("per_example_sign_sgd", ("sign_mean",))
register_request("sign_sgd", ("mean",))
register_request("ema_of_sign", ("mean",))
register_request("sign_ema", ("mean",))

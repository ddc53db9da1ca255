"""Learning-rate helpers."""

from __future__ import annotations

import math

import numpy as np
import optax

from jaxpr_surgery._src.optim.requests import is_int

__all__ = ["sqrt_batch_size_scaling", "adam_sqrt_scaling"]


def _check_batch_sizes(base_batch_size, batch_size, owner):
    """Batch sizes are positive numbers: ints (numpy's too, `is_int`) or floats."""
    for name, value in (("base_batch_size", base_batch_size), ("batch_size", batch_size)):
        number = is_int(value) or isinstance(value, (float, np.floating))
        if not number or not value > 0:
            raise ValueError(f"{owner}({name}=...): must be a positive number, got {value!r}.")


def sqrt_batch_size_scaling(
    base_lr: optax.ScalarOrSchedule, base_batch_size: int, batch_size: int
) -> optax.ScalarOrSchedule:
    r"""Scales a learning rate (or schedule) by the square root of the batch-size ratio.

    \[
      \alpha(B) = \alpha_0 \sqrt{B / B_0}
    \]

    The square-root rule keeps the noise of an Adam-type update comparable
    across batch sizes; Roulet & Agarwala report matching training curves with
    it over small to medium batch sizes.

    Args:
      base_lr: \(\alpha_0\), a float or an optax schedule (``step -> lr``),
        tuned at batch size ``base_batch_size``.
      base_batch_size: \(B_0\), a positive number.
      batch_size: \(B\), a positive number.

    Returns:
      A float when ``base_lr`` is a number, otherwise a schedule.

    Raises:
      ValueError: if a batch size is not positive.

    Examples:
      >>> import optax
      >>> import jaxpr_surgery.optim as jso
      >>> jso.sqrt_batch_size_scaling(1e-3, base_batch_size=64, batch_size=256)
      0.002
      >>> sched = jso.sqrt_batch_size_scaling(optax.constant_schedule(1.0), 4, 1)
      >>> float(sched(0))
      0.5

    References:
      Roulet & Agarwala, Per-example gradients: a new frontier for understanding
      and improving optimizers <https://arxiv.org/abs/2510.00236>, 2025

      Malladi et al., On the SDEs and Scaling Rules for Adaptive Gradient
      Algorithms <https://arxiv.org/abs/2205.10287>, 2022
    """
    _check_batch_sizes(base_batch_size, batch_size, "sqrt_batch_size_scaling")
    factor = math.sqrt(batch_size / base_batch_size)
    if callable(base_lr):
        return lambda count: base_lr(count) * factor
    return base_lr * factor


def adam_sqrt_scaling(
    base_batch_size: int,
    batch_size: int,
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> dict:
    r"""Malladi et al.'s square-root scaling rule for Adam-type optimizers, in full.

    With \(\kappa = B/B_0\), tuned hyperparameters at \(B_0\) map to

    \[
      \alpha \to \sqrt\kappa\,\alpha,\quad
      1-\beta_1 \to \kappa(1-\beta_1),\quad
      1-\beta_2 \to \kappa(1-\beta_2),\quad
      \varepsilon \to \varepsilon/\sqrt\kappa,
    \]

    so the SDE the optimizer approximates is unchanged: the EMAs cover the same
    number of *examples*, and the update noise keeps its scale. Compare runs
    against examples seen, not steps.

    Returns:
      ``dict(learning_rate=..., b1=..., b2=..., eps=...)`` to pass to `adam`,
      `micro_adam`, ... (a schedule stays a schedule).

    Raises:
      ValueError: a batch size that is not positive, or a \(\kappa\) so large that
        a decay would leave \([0, 1)\).

    Examples:
      >>> import jaxpr_surgery.optim as jso
      >>> hp = jso.adam_sqrt_scaling(64, 256, 1e-3, b1=0.9, b2=0.99, eps=1e-8)
      >>> {k: round(v, 10) for k, v in hp.items()}
      {'learning_rate': 0.002, 'b1': 0.6, 'b2': 0.96, 'eps': 5e-09}
    """
    _check_batch_sizes(base_batch_size, batch_size, "adam_sqrt_scaling")
    kappa = batch_size / base_batch_size
    out = {"learning_rate": sqrt_batch_size_scaling(learning_rate, base_batch_size, batch_size)}
    for name, beta in (("b1", b1), ("b2", b2)):
        new = 1 - kappa * (1 - beta)
        if not 0 <= new < 1:
            raise ValueError(
                f"adam_sqrt_scaling: {name}={beta} at batch size {batch_size} (kappa={kappa:g}) "
                f"maps to {new:g}, outside [0, 1): the batch grew beyond what the rule covers."
            )
        out[name] = new
    out["eps"] = eps / math.sqrt(kappa)
    return out

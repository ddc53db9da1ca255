"""Learning-rate helpers."""

from __future__ import annotations

import math

import optax

__all__ = ["sqrt_batch_size_scaling"]


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
    for name, value in (("base_batch_size", base_batch_size), ("batch_size", batch_size)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(
                f"sqrt_batch_size_scaling({name}=...): must be a positive number, got {value!r}."
            )
    factor = math.sqrt(batch_size / base_batch_size)
    if callable(base_lr):
        return lambda count: base_lr(count) * factor
    return base_lr * factor

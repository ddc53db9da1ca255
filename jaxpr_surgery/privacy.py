"""Differential privacy as practitioners run it: accounting, calibration, Poisson batches,
and jax-privacy's ``clipped_grad`` entry point.

* `epsilon` / `calibrate_noise_multiplier`: the privacy spent by DP-SGD with Poisson
  sampling (Google's ``dp_accounting``, PLD or RDP; ``pip install 'jaxpr_surgery[dp]'``),
  and the noise multiplier that reaches a target; `epsilon_of` for a
  `jaxpr_surgery.optim.dp_sgd` / ``dp_adam`` configuration.
* `poisson_batches`: Poisson-sampled batches of a fixed shape, padding marked for
  ``is_padding_example=``; `min_max_batch_size`, the size it accepts without truncation.
* `clipped_grad`: ``jax_privacy.clipping.clipped_grad``'s arguments and outputs, computed
  by the ``clipped_sum`` statistic (switch by one import).

    import jax, jaxpr_surgery as js

    z = js.privacy.calibrate_noise_multiplier(
        target_epsilon=3.0, delta=1e-5, sampling_probability=256 / 60_000, steps=2_000)
    idx, pad = js.privacy.poisson_batches(
        jax.random.key(0), num_examples=60_000, sampling_probability=256 / 60_000,
        max_batch_size=400, steps=2_000)
"""

from jaxpr_surgery._src.privacy.accounting import (
    calibrate_noise_multiplier as calibrate_noise_multiplier,
)
from jaxpr_surgery._src.privacy.accounting import epsilon as epsilon
from jaxpr_surgery._src.privacy.accounting import epsilon_of as epsilon_of
from jaxpr_surgery._src.privacy.clipped_grad import AuxiliaryOutput as AuxiliaryOutput
from jaxpr_surgery._src.privacy.clipped_grad import (
    BoundedSensitivityCallable as BoundedSensitivityCallable,
)
from jaxpr_surgery._src.privacy.clipped_grad import clipped_grad as clipped_grad
from jaxpr_surgery._src.privacy.sampling import OVERFLOW_PROBABILITY as OVERFLOW_PROBABILITY
from jaxpr_surgery._src.privacy.sampling import min_max_batch_size as min_max_batch_size
from jaxpr_surgery._src.privacy.sampling import poisson_batches as poisson_batches

__all__ = [
    "epsilon",
    "calibrate_noise_multiplier",
    "epsilon_of",
    "poisson_batches",
    "min_max_batch_size",
    "OVERFLOW_PROBABILITY",
    "clipped_grad",
    "AuxiliaryOutput",
    "BoundedSensitivityCallable",
]

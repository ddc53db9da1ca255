"""Optax optimizers that use statistics of per-example gradients.

Every optimizer here is an `optax.GradientTransformationExtraArgs`
(`PerExampleTransformation`) whose ``update(updates, state, params,
**extra_args)`` takes the batch-mean gradient as ``updates`` and the other
per-example statistics it needs as keyword-only extra args, named after them
(``second_moment=...``, ``variance=...``, ``sign_mean=...``,
``clipped_sum=...``, ``batch_size=...``; DP also takes a PRNG ``key=...``).
Each optimizer also carries ``stat_request``, the dict of statistics to compute
under those names, so a training step is one statistic call and one update:

    import jax, optax
    import jaxpr_surgery as js

    opt = js.optim.micro_adam(learning_rate=1e-3)

    @jax.jit
    def step(params, state, batch):
        request = js.optim.stat_request(opt, state)  # {"mean": ..., "second_moment": ...}
        loss, stats = js.value_and_per_example_stat(loss_fn, request)(params, batch)
        updates, state = opt.update(stats["mean"], state, params,
                                    **js.optim.update_kwargs(stats))
        return optax.apply_updates(params, updates), state, loss

``update_kwargs(stats, key=k)`` adds further extra args (the DP noise key).
The state lets the request follow hyperparameters that a statistic depends on
(a clip norm scheduled with `inject_hyperparams`); other optimizers ignore it.
optax's wrappers forget the request of what they wrap, and ``optax.masked``
does not mask statistics: use `chain`, `named_chain`, `masked`,
`partition` / `multi_transform` and `inject_hyperparams` from here, e.g.
``js.optim.chain(js.optim.track_gradient_statistics(),
optax.clip_by_global_norm(1.0), js.optim.micro_adam_var(1e-3))``.
`stat_request` refuses an optax wrapper hiding a request, and
``optax.MultiSteps`` around an optimizer that needs more than the mean: use
`accumulate`, which takes one step every ``k`` micro-batches on their exact
statistics (merged partials, `jaxpr_surgery.per_example_partial`).
``stat_request("dp_sgd", clip_norm=1.0)`` also accepts optimizer names.

Families (Roulet & Agarwala, arXiv 2510.00236):

* sign placement: `per_example_sign_sgd`, `sign_sgd`,
  `ema_of_sign`, `sign_ema` (Signum);
* Adam's preconditioner: `adam`, `micro_adam`,
  `micro_adam_var`, `micro_adam_msq` and their ``scale_by_*``;
* matrix preconditioners: `shampoo` / `scale_by_shampoo` (per-example Kronecker
  moments, or classic Shampoo with ``per_example=False``);
* differential privacy: `dp_sgd`, `dp_adam`, `dp_aggregate` (per-layer clipping with a
  pytree of bounds; `dp_sensitivity`);
* monitoring: `track_gradient_statistics`;
* schedules: `sqrt_batch_size_scaling`, `adam_sqrt_scaling` (Malladi et al.'s
  full rule);
* optax's wrappers keeping requests: `chain`, `named_chain`, `masked`,
  `partition`, `multi_transform`, `inject_hyperparams`;
* gradient accumulation over micro-batches: `accumulate`.
"""

from jaxpr_surgery._src.optim.accumulate import AccumulateState as AccumulateState
from jaxpr_surgery._src.optim.accumulate import (
    AccumulatingTransformation as AccumulatingTransformation,
)
from jaxpr_surgery._src.optim.accumulate import accumulate as accumulate
from jaxpr_surgery._src.optim.adam import ScaleByMicroAdamState as ScaleByMicroAdamState
from jaxpr_surgery._src.optim.adam import adam as adam
from jaxpr_surgery._src.optim.adam import micro_adam as micro_adam
from jaxpr_surgery._src.optim.adam import micro_adam_msq as micro_adam_msq
from jaxpr_surgery._src.optim.adam import micro_adam_var as micro_adam_var
from jaxpr_surgery._src.optim.adam import scale_by_adam as scale_by_adam
from jaxpr_surgery._src.optim.adam import scale_by_micro_adam as scale_by_micro_adam
from jaxpr_surgery._src.optim.adam import scale_by_micro_adam_msq as scale_by_micro_adam_msq
from jaxpr_surgery._src.optim.adam import scale_by_micro_adam_var as scale_by_micro_adam_var
from jaxpr_surgery._src.optim.dp import dp_adam as dp_adam
from jaxpr_surgery._src.optim.dp import dp_aggregate as dp_aggregate
from jaxpr_surgery._src.optim.dp import dp_sensitivity as dp_sensitivity
from jaxpr_surgery._src.optim.dp import dp_sgd as dp_sgd
from jaxpr_surgery._src.optim.monitor import (
    TrackGradientStatisticsState as TrackGradientStatisticsState,
)
from jaxpr_surgery._src.optim.monitor import track_gradient_statistics as track_gradient_statistics
from jaxpr_surgery._src.optim.requests import PerExampleTransformation as PerExampleTransformation
from jaxpr_surgery._src.optim.requests import example_count as example_count
from jaxpr_surgery._src.optim.requests import stat_request as stat_request
from jaxpr_surgery._src.optim.requests import update_kwargs as update_kwargs
from jaxpr_surgery._src.optim.schedules import adam_sqrt_scaling as adam_sqrt_scaling
from jaxpr_surgery._src.optim.schedules import sqrt_batch_size_scaling as sqrt_batch_size_scaling
from jaxpr_surgery._src.optim.shampoo import ScaleByShampooState as ScaleByShampooState
from jaxpr_surgery._src.optim.shampoo import scale_by_shampoo as scale_by_shampoo
from jaxpr_surgery._src.optim.shampoo import shampoo as shampoo
from jaxpr_surgery._src.optim.sign import ema_of_sign as ema_of_sign
from jaxpr_surgery._src.optim.sign import per_example_sign_sgd as per_example_sign_sgd
from jaxpr_surgery._src.optim.sign import scale_by_per_example_sign as scale_by_per_example_sign
from jaxpr_surgery._src.optim.sign import sign_ema as sign_ema
from jaxpr_surgery._src.optim.sign import sign_sgd as sign_sgd
from jaxpr_surgery._src.optim.wrappers import chain as chain
from jaxpr_surgery._src.optim.wrappers import inject_hyperparams as inject_hyperparams
from jaxpr_surgery._src.optim.wrappers import masked as masked
from jaxpr_surgery._src.optim.wrappers import multi_transform as multi_transform
from jaxpr_surgery._src.optim.wrappers import named_chain as named_chain
from jaxpr_surgery._src.optim.wrappers import partition as partition

__all__ = [
    "PerExampleTransformation",
    "chain",
    "named_chain",
    "masked",
    "partition",
    "multi_transform",
    "inject_hyperparams",
    "accumulate",
    "AccumulatingTransformation",
    "AccumulateState",
    "example_count",
    "stat_request",
    "update_kwargs",
    "ScaleByMicroAdamState",
    "scale_by_adam",
    "scale_by_micro_adam",
    "scale_by_micro_adam_var",
    "scale_by_micro_adam_msq",
    "adam",
    "micro_adam",
    "micro_adam_var",
    "micro_adam_msq",
    "ScaleByShampooState",
    "scale_by_shampoo",
    "shampoo",
    "scale_by_per_example_sign",
    "per_example_sign_sgd",
    "sign_sgd",
    "ema_of_sign",
    "sign_ema",
    "dp_aggregate",
    "dp_sgd",
    "dp_adam",
    "dp_sensitivity",
    "TrackGradientStatisticsState",
    "track_gradient_statistics",
    "sqrt_batch_size_scaling",
    "adam_sqrt_scaling",
]

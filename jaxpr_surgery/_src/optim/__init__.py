"""Optimizers that consume per-example gradient statistics (see ``jaxpr_surgery.optim``).

One module per concept: ``requests`` (the transformation type, statistic
requests), ``wrappers`` (optax's wrappers keeping requests), ``accumulate``
(gradient accumulation over micro-batches), ``sign``, ``adam``, ``shampoo``,
``dp``, ``monitor``, ``schedules``.
Importing the package imports every module, so that every optimizer name is
registered for ``stat_request(name)``.
"""

from jaxpr_surgery._src.optim import accumulate as accumulate
from jaxpr_surgery._src.optim import adam as adam
from jaxpr_surgery._src.optim import dp as dp
from jaxpr_surgery._src.optim import monitor as monitor
from jaxpr_surgery._src.optim import requests as requests
from jaxpr_surgery._src.optim import schedules as schedules
from jaxpr_surgery._src.optim import shampoo as shampoo
from jaxpr_surgery._src.optim import sign as sign
from jaxpr_surgery._src.optim import wrappers as wrappers

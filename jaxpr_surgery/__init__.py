"""jaxpr_surgery: statistics of per-example gradients by surgery of the jaxpr.

import jaxpr_surgery as js
m, v = js.per_example_stat(loss, (js.stats.mean(), js.stats.variance()))(params, batch)
"""

from jaxpr_surgery import optim as optim
from jaxpr_surgery import stats as stats
from jaxpr_surgery._src.api import check_per_example as check_per_example
from jaxpr_surgery._src.api import per_example_stat as per_example_stat
from jaxpr_surgery._src.api import value_and_per_example_stat as value_and_per_example_stat
from jaxpr_surgery._src.explain import Report as Report
from jaxpr_surgery._src.explain import explain as explain

__version__ = "0.1.0"

__all__ = [
    "stats",
    "optim",
    "per_example_stat",
    "value_and_per_example_stat",
    "explain",
    "Report",
    "check_per_example",
]

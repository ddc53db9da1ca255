"""jaxpr_surgery: statistics of per-example gradients by surgery of the jaxpr.

import jaxpr_surgery as js
m, v = js.per_example_stat(loss, (js.stats.mean(), js.stats.variance()))(params, batch)
"""

from jaxpr_surgery._src import versions as _versions

_versions.warn_if_untested()

from jaxpr_surgery import extend as extend  # noqa: E402
from jaxpr_surgery import optim as optim  # noqa: E402
from jaxpr_surgery import privacy as privacy  # noqa: E402
from jaxpr_surgery import stats as stats  # noqa: E402
from jaxpr_surgery._src.api import per_example_stat as per_example_stat  # noqa: E402
from jaxpr_surgery._src.api import value_and_per_example_stat as value_and_per_example_stat  # noqa: E402
from jaxpr_surgery._src.check import check_per_example as check_per_example  # noqa: E402
from jaxpr_surgery._src.explain import Report as Report  # noqa: E402
from jaxpr_surgery._src.explain import explain as explain  # noqa: E402
from jaxpr_surgery._src.independence import CrossExampleError as CrossExampleError  # noqa: E402
from jaxpr_surgery._src.independence import (  # noqa: E402
    CrossExampleWarning as CrossExampleWarning,
)
from jaxpr_surgery._src.partials import Partial as Partial  # noqa: E402
from jaxpr_surgery._src.partials import finalize_partial as finalize_partial  # noqa: E402
from jaxpr_surgery._src.partials import merge_partials as merge_partials  # noqa: E402
from jaxpr_surgery._src.partials import per_example_partial as per_example_partial  # noqa: E402
from jaxpr_surgery._src.versions import TESTED_JAX as TESTED_JAX  # noqa: E402
from jaxpr_surgery._src.versions import UntestedJaxWarning as UntestedJaxWarning  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "stats",
    "optim",
    "extend",
    "privacy",
    "per_example_stat",
    "value_and_per_example_stat",
    "per_example_partial",
    "merge_partials",
    "finalize_partial",
    "Partial",
    "explain",
    "Report",
    "check_per_example",
    "CrossExampleError",
    "CrossExampleWarning",
    "TESTED_JAX",
    "UntestedJaxWarning",
]

"""Layer kinds: one module per kind, each registering a `.base.Kernel`."""

from jaxpr_surgery._src.sites import conv as _conv  # noqa: F401
from jaxpr_surgery._src.sites import dense as _dense  # noqa: F401
from jaxpr_surgery._src.sites import embedding as _embedding  # noqa: F401
from jaxpr_surgery._src.sites import generic as _generic  # noqa: F401
from jaxpr_surgery._src.sites.base import KERNELS as KERNELS
from jaxpr_surgery._src.sites.base import kernel_for as kernel_for

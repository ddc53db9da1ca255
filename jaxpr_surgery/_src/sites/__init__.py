"""Layer kinds: one module per kind, each registering its `.base.Kernel` (importing
this package registers them all)."""

from jaxpr_surgery._src.sites import conv as _conv  # noqa: F401
from jaxpr_surgery._src.sites import custom as _custom  # noqa: F401
from jaxpr_surgery._src.sites import dense as _dense  # noqa: F401
from jaxpr_surgery._src.sites import embedding as _embedding  # noqa: F401
from jaxpr_surgery._src.sites import generic as _generic  # noqa: F401
from jaxpr_surgery._src.sites import lora as _lora  # noqa: F401
from jaxpr_surgery._src.sites import ragged as _ragged  # noqa: F401
from jaxpr_surgery._src.sites.base import KERNELS as KERNELS
from jaxpr_surgery._src.sites.base import SITE_RULES as SITE_RULES
from jaxpr_surgery._src.sites.base import kernel_for as kernel_for
from jaxpr_surgery._src.sites.base import kind_for as kind_for
from jaxpr_surgery._src.sites.base import pre_scales as pre_scales

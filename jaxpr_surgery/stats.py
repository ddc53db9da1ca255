"""Statistics of per-example gradients (see ``docs/`` and ``api.md``)."""

from jaxpr_surgery._src.dots import per_example_cosines as per_example_cosines
from jaxpr_surgery._src.dots import per_example_dots as per_example_dots
from jaxpr_surgery._src.stats import Centered as Centered
from jaxpr_surgery._src.stats import ClippedSum as ClippedSum
from jaxpr_surgery._src.stats import KronSum as KronSum
from jaxpr_surgery._src.stats import Moments as Moments
from jaxpr_surgery._src.stats import NoiseScaleComponents as NoiseScaleComponents
from jaxpr_surgery._src.stats import Norms as Norms
from jaxpr_surgery._src.stats import PhiSum as PhiSum
from jaxpr_surgery._src.stats import Reduction as Reduction
from jaxpr_surgery._src.stats import SqNorms as SqNorms
from jaxpr_surgery._src.stats import Statistic as Statistic
from jaxpr_surgery._src.stats import abs_mean as abs_mean
from jaxpr_surgery._src.stats import clipped_mean as clipped_mean
from jaxpr_surgery._src.stats import clipped_sum as clipped_sum
from jaxpr_surgery._src.stats import elementwise as elementwise
from jaxpr_surgery._src.stats import gradient_noise_scale as gradient_noise_scale
from jaxpr_surgery._src.stats import kron_moments as kron_moments
from jaxpr_surgery._src.stats import mean as mean
from jaxpr_surgery._src.stats import noise_scale_components as noise_scale_components
from jaxpr_surgery._src.stats import nonfinite_count as nonfinite_count
from jaxpr_surgery._src.stats import norms as norms
from jaxpr_surgery._src.stats import second_moment as second_moment
from jaxpr_surgery._src.stats import sign_mean as sign_mean
from jaxpr_surgery._src.stats import snr as snr
from jaxpr_surgery._src.stats import sq_norms as sq_norms
from jaxpr_surgery._src.stats import sum as sum  # noqa: A004
from jaxpr_surgery._src.stats import variance as variance
from jaxpr_surgery._src.stats_research import fourth_moment as fourth_moment
from jaxpr_surgery._src.stats_research import gradient_diversity as gradient_diversity
from jaxpr_surgery._src.stats_research import kurtosis as kurtosis
from jaxpr_surgery._src.stats_research import norm_quantiles as norm_quantiles

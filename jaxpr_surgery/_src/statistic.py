"""The `Statistic` protocol and the built-in statistics' classes: what each needs of the
reductions over examples (reductions.py) and how it finalizes their values. The public
constructors (`stats.mean`, ...) are in stats.py.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src.clip_reductions import ClippedSum, nonfinite_examples
from jaxpr_surgery._src.example_weights import effective_size
from jaxpr_surgery._src.fn_equality import equal_as_bool, function_name, same_function
from jaxpr_surgery._src.kron_sum import KronSum
from jaxpr_surgery._src.moments import Moments
from jaxpr_surgery._src.norms import combine_norms, stacked_parts
from jaxpr_surgery._src.reductions import SUM, Centered, Norms, PhiSum, Reduction, SqNorms

PyTree = Any
_builtin_sum = sum


# --------------------------------------------------------------------------- #
# Protocol
# --------------------------------------------------------------------------- #
class Statistic(abc.ABC):
    """Protocol of a statistic of per-example gradients.

    Subclasses implement:

    * ``reductions() -> Mapping[str, Reduction]``: the named reductions needed.
    * ``finalize(values, count) -> PyTree``: ``values[name]`` holds, for every
      reduction, a pytree shaped like the differentiated arguments whose leaves
      are the reduced values (an array like the leaf for `PhiSum` and
      `ClippedSum`, a `Moments` for `Centered`, a ``[B]``
      array for `SqNorms`); ``count`` is the number of examples ``B``.

    Attributes:
      gradient_like: results shaped like the parameters come back in the parameters'
        dtype (like ``jax.grad``) when True; otherwise in at least float32.
      whole_batch: ``finalize`` reduces per-example values (`SqNorms`, per-example
        dots) over the batch, as quantiles or a sum of the norms do. With
        ``axis_name`` (``pmap``, ``shard_map``) every device's ``finalize`` then gets
        the whole batch's per-example values: ``[N]`` arrays of all devices'
        examples, in the order of the devices along the axis, gathered for this
        statistic only. False (the default) for statistics that return per-example
        values, which stay ``[B]`` with the device holding the examples. Without
        ``axis_name`` it changes nothing.
      defined_when_empty: the statistic has a value on a batch of no example (every
        example padding, total weight ``W = 0``: Poisson sampling draws one now and
        then): a sum (0), a count, per-example outputs (0 at a padded example). False
        (the default) for those that divide by ``W`` (means, variances, ...): on such a
        batch they are NaN under ``jit``, and an eager call whose statistics are all
        undefined there raises.

    Example -- the per-coordinate mean of ``g^4``:

        class FourthMoment(js.stats.Statistic):
            def reductions(self):
                return {"p4": js.stats.PhiSum(lambda g: g**4, multiplicative=True,
                                              name="pow4")}
            def finalize(self, values, count):
                return jax.tree.map(lambda s: s / count, values["p4"])
    """

    gradient_like: bool = False
    whole_batch: bool = False
    defined_when_empty: bool = False

    @abc.abstractmethod
    def reductions(self) -> Mapping[str, Reduction]:
        """The named reductions this statistic needs."""

    @abc.abstractmethod
    def finalize(self, values: Mapping[str, PyTree], count) -> PyTree:
        """Turns reduced values into the statistic's result."""

    def __repr__(self):
        name = getattr(self, "_name", None) or type(self).__name__
        fields = ", ".join(
            f"{k}={v!r}"
            for k, v in vars(self).items()
            if not k.startswith("_") and k != "reduction"
        )
        return f"{name}({fields})"


def is_statistic(x) -> bool:
    return isinstance(x, Statistic)


def same_statistic(a, b) -> bool:
    """``a`` and ``b`` compute the same thing: one object, or one type with the same
    attributes (``js.stats.variance(1)`` built twice; the same clip bounds, concrete
    arrays equal elementwise; the same function, also a lambda built afresh). Two
    traced values are the same only when they are one value. When in doubt: not the
    same. (Partials refuse to merge, and optimizers' requests to share, statistics that
    are not.)"""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    va, vb = getattr(a, "__dict__", None), getattr(b, "__dict__", None)
    if va is None or vb is None:
        return _same_value(a, b)
    return va.keys() == vb.keys() and all(_same_value(va[k], vb[k]) for k in va)


def _same_value(a, b) -> bool:
    """One attribute of two statistics (`same_statistic`)."""
    if a is b:
        return True
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return False
    if isinstance(a, Statistic) or isinstance(b, Statistic):  # a statistic of statistics
        return same_statistic(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):  # a reduction: field by
        return type(a) is type(b) and all(  # field (its == compares a key, e.g. a name)
            _same_value(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (jax.Array, np.ndarray)) or isinstance(b, (jax.Array, np.ndarray)):
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except Exception:  # noqa: BLE001 - not comparable
            return False
    if callable(a) and callable(b):
        return same_function(a, b)
    la, ta = jax.tree.flatten(a)
    if not (len(la) == 1 and la[0] is a):  # a container: a tree of clip bounds, a tuple
        lb, tb = jax.tree.flatten(b)
        return ta == tb and all(_same_value(x, y) for x, y in zip(la, lb))
    return equal_as_bool(a, b)


def check_count(count, ddof, name):
    """Raises at trace time when ``count`` examples cannot give a ``ddof`` estimate."""
    try:
        n = int(count)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return  # a traced count (psum over devices): checked per device by the caller
    if n <= ddof:
        raise ValueError(
            f"{name}(ddof={ddof}) needs more than {ddof} example(s), but the batch has B={n}: "
            f"the estimate divides by B - ddof = {n - ddof}. Use a larger batch"
            + (" or ddof=0." if ddof > 0 else ".")
        )


@fp.traced_once
def per_dof(x, count, ddof):
    """``x / (count - ddof)``; NaN where a traced ``count`` (a sum of example weights,
    a psum over devices) is not above ``ddof`` (a concrete one raised: `check_count`)."""
    if isinstance(count, (int, np.integer)):
        return x / (count - ddof)
    count = jnp.asarray(count, jnp.result_type(x))
    return jnp.where(count > ddof, x / jnp.where(count > ddof, count - ddof, 1), jnp.nan)


@fp.traced_once
def _div(s, count):
    return s / count


def tree_div(tree, count):
    return jax.tree.map(lambda s: _div(s, count), tree)


class _Mean(Statistic):
    _name = "mean"
    gradient_like = True

    def reductions(self):
        return {"s": SUM}

    def finalize(self, values, count):
        return tree_div(values["s"], count)


class _Sum(Statistic):
    _name = "sum"
    gradient_like = True
    defined_when_empty = True  # (0)

    def reductions(self):
        return {"s": SUM}

    def finalize(self, values, count):
        return values["s"]


class _PhiMean(Statistic):
    def __init__(self, reduction: PhiSum, name: str = "elementwise"):
        self.reduction = reduction
        self._name = name

    def reductions(self):
        return {"p": self.reduction}

    def finalize(self, values, count):
        return tree_div(values["p"], count)

    def __repr__(self):
        if self._name != "elementwise":
            return f"{self._name}()"
        r = self.reduction
        return (f"elementwise({function_name(r.phi)}, multiplicative={r.multiplicative}, "
                f"name={r.name!r})")


class _Variance(Statistic):
    _name = "variance"

    def __init__(self, ddof: int):
        self.ddof = ddof

    def reductions(self):
        return {"c": Centered()}

    def finalize(self, values, count):
        check_count(count, self.ddof, "variance")
        return jax.tree.map(
            lambda m: per_dof(m.m2, count, self.ddof),
            values["c"],
            is_leaf=lambda x: isinstance(x, Moments),
        )


class _SqNorms(Statistic):
    defined_when_empty = True  # (per-example: 0 at a padded example)

    def __init__(self, per_leaf: bool, sqrt: bool):
        self.per_leaf = per_leaf
        self._sqrt = sqrt
        self._name = "norms" if sqrt else "sq_norms"

    def reductions(self):
        return {"n": Norms() if self._sqrt else SqNorms()}

    def finalize(self, values, count):
        tree = values["n"]
        if self.per_leaf:
            return tree
        leaves = jax.tree.leaves(tree)
        if self._sqrt:
            dt = jnp.result_type(*leaves)
            return combine_norms(jnp.stack([x.astype(dt) for x in leaves]))
        return jnp.sum(stacked_parts(leaves), axis=0)  # (one reduction: `stacked_parts`)


class _Clipped(Statistic):
    gradient_like = True

    def __init__(self, clip_norm, average: bool, nonfinite: str = "drop"):
        self.clip_norm = clip_norm
        self.nonfinite = nonfinite
        self._average = average
        self._name = "clipped_mean" if average else "clipped_sum"

    @property
    def defined_when_empty(self):  # the sum of no example is 0; their mean is not defined
        return not self._average

    def reductions(self):
        return {"c": ClippedSum(self.clip_norm, self.nonfinite)}

    def finalize(self, values, count):
        return tree_div(values["c"], count) if self._average else values["c"]

    def __repr__(self):
        extra = "" if self.nonfinite == "drop" else f", nonfinite={self.nonfinite!r}"
        return f"{self._name}(clip_norm={self.clip_norm!r}{extra})"


class _NonfiniteCount(Statistic):
    _name = "nonfinite_count"
    whole_batch = True  # (counted over every device's examples under axis_name)
    defined_when_empty = True

    def reductions(self):
        return {"n": Norms()}  # (shared with the norms a clipped sum computes anyway)

    def finalize(self, values, count):
        del count
        bad = nonfinite_examples(jax.tree.leaves(values["n"]))
        return jnp.sum(bad, dtype=jnp.int32)

    def __repr__(self):
        return "nonfinite_count()"


def safe_ratio(num, den):
    """``num / den`` with ``x/0 = inf`` for ``x > 0`` and ``0/0 = 0``; a non-positive
    denominator (an unbiased estimate of a positive quantity below zero) gives ``inf``."""
    pos = den > 0
    safe = jnp.where(pos, den, 1)
    out = jnp.where(pos, num / safe, jnp.where(num > 0, jnp.inf, 0.0))
    return jnp.where(jnp.isnan(num) | jnp.isnan(den), jnp.nan, out)  # NaN in, NaN out


class _Snr(Statistic):
    _name = "snr"
    uses_weights = True  # (the bias correction divides by the effective batch size)
    weight_summary = True  # (read through effective_size alone: `WeightSummary`)

    def __init__(self, ddof: int, bias_corrected: bool = False):
        self.ddof = ddof
        self.bias_corrected = bias_corrected

    def reductions(self):
        return {"c": Centered()}

    def finalize(self, values, count, weights=None):
        check_count(count, self.ddof, "snr")
        n_eff = effective_size(weights, count)

        def one(m):
            var = per_dof(m.m2, count, self.ddof)
            sig = jnp.square(m.mean)
            if self.bias_corrected:  # E[mean^2] = mu^2 + sigma^2 / B (B_eff: weighted)
                sig = sig - var / n_eff
            return safe_ratio(sig, var).astype(m.mean.dtype)

        return jax.tree.map(one, values["c"], is_leaf=lambda x: isinstance(x, Moments))


class NoiseScaleComponents(NamedTuple):
    r"""Unbiased pieces of the gradient noise scale (McCandlish et al., App. A).

    ``print(c)`` (``str``) reads concrete scalar pieces as a sentence: the value with
    its pieces, or why it is not defined (see `noise_scale`); traced or batched
    pieces print as the tuple. Averaged pieces print the same way:
    ``NoiseScaleComponents(g2_avg, tr_avg, B)``.

    Attributes:
      grad_sq_norm: \(|G|^2\) estimated as \(\|\bar g\|^2 - \mathrm{tr}\hat\Sigma/B\)
        (may be negative on a small batch: average it over steps before dividing).
      trace_cov: \(\mathrm{tr}\,\Sigma\) estimated as \(\mathrm{tr}\hat\Sigma\), the
        summed per-coordinate variance (``ddof=1``: unbiased).
      batch_size: \(B\) (with example weights, the effective batch size).
    """

    grad_sq_norm: jax.Array
    trace_cov: jax.Array
    batch_size: jax.Array

    @property
    def noise_scale(self):
        r"""\(B_\mathrm{simple} = \mathrm{tr}\Sigma/|G|^2\), ``trace_cov / grad_sq_norm``.

        Not defined where the estimate of \(|G|^2\) is not positive (the batch mean
        is within its noise of zero, common on a batch much smaller than the noise
        scale): there ``inf``, the limit of a vanishing signal. ``0`` where
        ``trace_cov`` is 0 (every example has the same gradient: no noise), ``nan``
        where a piece is ``nan``. The values are traced (``jit``): nothing raises;
        ``print`` the components to read the reason."""
        return safe_ratio(self.trace_cov, self.grad_sq_norm)

    def __str__(self):
        if any(np.ndim(x) for x in self):  # batched (vmapped): the tuple reads better
            return repr(self)
        try:
            g2, tr, n = (float(x) for x in self)  # concrete scalars only
        except TypeError:  # traced: ConcretizationTypeError, a TypeError
            return repr(self)
        value = float(self.noise_scale)
        pieces = f"tr(Sigma) / |G|^2 = {tr:.4g} / {g2:.4g}"
        if not (math.isfinite(g2) and math.isfinite(tr)):
            return (f"noise scale {value}: {pieces}, a piece is not finite (check the "
                    "per-example gradients for NaN or inf: stats.nonfinite_count())")
        if tr == 0:
            return (f"noise scale 0: {pieces}, no noise (every example has the same "
                    f"gradient; B = {n:g})")
        if g2 <= 0:
            return (f"noise scale {value} (undefined): the unbiased |G|^2 estimate "
                    f"|g_mean|^2 - tr(Sigma)/B = {g2 + tr / n if n else math.nan:.4g} - "
                    f"{tr:.4g}/{n:g} = {g2:.4g} is not positive: the batch mean is within "
                    "its noise of zero. Average the pieces over steps (or batches) before "
                    "dividing, or use a larger batch")
        return f"noise scale {value:.4g} = {pieces} (unbiased pieces, B = {n:g})"


def _noise_pieces(values, count, ddof, weights=None):
    moments = jax.tree.leaves(values["c"], is_leaf=lambda x: isinstance(x, Moments))
    dtype = jnp.result_type(jnp.float32, *[m.mean.dtype for m in moments])
    tr = per_dof(_builtin_sum(jnp.sum(m.m2.astype(dtype)) for m in moments), count, ddof)
    g2 = _builtin_sum(jnp.sum(jnp.square(m.mean.astype(dtype))) for m in moments)
    n = jnp.asarray(effective_size(weights, count), dtype)  # (Kish's, with weights)
    return NoiseScaleComponents(g2 - tr / n, tr, n)


class _NoiseScale(Statistic):
    _name = "gradient_noise_scale"
    uses_weights = True
    weight_summary = True  # (read through effective_size alone: `WeightSummary`)

    def __init__(self, ddof: int):
        self.ddof = ddof

    def reductions(self):
        return {"c": Centered()}

    def finalize(self, values, count, weights=None):
        check_count(count, self.ddof, "gradient_noise_scale")
        return _noise_pieces(values, count, self.ddof, weights).noise_scale


class _NoiseComponents(Statistic):
    _name = "noise_scale_components"
    uses_weights = True
    weight_summary = True  # (read through effective_size alone: `WeightSummary`)
    ddof = 1

    def reductions(self):
        return {"c": Centered()}

    def finalize(self, values, count, weights=None):
        check_count(count, 1, "noise_scale_components")
        return _noise_pieces(values, count, 1, weights)


class _KronMoments(Statistic):
    _name = "kron_moments"

    def __init__(self, max_dim: int):
        self.max_dim = max_dim

    def reductions(self):
        return {"k": KronSum(self.max_dim)}

    def finalize(self, values, count):
        return tree_div(values["k"], count)

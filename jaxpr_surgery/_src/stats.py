"""Statistics of per-example gradients: the protocol and the built-in statistics.

A statistic never sees per-example gradients directly. It declares the
*reductions over examples* it needs (from a small fixed set, each of which the
engine knows how to compute cheaply per layer kind and how to combine across
batch chunks and devices), and a ``finalize`` that turns the reduced values
into its result. Built-in statistics use exactly this protocol, so a user's
statistic is a first-class citizen.

The reductions (``g_b`` is the per-example gradient of one parameter leaf,
``B`` the number of examples):

* `PhiSum` -- ``sum_b phi(g_b)`` elementwise (``phi=None``: the plain sum).
* `Centered` -- ``(mean_b g_b, sum_b (g_b - mean)^2)``, computed without
  catastrophic cancellation and merged across chunks/devices with Chan's rule.
* `SqNorms` -- ``[B]`` array of ``||g_b||^2`` for the leaf.
* `ClippedSum` -- ``sum_b min(1, C / ||g_b||) g_b`` where ``||g_b||`` is
  the *global* norm over every differentiated leaf.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any

__all__ = [
    "Reduction",
    "PhiSum",
    "Centered",
    "SqNorms",
    "ClippedSum",
    "Moments",
    "Statistic",
    "mean",
    "sum",
    "second_moment",
    "variance",
    "sign_mean",
    "abs_mean",
    "sq_norms",
    "norms",
    "clipped_mean",
    "clipped_sum",
    "elementwise",
    "snr",
    "gradient_noise_scale",
    "is_statistic",
]

_builtin_sum = sum


# --------------------------------------------------------------------------- #
# Reductions
# --------------------------------------------------------------------------- #
class Reduction:
    """Base class of the reductions over examples that the engine computes."""


@dataclasses.dataclass(frozen=True, eq=False)
class PhiSum(Reduction):
    """``sum_b phi(g_b)`` elementwise, per leaf (``phi=None`` is the identity).

    Attributes:
      phi: elementwise function of an array, or ``None`` for the plain sum.
      multiplicative: declares ``phi(a * b) == phi(a) * phi(b)`` (square, sign,
        abs, powers), which lets rank-one layers use ``phi(x)^T phi(dy)``.
      name: used for equality and in reports; two ``PhiSum`` with the same
        ``name`` and ``multiplicative`` are computed once.
    """

    phi: Callable[[jax.Array], jax.Array] | None = None
    multiplicative: bool = False
    name: str | None = None

    def _key(self):
        return ("phisum", self.name if self.name is not None else self.phi, self.multiplicative)

    def __eq__(self, other):
        return isinstance(other, PhiSum) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def apply(self, g):
        return g if self.phi is None else self.phi(g)


@dataclasses.dataclass(frozen=True)
class Centered(Reduction):
    """Mean and centered sum of squares ``(mean_b g_b, sum_b (g_b - mean)^2)``."""


@dataclasses.dataclass(frozen=True)
class SqNorms(Reduction):
    """Per-example squared norm ``||g_b||^2`` of each leaf, an array ``[B]``."""


@dataclasses.dataclass(frozen=True)
class ClippedSum(Reduction):
    """``sum_b min(1, clip_norm / ||g_b||) g_b`` with the global per-example norm."""

    clip_norm: float


class Moments(NamedTuple):
    """Value of `Centered` for one leaf: mean and centered sum of squares."""

    mean: jax.Array
    m2: jax.Array


SQUARE = PhiSum(jnp.square, multiplicative=True, name="square")
SIGN = PhiSum(jnp.sign, multiplicative=True, name="sign")
ABS = PhiSum(jnp.abs, multiplicative=True, name="abs")
SUM = PhiSum(None, multiplicative=True, name="identity")


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

    Example -- the per-coordinate mean of ``g^4``:

        class FourthMoment(js.stats.Statistic):
            def reductions(self):
                return {"p4": js.stats.PhiSum(lambda g: g**4, multiplicative=True,
                                              name="pow4")}
            def finalize(self, values, count):
                return jax.tree.map(lambda s: s / count, values["p4"])
    """

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


def _tree_div(tree, count):
    return jax.tree.map(lambda s: s / count, tree)


class _Mean(Statistic):
    _name = "mean"

    def reductions(self):
        return {"s": SUM}

    def finalize(self, values, count):
        return _tree_div(values["s"], count)


class _Sum(Statistic):
    _name = "sum"

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
        return _tree_div(values["p"], count)


class _Variance(Statistic):
    _name = "variance"

    def __init__(self, ddof: int):
        self.ddof = ddof

    def reductions(self):
        return {"c": Centered()}

    def finalize(self, values, count):
        return jax.tree.map(
            lambda m: m.m2 / (count - self.ddof),
            values["c"],
            is_leaf=lambda x: isinstance(x, Moments),
        )


class _SqNorms(Statistic):
    def __init__(self, per_leaf: bool, sqrt: bool):
        self.per_leaf = per_leaf
        self._sqrt = sqrt
        self._name = "norms" if sqrt else "sq_norms"

    def reductions(self):
        return {"n": SqNorms()}

    def finalize(self, values, count):
        tree = values["n"]
        if self.per_leaf:
            out = tree
        else:
            leaves = jax.tree.leaves(tree)
            out = _builtin_sum(leaves[1:], leaves[0])
        return jax.tree.map(jnp.sqrt, out) if self._sqrt else out


class _Clipped(Statistic):
    def __init__(self, clip_norm, average: bool):
        self.clip_norm = clip_norm
        self._average = average
        self._name = "clipped_mean" if average else "clipped_sum"

    def reductions(self):
        return {"c": ClippedSum(self.clip_norm)}

    def finalize(self, values, count):
        return _tree_div(values["c"], count) if self._average else values["c"]


class _Snr(Statistic):
    _name = "snr"

    def __init__(self, ddof: int):
        self.ddof = ddof

    def reductions(self):
        return {"c": Centered()}

    def finalize(self, values, count):
        def one(m):
            var = m.m2 / (count - self.ddof)
            sig = jnp.square(m.mean)
            safe = jnp.where(var > 0, var, 1)
            return jnp.where(var > 0, sig / safe, jnp.where(sig > 0, jnp.inf, 0.0)).astype(
                m.mean.dtype
            )

        return jax.tree.map(one, values["c"], is_leaf=lambda x: isinstance(x, Moments))


class _NoiseScale(Statistic):
    _name = "gradient_noise_scale"

    def __init__(self, ddof: int):
        self.ddof = ddof

    def reductions(self):
        return {"c": Centered()}

    def finalize(self, values, count):
        moments = jax.tree.leaves(values["c"], is_leaf=lambda x: isinstance(x, Moments))
        dtype = jnp.result_type(jnp.float32, *[m.mean.dtype for m in moments])
        tr = _builtin_sum(jnp.sum(m.m2.astype(dtype)) for m in moments) / (count - self.ddof)
        g2 = _builtin_sum(jnp.sum(jnp.square(m.mean.astype(dtype))) for m in moments)
        return tr / g2


# --------------------------------------------------------------------------- #
# Public constructors
# --------------------------------------------------------------------------- #
def mean() -> Statistic:
    r"""Mean per-example gradient \(\frac1B\sum_b g_b\) (equals ``jax.grad`` of a mean loss).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.mean())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [-2.6667 -3.3333]
    """
    return _Mean()


def sum() -> Statistic:  # noqa: A001 - the contract's name
    r"""Sum of per-example gradients \(\sum_b g_b\).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.sum())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [ -8. -10.]
    """
    return _Sum()


def second_moment() -> Statistic:
    r"""Elementwise second moment \(\frac1B\sum_b g_b^2\).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.second_moment())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [13.3333 17.3333]
    """
    return _PhiMean(SQUARE, "second_moment")


def variance(ddof: int = 1) -> Statistic:
    r"""Elementwise variance \(\sum_b (g_b-\bar g)^2/(B-\mathrm{ddof})\).

    Computed from centered sums (never as \(E[g^2]-\bar g^2\)), so it stays
    accurate when the examples nearly agree.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.variance())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [9.3333 9.3333]
    """
    if not isinstance(ddof, int) or ddof < 0:
        raise ValueError(f"variance(ddof=...): ddof must be a non-negative int, got {ddof!r}.")
    return _Variance(ddof)


def sign_mean() -> Statistic:
    r"""Mean of signs \(\frac1B\sum_b \mathrm{sign}(g_b)\) (``sign(0) = 0``).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.sign_mean())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [-0.6667 -0.6667]
    """
    return _PhiMean(SIGN, "sign_mean")


def abs_mean() -> Statistic:
    r"""Mean absolute value \(\frac1B\sum_b |g_b|\).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.abs_mean())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [2.6667 3.3333]
    """
    return _PhiMean(ABS, "abs_mean")


def sq_norms(per_leaf: bool = False) -> Statistic:
    r"""Per-example squared norms \(\|g_b\|^2\), an array ``[B]``.

    Args:
      per_leaf: if True, a pytree like params of ``[B]`` arrays, one per leaf.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.sq_norms())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [ 4. 16. 72.]
    """
    return _SqNorms(bool(per_leaf), sqrt=False)


def norms(per_leaf: bool = False) -> Statistic:
    r"""Per-example gradient norms \(\|g_b\|\) (square roots of `sq_norms`).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.norms())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [2.     4.     8.4853]
    """
    return _SqNorms(bool(per_leaf), sqrt=True)


def _check_clip(clip_norm, name):
    if isinstance(clip_norm, (int, float)):
        if not clip_norm > 0:  # also rejects NaN
            raise ValueError(
                f"{name}(clip_norm=...): clip_norm must be a positive number (or inf), "
                f"got {clip_norm!r}."
            )
        return float(clip_norm)
    return clip_norm


def clipped_mean(clip_norm) -> Statistic:
    r"""DP-SGD clipped mean \(\frac1B\sum_b g_b\min(1, C/\|g_b\|)\), global norm.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.clipped_mean(4.0))(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [-1.6095 -2.2761]
    """
    return _Clipped(_check_clip(clip_norm, "clipped_mean"), average=True)


def clipped_sum(clip_norm) -> Statistic:
    r"""Clipped sum \(\sum_b g_b\min(1, C/\|g_b\|)\), global norm over all params.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.clipped_sum(4.0))(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [-4.8284 -6.8284]
    """
    return _Clipped(_check_clip(clip_norm, "clipped_sum"), average=False)


def elementwise(
    phi: Callable[[jax.Array], jax.Array], multiplicative: bool = False, name: str | None = None
) -> Statistic:
    r"""Mean of a user's elementwise function \(\frac1B\sum_b \varphi(g_b)\).

    Args:
      phi: elementwise function (applied to arrays of per-example gradients).
      multiplicative: declare \(\varphi(ab)=\varphi(a)\varphi(b)\) so the
        rank-one fast path \(\varphi(X)^T\varphi(dY)\) applies. Declaring it
        falsely gives wrong numbers; leave it False when unsure.
      name: optional identity used to share work between equal statistics.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> cube = js.stats.elementwise(lambda g: jnp.abs(g) ** 3, multiplicative=True)
      >>> out = js.per_example_stat(loss, cube)(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [74.6667 93.3333]
    """
    if not callable(phi):
        raise TypeError(f"elementwise(phi=...): phi must be callable, got {phi!r}.")
    return _PhiMean(PhiSum(phi, bool(multiplicative), name))


def snr(ddof: int = 1) -> Statistic:
    r"""Per-coordinate signal-to-noise ratio \(\bar g^2/\mathrm{Var}_b(g_b)\).

    Where the variance is 0, the result is ``inf`` (or 0 where the mean is 0 too).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.snr())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [0.7619 1.1905]
    """
    return _Snr(ddof)


def gradient_noise_scale(ddof: int = 1) -> Statistic:
    r"""Simple gradient noise scale \(\mathrm{tr}(\Sigma)/\|\bar g\|^2\) (McCandlish et al.).

    \(\mathrm{tr}(\Sigma)\) is the summed per-coordinate variance of the
    per-example gradients over all parameters; a scalar.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.gradient_noise_scale())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      1.0244
    """
    return _NoiseScale(ddof)


def validate(stat) -> dict:
    """Checks that ``stat`` follows the protocol; returns its reductions."""
    if not isinstance(stat, Statistic):
        missing = [m for m in ("reductions", "finalize") if not callable(getattr(stat, m, None))]
        if missing:
            raise TypeError(
                f"stat: {stat!r} is not a statistic: it lacks {', '.join(missing)}. Use a "
                "constructor from jaxpr_surgery.stats (e.g. js.stats.mean()) or subclass "
                "js.stats.Statistic."
            )
    red = stat.reductions()
    if not isinstance(red, Mapping) or not red:
        raise TypeError(
            f"stat: {stat!r}.reductions() must return a non-empty mapping from names to "
            f"reductions, got {red!r}."
        )
    for k, r in red.items():
        if not isinstance(r, Reduction):
            raise TypeError(
                f"stat: {stat!r}.reductions()[{k!r}] is {r!r}, not a reduction. Use "
                "js.stats.PhiSum, Centered, SqNorms or ClippedSum."
            )
        if isinstance(r, ClippedSum) and isinstance(r.clip_norm, float) and math.isnan(r.clip_norm):
            raise ValueError(f"stat: {stat!r} has a NaN clip_norm.")
    return dict(red)

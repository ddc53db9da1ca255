"""Statistics of per-example gradients: the protocol and the built-in statistics.

A statistic never sees per-example gradients directly. It declares the
*reductions over examples* it needs (reductions.py: each knows how to reduce tiles
of per-example gradients, merge over chunks and devices and map back to the leaf;
each layer kind may have a cheaper rule for it), and a ``finalize`` that turns the
reduced values into its result. Built-in statistics use exactly this protocol, so a
user's statistic is a first-class citizen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat  # noqa: F401
from jaxpr_surgery._src.clip_reductions import (  # noqa: F401 - the protocol's names, re-exported
    ClippedSum,
    check_nonfinite,
    clip_factor,
    is_norms,
    nonfinite_examples,
)
from jaxpr_surgery._src.cuts import FeatureBlocks, feature_blocks_of  # noqa: F401
from jaxpr_surgery._src.fn_equality import (  # noqa: F401 - the protocol's names, re-exported
    equal_as_bool,
    function_name,
    same_function,
)
from jaxpr_surgery._src.kron_sum import KronSum  # noqa: F401 - the protocol's names, re-exported
from jaxpr_surgery._src.moments import (  # noqa: F401 - the protocol's names, re-exported
    Moments,
    Shifted,
    merge_moments,
    merge_shifted,
    nonneg,
    recentre,
    shifted_moments,
)
from jaxpr_surgery._src.reductions import (  # noqa: F401 - the protocol's names, re-exported
    ABS,
    MAX_SHIFT_AMPLIFICATION,
    SIGN,
    SQUARE,
    SUM,
    Centered,
    CenteredAbout,
    ElementwiseReduction,
    Norms,
    PhiSum,
    Reduction,
    SqNorms,
    acc_dtype_for,
    centred_copies,
    centred_share,
    combined_copies,
    combined_share,
    gather_over_axis,
    is_additive,
    lookup,
)
from jaxpr_surgery._src.statistic import (  # noqa: F401 - the protocol's names, re-exported
    NoiseScaleComponents,
    Statistic,
    _Clipped,
    _KronMoments,
    _Mean,
    _NoiseComponents,
    _NoiseScale,
    _NonfiniteCount,
    _PhiMean,
    _Snr,
    _SqNorms,
    _Sum,
    _Variance,
    check_count,
    is_statistic,
    per_dof,
    same_statistic,
)
from jaxpr_surgery._src.weighting import (  # noqa: F401 - the protocol's names, re-exported
    Carry,
    Weighted,
    weighs,
)

PyTree = Any

__all__ = [
    "Reduction",
    "PhiSum",
    "Centered",
    "SqNorms",
    "Norms",
    "ClippedSum",
    "KronSum",
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
    "nonfinite_count",
    "elementwise",
    "snr",
    "gradient_noise_scale",
    "noise_scale_components",
    "NoiseScaleComponents",
    "kron_moments",
    "is_statistic",
]

_builtin_sum = sum


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

    Past the range of the dtype the value is ``inf`` (float32: gradient norms above
    about ``1.8e19``), the honest value of the square; `norms` stays finite there, and
    clipping and cosines use the norms.

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

    Finite wherever the norm is representable, also where its square is not (float32
    norms past ``2^64``): there the examples are scaled by a power of two before
    squaring (only when some square overflowed; no cost otherwise).

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


def _check_bound(clip_norm, name, path=None):
    """One bound: a concrete one (Python, NumPy or JAX scalar) is validated and becomes a
    float; a traced one is checked where it is used: NaN, zero or negative poisons the
    result. ``path``: where it sits in a tree of bounds (None: a single bound)."""
    what = "clip_norm" if path is None else f"the bound at {path}"
    if clip_norm is None:
        raise TypeError(
            f"{name}(clip_norm=...): {what} is None; give a positive number (float('inf') "
            "leaves that group unclipped)."
        )
    if isinstance(clip_norm, bool):
        raise TypeError(f"{name}(clip_norm=...): {what}: expected a number, got {clip_norm!r}.")
    if isinstance(clip_norm, jax.core.Tracer):
        if jnp.ndim(clip_norm) != 0:
            raise ValueError(
                f"{name}(clip_norm=...): {what} must be a scalar, got shape "
                f"{jnp.shape(clip_norm)}. For one bound per group of parameters, give a "
                "pytree of scalars (e.g. a dict with one bound per layer)."
            )
        return clip_norm
    try:
        arr = jnp.asarray(clip_norm) if not isinstance(clip_norm, (int, float)) else None
    except TypeError as e:
        raise TypeError(
            f"{name}(clip_norm=...): {what}: expected a number, got {clip_norm!r}."
        ) from e
    if arr is not None:
        if arr.ndim != 0 or not jnp.issubdtype(arr.dtype, jnp.number):
            raise ValueError(
                f"{name}(clip_norm=...): {what} must be a real scalar, got {clip_norm!r}. For "
                "one bound per group of parameters, give a pytree of scalars (e.g. a dict "
                "with one bound per layer)."
            )
        clip_norm = float(arr)
    if not clip_norm > 0:  # also rejects NaN
        raise ValueError(
            f"{name}(clip_norm=...): {what} must be a positive number (or inf), "
            f"got {clip_norm!r}."
        )
    return float(clip_norm)


def _check_clip(clip_norm, name):
    """A single bound (`_check_bound`), or a pytree of bounds, each checked and named by
    its path; returns it with every concrete bound a float."""
    flat, tree = jax.tree_util.tree_flatten_with_path(clip_norm, is_leaf=lambda x: x is None)
    if jax.tree_util.treedef_is_leaf(tree) and len(flat) == 1:
        return _check_bound(clip_norm, name)
    if not flat:
        raise ValueError(
            f"{name}(clip_norm=...): the tree of bounds {clip_norm!r} holds no bound; give "
            "one positive number per group of parameters (or a single number)."
        )
    return jax.tree.unflatten(
        tree, [_check_bound(x, name, jax.tree_util.keystr(p)) for p, x in flat]
    )


def _bounds(clip_norm):
    """The bounds of a single bound or a tree of bounds, as a list."""
    return jax.tree.leaves(clip_norm)


def clipped_mean(clip_norm, nonfinite: str = "drop") -> Statistic:
    r"""DP-SGD clipped mean \(\frac1B\sum_b g_b\min(1, C/\|g_b\|)\), global norm, or
    per group of parameters with a bound each (per-layer clipping).

    Args:
      clip_norm: \(C\), a positive number (``inf``: no clipping), also a traced scalar
        inside ``jit`` (an adaptive bound), clipping each example's gradient by its
        *global* norm over every differentiated leaf. Or a pytree of such bounds that
        is a *prefix* of the differentiated arguments' structure (as the extra trees of
        ``jax.tree.map`` and the masks of ``optax.masked`` are): **per-layer
        clipping**, each bound \(C_k\) clips the part \(g_{b,k}\) of every
        example's gradient under it (one leaf, or a subtree as one group) by that
        part's own norm, \(\sum_b \min(1, C_k/\|g_{b,k}\|)\, g_{b,k}\). The
        clipped gradient's norm is then at most \(\sqrt{\sum_k C_k^2}\), the
        sensitivity the DP optimizers of `jaxpr_surgery.optim` calibrate their noise to.
        Leaves that are not differentiated (integer buffers, PRNG keys) need no bound:
        a dict of bounds may leave out their keys.
      nonfinite: what an example whose gradient is not finite (a NaN or an infinity
        in some leaf: a NaN loss, an infinite input) does to the sum. ``"drop"`` (the
        default): it adds nothing, as if its weight were 0 (its clip factor
        ``min(1, C/inf)`` times its NaN would be NaN), and it still counts in the
        batch size; `nonfinite_count` says how many were dropped. The sensitivity bound
        holds (an example moves the sum by at most ``C``, here by 0), so DP training
        goes on. The sums read the non-finite entries of each site's inputs as zeros
        (exact: a finite gradient has finite inputs; one select per input, no second
        pass; with remat, a second pass only on a step that has one). ``"propagate"``:
        it makes the sum NaN, as ``jax.grad`` would.

    Raises:
      ValueError: a concrete bound that is not positive (or NaN), naming its path in a
        tree of bounds; at call time, a tree of bounds that is not a prefix of the
        parameters, naming the path that does not fit. A traced bound that is NaN,
        zero or negative makes the result NaN. An unknown ``nonfinite``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.clipped_mean(4.0))(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [-1.6095 -2.2761]

      Per-layer clipping: one bound per leaf of a dict of parameters.

      >>> loss2 = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["c"] - b["y"]) ** 2)
      >>> params = {"w": jnp.zeros(2), "c": jnp.zeros(())}
      >>> out = js.per_example_stat(loss2, js.stats.clipped_mean({"w": 4.0, "c": 1.0}))(
      ...     params, batch)
      >>> print(np.asarray(out["w"], float).round(4), np.asarray(out["c"], float).round(4))
      [-1.6095 -2.2761] -1.0
    """
    return _Clipped(_check_clip(clip_norm, "clipped_mean"), average=True,
                    nonfinite=check_nonfinite(nonfinite, "clipped_mean"))


def clipped_sum(clip_norm, nonfinite: str = "drop") -> Statistic:
    r"""Clipped sum \(\sum_b g_b\min(1, C/\|g_b\|)\), global norm over all params, or
    per group of parameters with a bound each (per-layer clipping).

    Args:
      clip_norm: \(C\), a positive number (``inf``: no clipping), also a traced scalar
        inside ``jit`` (an adaptive bound), clipping each example's gradient by its
        *global* norm over every differentiated leaf. Or a pytree of such bounds that
        is a *prefix* of the differentiated arguments' structure (as the extra trees of
        ``jax.tree.map`` and the masks of ``optax.masked`` are): **per-layer
        clipping**, each bound \(C_k\) clips the part \(g_{b,k}\) of every
        example's gradient under it (one leaf, or a subtree as one group) by that
        part's own norm, \(\sum_b \min(1, C_k/\|g_{b,k}\|)\, g_{b,k}\). The
        clipped gradient's norm is then at most \(\sqrt{\sum_k C_k^2}\), the
        sensitivity the DP optimizers of `jaxpr_surgery.optim` calibrate their noise to.
        Leaves that are not differentiated (integer buffers, PRNG keys) need no bound:
        a dict of bounds may leave out their keys.
      nonfinite: what an example whose gradient is not finite (a NaN or an infinity
        in some leaf: a NaN loss, an infinite input) does to the sum. ``"drop"`` (the
        default): it adds nothing, as if its weight were 0 (its clip factor
        ``min(1, C/inf)`` times its NaN would be NaN), and it still counts in the
        batch size; `nonfinite_count` says how many were dropped. The sensitivity bound
        holds (an example moves the sum by at most ``C``, here by 0), so DP training
        goes on. The sums read the non-finite entries of each site's inputs as zeros
        (exact: a finite gradient has finite inputs; one select per input, no second
        pass; with remat, a second pass only on a step that has one). ``"propagate"``:
        it makes the sum NaN, as ``jax.grad`` would.

    Raises:
      ValueError: a concrete bound that is not positive (or NaN), naming its path in a
        tree of bounds; at call time, a tree of bounds that is not a prefix of the
        parameters, naming the path that does not fit. A traced bound that is NaN,
        zero or negative makes the result NaN. An unknown ``nonfinite``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.clipped_sum(4.0))(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [-4.8284 -6.8284]

      Per-layer clipping: one bound per leaf of a dict of parameters.

      >>> loss2 = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["c"] - b["y"]) ** 2)
      >>> params = {"w": jnp.zeros(2), "c": jnp.zeros(())}
      >>> out = js.per_example_stat(loss2, js.stats.clipped_sum({"w": 4.0, "c": 1.0}))(
      ...     params, batch)
      >>> print(np.asarray(out["w"], float).round(4), np.asarray(out["c"], float).round(4))
      [-4.8284 -6.8284] -3.0
    """
    return _Clipped(_check_clip(clip_norm, "clipped_sum"), average=False,
                    nonfinite=check_nonfinite(nonfinite, "clipped_sum"))


def nonfinite_count() -> Statistic:
    r"""The number of examples whose gradient is not finite: a NaN or an infinity in
    some leaf (or a leaf's norm past the float range), as their per-example norms say.
    These are the examples `clipped_sum` and `clipped_mean` drop (``nonfinite="drop"``,
    the default). An int32 scalar; an example of weight 0 (padding) is never counted, and
    with ``axis_name`` every device gets the count of all examples.

    Requested beside a clipped sum it costs nothing more: it reads the per-example norms
    the clipping computes anyway (and is defined on an all-padding batch: 0).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean(jnp.sqrt(b["x"] @ w))  # a NaN gradient below 0
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, -1.0], [1.0, 1.0]])}
      >>> out = js.per_example_stat(loss, {"sum": js.stats.clipped_sum(1.0),
      ...                                  "dropped": js.stats.nonfinite_count()})(
      ...     jnp.ones(2), batch)
      >>> int(out["dropped"]), np.asarray(out["sum"]).round(4)  # examples 0 and 2
      (1, array([0.8536, 0.3536], dtype=float32))
    """
    return _NonfiniteCount()


def elementwise(
    phi: Callable[[jax.Array], jax.Array], multiplicative: bool = False, name: str | None = None
) -> Statistic:
    r"""Mean of a user's elementwise function \(\frac1B\sum_b \varphi(g_b)\).

    Args:
      phi: elementwise function (applied to arrays of per-example gradients).
      multiplicative: declare \(\varphi(ab)=\varphi(a)\varphi(b)\) so the
        rank-one fast path \(\varphi(X)^T\varphi(dY)\) applies. Declaring it
        falsely gives wrong numbers; leave it False when unsure.
      name: optional identity used to share work between equal statistics: two
        ``elementwise`` statistics of one name are computed once. One name must mean
        one function: giving it to different functions in one request raises a
        ``ValueError``.

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


def snr(ddof: int = 1, bias_corrected: bool = False) -> Statistic:
    r"""Per-coordinate signal-to-noise ratio \(\bar g^2/\hat\sigma^2\).

    \(\hat\sigma^2\) is the per-example variance (``ddof=1``: unbiased). Since
    \(E[\bar g^2] = \mu^2 + \sigma^2/B\), the plain ratio is biased up by about
    \(1/B\); ``bias_corrected=True`` returns \((\bar g^2 - \hat\sigma^2/B)/\hat\sigma^2\),
    which is unbiased in its numerator and can be negative where the signal is
    below the noise of the batch mean. Where the variance is 0 the result is ``inf``
    (or 0 where the numerator is 0 too).

    The optimizers of `jaxpr_surgery.optim` use no SNR; the monitor
    `jaxpr_surgery.optim.track_gradient_statistics` reports the bias-corrected form.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.snr())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [0.7619 1.1905]
      >>> out = js.per_example_stat(loss, js.stats.snr(bias_corrected=True))(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [0.4286 0.8571]
    """
    if not isinstance(ddof, int) or ddof < 0:
        raise ValueError(f"snr(ddof=...): ddof must be a non-negative int, got {ddof!r}.")
    return _Snr(ddof, bool(bias_corrected))


def gradient_noise_scale(ddof: int = 1) -> Statistic:
    r"""Simple gradient noise scale \(B_\mathrm{simple} = \mathrm{tr}(\Sigma)/|G|^2\)
    (McCandlish et al., 2018), from unbiased pieces.

    \(\mathrm{tr}(\Sigma)\) is estimated by \(\mathrm{tr}\hat\Sigma\), the summed
    per-coordinate variance of the per-example gradients, and \(|G|^2\) by
    \(\|\bar g\|^2 - \mathrm{tr}\hat\Sigma/B\): the plain \(\|\bar g\|^2\) includes
    the noise of the batch mean, which caps the plain ratio near \(B\).

    Where the estimate of \(|G|^2\) is not positive, the noise scale is not
    defined: the batch mean is within its noise of zero, common on a batch much
    smaller than the noise scale. The result is then ``inf`` (the limit of a
    vanishing signal); it is ``0`` where every example has the same gradient
    (\(\mathrm{tr}\hat\Sigma = 0\)) and ``nan`` where a gradient holds a NaN. The
    value is traced (``jit``), so nothing raises: to see the pieces and the reason,
    request `noise_scale_components` instead and ``print`` the result. One batch's
    ratio is noisy: to track it, average those pieces over steps before dividing
    (`jaxpr_surgery.optim.track_gradient_statistics`).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> out = js.per_example_stat(loss, js.stats.gradient_noise_scale())(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      1.5556
      >>> # y = [1, 2, -3]: gradients [-2, 0], [0, -4], [6, 6], a mean within noise of zero
      >>> noisy = dict(batch, y=jnp.array([1.0, 2.0, -3.0]))
      >>> print(js.per_example_stat(loss, js.stats.gradient_noise_scale())(jnp.zeros(2), noisy))
      inf
    """
    if not isinstance(ddof, int) or ddof < 0:
        raise ValueError(
            f"gradient_noise_scale(ddof=...): ddof must be a non-negative int, got {ddof!r}."
        )
    return _NoiseScale(ddof)


def noise_scale_components() -> Statistic:
    r"""The unbiased pieces of the gradient noise scale, a `NoiseScaleComponents`.

    ``grad_sq_norm`` \(=\|\bar g\|^2 - \mathrm{tr}\hat\Sigma/B\) estimates \(|G|^2\),
    ``trace_cov`` \(=\mathrm{tr}\hat\Sigma\) estimates \(\mathrm{tr}\,\Sigma\)
    (``ddof=1``), and ``batch_size`` is \(B\); ``.noise_scale`` divides them
    (``inf`` where ``grad_sq_norm`` is not positive: see
    `NoiseScaleComponents.noise_scale`). ``print`` them to read the value with its
    pieces, or why it is not defined. Average the pieces over steps (or batches)
    before dividing.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> c = js.per_example_stat(loss, js.stats.noise_scale_components())(jnp.zeros(2), batch)
      >>> print(round(float(c.grad_sq_norm), 4), round(float(c.trace_cov), 4))
      12.0 18.6667
      >>> print(c)
      noise scale 1.556 = tr(Sigma) / |G|^2 = 18.67 / 12 (unbiased pieces, B = 3)
      >>> noisy = dict(batch, y=jnp.array([1.0, 2.0, -3.0]))  # gradients [-2, 0], [0, -4], [6, 6]
      >>> print(js.per_example_stat(loss, js.stats.noise_scale_components())(jnp.zeros(2), noisy))
      noise scale inf (undefined): the unbiased |G|^2 estimate |g_mean|^2 - tr(Sigma)/B =
      2.222 - 42.67/3 = -12 is not positive: the batch mean is within its noise of zero.
      Average the pieces over steps (or batches) before dividing, or use a larger batch
    """
    return _NoiseComponents()


def kron_moments(max_dim: int = 1024) -> Statistic:
    r"""Per-example Kronecker (Shampoo/SOAP-style) moments of every leaf.

    For a leaf of shape \((n_1, \dots, n_k)\) the value is a tuple of \(k\)
    entries; entry \(j\) is

    \[ M_j = \frac1B \sum_b U_j(g_b) U_j(g_b)^\top, \qquad
       U_j(g) = \mathrm{moveaxis}(g, j, 0).\mathrm{reshape}(n_j, -1), \]

    an ``[n_j, n_j]`` matrix when \(n_j \le\) ``max_dim``, otherwise its diagonal,
    a vector ``[n_j]`` (a 50k-row vocabulary axis costs 50k floats, not 50k\(^2\)).
    A 0-d leaf gives ``()``; a leaf with a zero-size axis, or whose layer sees no
    tokens, gives zeros of those shapes. Results come back in at least float32.

    At dense, einsum, conv-over-patches and embedding sites (a tied embedding
    included) the moments come from token grams, one sandwich per example, without
    forming any per-example gradient; elsewhere from tiles of exact per-example
    gradients (``explain`` says which).

    Args:
      max_dim: largest axis kept as a full matrix (a positive int).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> (m,) = js.per_example_stat(loss, js.stats.kron_moments())(jnp.zeros(2), batch)
      >>> print(np.asarray(m, float).round(4))
      [[13.3333 12.    ]
       [12.     17.3333]]
    """
    if isinstance(max_dim, bool) or not isinstance(max_dim, (int, np.integer)) or max_dim < 1:
        raise ValueError(
            f"kron_moments(max_dim=...): max_dim must be a positive int (the largest axis "
            f"kept as a full matrix; larger axes give their diagonal), got {max_dim!r}."
        )
    return _KronMoments(int(max_dim))


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
                "js.stats.PhiSum, Centered, SqNorms, Norms or ClippedSum."
            )
        if isinstance(r, ClippedSum) and any(
            isinstance(C, float) and math.isnan(C) for C in _bounds(r.clip_norm)
        ):
            raise ValueError(f"stat: {stat!r} has a NaN clip_norm.")
    return dict(red)

r"""DP-SGD and DP-Adam from the clipped-sum statistic.

The per-example clipping happens in the statistic
(`jaxpr_surgery.stats.clipped_sum`, one pass, no materialised per-example
gradients where the layer allows it); the optimizer adds the Gaussian noise and
divides by the batch size:

\[
  \tilde g = \frac{1}{B}\Big(\sum_b g_b \min\big(1, \tfrac{C}{\|g_b\|}\big)
  + \mathcal N\big(0, (z C)^2 I\big)\Big)
\]

with \(C\) = ``clip_norm`` and \(z\) = ``noise_multiplier``. With per-layer
clipping (``clip_norm`` a pytree of bounds \(C_k\), one per group of parameters:
`jaxpr_surgery.stats.clipped_sum`), each group's part of \(g_b\) is clipped by its own
norm and \(C\) in the noise is the clipped sum's L2 sensitivity
\(\sqrt{\sum_k C_k^2}\) over the groups holding a differentiated (float) leaf. With
``example_weights`` \(w_b\) the clipped sum is \(\sum_b w_b \min(1, C/\|g_b\|)\, g_b\):
one example moves it by up to \(w_b C\), so the noise is scaled by a declared bound
\(M\) = ``max_example_weight`` of the weights (1 by default: unweighted or 0/1-padded
batches), fixed in advance rather than read from the data, and ``update`` refuses a
call whose weights exceed it. The PRNG
key is an explicit extra arg of ``update``: pass a fresh one every step. Privacy
accounting lives in `jaxpr_surgery.privacy`: ``calibrate_noise_multiplier`` chooses
\(z\) for a target \((\varepsilon, \delta)\), ``epsilon_of(config, steps=...)`` gives
the \(\varepsilon\) spent by an optimizer built from ``config`` (with Poisson batches,
``poisson_batches``, and ``batch_size`` the expected batch size).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpr_surgery._src import compat
from jaxpr_surgery._src.norms import stacked_parts
from jaxpr_surgery._src.optim.requests import (
    PerExampleTransformation,
    build_request,
    positive_int,
    refuse_masked,
    register_request,
    register_static_hyperparams,
    require,
    require_like,
)
from jaxpr_surgery._src.optim.wrappers import chain

__all__ = ["dp_aggregate", "dp_sgd", "dp_adam", "dp_sensitivity"]


def _bound_entries(clip_norm):
    """``[(path, bound)]`` of a single clip bound (path ``""``) or a tree of bounds."""
    flat = jax.tree_util.tree_flatten_with_path(clip_norm, is_leaf=lambda x: x is None)[0]
    return [(jax.tree_util.keystr(p), x) for p, x in flat]


def _where(path):
    return f" (the bound at {path})" if path else ""


def _check(clip_norm, noise_multiplier, batch_size, owner, max_example_weight=1.0):
    """Raises on a bad hyperparameter; returns ``batch_size`` (a Python int, None, or an
    array injected by `inject_hyperparams`)."""
    entries = _bound_entries(clip_norm)
    if not entries:
        raise ValueError(
            f"{owner}(clip_norm=...): the tree of bounds {clip_norm!r} holds no bound; give "
            "a positive number, or one per group of parameters (per-layer clipping)."
        )
    for path, C in entries:
        if C is None or isinstance(C, bool):
            raise TypeError(f"{owner}(clip_norm=...): expected a number{_where(path)}, got {C!r}.")
        if isinstance(C, (int, float)) and not C > 0:
            raise ValueError(
                f"{owner}(clip_norm=...): must be > 0 (or inf){_where(path)}, got {C!r}."
            )
    if isinstance(noise_multiplier, (int, float)):
        if not 0 <= noise_multiplier < math.inf:
            raise ValueError(
                f"{owner}(noise_multiplier=...): must be finite and >= 0 (0 for no noise), "
                f"got {noise_multiplier!r}: infinite noise leaves no signal in the update."
            )
        infinite = [p for p, C in entries if isinstance(C, (int, float)) and math.isinf(C)]
        if noise_multiplier > 0 and infinite:
            raise ValueError(
                f"{owner}: clip_norm=inf{_where(infinite[0])} with noise_multiplier="
                f"{noise_multiplier} adds infinite noise. Use a finite clip_norm, or "
                "noise_multiplier=0 for non-private training."
            )
    _check_max_weight(max_example_weight, noise_multiplier, owner)
    injected = isinstance(batch_size, (jax.Array, np.ndarray))  # by inject_hyperparams
    if batch_size is None or injected:
        return batch_size
    return positive_int(batch_size, "batch_size", owner,
                        "the fixed denominator, the expected batch size; or None")


def _check_max_weight(M, noise_multiplier, owner):
    """``max_example_weight``: a positive number (``inf`` only without noise), or an array
    (injected by `inject_hyperparams`, checked where it is used)."""
    what = f"{owner}(max_example_weight=...)"
    if isinstance(M, bool) or not isinstance(
        M, (int, float, jax.Array, np.ndarray, np.generic)
    ):
        raise TypeError(
            f"{what}: expected a positive number, the largest example weight the DP "
            f"optimizer accepts (1 for unweighted or 0/1-padded batches), got {M!r}."
        )
    if isinstance(M, jax.core.Tracer) or np.ndim(M) != 0:
        if np.ndim(M) != 0:
            raise ValueError(f"{what}: must be a scalar, got shape {np.shape(M)}.")
        return
    M = float(np.asarray(M))
    if not M > 0:  # also NaN
        raise ValueError(
            f"{what}: must be > 0, the largest example weight the noise covers, got {M!r}."
        )
    if math.isinf(M) and _is_number(noise_multiplier) and noise_multiplier > 0:
        raise ValueError(
            f"{owner}: max_example_weight=inf with noise_multiplier={noise_multiplier} "
            "adds infinite noise. Declare a finite bound of the example weights (the "
            "noise is scaled to it), or noise_multiplier=0 for non-private training."
        )


def _noise_like(key, tree, std):
    """Gaussian noise of standard deviation ``std`` shaped like ``tree``.

    Sampled in at least float32, then cast to each leaf's dtype. Inside ``shard_map`` a
    leaf that varies over manual mesh axes is a shard of a parameter split over them
    (hand-written FSDP: the clipped sum comes back sharded like the parameter), and its
    noise is drawn from the key folded with the shard's position on those axes: every
    shard its own noise, each shard's replicas (devices that differ only on the axes the
    leaf does not vary over) the same. With the same key everywhere, each shard of a
    weight would get the same noise, so the difference of two shards' updates would be
    the difference of their clipped sums with no noise at all. (A leaf that varies over
    no manual axis, replicated, takes the same noise on every device, as the update of
    replicas must; so does every leaf with ``check_vma=False`` and under ``jax.pmap``,
    where JAX does not type which values differ between devices: there the statistics
    refuse the clipped sums of leaves that may be shards, untyped.py.)
    """
    keys = optax.tree.split_key_like(key, tree)

    def one(leaf, k):
        dtype = jnp.promote_types(leaf.dtype, jnp.float32)
        axes = tuple(sorted(compat.vma_of(leaf), key=str))
        if axes:
            k = jax.random.fold_in(k, jax.lax.axis_index(axes))
        return (std * jax.random.normal(k, leaf.shape, dtype)).astype(leaf.dtype)

    return jax.tree.map(one, tree, keys)


#: Relative difference tolerated between the clip norm the clipping used and the
#: optimizer's (two computations of one scheduled value in different dtypes).
CLIP_NORM_RTOL = 1e-4


def _plain(x):
    """A numpy scalar (``np.float32(0.5)``, ``np.int64(1)``) as the Python number it
    holds; anything else as it is."""
    if isinstance(x, (np.floating, np.integer)) and not isinstance(x, np.bool_):
        return x.item()
    return x


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _differentiated(x) -> bool:
    """A leaf that `per_example_stat` differentiates: a float array. None (a skipped
    leaf's statistic), integer and bool arrays, PRNG keys and non-array (static) leaves
    are not, as under ``eqx.filter_grad``."""
    arrays = (jax.Array, np.ndarray, np.generic, jax.core.Tracer, jax.ShapeDtypeStruct)
    return isinstance(x, arrays) and jnp.issubdtype(x.dtype, jnp.floating)


def _covering_bounds(clip_norm, params):
    """The bounds of ``clip_norm`` (a bound or a tree of bounds, a prefix of ``params``'s
    structure) whose group holds a differentiated leaf of ``params``; every bound when
    ``params`` is None. A bound with no leaf of ``params`` under it is kept (its group is
    unknown here: counting it never lowers the noise)."""
    entries = jax.tree_util.tree_flatten_with_path(clip_norm, is_leaf=lambda x: x is None)[0]
    if params is None:
        return [C for _, C in entries]
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: x is None)[0]
    under = [
        [x for q, x in leaves if tuple(q[: len(p)]) == tuple(p)] for p, _ in entries
    ]
    for q, x in leaves:
        if _differentiated(x) and not any(tuple(q[: len(p)]) == tuple(p) for p, _ in entries):
            raise ValueError(
                f"dp_sensitivity: the parameter leaf {jax.tree_util.keystr(q)} has no clip "
                "bound above it: the tree of bounds must be a prefix of the parameters' "
                "structure (each bound standing for the leaf or subtree under it)."
            )
    return [
        C for (_, C), xs in zip(entries, under) if not xs or any(map(_differentiated, xs))
    ]


def dp_sensitivity(clip_norm, params=None):
    r"""The L2 sensitivity of a clipped sum to one example: \(C\) for a single bound,
    \(\sqrt{\sum_k C_k^2}\) for per-group bounds \(C_k\) (each group's part of an
    example's gradient has norm at most \(C_k\)). A Python float where every bound is
    one, else a float32 array (a traced bound).

    With ``example_weights`` an example's weighted clipped gradient has norm at most
    \(w_b\) times this: the DP optimizers multiply it by their ``max_example_weight``.

    Args:
      clip_norm: a bound, or a pytree of bounds (a prefix of the parameters' structure).
      params: optional, a pytree like the parameters (the parameters, or the clipped sum
        itself). Bounds whose group holds no float leaf (only integer or bool buffers,
        PRNG keys, static values, or the ``None`` a statistic holds for them: leaves that
        `jaxpr_surgery.per_example_stat` skips) clip nothing and are not counted, so
        ``jax.tree.map(lambda _: C, params)`` adds no noise for a skipped leaf. Without
        it every bound counts.

    Raises:
      ValueError: with ``params``, a float leaf of ``params`` under no bound.
    """
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(clip_norm)):
        return clip_norm
    bounds = _covering_bounds(clip_norm, params)
    if all(_is_number(C) for C in bounds):
        return math.hypot(*bounds)  # no overflow, inf where a bound is
    sq = [jnp.square(jnp.asarray(C, jnp.float32)) for C in bounds]
    return jnp.sqrt(sum(sq[1:], sq[0]))


#: Relative excess of the largest example weight over ``max_example_weight`` tolerated
#: (the rounding of a bound such as 0.1 to the weights' float32).
MAX_WEIGHT_RTOL = 1e-6


def _max_weight_check(used, declared, owner):
    """``None`` if the largest example weight ``used`` by the call (the statistic
    ``max_weight``; None: not given, statistics computed by hand) is at most the
    ``declared`` ``max_example_weight``, or a traced boolean that says so; raises where
    that can be decided now."""
    if used is None:
        return None
    if not (isinstance(used, jax.core.Tracer) or isinstance(declared, jax.core.Tracer)):
        u, m = float(np.asarray(used)), float(np.asarray(declared))
        if not u <= m * (1 + MAX_WEIGHT_RTOL):
            raise ValueError(
                f"{owner}: the largest example weight of this call is {u:g}, above "
                f"max_example_weight={m:g}. An example of weight w moves the weighted "
                "clipped sum by up to w * clip_norm, but the noise is scaled to "
                "max_example_weight * clip_norm: the privacy guarantee would not be the "
                f"configured one. Declare the bound of your weights, {owner}(..., "
                "max_example_weight=...) (fixed in advance, not computed from the data: the "
                f"noise grows with it), or pass example_weights of at most {m:g} (0/1 "
                "padding: is_padding_example)."
            )
        return None
    u = jnp.asarray(used, jnp.float32)
    m = jnp.asarray(declared, jnp.float32)
    return u <= m * (1 + MAX_WEIGHT_RTOL)


def _batch_size_check(batch_size, owner):
    """``None`` if ``batch_size`` (read from the batch: its number of examples, or their
    total weight) is positive, or a traced boolean that says so; raises where that can be
    decided now. An all-padding batch (Poisson sampling draws one now and then) has 0,
    and its update would divide the noise by it."""
    if not isinstance(batch_size, jax.core.Tracer):
        b = float(np.asarray(batch_size))
        if not b > 0:
            raise ValueError(
                f"{owner}: batch_size={b:g} read from the batch (its example_count: the total "
                "weight of its examples, 0 when every example is padding): the update would "
                "divide the noise by it. With Poisson sampling, whose batches are empty now "
                "and then, fix the denominator to the expected batch size, "
                "dp_sgd/dp_adam/dp_aggregate(..., batch_size=expected_B) (what the privacy "
                "accounting assumes); the update of an empty batch is then its noise over "
                "it. Under jit such a step's update is NaN."
            )
        return None
    return jnp.asarray(batch_size) > 0


def _clip_norm_check(used, configured, owner):
    """``None`` if the clip norm ``used`` by the clipping is ``configured`` (a bound, or
    a tree of bounds per group: the same tree, each bound the same), or a traced boolean
    that says so; raises where that can be decided now."""
    if used is None:
        if all(_is_number(C) for C in jax.tree.leaves(configured)):
            return None  # statistics computed by hand for a fixed clip norm
        raise ValueError(
            f"{owner}: the clip norm is an injected or traced value ({configured!r}), so "
            "update() needs the keyword-only extra argument `clip_norm`, the clip norm "
            "its clipped_sum was clipped with: compute the statistics of "
            "js.optim.stat_request(opt, state) from the current state inside the step "
            "(they include it) and pass **js.optim.update_kwargs(stats)."
        )
    used_tree, conf_tree = jax.tree.structure(used), jax.tree.structure(configured)
    if used_tree != conf_tree:
        raise ValueError(
            f"{owner}: clipped_sum was clipped with clip_norm of structure {used_tree}, but "
            f"this optimizer's clip_norm has structure {conf_tree}: the noise would not "
            "match the clipping (the privacy guarantee would not be the configured one). "
            "Give the statistic and the optimizer the same bounds: compute "
            "js.optim.stat_request(opt, state)."
        )
    oks = []
    for (path, u), (_, c) in zip(_bound_entries(used), _bound_entries(configured)):
        traced = isinstance(u, jax.core.Tracer) or isinstance(c, jax.core.Tracer)
        if not traced:
            u, c = float(np.asarray(u)), float(np.asarray(c))  # (no tracer under jit)
            if not (u == c or abs(u - c) <= CLIP_NORM_RTOL * abs(c)):
                raise ValueError(
                    f"{owner}: clipped_sum was clipped at clip_norm={u:g}{_where(path)}, but "
                    f"this optimizer's clip norm is {c:g} at this step: the noise would not "
                    "match the clipping (the privacy guarantee would not be the configured "
                    "one). Build the request inside the training step from the current "
                    "state, js.optim.stat_request(opt, state), not once before training."
                )
            continue
        u = jnp.asarray(u, jnp.float32)
        c = jnp.asarray(c, jnp.float32)
        oks.append((u == c) | (jnp.abs(u - c) <= CLIP_NORM_RTOL * c))
    if not oks:
        return None
    return jnp.all(stacked_parts(oks), axis=0)  # (one reduction: `stacked_parts`)


def dp_aggregate(
    clip_norm: float,
    noise_multiplier: float,
    batch_size: int | None = None,
    *,
    max_example_weight: float = 1.0,
) -> PerExampleTransformation:
    r"""Replaces updates by the noised mean of clipped per-example gradients.

    \[
      u = \frac{1}{B}\Big(\sum_b w_b\, g_b \min\big(1, \tfrac{C}{\|g_b\|}\big)
      + \mathcal N\big(0, (z C M)^2 I\big)\Big)
    \]

    with \(w_b = 1\) and \(M = 1\) without ``example_weights``. With per-layer
    clipping, ``clip_norm`` a pytree of bounds \(C_k\) (a prefix of the
    parameters' structure, `jaxpr_surgery.stats.clipped_sum`), the clipped sum is
    \(\sum_b \min(1, C_k/\|g_{b,k}\|)\, g_{b,k}\) per group \(k\) and the noise's
    \(C\) is its L2 sensitivity \(\sqrt{\sum_k C_k^2}\) (`dp_sensitivity`), counting
    only the groups that hold a differentiated leaf: a bound whose leaves are all
    skipped (integer buffers, PRNG keys: ``None`` in ``clipped_sum``) clips nothing and
    adds no noise.

    **Example weights.** With ``example_weights`` \(w_b\) (e.g. token counts) the
    clipped sum is weighted, and removing one example moves it by up to
    \(w_b C\), not \(C\). The noise is scaled to ``max_example_weight``
    \(M\), a bound on the weights declared here: the noise must not depend on the
    data, so it is never read from the batch. ``update`` checks the largest weight of
    the call (extra arg ``max_weight``, in the request; 1 without weights, and with
    ``is_padding_example``): above \(M\) it raises, or, when traced, makes the update
    NaN. The check is skipped with ``noise_multiplier=0`` (no privacy to calibrate).

    **Empty batches, non-finite gradients.** The clipped sum of an all-padding batch
    (Poisson sampling draws one now and then) is 0, so its update is the noise alone over
    the fixed ``batch_size``. An example whose gradient holds a NaN or an infinity adds
    nothing to the clipped sum (`jaxpr_surgery.stats.clipped_sum` drops it by default):
    less than the sensitivity, so the step stays finite and private; request
    `jaxpr_surgery.stats.nonfinite_count` beside the request to watch them.

    ``updates`` (the non-private batch mean) is ignored. ``update`` takes the
    keyword-only extra args ``clipped_sum`` (statistic
    `jaxpr_surgery.stats.clipped_sum` with the same ``clip_norm``),
    ``batch_size`` (\(B\), statistic `example_count`; not needed when
    fixed here), ``key`` (a fresh PRNG key; not needed when
    ``noise_multiplier == 0``), ``max_weight`` (the call's largest example
    weight, see above; optional, unchecked when absent) and ``clip_norm``, the clip
    norm the clipped sum was clipped with (in the request; optional with a fixed
    ``clip_norm`` here, required when it is injected or traced). A clip norm that differs
    from this transform's raises, or, when traced, makes the update NaN: noise
    scaled for another bound than the clipping's would silently weaken the
    privacy guarantee. Under `inject_hyperparams` the clip norm can be
    scheduled (also one bound of a tree: ``{"w": schedule, "b": 1.0}``); build the
    request from the current state, ``stat_request(opt, state)``.

    Args:
      clip_norm: \(C\), the per-example global-norm bound (``inf``: no
        clipping, only with ``noise_multiplier=0``), or a pytree of bounds, one per
        group of parameters (per-layer clipping). Leaves that are not differentiated
        (integer or bool buffers, PRNG keys) need no bound.
      noise_multiplier: \(z\), the noise standard deviation in units of ``C``.
      batch_size: a fixed denominator \(B\), the expected batch size under Poisson
        sampling (what the privacy accounting assumes; an empty batch's update is then
        its noise over \(B\)). ``None`` reads the ``batch_size`` extra arg (with
        ``example_weights``, the total weight): 0 for an all-padding batch, which raises
        (a ``ValueError``) or, traced, makes the update NaN.
      max_example_weight: \(M\), the largest ``example_weights`` entry the noise
        covers (default 1: unweighted or 0/1-padded batches). The noise standard
        deviation is \(z C M\); weights above \(M\) are refused.

    Returns:
      A stateless `PerExampleTransformation` requesting
      ``mean, clipped_sum, clip_norm, max_weight, batch_size`` (no ``batch_size`` when
      fixed).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> g = jnp.array([[3.0, 4.0], [0.3, 0.4]])  # per-example gradients, norms 5, 0.5
      >>> tx = jso.dp_aggregate(clip_norm=1.0, noise_multiplier=0.0)
      >>> clipped_sum = (g * jnp.minimum(1, 1.0 / jnp.linalg.norm(g, axis=1))[:, None]).sum(0)
      >>> u, _ = tx.update(g.mean(0), tx.init(None), clipped_sum=clipped_sum, batch_size=2)
      >>> print(np.asarray(u).round(4))
      [0.45 0.6 ]

      Per-layer bounds: the noise is calibrated to \(\sqrt{3^2 + 4^2} = 5\).

      >>> jso.dp_sensitivity({"w": 3.0, "b": 4.0})
      5.0

      Weighted examples (weights up to 4, e.g. token counts): declare the bound, the
      noise grows with it.

      >>> tx = jso.dp_aggregate(clip_norm=1.0, noise_multiplier=1.0, max_example_weight=4.0)

    References:
      Abadi et al., Deep Learning with Differential Privacy
      <https://arxiv.org/abs/1607.00133>, 2016
    """
    owner = "dp_aggregate"
    # numpy scalars as the Python numbers they are (checked, and `no_noise`, alike)
    clip_norm, noise_multiplier, max_example_weight = jax.tree.map(
        _plain, (clip_norm, noise_multiplier, max_example_weight))
    batch_size = _check(clip_norm, noise_multiplier, batch_size, owner, max_example_weight)
    no_noise = isinstance(noise_multiplier, (int, float)) and noise_multiplier == 0
    fixed_batch_size = batch_size
    configured_clip_norm = clip_norm

    def update_fn(
        updates,
        state,
        params=None,
        *,
        clipped_sum=None,
        batch_size=None,
        key=None,
        clip_norm=None,
        max_weight=None,
        **extra_args,
    ):
        del params, extra_args
        refuse_masked(
            updates,
            owner,
            "the clipped sum is clipped by each example's norm over every parameter (or "
            "over groups covering them all: per-layer clipping), so it cannot be restricted "
            "to a subset, and masked groups would draw their noise from one key. "
            "Differentiate only the parameters to train privately (their own argument, "
            "argnums=...) and apply the DP optimizer to them whole.",
        )
        clipped_sum = require_like(clipped_sum, updates, "clipped_sum", owner)
        oks = [_clip_norm_check(clip_norm, configured_clip_norm, owner)]
        if fixed_batch_size is not None:
            batch_size = fixed_batch_size
        batch_size = require(batch_size, "batch_size", owner)
        if fixed_batch_size is None:  # (read from the batch: 0 for an empty one)
            oks.append(_batch_size_check(batch_size, owner))
        if not no_noise:
            oks.append(_max_weight_check(max_weight, max_example_weight, owner))
            key = require(key, "key", owner)
            # bounds whose group holds only skipped leaves (None here) clip nothing
            sensitivity = dp_sensitivity(configured_clip_norm, clipped_sum)
            noise = _noise_like(
                key, clipped_sum, noise_multiplier * sensitivity * max_example_weight
            )
            clipped_sum = jax.tree.map(jnp.add, clipped_sum, noise)
        out = jax.tree.map(lambda s: s / jnp.asarray(batch_size).astype(s.dtype), clipped_sum)
        oks = [ok for ok in oks if ok is not None]
        if oks:  # traced: a mismatch poisons the update instead of hiding
            ok = jnp.all(stacked_parts(oks), axis=0)
            out = jax.tree.map(lambda u: jnp.where(ok, u, jnp.nan).astype(u.dtype), out)
        return out, state

    keys = ("clipped_sum", "max_weight")
    if fixed_batch_size is None:
        keys += ("batch_size",)
    return PerExampleTransformation(
        optax.init_empty_state, update_fn, build_request(*keys, clip_norm=clip_norm)
    )


def dp_sgd(
    learning_rate: optax.ScalarOrSchedule,
    clip_norm: float,
    noise_multiplier: float,
    *,
    batch_size: int | None = None,
    momentum: float | None = None,
    nesterov: bool = False,
    max_example_weight: float = 1.0,
) -> PerExampleTransformation:
    r"""DP-SGD: SGD (optionally with momentum) on the noised mean of clipped gradients.

    \[
      \theta_{t+1} = \theta_t - \alpha_t \frac{1}{B}\Big(\sum_b g_{t,b}
      \min\big(1, \tfrac{C}{\|g_{t,b}\|}\big) + \mathcal N\big(0, (z C)^2 I\big)\Big)
    \]

    (with ``example_weights``, the weighted clipped sum and noise \(z C M\),
    `dp_aggregate`). ``update`` takes the extra args of `dp_aggregate`:
    ``clipped_sum``, ``batch_size``, ``clip_norm``, ``max_weight`` and ``key``. With
    ``noise_multiplier=0`` and ``clip_norm=inf`` this is plain SGD. To schedule the clip norm, use
    ``js.optim.inject_hyperparams(js.optim.dp_sgd)`` and build the request
    inside the step with ``stat_request(opt, state)``: clipping and noise then
    use the same clip norm at every step.

    Args:
      learning_rate: a float or an optax schedule.
      clip_norm: \(C\), the per-example global-norm bound, or a pytree of bounds,
        one per group of parameters (per-layer clipping, see `dp_aggregate`).
      noise_multiplier: \(z\), the noise standard deviation in units of ``C``.
      batch_size: a fixed denominator; ``None`` reads the ``batch_size`` extra arg.
      momentum: optional heavy-ball momentum decay (`optax.trace`).
      nesterov: use Nesterov momentum (with ``momentum``).
      max_example_weight: \(M\), the largest example weight the noise covers
        (default 1; see `dp_aggregate`).

    Returns:
      A `PerExampleTransformation` requesting ``mean, clipped_sum, batch_size,
      clip_norm, max_weight``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.dp_sgd(learning_rate=0.1, clip_norm=1.0, noise_multiplier=1.1)
      >>> params = jnp.array([1.0, -2.0])
      >>> state = opt.init(params)
      >>> g = jnp.array([[3.0, 4.0], [0.3, 0.4]])  # per-example gradients
      >>> clipped = g * jnp.minimum(1, 1.0 / jnp.linalg.norm(g, axis=1))[:, None]
      >>> stats = {"mean": g.mean(0), "clipped_sum": clipped.sum(0), "batch_size": 2}
      >>> updates, state = opt.update(stats["mean"], state, params,
      ...                             **jso.update_kwargs(stats, key=jax.random.key(0)))
      >>> updates.shape
      (2,)

    References:
      Abadi et al., Deep Learning with Differential Privacy
      <https://arxiv.org/abs/1607.00133>, 2016
    """
    parts = [dp_aggregate(clip_norm, noise_multiplier, batch_size,
                          max_example_weight=max_example_weight)]
    if momentum is not None:
        parts.append(optax.trace(decay=momentum, nesterov=nesterov))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return chain(*parts)


def dp_adam(
    learning_rate: optax.ScalarOrSchedule,
    clip_norm: float,
    noise_multiplier: float,
    *,
    batch_size: int | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    max_example_weight: float = 1.0,
) -> PerExampleTransformation:
    r"""DP-Adam: Adam on the noised mean of clipped per-example gradients.

    \[
      \tilde g_t = \frac{1}{B}\Big(\sum_b g_{t,b}\min\big(1, \tfrac{C}{\|g_{t,b}\|}\big)
      + \mathcal N\big(0, (z C)^2 I\big)\Big),\qquad
      \theta_{t+1} = \theta_t - \alpha_t\,\mathrm{Adam}(\tilde g_t)
    \]

    ``update`` takes the extra args of `dp_aggregate`. The second moment
    of Adam then sees the noise variance \((zC/B)^2\); a larger ``eps`` is
    common in private training.

    Args:
      learning_rate: a float or an optax schedule.
      clip_norm: \(C\), the per-example global-norm bound, or a pytree of bounds,
        one per group of parameters (per-layer clipping, see `dp_aggregate`).
      noise_multiplier: \(z\), the noise standard deviation in units of ``C``.
      batch_size: a fixed denominator; ``None`` reads the ``batch_size`` extra arg.
      b1: decay of Adam's first moment.
      b2: decay of Adam's second moment.
      eps: added to the denominator outside the square root.
      eps_root: added to the denominator inside the square root.
      max_example_weight: \(M\), the largest example weight the noise covers
        (default 1; see `dp_aggregate`).

    Returns:
      A `PerExampleTransformation` requesting ``mean, clipped_sum, batch_size,
      clip_norm, max_weight``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.dp_adam(learning_rate=1e-3, clip_norm=1.0, noise_multiplier=1.1)
      >>> sorted(jso.stat_request(opt))
      ['batch_size', 'clip_norm', 'clipped_sum', 'max_weight', 'mean']

    References:
      Abadi et al., Deep Learning with Differential Privacy
      <https://arxiv.org/abs/1607.00133>, 2016
    """
    return chain(
        dp_aggregate(clip_norm, noise_multiplier, batch_size,
                     max_example_weight=max_example_weight),
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root),
        optax.scale_by_learning_rate(learning_rate),
    )


_DP_KEYS = ("clipped_sum", "max_weight", "batch_size")
register_request("dp_aggregate", _DP_KEYS)
for _factory in (dp_aggregate, dp_sgd, dp_adam):
    register_static_hyperparams(_factory, ("batch_size",))
register_request("dp_sgd", _DP_KEYS)
register_request("dp_adam", _DP_KEYS)

r"""``clipped_grad``: jax-privacy 2.x's entry point, computed by `per_example_stat`.

``jax_privacy.clipping.clipped_grad(fun, ...)`` returns a function computing the sum of
the per-example gradients of ``fun``, each clipped to ``l2_clip_norm`` (with
``vmap(grad)`` over examples). Here the same sum comes from the ``clipped_sum``
statistic, in one forward and one backward pass without materialising per-example
gradients where the layer allows it; the arguments, the output structure
(``AuxiliaryOutput``), ``is_padding_example``, ``prng_argnum`` and the returned
``BoundedSensitivityCallable`` are jax-privacy's, so switching is one import. The
differences that remain are listed in `clipped_grad`'s docstring.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery import stats as js_stats
from jaxpr_surgery._src import compat
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src.api import value_and_per_example_stat
from jaxpr_surgery._src.optim.dp import dp_sensitivity

__all__ = ["clipped_grad", "AuxiliaryOutput", "BoundedSensitivityCallable"]

#: jax-privacy's namedtuple of the per-example outputs (the same name and fields).
AuxiliaryOutput = collections.namedtuple("Aux", ["values", "grad_norms", "aux"])

_OWNER = "jaxpr_surgery.privacy.clipped_grad"
#: per_example_stat's options that clipped_grad passes on (``chunk_size``: only without
#: ``microbatch_size``, its jax-privacy name).
_OPTIONS = ("chunk_size", "strict", "memory_budget_bytes", "check")


@dataclasses.dataclass(frozen=True)
class BoundedSensitivityCallable:
    """A callable with the L2 sensitivity of its first output, as jax-privacy's.

    Attributes:
      fun: the function.
      l2_norm_bound: the bound of one example's contribution to the first output:
        the clip norm (the L2 norm of the per-layer bounds with per-layer clipping), or 1
        with ``rescale_to_unit_norm``, divided by ``normalize_by``.
      has_aux: the function returns ``(value, aux)``.
    """

    fun: Callable[..., Any]
    l2_norm_bound: Any
    has_aux: bool

    def __call__(self, *args, **kwargs):
        return self.fun(*args, **kwargs)

    def sensitivity(self, neighboring_relation=None):
        """The L2 sensitivity under ``neighboring_relation``: a
        ``dp_accounting.NeighboringRelation`` or its name. ``ADD_OR_REMOVE_ONE`` and
        ``REPLACE_SPECIAL`` (zero-out; the default, as in jax-privacy) give
        ``l2_norm_bound``, ``REPLACE_ONE`` twice it."""
        name = getattr(neighboring_relation, "name", neighboring_relation)
        if name is None or name in ("ADD_OR_REMOVE_ONE", "REPLACE_SPECIAL"):
            return self.l2_norm_bound
        if name == "REPLACE_ONE":
            return 2 * self.l2_norm_bound
        raise ValueError(f"sensitivity: unsupported neighboring_relation={neighboring_relation!r}.")


class _ClippedSumAs(js_stats.Statistic):
    """The clipped sum in ``dtype`` (accumulated in at least float32, then cast), not in
    the parameters' dtype: jax-privacy's ``dtype`` argument."""

    gradient_like = False
    defined_when_empty = True  # (0 on an all-padding batch)

    def __init__(self, clip_norm, dtype, nonfinite):
        self.clip_norm = clip_norm
        self.dtype = dtype
        self.nonfinite = nonfinite
        self._name = "clipped_sum"

    def reductions(self):
        return {"c": js_stats.ClippedSum(self.clip_norm, self.nonfinite)}

    def finalize(self, values, count):
        return jax.tree.map(lambda x: x.astype(self.dtype), values["c"])


def _is_index(n):
    return isinstance(n, (int, np.integer)) and not isinstance(n, bool)


def _nums(nums, what):
    if _is_index(nums):
        return (int(nums),)
    if isinstance(nums, Sequence) and not isinstance(nums, str) and all(
            _is_index(n) for n in nums):
        if not nums:  # (jax-privacy's words, which its tests match)
            name = "Batch Argnums" if what == "batch_argnums" else what
            role = ("holding the examples on axis 0 (the default 1: fun(params, batch))"
                    if what == "batch_argnums" else
                    "to differentiate (the default 0: the parameters)")
            raise ValueError(f"{_OWNER}({what}={nums!r}): {name} must not be empty; name the "
                             f"argument(s) {role}.")
        return tuple(int(n) for n in nums)
    raise TypeError(f"{_OWNER}({what}=...): expected an int or a non-empty tuple of ints, "
                    f"got {nums!r}.")


def _check_static(argnums, batch_argnums, normalize_by, prng_argnum, microbatch_size,
                  spmd_axis_name, options):
    a, b = _nums(argnums, "argnums"), _nums(batch_argnums, "batch_argnums")
    if min(a + b) < 0:
        raise ValueError(f"{_OWNER}: argnums={argnums!r} and batch_argnums={batch_argnums!r} "
                         "must be >= 0.")
    if set(a) & set(b):
        raise ValueError(
            f"{_OWNER}: argnums={argnums!r} and batch_argnums={batch_argnums!r} overlap on "
            f"{sorted(set(a) & set(b))}: cannot compute clipped gradients for arguments that "
            "have a batch axis.")
    if isinstance(normalize_by, bool) or not isinstance(normalize_by, numbers.Real) or not (
            normalize_by > 0):
        raise ValueError(f"{_OWNER}(normalize_by=...): must be a number > 0, got "
                         f"{normalize_by!r}.")
    if prng_argnum is not None:
        if isinstance(prng_argnum, bool) or not isinstance(prng_argnum, (int, np.integer)) or (
                prng_argnum < 0):
            raise TypeError(f"{_OWNER}(prng_argnum=...): expected an int >= 0, got "
                            f"{prng_argnum!r}.")
        p = int(prng_argnum)
        if p in a or p in b:
            raise ValueError(
                f"{_OWNER}(prng_argnum={p}): the PRNG key argument must be neither "
                "differentiated (argnums) nor a batch argument (batch_argnums): it is one key, "
                "split into one key per example.")
    if microbatch_size is not None and (
            isinstance(microbatch_size, bool) or not isinstance(microbatch_size, (int, np.integer))
            or microbatch_size < 1):
        raise ValueError(f"{_OWNER}(microbatch_size=...): must be a positive int or None, got "
                         f"{microbatch_size!r}.")
    if spmd_axis_name is not None:
        raise NotImplementedError(
            f"{_OWNER}(spmd_axis_name={spmd_axis_name!r}): not supported here (there is no "
            "vmap over examples to name). Under jit with the batch sharded over devices the "
            "computation follows the sharding; inside shard_map use js.per_example_stat("
            "..., axis_name=...) with js.stats.clipped_sum.")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"{_OWNER}: unexpected keyword argument(s) {unknown}; besides jax-privacy's "
            f"arguments it takes per_example_stat's options {list(_OPTIONS)}.")
    if microbatch_size is not None and options.get("chunk_size") is not None:
        raise ValueError(
            f"{_OWNER}: pass microbatch_size (jax-privacy's name) or chunk_size, not both: "
            "microbatch_size=m is chunk_size=m.")
    return a, b


def _check_clip(l2_clip_norm, rescale_to_unit_norm):
    per_layer = not jax.tree_util.treedef_is_leaf(jax.tree.structure(l2_clip_norm))
    if not per_layer and isinstance(l2_clip_norm, numbers.Real) and l2_clip_norm == 0:
        raise ValueError(
            f"{_OWNER}(l2_clip_norm=0): a zero clip norm is not supported (jax-privacy "
            "returns zeros); give a positive bound.")
    try:  # the same checks as the statistic (a bound > 0 or inf, or a tree of them)
        stat = js_stats.clipped_sum(l2_clip_norm)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("clipped_sum(clip_norm=...)",
                                     f"{_OWNER}(l2_clip_norm=...)")) from None
    if per_layer and rescale_to_unit_norm:
        raise NotImplementedError(
            f"{_OWNER}: rescale_to_unit_norm=True with per-layer bounds (l2_clip_norm a "
            "pytree) has no single meaning; divide the result by the bounds yourself, or use "
            "one global bound.")
    return stat.clip_norm, per_layer


def _split_keys(key_arg, B):
    """One key per example: ``jax.random.split`` of every key of ``key_arg`` (as
    jax-privacy), carried as raw key data; returns ``(data, rewrap)``."""
    leaves, tree = jax.tree.flatten(key_arg)
    data, impls = [], []
    for k in leaves:
        typed = jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
        split = jax.random.split(k, B)
        data.append(jax.random.key_data(split) if typed else split)
        impls.append(jax.random.key_impl(k) if typed else None)

    def rewrap(d, drop_axis):
        ks = [x[0] if drop_axis else x for x in jax.tree.leaves(d)]
        ks = [jax.random.wrap_key_data(x, impl=i) if i is not None else x
              for x, i in zip(ks, impls)]
        return jax.tree.unflatten(tree, ks)

    return jax.tree.unflatten(tree, data), rewrap


def _maybe_squeeze_axis_1(x):
    """jax-privacy's treatment of aux under keep_batch_dim: ``[B, 1, ...]`` -> ``[B, ...]``."""
    if hasattr(x, "shape") and len(x.shape) >= 2 and x.shape[1] == 1:
        return jnp.squeeze(x, axis=1)
    return x


def _global_norm(tree):
    """``optax.global_norm``: the L2 norm of every leaf together."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _clip_tree(tree, bounds, nan_safe):
    """jax-privacy's ``clip_pytree`` of one example's gradient, per bound of ``bounds``
    (a prefix of ``tree``'s structure)."""
    if nan_safe:
        tree = jax.tree.map(lambda x: jnp.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), tree)

    def clip(C, sub):
        norm = _global_norm(sub)
        scale = jnp.nan_to_num(jnp.minimum(1.0, C / norm), nan=0.0, posinf=0.0)
        return jax.tree.map(lambda x: jnp.asarray(scale, x.dtype) * x, sub)

    if jax.tree_util.treedef_is_leaf(jax.tree.structure(bounds)):
        return clip(bounds, tree)
    return jax.tree.map(clip, bounds, tree, is_leaf=lambda x: x is None)


def clipped_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    l2_clip_norm,
    rescale_to_unit_norm: bool = False,
    normalize_by: float = 1.0,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    return_values: bool = False,
    return_grad_norms: bool = False,
    pre_clipping_transform: Callable | None = None,
    microbatch_size: int | None = None,
    nan_safe: bool = True,
    dtype=None,
    prng_argnum: int | None = None,
    spmd_axis_name: str | None = None,
    **options,
) -> BoundedSensitivityCallable:
    r"""The sum of clipped per-example gradients of ``fun``, as
    ``jax_privacy.clipping.clipped_grad`` (jax-privacy 2.x) computes it.

    \[
      \frac{1}{\text{normalize\_by}}\sum_b g_b \min\Big(1, \frac{C}{\|g_b\|}\Big),
      \qquad g_b = \nabla_{\text{argnums}}\, \text{fun}(\ldots, \text{batch}[b{:}b{+}1], \ldots)
    \]

    The same arguments and outputs as jax-privacy's: replace
    ``from jax_privacy.clipping import clipped_grad`` by
    ``from jaxpr_surgery.privacy import clipped_grad``. The sum comes from
    `jaxpr_surgery.stats.clipped_sum` in one forward and one backward pass (no
    ``vmap(grad)``, no per-example gradients where the layer allows it).

    The returned function takes ``fun``'s arguments, and ``is_padding_example=`` (a bool
    ``[B]``: a padded example contributes nothing). It returns the clipped sum, or, with
    ``has_aux``, ``return_values`` or ``return_grad_norms``, ``(clipped_sum,
    AuxiliaryOutput(values, grad_norms, aux))``, each field ``None`` unless asked for:
    the per-example losses ``[B]``, the per-example norms ``[B]`` of the unclipped
    gradients and ``fun``'s per-example aux, stacked on axis 0 (with ``keep_batch_dim``, an
    axis 1 of size 1 squeezed, as jax-privacy does).

    Args:
      fun: the loss, ``fun(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``),
        written for a batch (``keep_batch_dim=True``: each example is passed with a leading
        axis of size 1) or for one example (``keep_batch_dim=False``).
      argnums: the argument(s) differentiated (a tuple: a tuple of gradients). Their
        Python floats are differentiated too, as by ``jax.grad``.
      has_aux: ``fun`` returns ``(loss, aux)``.
      l2_clip_norm: \(C > 0\) (``inf``: no clipping), or a pytree of bounds that is a
        prefix of the parameters' structure: per-layer clipping, each group of
        parameters clipped by its own norm (an extension; the sensitivity is then
        \(\sqrt{\sum_k C_k^2}\)).
      rescale_to_unit_norm: divide the clipped gradients by \(C\) (sensitivity 1).
      normalize_by: divide the result by this (> 0).
      batch_argnums: the argument(s) with examples on axis 0.
      keep_batch_dim: as above.
      return_values: also return the per-example losses.
      return_grad_norms: also return the per-example gradient norms.
      pre_clipping_transform: a function of one example's gradient pytree applied before
        clipping. Arbitrary functions need the per-example gradients: given one, this
        falls back to jax-privacy's computation (``vmap`` of ``grad``, by micro-batches),
        exactly, at its cost.
      microbatch_size: process the examples this many at a time (`per_example_stat`'s
        ``chunk_size``); bounds the memory, the result is the same.
      nan_safe: an example whose gradient holds a NaN or an infinity contributes nothing,
        so the sensitivity bound holds: `jaxpr_surgery.stats.clipped_sum`'s
        ``nonfinite="drop"``. jax-privacy instead zeroes the non-finite coordinates and clips
        the rest. ``False``: a non-finite gradient makes the sum NaN
        (``nonfinite="propagate"``).
      dtype: the dtype of the result (accumulated in at least float32); ``None``: the
        parameters' dtype.
      prng_argnum: the argument holding a PRNG key (or a pytree of keys): it is split into
        one key per example, ``jax.random.split(key, B)`` as in jax-privacy, and ``fun``
        sees example ``b``'s key (dropout per example, the same draws as jax-privacy's).
      spmd_axis_name: not supported (``NotImplementedError``).
      **options: `per_example_stat`'s ``chunk_size`` (instead of ``microbatch_size``),
        ``strict``, ``memory_budget_bytes`` and ``check`` (default ``False`` here: each
        gradient is that of the batch of one, as in jax-privacy, whatever ``fun`` does
        on a whole batch).

    Returns:
      A `BoundedSensitivityCallable`: call it like ``fun``; ``.sensitivity()`` and
      ``.l2_norm_bound`` give the L2 sensitivity of the clipped sum.

    Differences from jax-privacy that remain:

    * ``nan_safe=True`` drops an example with a non-finite gradient (jax-privacy keeps its
      finite coordinates, clipped);
    * ``grad_norms`` (and the sum) read 0 at a padded example (jax-privacy reports its
      norm);
    * ``l2_clip_norm=0`` raises (jax-privacy returns zeros), ``spmd_axis_name`` is not
      supported;
    * ``fun`` is traced on one example and its gradients come from the jaxpr, so
      `per_example_stat`'s limits apply (see Sharp edges).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxpr_surgery.privacy import clipped_grad
      >>> f = lambda param, data: 0.5 * jnp.mean((data - param) ** 2)
      >>> g = clipped_grad(f, l2_clip_norm=jnp.inf)
      >>> g(3.0, jnp.array([0, 7, -2]))
      Array(4., dtype=float32)
      >>> g = clipped_grad(f, l2_clip_norm=1.0, return_grad_norms=True)
      >>> total, aux = g(3.0, jnp.array([0, 7, -2]))
      >>> total, aux.grad_norms
      (Array(1., dtype=float32), Array([3., 4., 5.], dtype=float32))

    References:
      jax-privacy, ``jax_privacy.clipping.clipped_grad``
      <https://github.com/google-deepmind/jax_privacy>
    """
    argnums_t, batch_t = _check_static(argnums, batch_argnums, normalize_by, prng_argnum,
                                       microbatch_size, spmd_axis_name, options)
    if not callable(fun):
        raise TypeError(f"{_OWNER}: fun must be callable, got {fun!r}.")
    if pre_clipping_transform is not None and not callable(pre_clipping_transform):
        raise TypeError(f"{_OWNER}(pre_clipping_transform=...): expected a function of one "
                        f"example's gradient, got {pre_clipping_transform!r}.")
    bounds, per_layer = _check_clip(l2_clip_norm, rescale_to_unit_norm)
    dtype = None if dtype is None else jnp.dtype(dtype)
    wants_aux = bool(has_aux or return_values or return_grad_norms)
    chunk = microbatch_size if microbatch_size is not None else options.get("chunk_size", "auto")
    cfg = _Config(fun, argnums if isinstance(argnums, (int, np.integer)) else argnums_t,
                  batch_t, bool(has_aux), bounds, bool(rescale_to_unit_norm),
                  float(normalize_by), bool(keep_batch_dim), bool(return_values),
                  bool(return_grad_norms), pre_clipping_transform, chunk, bool(nan_safe),
                  dtype, prng_argnum, {k: v for k, v in options.items() if k != "chunk_size"})
    bound = 1.0 if rescale_to_unit_norm else dp_sensitivity(bounds)
    return BoundedSensitivityCallable(_compiled(cfg), bound / float(normalize_by), wants_aux)


@dataclasses.dataclass(frozen=True, eq=False)
class _Config:
    fun: Callable
    argnums: Any
    batch_argnums: tuple
    has_aux: bool
    bounds: Any
    rescale: bool
    normalize_by: float
    keep_batch_dim: bool
    return_values: bool
    return_grad_norms: bool
    transform: Callable | None
    chunk: Any
    nan_safe: bool
    dtype: Any
    prng_argnum: int | None
    options: dict


def _compiled(cfg):
    """``cfg``'s function, compiled once per structure of its arguments when called
    eagerly (non-array leaves static, as in `per_example_stat`); traced into the caller's
    computation under jit (`fingerprint.EagerCache`: also across a change of the x64
    mode)."""
    cache = fp.EagerCache()

    @functools.wraps(cfg.fun)
    def call(*args, **kwargs):
        args = _floats_as_arrays(args, cfg.argnums)
        if "example_weights" in kwargs:
            raise TypeError(
                f"{_OWNER}: takes is_padding_example (jax-privacy's), not example_weights: "
                "a weight w moves the sum by up to w * l2_clip_norm, outside the sensitivity "
                "bound. For weighted sums use js.per_example_stat with js.stats.clipped_sum "
                "and js.optim.dp_sgd(..., max_example_weight=...).")
        leaves, tree = jax.tree.flatten((args, kwargs))
        arrays = [isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))
                  for x in leaves]
        if any(isinstance(x, jax.core.Tracer) for x in leaves) and not (
                compat.under_eager_transformations()):
            return _call(cfg, args, kwargs)
        static = tuple(None if a else x for a, x in zip(arrays, leaves))
        key = (tree, tuple(arrays), static)
        try:
            hash(key)
        except TypeError:
            return _call(cfg, args, kwargs)
        def build(key=key):
            def run(arr):
                it = iter(arr)
                full = [next(it) if a else s for a, s in zip(key[1], key[2])]
                a, k = jax.tree.unflatten(key[0], full)
                return _call(cfg, a, k)

            return run

        return cache.get(key, build)([x for x, a in zip(leaves, arrays) if a])

    return call


def _floats_as_arrays(args, argnums):
    """The Python floats of the differentiated arguments as arrays: ``jax.grad``, and so
    jax-privacy, differentiates them (``params = {"w": 2.5}``), where `per_example_stat`
    holds a non-array leaf static."""
    nums = (argnums,) if _is_index(argnums) else argnums
    if not any(isinstance(x, float) for i in nums if i < len(args)
               for x in jax.tree.leaves(args[i])):
        return args
    args = list(args)
    for i in nums:
        if i < len(args):
            args[i] = jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, float) else x,
                                   args[i])
    return tuple(args)


def _batch_size(args, batch_argnums):
    nargs = len(args)
    if max(batch_argnums) >= nargs:
        raise ValueError(f"{_OWNER}: batch_argnums={batch_argnums} names argument "
                         f"{max(batch_argnums)}, but the function got {nargs} argument(s).")
    sizes = {}
    for i in batch_argnums:
        for path, x in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            where = f"argument {i}{jax.tree_util.keystr(path)}"
            if np.ndim(x) == 0:
                raise ValueError(
                    f"{_OWNER}: the batch {where} is a scalar; every array of the batch "
                    f"argument(s) batch_argnums={batch_argnums} needs an example axis 0.")
            sizes[where] = int(np.shape(x)[0])
    if not sizes:
        raise ValueError(f"{_OWNER}: the batch argument(s) {batch_argnums} hold no arrays.")
    if len(set(sizes.values())) > 1:  # (jax-privacy's words, which its tests match)
        listed = ", ".join(f"{w}: {n}" for w, n in sizes.items())
        raise ValueError(
            f"{_OWNER}: Batch axis sizes differ ({listed}): every array of the batch "
            f"argument(s) batch_argnums={batch_argnums} must have the same size along axis 0 "
            "(one entry per example).")
    return next(iter(sizes.values()))


def _call(cfg, args, kwargs):
    kwargs = dict(kwargs)
    pad = kwargs.pop("is_padding_example", None)
    B = _batch_size(args, cfg.batch_argnums)
    args = list(args)
    batch_argnums = cfg.batch_argnums
    rewrap = None
    if cfg.prng_argnum is not None:
        if cfg.prng_argnum >= len(args):
            raise ValueError(f"{_OWNER}(prng_argnum={cfg.prng_argnum}): the function got "
                             f"{len(args)} argument(s).")
        args[cfg.prng_argnum], rewrap = _split_keys(args[cfg.prng_argnum], B)
        batch_argnums = batch_argnums + (cfg.prng_argnum,)
    if pad is not None:
        pad = jnp.asarray(pad)
        if pad.dtype != jnp.bool_ or pad.shape != (B,):
            raise ValueError(
                f"{_OWNER}: is_padding_example must be a bool array of shape ({B},) (True for a "
                f"padded example), got {pad.dtype}{list(pad.shape)}.")
    if cfg.transform is not None:
        grads, values, norms, aux = _materialised(cfg, args, kwargs, pad, B, batch_argnums,
                                                  rewrap)
    else:
        grads, values, norms, aux = _streamed(cfg, args, kwargs, pad, batch_argnums, rewrap)
    if cfg.rescale:
        C = cfg.bounds
        grads = jax.tree.map(
            lambda g: g * jnp.asarray(jnp.where(jnp.isinf(C), 0.0, 1.0 / C), g.dtype), grads)
    if cfg.normalize_by != 1.0:
        grads = jax.tree.map(lambda g: g / jnp.asarray(cfg.normalize_by, g.dtype), grads)
    if not (cfg.has_aux or cfg.return_values or cfg.return_grad_norms):
        return grads
    if cfg.has_aux and cfg.keep_batch_dim:
        aux = jax.tree.map(_maybe_squeeze_axis_1, aux)
    return grads, AuxiliaryOutput(
        values=values if cfg.return_values else None,
        grad_norms=norms if cfg.return_grad_norms else None,
        aux=aux if cfg.has_aux else None,
    )


def _loss_fn(cfg, rewrap):
    """``fun`` as `per_example_stat` calls it: the key argument rewrapped (one example's
    key), and ``(loss, (loss, aux))`` so the per-example losses come back as aux."""

    def f(*args, **kwargs):
        if rewrap is not None:
            args = list(args)
            args[cfg.prng_argnum] = rewrap(args[cfg.prng_argnum], cfg.keep_batch_dim)
        out = cfg.fun(*args, **kwargs)
        loss, aux = out if cfg.has_aux else (out, None)
        return loss, (loss if cfg.return_values else None, aux)

    return f


def _streamed(cfg, args, kwargs, pad, batch_argnums, rewrap):
    # nan_safe: the statistic drops an example whose gradient is not finite; an
    # all-padding batch (an empty Poisson batch) gives the sum 0 and the norms 0
    nonfinite = "drop" if cfg.nan_safe else "propagate"
    clipped = (js_stats.clipped_sum(cfg.bounds, nonfinite) if cfg.dtype is None
               else _ClippedSumAs(cfg.bounds, cfg.dtype, nonfinite))
    stats = {"c": clipped}
    if cfg.return_grad_norms:
        stats["n"] = js_stats.norms()
    f = value_and_per_example_stat(
        _loss_fn(cfg, rewrap), stats, argnums=cfg.argnums, batch_argnums=batch_argnums,
        keep_batch_dim=cfg.keep_batch_dim, has_aux=True, chunk_size=cfg.chunk,
        **{"check": False, **cfg.options})
    (_, (values, aux)), out = f(*args, is_padding_example=pad, **kwargs)
    return out["c"], values, out.get("n"), aux


def _materialised(cfg, args, kwargs, pad, B, batch_argnums, rewrap):
    """jax-privacy's computation (``vmap`` of ``grad``, by micro-batches): for an arbitrary
    ``pre_clipping_transform``, which needs each example's gradient."""
    if pad is None:
        pad = jnp.zeros((B,), bool)
    f = _loss_fn(cfg, rewrap)
    grad_fn = jax.value_and_grad(f, cfg.argnums, has_aux=True)
    batched = set(batch_argnums)

    def one(examples, pad_b):
        a = list(args)
        for i, x in zip(sorted(batched), examples):
            a[i] = jax.tree.map(lambda v: v[None], x) if cfg.keep_batch_dim else x
        (loss, (_, aux)), g = grad_fn(*a, **kwargs)
        norm = _global_norm(g).astype(jnp.float32)
        t = cfg.transform(g)
        if cfg.dtype is not None:
            t = jax.tree.map(lambda x: x.astype(cfg.dtype), t)
        t = _clip_tree(t, cfg.bounds, cfg.nan_safe)
        t = jax.tree.map(lambda x: jnp.where(pad_b, jnp.zeros_like(x), x), t)
        return t, loss, jnp.where(pad_b, 0.0, norm), aux

    examples = tuple(args[i] for i in sorted(batched))
    m = B if cfg.chunk in (None, "auto") else int(cfg.chunk)
    n_chunks = -(-B // m)
    extra = n_chunks * m - B

    def chunked(x):
        x = jnp.concatenate([x, jnp.zeros((extra, *x.shape[1:]), x.dtype)]) if extra else x
        return x.reshape(n_chunks, m, *x.shape[1:])

    ex_c = jax.tree.map(chunked, examples)
    pad_c = chunked(jnp.concatenate([pad, jnp.ones((extra,), bool)]) if extra else pad)

    def body(total, xs):
        t, loss, norm, aux = jax.vmap(one)(*xs)
        s = jax.tree.map(lambda x: jnp.sum(x, axis=0), t)
        total = s if total is None else jax.tree.map(jnp.add, total, s)
        return total, (loss, norm, aux)

    first = jax.tree.map(lambda x: x[0], (ex_c, pad_c))
    total, outs0 = body(None, first)
    if n_chunks > 1:
        rest = jax.tree.map(lambda x: x[1:], (ex_c, pad_c))
        total, outs = jax.lax.scan(body, total, rest)
        outs = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), outs0, outs)
    else:
        outs = jax.tree.map(lambda a: a[None], outs0)
    loss, norm, aux = jax.tree.map(lambda x: x.reshape(n_chunks * m, *x.shape[2:])[:B], outs)
    return total, loss, norm, aux

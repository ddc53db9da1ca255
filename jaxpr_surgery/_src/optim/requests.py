"""Which per-example statistics an optimizer consumes, and how they reach ``update``.

Every optimizer in `jaxpr_surgery.optim` is a `PerExampleTransformation`:
an ordinary `optax.GradientTransformationExtraArgs` that also knows its
statistic request, the dict of statistics its ``update`` reads as keyword-only
extra args. The keys of that dict are the extra-arg names, so one call computes
everything and one update consumes it:

    request = js.optim.stat_request(opt, state)  # {"mean": ..., "second_moment": ...}
    loss, stats = js.value_and_per_example_stat(loss_fn, request)(params, batch)
    updates, state = opt.update(stats["mean"], state, params,
                                **js.optim.update_kwargs(stats))

A request may depend on the optimizer state: under `inject_hyperparams`, a
clip norm lives in ``state.hyperparams`` and the clipping statistic must use
the value of the current step. Such a transformation carries a ``request_fn``
(state -> request) instead of a fixed request. Optax's own wrappers (`optax.chain`,
`optax.masked`, `optax.MultiSteps`, ...) return plain transformations that know
nothing of requests; `stat_request` looks inside them and refuses the ones that
wrap an optimizer of this package needing more than the mean (`request_of`).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpr_surgery._src import example_weights as _ew
from jaxpr_surgery._src import stats as _stats

__all__ = [
    "PerExampleTransformation",
    "example_count",
    "stat_request",
    "update_kwargs",
    "register_request",
    "register_static_hyperparams",
    "require",
    "require_like",
    "is_int",
    "positive_int",
    "distinct_buffers",
    "request_of",
    "merge_requests",
    "PARAM_SHAPED",
]


# --------------------------------------------------------------------------- #
# The number of examples, and the clip norm used, as statistics
# --------------------------------------------------------------------------- #
class _ExampleCount(_stats.Statistic):
    """Value: the number of examples ``B`` (a scalar array)."""

    defined_when_empty = True  # (on an all-padding batch too)

    def reductions(self):
        # The plain sum: shared with ``mean()``, so requesting the count is free.
        return {"s": _stats.SUM}

    def finalize(self, values, count):
        del values
        return jnp.asarray(count)

    def __repr__(self):
        return "example_count()"


def example_count() -> _stats.Statistic:
    r"""Statistic whose value is the number of examples \(B\) in the batch.

    It reuses the plain-sum reduction of `jaxpr_surgery.stats.mean`, so
    adding it to a request costs nothing. Optimizers that divide by the batch
    size (``micro_adam_msq``, ``dp_sgd``) request it under the key
    ``"batch_size"``.
    """
    return _ExampleCount()


class _ClipNormUsed(_stats.Statistic):
    """Value: the clip norm of the ``clipped_sum`` of the same request (a scalar array).

    DP optimizers compare it with their own clip norm in ``update``, so noise is
    never scaled for another bound than the one the clipping used.
    """

    defined_when_empty = True  # (on an all-padding batch too)

    def __init__(self, clip_norm):
        self.clip_norm = clip_norm

    def reductions(self):
        return {"s": _stats.SUM}  # shared with mean(): free

    def finalize(self, values, count):
        del values, count
        return jax.tree.map(jnp.asarray, self.clip_norm)  # a bound, or a tree of bounds

    def __repr__(self):
        return f"clip_norm_used({self.clip_norm!r})"


class _MaxWeight(_stats.Statistic):
    """Value: the largest ``example_weights`` entry of the call (a scalar array): 1 without
    weights, and with ``is_padding_example`` (weights 0 and 1).

    DP optimizers compare it with their declared ``max_example_weight`` in ``update``: an
    example of weight ``w`` moves the weighted clipped sum by up to ``w C``, so noise
    scaled for a smaller bound would not cover the sensitivity.
    """

    defined_when_empty = True  # (on an all-padding batch too)

    uses_weights = True
    # read through example_weights.max_weight alone: `js.optim.accumulate` keeps the
    # largest weight of its micro-batches (`WeightSummary`)
    weight_summary = True

    def reductions(self):
        return {"s": _stats.SUM}  # shared with mean(): free

    def finalize(self, values, count, weights=None):
        del values, count
        return _ew.max_weight(weights)

    def __repr__(self):
        return "max_weight()"


# --------------------------------------------------------------------------- #
# Requests: keys are the extra-arg names of ``update``
# --------------------------------------------------------------------------- #
def _clip_norm_value(clip_norm, key):
    if clip_norm is None:
        raise ValueError(
            f"stat_request: the statistic {key!r} needs a clip norm; pass "
            "clip_norm=... (e.g. js.optim.stat_request('dp_sgd', clip_norm=1.0))."
        )
    return clip_norm


# Extra-arg name -> constructor of the statistic passed under that name.
_FACTORIES: dict[str, Callable[..., _stats.Statistic]] = {
    "mean": lambda **kw: _stats.mean(),
    "second_moment": lambda **kw: _stats.second_moment(),
    "variance": lambda **kw: _stats.variance(ddof=1),
    "sign_mean": lambda **kw: _stats.sign_mean(),
    "clipped_sum": lambda clip_norm=None, **kw: _stats.clipped_sum(
        _clip_norm_value(clip_norm, "clipped_sum")
    ),
    "clip_norm": lambda clip_norm=None, **kw: _ClipNormUsed(
        _clip_norm_value(clip_norm, "clip_norm")
    ),
    "batch_size": lambda **kw: example_count(),
    "max_weight": lambda **kw: _MaxWeight(),
    "kron_moments": lambda **kw: _stats.kron_moments(),
}

#: Extra args whose value is a pytree like the parameters (a prefix of it for
#: ``kron_moments``): the ones a mask or a partition of the parameters must split.
PARAM_SHAPED = frozenset(
    {"mean", "second_moment", "variance", "sign_mean", "clipped_sum", "kron_moments"}
)

# Statistic to suggest in error messages, by extra-arg name.
_HINTS = {
    "mean": "js.stats.mean()",
    "second_moment": "js.stats.second_moment()",
    "variance": "js.stats.variance()",
    "sign_mean": "js.stats.sign_mean()",
    "clipped_sum": "js.stats.clipped_sum(clip_norm)",
    "clip_norm": "the clip norm of clipped_sum, in js.optim.stat_request(opt, state)",
    "batch_size": "js.optim.example_count(), or pass the batch size B",
    "max_weight": "the largest example weight of the call, in js.optim.stat_request(opt)",
    "kron_moments": "js.stats.kron_moments(max_dim)",
}

# Optimizer / transform name -> the extra-arg names it consumes.
_REGISTRY: dict[str, tuple[str, ...]] = {}

# Factory -> hyperparameters that `inject_hyperparams` keeps static by default.
_STATIC_HYPERPARAMS: dict[Callable, tuple[str, ...]] = {}


def _with_implied(keys) -> tuple[str, ...]:
    """``"mean"`` first; ``"clip_norm"`` wherever ``"clipped_sum"`` is requested."""
    keys = tuple(k for k in keys if k != "mean")
    if "clipped_sum" in keys and "clip_norm" not in keys:
        keys = keys + ("clip_norm",)
    return ("mean",) + keys


def register_request(name: str, keys: tuple[str, ...]) -> None:
    """Registers the statistics consumed by the optimizer called ``name``.

    Registering the same keys again is a no-op (a module imported twice).

    Raises:
      ValueError: if ``name`` is already registered with other keys, or a key
        is unknown.
    """
    entry = _with_implied(keys)
    if _REGISTRY.get(name, entry) != entry:
        raise ValueError(
            f"register_request: {name!r} is already registered with {_REGISTRY[name]}; "
            f"cannot register it again with {entry}."
        )
    unknown = [k for k in keys if k not in _FACTORIES]
    if unknown:
        raise ValueError(
            f"register_request({name!r}): unknown statistic keys {unknown}; known: "
            f"{sorted(_FACTORIES)}."
        )
    _REGISTRY[name] = entry


def register_static_hyperparams(factory: Callable, names: tuple[str, ...]) -> None:
    """Declares arguments of ``factory`` that fix shapes or the request (``max_dim``).

    `inject_hyperparams` keeps them static (optax would inject every int as an
    array).
    """
    _STATIC_HYPERPARAMS[factory] = tuple(names)


def static_hyperparams(factory: Callable) -> tuple[str, ...]:
    """The names registered for ``factory`` (or the factory it wraps)."""
    seen = 0
    while factory is not None and seen < 8:
        names = _STATIC_HYPERPARAMS.get(factory)
        if names is not None:
            return names
        factory = getattr(factory, "__wrapped__", None)
        seen += 1
    return ()


def build_request(*keys: str, clip_norm=None) -> dict[str, _stats.Statistic]:
    """The request dict for the extra-arg names ``keys`` (``"mean"`` always first)."""
    return {k: _FACTORIES[k](clip_norm=clip_norm) for k in _with_implied(keys)}


# --------------------------------------------------------------------------- #
# The transformation type
# --------------------------------------------------------------------------- #
def float_leaves(params):
    """``params`` with ``None`` at its non-float arrays (integer and bool buffers, PRNG
    keys): the leaves `per_example_stat` skips, as ``eqx.filter_grad`` does. Their
    statistics are None, so the optimizers keep no state and give no update for them,
    as optax gives for a None gradient."""

    def one(x):
        is_array = isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))
        return None if is_array and not jnp.issubdtype(x.dtype, jnp.inexact) else x

    return None if params is None else jax.tree.map(one, params)


def distinct_buffers(tree):
    """``tree`` with a copy of every array that appears in it a second time, so that each
    leaf owns its buffer: a state whose leaves share one cannot be donated
    (``jax.jit(step, donate_argnums=...)``: "Attempt to donate the same buffer twice").
    Traced leaves (``init`` under ``jit``) become distinct outputs anyway."""
    seen = set()

    def one(x):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if id(x) in seen:
                return jnp.copy(x)
            seen.add(id(x))
        return x

    return jax.tree.map(one, tree)


def _skipping_nonfloat(init, update):
    """``init`` and ``update`` that see the parameters' float leaves only (`float_leaves`);
    the state ``init`` returns owns a buffer per leaf (`distinct_buffers`)."""
    if getattr(init, "_js_float_leaves", False):
        return init, update

    @functools.wraps(init)
    def init_fn(params):
        return distinct_buffers(init(float_leaves(params)))

    @functools.wraps(update)
    def update_fn(updates, state, params=None, **extra_args):
        return update(updates, state, float_leaves(params), **extra_args)

    init_fn._js_float_leaves = True
    return init_fn, update_fn


class PerExampleTransformation(optax.GradientTransformationExtraArgs):
    """An `optax.GradientTransformationExtraArgs` that knows its statistics.

    It is an ordinary optax transformation (a ``(init, update)`` pair, usable
    anywhere optax expects one) that also knows which per-example statistics
    its ``update`` consumes. Read them with `stat_request`.

    ``init`` and ``update`` see the float leaves of the parameters only: a non-float
    array (an integer buffer, a PRNG key), whose statistics `per_example_stat` skips
    (None, as ``eqx.filter_grad`` gives), gets no state and a ``None`` update, as
    optax gives for a ``None`` gradient. Apply the updates with ``eqx.apply_updates``
    (``optax.apply_updates`` cannot add ``None`` to an array). Every array of the state
    ``init`` returns has its own buffer, so the state can be donated
    (``jax.jit(step, donate_argnums=...)``).

    Attributes:
      init: as in optax.
      update: ``update(updates, state, params=None, **extra_args)``; the
        per-example statistics arrive as keyword-only extra args.
      stat_request: mapping from extra-arg name to the
        `jaxpr_surgery.stats.Statistic` to compute for it. Always holds
        ``"mean"`` (the batch-mean gradient, passed as ``updates``). Reading it
        raises a ``ValueError`` when the request depends on the optimizer state
        (see ``request_fn``): use ``js.optim.stat_request(opt, state)``.
      request_fn: ``None``, or ``state -> request`` for a transformation whose
        statistics depend on its state (a clip norm injected by
        `inject_hyperparams`).
    """

    def __new__(
        cls,
        init,
        update,
        stat_request: Mapping[str, Any] | None = None,
        request_fn: Callable[[Any], Mapping[str, Any]] | None = None,
    ):
        # a non-float parameter (skipped by per_example_stat: its statistics are None)
        # has no state and its update is None, whatever transform runs inside
        init, update = _skipping_nonfloat(init, update)
        self = super().__new__(cls, init, update)
        request = dict(stat_request) if stat_request is not None else build_request()
        # With a request_fn, ``_request`` is the request at the initial
        # hyperparameters: its keys are right, its statistics not for every step.
        self._request = types.MappingProxyType(request)
        self.request_fn = request_fn
        # optax.chain keeps its parts' update functions, not the parts: mark the
        # function so that `stat_request` finds the request behind it.
        if isinstance(update, types.FunctionType):
            update._js_optim_transformation = self
        return self

    @property
    def stat_request(self) -> Mapping[str, Any]:
        if self.request_fn is not None:
            raise ValueError(
                "This optimizer's statistics depend on its state (e.g. a clip norm set by "
                "js.optim.inject_hyperparams): the request of the initial "
                "hyperparameters would be wrong at later steps. Build it from the "
                "current state inside the training step: "
                "request = js.optim.stat_request(opt, state)."
            )
        return self._request

    @property
    def request_keys(self) -> tuple[str, ...]:
        """The extra-arg names of the request (known even when it depends on the state)."""
        return tuple(self._request)

    def __reduce__(self):  # copy / deepcopy / pickle keep the request
        return (
            type(self),
            (self.init, self.update, dict(self._request), self.request_fn),
        )

    def _replace(self, **kwargs):
        fields = {"init": self.init, "update": self.update, **kwargs}
        return type(self)(fields["init"], fields["update"], self._request, self.request_fn)

    def __repr__(self):
        request = (
            "<depends on the state>" if self.request_fn is not None else dict(self._request)
        )
        return (
            f"{type(self).__name__}(init={self.init!r}, update={self.update!r}, "
            f"stat_request={request!r})"
        )


def with_request(tx: optax.GradientTransformation, *keys: str, clip_norm=None):
    """Wraps ``tx`` as a `PerExampleTransformation` requesting ``keys``."""
    return PerExampleTransformation(tx.init, tx.update, build_request(*keys, clip_norm=clip_norm))


# --------------------------------------------------------------------------- #
# Merging requests
# --------------------------------------------------------------------------- #
def merge_requests(requests, owner: str = "chain") -> dict[str, Any]:
    """The union of ``requests``; raises if two give one name different statistics."""
    merged: dict[str, Any] = build_request()
    for request in requests:
        for k, stat in request.items():
            if k in merged and not _stats.same_statistic(merged[k], stat):
                raise ValueError(
                    f"{owner}: two transformations request different statistics under the "
                    f"extra arg {k!r}: {merged[k]!r} and {stat!r} (e.g. two clip norms). "
                    "Give them the same settings."
                )
            merged.setdefault(k, stat)
    return merged


# --------------------------------------------------------------------------- #
# Optax's wrappers around optimizers of this package
# --------------------------------------------------------------------------- #
_JS_OPTIM_MODULE = "jaxpr_surgery._src.optim"

# optax wrapper (by the qualified name of its update function) -> (name, alternative).
_OPTAX_WRAPPERS = {
    "chain": ("optax.chain", "js.optim.chain"),
    "named_chain": ("optax.named_chain", "js.optim.named_chain"),
    "masked": ("optax.masked", "js.optim.masked"),
    "partition": ("optax.partition / optax.multi_transform", "js.optim.partition"),
    "inject_hyperparams": ("optax.inject_hyperparams", "js.optim.inject_hyperparams"),
    "MultiSteps": ("optax.MultiSteps", None),
}


def _optax_wrapper(tx) -> tuple[str, str | None]:
    """``(name, js.optim alternative)`` of the optax wrapper that built ``tx``."""
    if isinstance(tx, optax.MultiSteps):
        return _OPTAX_WRAPPERS["MultiSteps"]
    update = getattr(tx, "update", None)
    module = getattr(update, "__module__", "") or ""
    head = (getattr(update, "__qualname__", "") or "").split(".")[0]
    if module.startswith("optax") and head in _OPTAX_WRAPPERS:
        return _OPTAX_WRAPPERS[head]
    return ("a plain optax transformation", None)


def _is_js_factory(obj) -> bool:
    return (
        isinstance(obj, types.FunctionType)
        and (getattr(obj, "__module__", "") or "").startswith(_JS_OPTIM_MODULE)
        and obj.__name__ in _REGISTRY
    )


def _js_parts(obj, seen: set, budget: list) -> list:
    """Optimizers of this package (or their factories) reachable inside ``obj``.

    Looks through what optax's wrappers keep: tuples and dicts of transforms,
    closures of their ``init`` / ``update`` functions, bound methods
    (`optax.MultiSteps`), ``functools.partial``.
    """
    if id(obj) in seen or budget[0] <= 0:
        return []
    seen.add(id(obj))
    budget[0] -= 1
    if isinstance(obj, PerExampleTransformation) or _is_js_factory(obj):
        return [obj]
    owner = getattr(obj, "_js_optim_transformation", None)
    if isinstance(obj, types.FunctionType) and isinstance(owner, PerExampleTransformation):
        return [owner]  # the update function of an optimizer of this package
    children: list = []
    if isinstance(obj, optax.MultiSteps):
        children = [obj.inner_opt]
    elif isinstance(obj, (tuple, list)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, functools.partial):
        children = [obj.func, *obj.args, *obj.keywords.values()]
    elif inspect.ismethod(obj):
        children = [obj.__self__, obj.__func__]
    elif isinstance(obj, types.FunctionType) and obj.__closure__:
        for cell in obj.__closure__:
            try:
                children.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    out = []
    for child in children:
        out.extend(_js_parts(child, seen, budget))
    return out


def _part_keys(part) -> tuple[str, ...] | None:
    """Extra args ``part`` consumes; ``None`` when unknown."""
    if isinstance(part, PerExampleTransformation):
        return part.request_keys
    return _REGISTRY.get(part.__name__)


def _refuse_wrapped(tx, owner: str) -> None:
    """Raises when a plain optax wrapper hides an optimizer of this package that
    needs more than the mean (its request would silently shrink to ``{"mean"}``)."""
    needs: set[str] = set()
    state_dependent = False
    for part in _js_parts(tx, set(), [2000]):
        keys = _part_keys(part)
        if keys is None:
            needs.add("<unknown>")
        else:
            needs.update(k for k in keys if k != "mean")
        if isinstance(part, PerExampleTransformation) and part.request_fn is not None:
            state_dependent = True
    if not needs and not state_dependent:
        return
    wrapper, alternative = _optax_wrapper(tx)
    needs_txt = ", ".join(sorted(needs)) or "statistics that depend on its state"
    if wrapper == "optax.MultiSteps":
        raise ValueError(
            f"{owner}: optax.MultiSteps wraps a js.optim optimizer that consumes "
            f"per-example statistics ({needs_txt}). MultiSteps accumulates only the mean "
            "gradient over its micro-batches and hands the inner update the statistics "
            "of the last micro-batch alone, so the update would silently mix the "
            "accumulated mean with one micro-batch's statistics. Compute the statistics "
            "of the whole batch in one call instead: js.value_and_per_example_stat(..., "
            "chunk_size=k) bounds memory like accumulation does and stays exact; or "
            "accumulate micro-batches exactly with js.optim.accumulate(opt, every_k), "
            "which merges their statistics (js.per_example_partial). "
            "(MultiSteps is exact for js.optim optimizers that need only the mean.)"
        )
    fix = (
        f"Use {alternative}, which keeps the request"
        + (" and splits the statistics like the updates" if "masked" in wrapper
           or "partition" in wrapper else "")
        if alternative
        else "Wrap it as js.optim.PerExampleTransformation(tx.init, tx.update, request) "
        "with the request its update consumes"
    )
    raise ValueError(
        f"{owner}: {wrapper} wraps a js.optim optimizer that consumes per-example "
        f"statistics ({needs_txt}), but the transformation it returns does not carry "
        f"the request, which would shrink to {{'mean'}}. {fix}."
    )


def request_of(tx, state=None, *, owner: str = "stat_request") -> dict[str, Any]:
    """The request of transformation ``tx`` at ``state`` (``None``: no state given).

    Raises:
      ValueError: if ``tx``'s request depends on its state and ``state`` is
        ``None``, or if ``tx`` is an optax wrapper hiding an optimizer of this
        package that needs more than the mean.
      TypeError: if ``tx`` is not a transformation.
    """
    accumulated = getattr(tx, "_js_accumulates", None)  # js.optim.accumulate(inner, k)
    if accumulated is not None:
        return request_of(accumulated, None if state is None else state.inner_state,
                          owner=owner)
    if isinstance(tx, PerExampleTransformation):
        if tx.request_fn is None:
            return dict(tx._request)
        if state is None:
            raise ValueError(
                f"{owner}: this optimizer's statistics depend on its state (e.g. a clip "
                "norm set by js.optim.inject_hyperparams, scheduled or changed in "
                "state.hyperparams): the clipping must use the value of the current step, "
                "as the noise does. Pass the current state, inside the training step: "
                "js.optim.stat_request(opt, state)."
            )
        return dict(tx.request_fn(state))
    if isinstance(tx, (optax.GradientTransformation, optax.MultiSteps)):
        _refuse_wrapped(tx, owner)
        return build_request()  # a plain optax optimizer consumes the mean only
    raise TypeError(
        f"{owner}: expected an optax GradientTransformation or an optimizer name, "
        f"got {type(tx).__name__}: {tx!r}."
    )


# --------------------------------------------------------------------------- #
# Public helpers
# --------------------------------------------------------------------------- #
def stat_request(optimizer_or_name, state=None, *, clip_norm=None) -> dict[str, _stats.Statistic]:
    """The statistics to compute for an optimizer, keyed by its extra-arg names.

    Pass the result to `jaxpr_surgery.value_and_per_example_stat` (or
    ``per_example_stat``); it always contains ``"mean"``. Build it inside the
    training step from the current optimizer state,
    ``stat_request(opt, state)``: then a hyperparameter that a statistic
    depends on (the clip norm of ``dp_sgd`` under `inject_hyperparams`) takes
    the value of the current step. The state is needed only by such
    optimizers; for the others it is ignored.

    Args:
      optimizer_or_name: an optimizer of `jaxpr_surgery.optim` (or any
        `PerExampleTransformation`), a plain optax transformation (which needs
        only the mean), or the name of an optimizer or transform of this
        module, e.g. ``"micro_adam"``.
      state: the optimizer's current state (``opt.init(params)`` or the state
        returned by the last ``update``).
      clip_norm: with a name that consumes ``clipped_sum`` (``"dp_sgd"``...), the
        clip norm of that statistic (a bound, or a pytree of bounds for per-layer
        clipping). Ignored for optimizer objects.

    Returns:
      A new ``dict`` from extra-arg name to `jaxpr_surgery.stats.Statistic`.

    Raises:
      ValueError: on an unknown name or a missing ``clip_norm``; without
        ``state`` for an optimizer whose statistics depend on it; for an optax
        wrapper (``optax.chain``, ``optax.masked``, ``optax.MultiSteps``, ...)
        around an optimizer of this module that needs more than the mean: the
        wrapper drops the request (use the ``js.optim`` wrapper of the same name).

    Examples:
      >>> import jaxpr_surgery.optim as jso
      >>> sorted(jso.stat_request("micro_adam_msq"))
      ['batch_size', 'mean', 'variance']
      >>> sorted(jso.stat_request(jso.micro_adam(1e-3)))
      ['mean', 'second_moment']
    """
    if isinstance(optimizer_or_name, str):
        keys = _REGISTRY.get(optimizer_or_name)
        if keys is None:
            raise ValueError(
                f"stat_request: unknown optimizer name {optimizer_or_name!r}; known names: "
                f"{sorted(_REGISTRY)}."
            )
        return build_request(*keys, clip_norm=clip_norm)
    return request_of(optimizer_or_name, state)


def update_kwargs(stats: Mapping[str, Any], **extra) -> dict[str, Any]:
    """Turns the result of a statistic request into keyword arguments for ``update``.

    Every statistic is passed under its key (``"mean"`` included: transforms that
    need the raw batch mean read it even when ``updates`` was transformed earlier
    in a chain); ``extra`` adds further extra args such as a PRNG ``key``.

    Args:
      stats: the dict returned by ``js.per_example_stat(fn, request)(...)``.
      **extra: more extra args for ``update`` (e.g. ``key=...``).

    Returns:
      A ``dict`` to splat into ``opt.update(updates, state, params, **kwargs)``.

    Raises:
      TypeError: if ``stats`` is not a mapping with string keys.
      ValueError: if a key of ``extra`` is also a statistic.

    Examples:
      >>> import jaxpr_surgery.optim as jso
      >>> sorted(jso.update_kwargs({"mean": 0.0, "variance": 1.0}, key=0))
      ['key', 'mean', 'variance']
    """
    if not isinstance(stats, Mapping):
        raise TypeError(
            "update_kwargs: expected the dict of statistics computed for "
            f"js.optim.stat_request(opt), got {type(stats).__name__}. Request the "
            "statistics as a dict so their names match update's extra args."
        )
    bad = [k for k in stats if not isinstance(k, str)]
    if bad:
        raise TypeError(f"update_kwargs: statistic names must be strings, got {bad!r}.")
    clash = sorted(set(stats) & set(extra))
    if clash:
        raise ValueError(
            f"update_kwargs: {clash} given both as statistics and as extra keyword "
            "arguments; pass each once."
        )
    return {**stats, **extra}


def is_int(value) -> bool:
    """A Python or numpy integer (``4``, ``np.int64(4)``: a value read from a config or
    an array's shape), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def positive_int(value, name: str, owner: str, meaning: str = "") -> int:
    """``value`` as a Python int, if `is_int` and at least 1; else a ``ValueError`` naming
    the hyperparameter ``owner(name=...)`` (``meaning``: what it counts, for the message).
    One checker for every int hyperparameter of the optimizers."""
    if not is_int(value) or value < 1:
        what = f" ({meaning})" if meaning else ""
        raise ValueError(
            f"{owner}({name}=...): expected a positive int{what}, got {value!r}."
        )
    return int(value)


def require(value, name: str, owner: str):
    """Returns ``value`` or raises a ``ValueError`` naming the missing extra arg."""
    if value is None:
        if name == "key":
            raise ValueError(
                f"{owner}: update() needs the keyword-only extra argument `key`, a fresh "
                "jax.random key for every step (e.g. opt.update(..., key=step_key)); "
                "never reuse a key across steps."
            )
        raise ValueError(
            f"{owner}: update() needs the keyword-only extra argument `{name}` "
            f"(statistic: {_HINTS.get(name, name)}). Compute the statistics of "
            "js.optim.stat_request(opt, state) with js.value_and_per_example_stat and "
            "pass **js.optim.update_kwargs(stats) to update(). Optax's wrappers "
            "(optax.chain, optax.masked, optax.inject_hyperparams, ...) drop the request "
            "of what they wrap: use js.optim.chain, js.optim.masked, "
            "js.optim.inject_hyperparams, ..."
        )
    return value


def _structure_name(tree) -> str:
    text = str(jax.tree.structure(tree))
    return text if len(text) <= 200 else text[:197] + "..."


def require_like(value, updates, name: str, owner: str, prefix: bool = False):
    """`require`, then checks that ``value`` has the tree structure of ``updates``.

    With ``prefix``, the structure of ``updates`` need only be a prefix of
    ``value``'s (per-leaf tuples of ``kron_moments``). A mismatch is what optax's
    masking wrappers produce: they mask ``updates`` but pass statistics whole.
    """
    value = require(value, name, owner)
    treedef = jax.tree.structure(updates)
    try:
        if prefix:
            treedef.flatten_up_to(value)
            ok = True
        else:
            ok = jax.tree.structure(value) == treedef
    except (ValueError, TypeError):
        ok = False
    if not ok:
        masked = any(
            isinstance(x, optax.MaskedNode)
            for x in jax.tree.leaves(updates, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
        )
        why = (
            "The updates are masked (optax.masked, optax.partition / multi_transform) but "
            f"`{name}` is not: use js.optim.masked / js.optim.partition, which split the "
            "statistics like the updates."
            if masked
            else f"Pass `{name}` for the same parameters as the updates."
        )
        raise ValueError(
            f"{owner}: the extra argument `{name}` has tree structure "
            f"{_structure_name(value)}, but the updates have {_structure_name(updates)}. "
            + why
        )
    return value


def refuse_masked(updates, owner: str, why: str) -> None:
    """Raises ``NotImplementedError`` if ``updates`` come masked (hold `optax.MaskedNode`)."""
    for x in jax.tree.leaves(updates, is_leaf=lambda x: isinstance(x, optax.MaskedNode)):
        if isinstance(x, optax.MaskedNode):
            raise NotImplementedError(f"{owner} inside optax.masked / optax.partition: {why}")

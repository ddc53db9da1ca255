"""Which per-example statistics an optimizer consumes, and how they reach ``update``.

Every optimizer in `jaxpr_surgery.optim` is a `PerExampleTransformation`:
an ordinary `optax.GradientTransformationExtraArgs` that also carries
``stat_request``, the dict of statistics its ``update`` reads as keyword-only
extra args. The keys of that dict are the extra-arg names, so one call computes
everything and one update consumes it:

    request = js.optim.stat_request(opt)     # {"mean": ..., "second_moment": ...}
    loss, stats = js.value_and_per_example_stat(loss_fn, request)(params, batch)
    updates, state = opt.update(stats["mean"], state, params,
                                **js.optim.update_kwargs(stats))
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import optax

from jaxpr_surgery._src import stats as _stats

__all__ = [
    "PerExampleTransformation",
    "example_count",
    "chain",
    "inject_hyperparams",
    "stat_request",
    "update_kwargs",
    "register_request",
    "require",
]


# --------------------------------------------------------------------------- #
# The number of examples as a statistic
# --------------------------------------------------------------------------- #
class _ExampleCount(_stats.Statistic):
    """Value: the number of examples ``B`` (a scalar array)."""

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


# --------------------------------------------------------------------------- #
# Requests: keys are the extra-arg names of ``update``
# --------------------------------------------------------------------------- #
def _clipped_sum(clip_norm=None):
    if clip_norm is None:
        raise ValueError(
            "stat_request: the statistic 'clipped_sum' needs a clip norm; pass "
            "clip_norm=... (e.g. js.optim.stat_request('dp_sgd', clip_norm=1.0))."
        )
    return _stats.clipped_sum(clip_norm)


# Extra-arg name -> constructor of the statistic passed under that name.
_FACTORIES: dict[str, Callable[..., _stats.Statistic]] = {
    "mean": lambda **kw: _stats.mean(),
    "second_moment": lambda **kw: _stats.second_moment(),
    "variance": lambda **kw: _stats.variance(ddof=1),
    "sign_mean": lambda **kw: _stats.sign_mean(),
    "clipped_sum": lambda clip_norm=None, **kw: _clipped_sum(clip_norm),
    "batch_size": lambda **kw: example_count(),
    "kron_moments": lambda **kw: _stats.kron_moments(),
}

# Statistic to suggest in error messages, by extra-arg name.
_HINTS = {
    "mean": "js.stats.mean()",
    "second_moment": "js.stats.second_moment()",
    "variance": "js.stats.variance()",
    "sign_mean": "js.stats.sign_mean()",
    "clipped_sum": "js.stats.clipped_sum(clip_norm)",
    "batch_size": "js.optim.example_count(), or pass the batch size B",
    "kron_moments": "js.stats.kron_moments(max_dim)",
}

# Optimizer / transform name -> the extra-arg names it consumes.
_REGISTRY: dict[str, tuple[str, ...]] = {}


def register_request(name: str, keys: tuple[str, ...]) -> None:
    """Registers the statistics consumed by the optimizer called ``name``.

    Registering the same keys again is a no-op (a module imported twice).

    Raises:
      ValueError: if ``name`` is already registered with other keys, or a key
        is unknown.
    """
    entry = ("mean",) + tuple(k for k in keys if k != "mean")
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


def build_request(*keys: str, clip_norm=None) -> dict[str, _stats.Statistic]:
    """The request dict for the extra-arg names ``keys`` (``"mean"`` always first)."""
    ordered = ("mean",) + tuple(k for k in keys if k != "mean")
    return {k: _FACTORIES[k](clip_norm=clip_norm) for k in ordered}


# --------------------------------------------------------------------------- #
# The transformation type
# --------------------------------------------------------------------------- #
class PerExampleTransformation(optax.GradientTransformationExtraArgs):
    """An `optax.GradientTransformationExtraArgs` that knows its statistics.

    It is an ordinary optax transformation (a ``(init, update)`` pair, usable in
    `optax.chain` and anywhere optax expects one) with one extra read-only
    attribute.

    Attributes:
      init: as in optax.
      update: ``update(updates, state, params=None, **extra_args)``; the
        per-example statistics arrive as keyword-only extra args.
      stat_request: mapping from extra-arg name to the
        `jaxpr_surgery.stats.Statistic` to compute for it. Always holds
        ``"mean"`` (the batch-mean gradient, passed as ``updates``).
    """

    def __new__(cls, init, update, stat_request: Mapping[str, Any] | None = None):
        self = super().__new__(cls, init, update)
        request = dict(stat_request) if stat_request is not None else build_request()
        self.stat_request = types.MappingProxyType(request)
        return self

    def __reduce__(self):  # copy / deepcopy / pickle keep the request
        return (type(self), (self.init, self.update, dict(self.stat_request)))

    def _replace(self, **kwargs):
        fields = {"init": self.init, "update": self.update, **kwargs}
        return type(self)(fields["init"], fields["update"], self.stat_request)

    def __repr__(self):
        return (
            f"{type(self).__name__}(init={self.init!r}, update={self.update!r}, "
            f"stat_request={dict(self.stat_request)!r})"
        )


def _same_stat(a, b) -> bool:
    if a is b:
        return True
    return type(a) is type(b) and vars(a) == vars(b)


def _merge(requests) -> dict[str, Any]:
    merged: dict[str, Any] = build_request()
    for request in requests:
        for k, stat in request.items():
            if k in merged and not _same_stat(merged[k], stat):
                raise ValueError(
                    f"chain: two transformations request different statistics under the "
                    f"extra arg {k!r}: {merged[k]!r} and {stat!r} (e.g. two clip norms). "
                    "Give them the same settings."
                )
            merged.setdefault(k, stat)
    return merged


def chain(*transforms: optax.GradientTransformation) -> PerExampleTransformation:
    """`optax.chain` that keeps the union of the parts' statistic requests.

    `optax.chain` returns a plain optax transformation, which forgets the
    ``stat_request`` of its parts; use this instead when chaining optimizers of
    `jaxpr_surgery.optim` with each other or with optax transforms.

    Args:
      *transforms: optax transformations, with or without ``stat_request``.

    Returns:
      A `PerExampleTransformation`.

    Raises:
      ValueError: if two parts request different statistics under one name.

    Examples:
      >>> import optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.chain(jso.track_gradient_statistics(0.99),
      ...                 optax.clip_by_global_norm(1.0), jso.micro_adam(1e-3))
      >>> sorted(jso.stat_request(opt))
      ['batch_size', 'mean', 'second_moment', 'variance']
    """
    tx = optax.chain(*transforms)
    request = _merge(getattr(t, "stat_request", {}) for t in transforms)
    return PerExampleTransformation(tx.init, tx.update, request)


def with_request(tx: optax.GradientTransformation, *keys: str, clip_norm=None):
    """Wraps ``tx`` as a `PerExampleTransformation` requesting ``keys``."""
    return PerExampleTransformation(tx.init, tx.update, build_request(*keys, clip_norm=clip_norm))


# --------------------------------------------------------------------------- #
# Public helpers
# --------------------------------------------------------------------------- #
def stat_request(optimizer_or_name, *, clip_norm=None) -> dict[str, _stats.Statistic]:
    """The statistics to compute for an optimizer, keyed by its extra-arg names.

    Pass the result to `jaxpr_surgery.value_and_per_example_stat` (or
    ``per_example_stat``); it always contains ``"mean"``.

    Args:
      optimizer_or_name: an optimizer of `jaxpr_surgery.optim` (or any
        transformation with a ``stat_request`` attribute), a plain optax
        transformation (which needs only the mean), or the name of an optimizer
        or transform of this module, e.g. ``"micro_adam"``.
      clip_norm: with a name that consumes ``clipped_sum`` (``"dp_sgd"``...), the
        clip norm of that statistic. Ignored for optimizer objects.

    Returns:
      A new ``dict`` from extra-arg name to `jaxpr_surgery.stats.Statistic`.

    Raises:
      ValueError: on an unknown name, or a missing ``clip_norm``.

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
    request = getattr(optimizer_or_name, "stat_request", None)
    if request is not None:
        return dict(request)
    if isinstance(optimizer_or_name, optax.GradientTransformation):
        # A plain optax optimizer consumes the batch-mean gradient only. If it
        # is an optax.chain of js.optim parts, their update will say what is missing.
        return build_request()
    raise TypeError(
        f"stat_request: expected an optax GradientTransformation or an optimizer name, "
        f"got {type(optimizer_or_name).__name__}: {optimizer_or_name!r}."
    )


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
            "js.optim.stat_request(opt) with js.value_and_per_example_stat and pass "
            "**js.optim.update_kwargs(stats) to update(). Wrappers such as optax.chain "
            "or optax.inject_hyperparams drop the request of what they wrap: use "
            "js.optim.chain, or js.optim.stat_request('<optimizer name>')."
        )
    return value


def inject_hyperparams(inner_factory, static_args=(), hyperparam_dtype=None):
    """`optax.inject_hyperparams` that keeps the optimizer's statistic request.

    `optax.inject_hyperparams(js.optim.micro_adam)(...)` returns a plain optax
    transformation and forgets ``stat_request``; this wrapper returns a
    `PerExampleTransformation` whose request is that of ``inner_factory`` built
    with the same arguments (a schedule evaluated at step 0 for the purpose).
    Hyperparameters then live in ``state.hyperparams`` and can be changed or
    scheduled as with optax.

    Examples:
      >>> import optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.inject_hyperparams(jso.micro_adam)(
      ...     learning_rate=optax.linear_schedule(1e-3, 0.0, 100))
      >>> sorted(jso.stat_request(opt))
      ['mean', 'second_moment']
    """
    import functools

    injected = optax.inject_hyperparams(inner_factory, static_args, hyperparam_dtype)

    @functools.wraps(inner_factory)
    def factory(*args, **kwargs):
        tx = injected(*args, **kwargs)
        probe_args = [a(0) if callable(a) else a for a in args]
        probe_kwargs = {k: (v(0) if callable(v) else v) for k, v in kwargs.items()}
        inner = inner_factory(*probe_args, **probe_kwargs)
        request = getattr(inner, "stat_request", None)
        return PerExampleTransformation(tx.init, tx.update, request)

    return factory

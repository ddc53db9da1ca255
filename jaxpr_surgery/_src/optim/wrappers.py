"""Optax's wrappers, keeping the statistic request of what they wrap.

`optax.chain`, `optax.named_chain`, `optax.masked`, `optax.partition`
(`optax.multi_transform`) and `optax.inject_hyperparams` return plain optax
transformations: the request of a wrapped optimizer of `jaxpr_surgery.optim`
is lost (`stat_request` refuses them rather than answer ``{"mean"}``). The
versions here return a `PerExampleTransformation` with the same state and
updates as optax's, and:

* ``chain`` / ``named_chain``: the union of the parts' requests;
* ``masked`` / ``partition``: the inner request, and the statistics shaped like
  the parameters are masked like the updates, so an inner optimizer sees exactly
  the statistics of its own parameters;
* ``inject_hyperparams``: the request of the inner optimizer *at the current
  hyperparameters*, read from the state (``stat_request(opt, state)``) when a
  statistic depends on one (a clip norm).

`optax.MultiSteps`'s counterpart is `accumulate` (accumulate.py): it merges the
micro-batches' statistics exactly.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpr_surgery._src.optim.requests import (
    PARAM_SHAPED,
    PerExampleTransformation,
    merge_requests,
    request_of,
    static_hyperparams,
)

__all__ = ["chain", "named_chain", "masked", "partition", "multi_transform", "inject_hyperparams"]


def _dependent(tx) -> bool:
    return isinstance(tx, PerExampleTransformation) and tx.request_fn is not None


def _initial_request(tx, owner) -> dict:
    """The request of ``tx``; for a state-dependent one, its initial request (keys)."""
    if _dependent(tx):
        return dict(tx._request)
    return request_of(tx, owner=owner)


def _compose(tx, parts, owner, substate):
    """A `PerExampleTransformation` of ``tx`` whose request merges ``parts``.

    ``parts`` maps a key to a transform; ``substate(state, key)`` is the part's state.
    """
    static = merge_requests((_initial_request(t, owner) for t in parts.values()), owner)
    if not any(_dependent(t) for t in parts.values()):
        return PerExampleTransformation(tx.init, tx.update, static)

    def request_fn(state):
        return merge_requests(
            (request_of(t, substate(state, k), owner=owner) for k, t in parts.items()), owner
        )

    return PerExampleTransformation(tx.init, tx.update, static, request_fn)


# --------------------------------------------------------------------------- #
# chain, named_chain
# --------------------------------------------------------------------------- #
def chain(*transforms: optax.GradientTransformation) -> PerExampleTransformation:
    """`optax.chain` that keeps the union of the parts' statistic requests.

    `optax.chain` returns a plain optax transformation, which forgets the
    ``stat_request`` of its parts; use this instead when chaining optimizers of
    `jaxpr_surgery.optim` with each other or with optax transforms. The state
    is that of `optax.chain` (a tuple of the parts' states).

    Args:
      *transforms: optax transformations, with or without a request.

    Returns:
      A `PerExampleTransformation`.

    Raises:
      ValueError: if two parts request different statistics under one name, or
        a part is an optax wrapper that hides a request (see `stat_request`).

    Examples:
      >>> import optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.chain(jso.track_gradient_statistics(0.99),
      ...                 optax.clip_by_global_norm(1.0), jso.micro_adam(1e-3))
      >>> sorted(jso.stat_request(opt))
      ['batch_size', 'mean', 'second_moment', 'variance']
    """
    tx = optax.chain(*transforms)
    return _compose(tx, dict(enumerate(transforms)), "chain", lambda state, i: state[i])


def named_chain(*transforms: tuple[str, optax.GradientTransformation]) -> PerExampleTransformation:
    """`optax.named_chain` that keeps the union of the parts' statistic requests.

    Args:
      *transforms: ``(name, transformation)`` pairs; the state is a dict keyed
        by the names, as in optax.

    Returns:
      A `PerExampleTransformation`.

    Examples:
      >>> import optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.named_chain(("stats", jso.track_gradient_statistics()),
      ...                       ("adam", jso.micro_adam(1e-3)))
      >>> sorted(jso.stat_request(opt))
      ['batch_size', 'mean', 'second_moment', 'variance']
    """
    tx = optax.named_chain(*transforms)
    return _compose(tx, dict(transforms), "named_chain", lambda state, name: state[name])


# --------------------------------------------------------------------------- #
# masked, partition
# --------------------------------------------------------------------------- #
_DP_REFUSAL = (
    "the clipped sum of js.stats.clipped_sum is clipped by each example's norm over "
    "*every* differentiated parameter, not over the selected ones, so the result would "
    "not be DP-SGD on the selected parameters; the others would get the non-private "
    "mean; and groups of a partition would draw their noise from one key. To train a "
    "subset privately, differentiate only that subset (pass it as its own argument, "
    "argnums=...) and apply the DP optimizer to it whole; to freeze parameters after "
    "DP-SGD, chain optax.masked(optax.set_to_zero(), frozen_mask) after it "
    "(js.optim.chain)."
)


def _refuse_dp(tx, owner):
    keys = tx.request_keys if isinstance(tx, PerExampleTransformation) else ()
    if "clipped_sum" in keys:
        raise NotImplementedError(f"{owner}: cannot mask a DP optimizer: {_DP_REFUSAL}")


def _mask_tree(value, mask_tree, name, owner):
    try:
        return jax.tree.map(lambda m, v: v if m else optax.MaskedNode(), mask_tree, value)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{owner}: the mask (tree structure {jax.tree.structure(mask_tree)}) is not a "
            f"prefix of the extra argument `{name}` ({jax.tree.structure(value)}): pass "
            "statistics of the same parameters as the updates."
        ) from e


def _resolve_mask(mask, updates):
    return mask(updates) if callable(mask) else mask


def masked(
    inner: optax.GradientTransformation,
    mask: Any | Callable[[optax.Params], Any],
) -> PerExampleTransformation:
    """`optax.masked` that masks the statistics like the updates and keeps the request.

    The inner transformation sees the updates, parameters *and* the per-example
    statistics shaped like the parameters (``mean``, ``second_moment``,
    ``variance``, ``sign_mean``, ``kron_moments``) restricted to the masked
    leaves, exactly as if it ran on those parameters alone; other leaves pass
    through unchanged. Scalars such as ``batch_size`` and the PRNG ``key`` are
    passed whole. The state is optax's `optax.MaskedState`.

    Args:
      inner: the transformation to apply to the masked leaves.
      mask: a pytree of booleans like (or a prefix of) the parameters, or a
        function of the parameters returning one; ``True`` selects a leaf.

    Returns:
      A `PerExampleTransformation` with ``inner``'s request.

    Raises:
      NotImplementedError: if ``inner`` is a DP optimizer (it consumes
        ``clipped_sum``): its clipping norm runs over every parameter, so it
        cannot be restricted to a mask (see the error for the alternatives).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.masked(jso.micro_adam(0.1), {"w": True, "b": False})
      >>> params = {"w": jnp.ones(2), "b": jnp.ones(3)}
      >>> g = {"w": jnp.full(2, 0.5), "b": jnp.full(3, 0.5)}
      >>> stats = {"mean": g, "second_moment": {"w": jnp.ones(2), "b": jnp.ones(3)}}
      >>> u, state = opt.update(g, opt.init(params), params, **jso.update_kwargs(stats))
      >>> print(np.asarray(u["w"]).round(4), u["b"])  # b passes through (not selected)
      [-0.05 -0.05] [0.5 0.5 0.5]
    """
    _refuse_dp(inner, "masked")
    tx = optax.masked(inner, mask)

    def update_fn(updates, state, params=None, **extra_args):
        mask_tree = _resolve_mask(mask, updates)
        extra_args = {
            k: (_mask_tree(v, mask_tree, k, "masked") if k in PARAM_SHAPED and v is not None
                else v)
            for k, v in extra_args.items()
        }
        return tx.update(updates, state, params, **extra_args)

    wrapped = optax.GradientTransformationExtraArgs(tx.init, update_fn)
    return _compose(wrapped, {0: inner}, "masked", lambda state, _: state.inner_state)


def partition(
    transforms: Mapping[Hashable, optax.GradientTransformation],
    param_labels: Any | Callable[[optax.Params], Any],
) -> PerExampleTransformation:
    """`optax.partition` (`optax.multi_transform`) that splits the statistics too.

    Each group's transformation runs as `masked` on the leaves of its label:
    it sees the statistics of its own parameters only, and the request is the
    union of the groups' requests. The state is optax's
    ``optax.transforms.PartitionState``.

    Args:
      transforms: a mapping from label to transformation.
      param_labels: a pytree of labels like (or a prefix of) the parameters, or
        a function of the parameters returning one.

    Returns:
      A `PerExampleTransformation`.

    Raises:
      NotImplementedError: if a group's transformation is a DP optimizer (see
        `masked`).
      ValueError: (at ``init``) if a label has no transformation.

    Examples:
      >>> import optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.partition({"adam": jso.micro_adam(1e-3), "sgd": optax.sgd(1e-2)},
      ...                     {"w": "adam", "b": "sgd"})
      >>> sorted(jso.stat_request(opt))
      ['mean', 'second_moment']
    """
    transforms = dict(transforms)
    for label, t in transforms.items():
        _refuse_dp(t, f"partition (label {label!r})")

    def group_tx(labels, group):
        return masked(transforms[group], jax.tree.map(lambda label: label == group, labels))

    def labels_of(tree):
        return param_labels(tree) if callable(param_labels) else param_labels

    def init_fn(params):
        labels = labels_of(params)
        missing = set(jax.tree.leaves(labels)) - set(transforms)
        if missing:
            raise ValueError(
                f"partition: parameters labelled {', '.join(sorted(map(repr, missing)))} have "
                "no transformation; transforms are given for "
                f"{', '.join(sorted(map(repr, transforms)))}."
            )
        return optax.transforms.PartitionState(
            {g: group_tx(labels, g).init(params) for g in transforms}
        )

    def update_fn(updates, state, params=None, **extra_args):
        labels = labels_of(updates)
        inner_states = {}
        for g in transforms:
            updates, inner_states[g] = group_tx(labels, g).update(
                updates, state.inner_states[g], params, **extra_args
            )
        return updates, optax.transforms.PartitionState(inner_states)

    tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    return _compose(
        tx, transforms, "partition", lambda state, g: state.inner_states[g].inner_state
    )


def multi_transform(
    transforms: Mapping[Hashable, optax.GradientTransformation],
    param_labels: Any | Callable[[optax.Params], Any],
) -> PerExampleTransformation:
    """Alias of `partition`, after `optax.multi_transform`."""
    return partition(transforms, param_labels)


# --------------------------------------------------------------------------- #
# inject_hyperparams
# --------------------------------------------------------------------------- #
def _convert_floats(x, dtype):
    """As optax's inject_hyperparams: floats become ``dtype``, strong arrays are kept."""
    if isinstance(x, jax.Array) and not getattr(x, "weak_type", False):
        return x
    current = x.dtype if hasattr(x, "dtype") else type(x)
    if jax.dtypes.issubdtype(current, jnp.floating):
        return jnp.asarray(x, dtype=dtype)
    return x


def _holds_tracer(request) -> bool:
    return any(
        isinstance(x, jax.core.Tracer)
        for stat in request.values()
        for v in getattr(stat, "__dict__", {}).values()
        for x in jax.tree.leaves(v)  # (a tree of clip bounds)
    )


def _is_number_like(x) -> bool:
    return isinstance(x, (int, float, jax.Array, np.ndarray, np.generic)) and not isinstance(
        x, bool)


def _is_tree_schedule(value) -> bool:
    """A pytree (not a leaf) of numbers and schedules with at least one schedule: a
    hyperparameter given per group, scheduled for some (``{"w": schedule, "b": 1.0}``,
    a per-layer clip bound)."""
    leaves, tree = jax.tree.flatten(value)
    return (
        not jax.tree_util.treedef_is_leaf(tree)
        and any(callable(x) for x in leaves)
        and all(callable(x) or _is_number_like(x) for x in leaves)
    )


class _TreeSchedule(optax.schedules.StatefulSchedule):
    """A pytree of hyperparameter values some of which are schedules, as one stateful
    schedule of `optax.inject_hyperparams`: its state is the tuple of its schedules'
    states (``()`` for a number), its value at a step the tree of their values (a number
    stays itself). So ``state.hyperparams[name]`` holds the tree of the step's values."""

    def __init__(self, tree):
        self.values, self.treedef = jax.tree.flatten(tree)
        self.parts = [
            v if isinstance(v, optax.schedules.StatefulSchedule)
            else optax.schedules.WrappedSchedule(v) if callable(v) else None
            for v in self.values
        ]

    def init(self):
        return tuple(() if p is None else p.init() for p in self.parts)

    def update(self, state, **extra_args):
        return tuple(
            s if p is None else p.update(s, **extra_args) for p, s in zip(self.parts, state)
        )

    def __call__(self, state, **extra_args):
        return jax.tree.unflatten(self.treedef, [
            jnp.asarray(v) if p is None else p(s, **extra_args)
            for v, p, s in zip(self.values, self.parts, state)
        ])


def inject_hyperparams(
    inner_factory: Callable[..., optax.GradientTransformation],
    static_args: str | tuple[str, ...] = (),
    hyperparam_dtype: Any | None = None,
) -> Callable[..., PerExampleTransformation]:
    """`optax.inject_hyperparams` that keeps the request, at the current hyperparameters.

    Hyperparameters live in ``state.hyperparams`` and can be scheduled or changed
    there, as with optax; state and updates are optax's. The request is that of
    ``inner_factory`` built with the hyperparameters of the step:

    * when no statistic depends on a hyperparameter (learning rates, decays),
      it is fixed and ``stat_request(opt)`` needs no state;
    * when one does (the clip norm of ``dp_sgd``: clipping and noise must use
      the same value at every step), ``stat_request(opt, state)`` reads it from
      the state, and ``stat_request(opt)`` raises. Build the request inside the
      training step from the current state.

    Arguments that fix shapes or the request (Shampoo's ``max_dim``, DP's
    ``batch_size``) stay static by default, where optax would inject every int.

    A pytree argument of numbers with schedules among them (per-layer clip bounds,
    ``clip_norm={"w": schedule, "b": 1.0}``; optax would pass it on unscheduled) is
    scheduled leaf by leaf: ``state.hyperparams[name]`` holds the tree of the step's
    values, and its numbers stay fixed. Name it in ``static_args`` to pass it as it is.

    Args:
      inner_factory: a function returning the transformation, such as
        ``js.optim.micro_adam``.
      static_args: names of further arguments not to inject (as in optax).
      hyperparam_dtype: optional dtype of the float hyperparameters (as in optax).

    Returns:
      A function with ``inner_factory``'s arguments (schedules allowed in place
      of numbers) returning a `PerExampleTransformation`.

    Examples:
      >>> import optax
      >>> import jaxpr_surgery.optim as jso
      >>> opt = jso.inject_hyperparams(jso.micro_adam)(
      ...     learning_rate=optax.linear_schedule(1e-3, 0.0, 100))
      >>> sorted(jso.stat_request(opt))
      ['mean', 'second_moment']
      >>> dp = jso.inject_hyperparams(jso.dp_sgd)(
      ...     learning_rate=0.1, clip_norm=optax.linear_schedule(1.0, 0.1, 100),
      ...     noise_multiplier=1.0)
      >>> import jax.numpy as jnp
      >>> state = dp.init(jnp.zeros(3))
      >>> jso.stat_request(dp, state)["clipped_sum"].clip_norm
      1.0
    """
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    static |= set(static_hyperparams(inner_factory)) & set(
        inspect.signature(inner_factory).parameters
    )
    injected = optax.inject_hyperparams(inner_factory, tuple(static), hyperparam_dtype)
    signature = inspect.signature(inner_factory)

    @functools.wraps(inner_factory)
    def factory(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        # The classification of optax.inject_hyperparams, and trees holding schedules
        # (which optax would pass on unscheduled): one stateful schedule each.
        sched, numeric, other = {}, {}, {}
        for name, value in bound.arguments.items():
            if name in static or isinstance(value, bool):
                other[name] = value
            elif isinstance(value, optax.schedules.StatefulSchedule):
                sched[name] = value
            elif callable(value):
                sched[name] = optax.schedules.WrappedSchedule(value)
            elif isinstance(value, (int, float, jax.Array, np.ndarray)):
                numeric[name] = value
            elif _is_tree_schedule(value):
                sched[name] = bound.arguments[name] = _TreeSchedule(value)
            else:
                other[name] = value
        tx = injected(*bound.args, **bound.kwargs)
        initial = {**numeric, **{k: f(f.init()) for k, f in sched.items()}}
        probe = inner_factory(**other, **initial)
        request = _initial_request(probe, "inject_hyperparams")  # refuses hidden requests

        # Does a statistic depend on an injected hyperparameter? Build the inner
        # optimizer with them traced, and look for tracers in its request.
        dependent = [_dependent(probe)]

        def trace(hps):
            inner = inner_factory(**other, **hps)
            if isinstance(inner, PerExampleTransformation):
                dependent[0] = dependent[0] or _dependent(inner) or _holds_tracer(inner._request)
            return 0

        if isinstance(probe, PerExampleTransformation) and not dependent[0]:
            jax.eval_shape(trace, jax.tree.map(jnp.asarray, initial))
        if not dependent[0]:
            return PerExampleTransformation(tx.init, tx.update, request)

        def request_fn(state):
            if not isinstance(state, optax.InjectStatefulHyperparamsState):
                raise TypeError(
                    "stat_request(opt, state): expected the state of this "
                    "js.optim.inject_hyperparams optimizer (an "
                    f"optax.InjectStatefulHyperparamsState), got {type(state).__name__}."
                )
            # The hyperparameters that optax's update uses at this step.
            hps = dict(state.hyperparams)
            for k, f in sched.items():
                value = f(state.hyperparams_states[k])
                # (optax converts a single value to the dtype of the hyperparameters and
                # passes a tree of values as it is)
                hps[k] = value if isinstance(f, _TreeSchedule) else _convert_floats(
                    value, jnp.asarray(state.hyperparams[k]).dtype)
            inner = inner_factory(**other, **hps)
            return request_of(inner, state.inner_state, owner="inject_hyperparams")

        return PerExampleTransformation(tx.init, tx.update, request, request_fn)

    return factory

r"""Gradient accumulation with exact statistics: one optimizer step every ``k`` micro-batches.

`optax.MultiSteps` averages the mean gradient over its micro-batches and hands the
inner optimizer the other statistics of the last micro-batch alone. `accumulate`
instead keeps the running *partial* of the micro-batches (`per_example_partial`:
every reduction's value, merged exactly) in its state, and on the ``k``-th
micro-batch finalizes it and runs the inner optimizer on the statistics of the ``k``
micro-batches together: the same update, state and parameters as one step on their
concatenation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpr_surgery._src import arguments
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src.optim.requests import (
    distinct_buffers,
    positive_int,
    request_of,
    update_kwargs,
)
from jaxpr_surgery._src.partials import (
    Partial,
    finalize_partial,
    merge_values,
    weight_dtype,
)
from jaxpr_surgery._src.reductions import acc_dtype_for
from jaxpr_surgery._src.stats import Statistic, same_statistic

__all__ = ["AccumulateState", "AccumulatingTransformation", "accumulate"]

_OWNER = "accumulate"


class AccumulateState(NamedTuple):
    """State of `accumulate`.

    Attributes:
      mini_step: micro-batches accumulated since the last optimizer step (int32);
        0 right after an update that took a step.
      gradient_step: optimizer steps taken (int32).
      inner_state: the state of the wrapped optimizer.
      sums: the running partial's values: per reduction of the request, per
        differentiated parameter leaf, its value over the micro-batches so far (in the
        accumulation dtype of the leaf, at least float32).
      num_examples: examples accumulated since the last step (int32).
      total_weight: their total weight (float), the count of merges and ``finalize``.
      weight_sq: the sum of their squared weights (float; 1 per example without
        ``example_weights``), for the effective batch size of weighted examples.
      weight_max: their largest weight (float).
      weighted: whether the micro-batches since the last step carried
        ``example_weights`` (bool; read while ``mini_step > 0``: the micro-batches of
        one step carry weights all, or none).
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_state: Any
    sums: tuple
    num_examples: jax.Array
    total_weight: jax.Array
    weight_sq: jax.Array
    weight_max: jax.Array
    weighted: jax.Array


class AccumulatingTransformation(optax.GradientTransformationExtraArgs):
    """The transformation `accumulate` returns: ``update`` takes a micro-batch's partial.

    Attributes:
      init: ``init(params) -> AccumulateState``.
      update: ``update(partial, state, params=None, **extra_args)``: ``partial`` is the
        micro-batch's `jaxpr_surgery.Partial` of ``stat_request(acc, state)``;
        ``extra_args`` (a DP noise ``key``) go to the inner update.
      inner: the wrapped optimizer.
      every_k: micro-batches per optimizer step.
    """

    def __new__(cls, init, update, inner, every_k):
        self = super().__new__(cls, init, update)
        self.inner = inner
        self.every_k = every_k
        self._js_accumulates = inner  # read by requests.request_of
        return self

    def __reduce__(self):
        return (accumulate, (self.inner, self.every_k))

    def _replace(self, **kwargs):
        raise TypeError("accumulate(...): rebuild it with js.optim.accumulate(inner, every_k).")


def _zero_value(r, shape, dtype):
    """The value of reduction ``r`` over no examples (the identity of its merge)."""
    aval = r.aval(tuple(shape), dtype, 0)
    empty = r.empty(tuple(shape), dtype)
    if jax.tree.structure(empty) == jax.tree.structure(aval):
        return empty
    # an accumulator of another form than the value (Centered: Shifted sums)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aval)


def _float_leaves(params):
    """The differentiated leaves of ``params``, as `per_example_stat` takes them."""
    return [x for x in jax.tree.leaves(params)
            if arguments.is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def _refuse_per_example(reductions, stats, owner):
    per = [r.describe() for r in reductions if r.per_example]
    if per:
        raise ValueError(
            f"{owner}: the request holds per-example statistics ({', '.join(per)}; from "
            f"{stats}), whose values grow by one entry per example: they cannot be "
            "accumulated in an optimizer state of fixed shape. Request them in a separate "
            "js.per_example_stat call (or merge their partials outside the state)."
        )


def _check_partial(partial, request, state, owner):
    if not isinstance(partial, Partial):
        raise TypeError(
            f"{owner}: update() takes the partial of a micro-batch as its first argument, "
            f"got {type(partial).__name__}: compute it with "
            "js.per_example_partial(loss_fn, js.optim.stat_request(acc, state))(params, "
            "batch). (An accumulating optimizer is outermost: it cannot be chained after "
            "another transformation, which would hand it gradients.)"
        )
    spec = partial._spec
    want = arguments.flatten_stats(dict(request))
    if spec.stat_tree != want[1] or [type(s) for s in spec.stats] != [type(s) for s in want[0]]:
        raise ValueError(
            f"{owner}: the partial holds {spec.describe()}, but the optimizer requests "
            f"{sorted(request)}: compute it for js.optim.stat_request(acc, state)."
        )
    # every statistic's settings too (a traced one, a clip norm scheduled under jit, is
    # compared where it is used: a DP optimizer's update poisons a step that differs)
    differ = [
        f"{name} {got!r} where the optimizer requests {wanted!r}"
        for name, got, wanted in zip(_stat_names(want[1]), spec.stats, want[0])
        if not same_statistic(got, wanted) and not (_traced(got) or _traced(wanted))
    ]
    if differ:
        raise ValueError(
            f"{owner}: the partial was computed for other statistics: "
            f"{_short_text('; '.join(differ))}. Their values would reach the inner "
            "update as if they were its own (for a DP optimizer: noise sized for another "
            "clipping than the partial's). Compute the partial of every micro-batch for "
            "js.optim.stat_request(acc, state), from the current state."
        )
    _refuse_per_example(spec.reductions, spec.describe(), owner)
    if partial.example_weights is not None:
        # the state keeps the weights' total, sum of squares and largest (`WeightSummary`)
        for s in spec.stats:
            if getattr(s, "uses_weights", False) and not getattr(s, "weight_summary", False):
                raise ValueError(
                    f"{owner}: the statistic {s!r} reads every example weight of the batch, "
                    "which an optimizer state of fixed shape cannot keep across micro-batches "
                    "with example_weights. Accumulate without it, or take one step per batch."
                )
    a, b = jax.tree.structure(state.sums), jax.tree.structure(partial._values)
    shapes_a = [np.shape(x) for x in jax.tree.leaves(state.sums)]
    shapes_b = [np.shape(x) for x in jax.tree.leaves(partial._values)]
    if a != b or shapes_a != shapes_b:
        raise ValueError(
            f"{owner}: the partial's values do not match the accumulator of the state "
            "(parameters of another structure or shapes than those given to init?): "
            f"{_short(b, shapes_b)} instead of {_short(a, shapes_a)}."
        )


def _stat_names(stat_tree):
    """The path of each statistic of a request (``['clipped_sum']``), in flat order."""
    flat = jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(stat_tree, list(range(stat_tree.num_leaves))))[0]
    return [jax.tree_util.keystr(path) for path, _ in flat]


def _traced(obj, depth=0) -> bool:
    """Whether a statistic holds a traced value (among its attributes, their trees, the
    statistics it holds), which `same_statistic` cannot compare."""
    if isinstance(obj, jax.core.Tracer):
        return True
    if depth > 8:
        return False
    if isinstance(obj, (list, tuple)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, Statistic) or hasattr(obj, "__dataclass_fields__"):
        children = list(getattr(obj, "__dict__", {}).values())
    else:
        return False
    return any(_traced(c, depth + 1) for c in children)


def _short_text(text, n=240):
    return text if len(text) <= n else text[: n - 3] + "..."


def _short(tree, shapes):
    return _short_text(f"{tree} with shapes {shapes}")


def accumulate(inner: optax.GradientTransformation, every_k: int) -> AccumulatingTransformation:
    r"""One step of ``inner`` every ``every_k`` micro-batches, on their exact statistics.

    The `optax.MultiSteps` of this package, exact for every optimizer: the state keeps
    the running *partial* of the micro-batches (`jaxpr_surgery.per_example_partial`),
    merged exactly (sums add, variances by Chan's rule). On the ``every_k``-th
    micro-batch, the statistics of all of them together are finalized and ``inner``
    takes one step with them; the other calls return zero updates and leave ``inner``'s
    state alone. ``every_k`` calls give the same updates, state and parameters as one
    step of ``inner`` on the concatenated micro-batches (up to rounding), also with
    micro-batches of different sizes (statistics weigh every example alike), and with
    ``example_weights`` (token counts, padding): partials made with weights give the
    weighted statistics of the concatenated micro-batches and their weights. Pass weights
    to every micro-batch or to none: a step whose micro-batches mix them raises a
    ``ValueError`` (under ``jit``, its update is NaN).

    ``update(partial, state, params=None, **extra_args)`` takes the micro-batch's
    partial in place of the gradient; ``extra_args`` (the DP noise ``key``) reach the
    inner update. The request is ``inner``'s: ``js.optim.stat_request(acc, state)``; a
    partial of other statistics, or of the same ones with other settings (a DP partial
    clipped at another clip norm), raises a ``ValueError``. The state can be donated
    (``jax.jit(step, donate_argnums=...)``).
    Statistics per example (``sq_norms``, ``norms``) cannot be accumulated in a state
    of fixed shape and raise a ``ValueError``; so does, with weights, a statistic that
    reads every weight (the state keeps their total, sum of squares and largest: the
    effective batch size of the noise scale and ``snr``, and the largest weight a DP
    optimizer checks against its ``max_example_weight``).

    Args:
      inner: an optimizer of `jaxpr_surgery.optim`, or any optax transformation
        (which needs only the mean).
      every_k: micro-batches per optimizer step (a positive int).

    Returns:
      An `AccumulatingTransformation` with state `AccumulateState`.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0, 4.0])}
      >>> acc = js.optim.accumulate(js.optim.micro_adam_var(0.1), every_k=2)
      >>> params = jnp.zeros(2)
      >>> state = acc.init(params)
      >>> for micro in ({k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}):
      ...     request = js.optim.stat_request(acc, state)
      ...     partial = js.per_example_partial(loss, request)(params, micro)
      ...     updates, state = acc.update(partial, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> int(state.gradient_step), int(state.mini_step)
      (1, 0)
      >>> print(np.asarray(params).round(4))
      [0.0843 0.1317]
      >>> inner = js.optim.micro_adam_var(0.1)  # one step on the 4 examples together
      >>> s = js.per_example_stat(loss, js.optim.stat_request(inner))(jnp.zeros(2), batch)
      >>> u, _ = inner.update(s["mean"], inner.init(jnp.zeros(2)), jnp.zeros(2),
      ...                     **js.optim.update_kwargs(s))
      >>> bool(jnp.allclose(params, u, rtol=1e-5))
      True
    """
    every_k = positive_int(every_k, "every_k", _OWNER, "micro-batches per optimizer step")
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(f"{_OWNER}: expected an optax transformation, got {inner!r}.")

    def init_fn(params):
        inner_state = inner.init(params)
        request = request_of(inner, inner_state, owner=_OWNER)
        stats, _, _, reductions = arguments.flatten_stats(dict(request))
        _refuse_per_example(reductions, sorted(request), _OWNER)
        leaves = _float_leaves(params)
        sums = tuple(
            tuple(_zero_value(r, np.shape(x), acc_dtype_for(jnp.result_type(x))) for x in leaves)
            for r in reductions
        )
        count = lambda: jnp.zeros([], jnp.int32)  # noqa: E731
        weight = lambda: jnp.zeros([], weight_dtype(sums))  # noqa: E731
        # every leaf its own buffer (also of the inner state): the state can be donated
        return distinct_buffers(AccumulateState(
            count(), count(), inner_state, sums, count(), weight(), weight(), weight(),
            jnp.zeros([], jnp.bool_)))

    def update_fn(updates, state, params=None, **extra_args):
        partial = updates
        request = request_of(inner, state.inner_state, owner=_OWNER)
        _check_partial(partial, request, state, _OWNER)
        spec = partial._spec
        weighted = partial.example_weights is not None
        # the micro-batches of one step carry example_weights all, or none
        mixed = (state.mini_step > 0) & (state.weighted != weighted)
        if not isinstance(mixed, jax.core.Tracer) and bool(mixed):
            k = int(state.mini_step)
            before = f"the {k} micro-batch{'es' if k > 1 else ''} accumulated before it"
            raise ValueError(
                f"{_OWNER}: "
                + (f"this micro-batch's partial has example_weights, but {before} had none"
                   if weighted else
                   f"this micro-batch's partial has no example_weights, but {before} had them")
                + ". The step would take neither the weighted nor the unweighted statistics "
                "of its micro-batches (and a DP optimizer would check its max_example_weight "
                "against the last micro-batch's weights alone). Pass example_weights to "
                "every micro-batch or to none (weights of 1 are the unweighted statistics; "
                "0/1 padding: is_padding_example)."
            )
        wdt = state.total_weight.dtype
        sums = merge_values(spec.reductions, state.sums, state.total_weight,
                            partial._values, partial.total_weight)
        # the state keeps its dtypes (a scan carry): the accumulation dtype of each leaf
        sums = jax.tree.map(lambda x, s: x.astype(s.dtype), sums, state.sums)
        n = state.num_examples + jnp.asarray(partial.num_examples).astype(jnp.int32)
        w = state.total_weight + jnp.asarray(partial.total_weight).astype(wdt)
        pw = partial.example_weights  # (without them: every example weighs 1)
        if pw is None:
            sq = jnp.asarray(partial.num_examples).astype(wdt)
            big = jnp.where(partial.num_examples > 0, 1, 0).astype(wdt)
        else:
            pw = jnp.asarray(pw).astype(wdt)
            sq, big = jnp.sum(jnp.square(pw)), jnp.max(pw, initial=0)
        wsq, wmax = state.weight_sq + sq, jnp.maximum(state.weight_max, big)
        if isinstance(mixed, jax.core.Tracer):  # traced: the step's statistics are NaN
            sums, w, wsq, wmax = ew.poison((sums, w, wsq, wmax), mixed)

        def step(sums, n, w, wsq, wmax, inner_state):
            weights = ew.WeightSummary(w, wsq, wmax) if weighted else None
            stats = finalize_partial(Partial(spec, sums, {}, n, w, weights))
            return inner.update(stats["mean"], inner_state, params,
                                **update_kwargs(stats, **extra_args))

        out = jax.eval_shape(step, sums, n, w, wsq, wmax, state.inner_state)

        def emit(operands):
            sums, n, w, wsq, wmax, inner_state = operands
            new_updates, inner_state = step(sums, n, w, wsq, wmax, inner_state)
            zeros = jax.tree.map(jnp.zeros_like, (sums, n, w, wsq, wmax))
            return (new_updates, inner_state) + zeros

        def wait(operands):
            sums, n, w, wsq, wmax, inner_state = operands
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out[0])
            return zeros, inner_state, sums, n, w, wsq, wmax

        now = state.mini_step + 1 >= every_k
        new_updates, inner_state, sums, n, w, wsq, wmax = jax.lax.cond(
            now, emit, wait, (sums, n, w, wsq, wmax, state.inner_state)
        )
        mini = jnp.where(now, 0, state.mini_step + 1).astype(jnp.int32)
        gstep = (state.gradient_step + now.astype(jnp.int32)).astype(jnp.int32)
        return new_updates, AccumulateState(mini, gstep, inner_state, sums, n, w, wsq, wmax,
                                            jnp.full([], weighted, jnp.bool_))

    return AccumulatingTransformation(init_fn, update_fn, inner, every_k)

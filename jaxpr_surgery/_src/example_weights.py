"""``example_weights`` and ``is_padding_example``: the reserved keyword arguments of the
functions `per_example_stat` returns (never passed to the loss).

With weights ``w_b >= 0`` every statistic is the weighted one over the examples
(frequency weights: a weight 2 counts an example twice, a weight 0 removes it exactly),
``W = sum_b w_b`` taking the place of the number of examples. The engine carries them
through every route (`stats.Weighted`, `engine.run`); this module reads and checks them.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

WEIGHTS, PADDING = "example_weights", "is_padding_example"
RESERVED = (WEIGHTS, PADDING)


def pop(kwargs, name):
    """``(kwargs without the reserved ones, (which, value) or None)``."""
    given = [k for k in RESERVED if kwargs.get(k) is not None]
    rest = {k: v for k, v in kwargs.items() if k not in RESERVED}
    if not given:
        return rest, None
    if len(given) == 2:
        raise ValueError(
            f"{name}: pass either example_weights or is_padding_example, not both (padding "
            "is the weight 0: fold the mask into the weights, example_weights * ~is_padding)."
        )
    return rest, (given[0], kwargs[given[0]])


def _is_traced(x):
    return isinstance(x, jax.core.Tracer)


def check_concrete(spec, name, ddofs=(), all_zero_ok=False, empty_ok=False):
    """Raises on bad concrete weights: negative, NaN or infinite, all zero, or a total
    weight not above a statistic's ``ddof`` (its estimate divides by ``W - ddof``).
    Traced weights are checked where the results are formed (`poison`).

    ``all_zero_ok``: no check of the total weight (a partial, which another may
    complete); ``empty_ok``: all zero is accepted (some statistic of the call is defined
    on a batch of no example, a sum; the others come out NaN), a positive total still
    checked against the ``ddofs``."""
    kind, value = spec
    if value is None or _is_traced(value):
        return
    arr = np.asarray(value)
    if kind == PADDING:
        if arr.dtype != np.bool_:
            raise TypeError(
                f"{name}: is_padding_example must be a bool array [B] (True for a padded "
                f"example), got dtype {arr.dtype}. For weights use example_weights."
            )
        arr = (~arr).astype(np.float64)
    # (jnp.issubdtype: bfloat16 is a float to JAX, not to numpy; traced weights of any
    # float dtype are accepted, so concrete ones are too)
    elif not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)
              or arr.dtype == np.bool_):
        raise TypeError(
            f"{name}: example_weights must be a float (or int/bool) array [B], got dtype "
            f"{arr.dtype}."
        )
    arr = arr.astype(np.float64)
    if arr.ndim == 1 and arr.size:
        if not np.all(np.isfinite(arr)):
            bad = np.flatnonzero(~np.isfinite(arr))[:5].tolist()
            raise ValueError(f"{name}: example_weights holds NaN or inf at examples {bad}; "
                             "weights must be finite and >= 0.")
        if np.any(arr < 0):
            bad = np.flatnonzero(arr < 0)[:5].tolist()
            raise ValueError(f"{name}: example_weights is negative at examples {bad}; weights "
                             "must be >= 0 (0 removes an example).")
        W = float(arr.sum())
        if all_zero_ok:
            return
        if W <= 0:
            if empty_ok:
                return
            raise ValueError(
                f"{name}: every example has weight 0 ({kind}): no example is left to take "
                "statistics of, and every statistic requested divides by the total weight "
                "W = 0. Skip the call for an all-padding batch (sums, clipped sums and "
                "per-example outputs are defined on one: 0)."
            )
        for stat_name, ddof in ddofs:
            if W <= ddof:
                raise ValueError(
                    f"{name}: {stat_name}(ddof={ddof}) divides by W - ddof, but the examples' "
                    f"total weight is W = {W:g}: give more weight (examples) or ddof=0."
                )


def as_weights(spec, B, name, per_device=False):
    """The weights as a float array ``[B]`` (``B``: the examples of this call; with
    ``per_device``, under ``axis_name`` or in a mapped function, those of this device)."""
    kind, value = spec
    x = jnp.asarray(value)
    if x.shape != (B,):
        what = "is_padding_example" if kind == PADDING else "example_weights"
        where = (", on this device: each device passes the weights of its own examples"
                 if per_device else "")
        raise ValueError(
            f"{name}: {what} must have shape ({B},), one entry per example of the batch "
            f"(axis 0 of the batch leaves{where}), got shape {x.shape}."
        )
    if kind == PADDING:
        if x.dtype != jnp.bool_:
            raise TypeError(
                f"{name}: is_padding_example must be a bool array [B], got dtype {x.dtype}."
            )
        return (~x).astype(jnp.result_type(float))
    if jnp.issubdtype(x.dtype, jnp.complexfloating) or not (
        jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)
        or x.dtype == jnp.bool_
    ):
        raise TypeError(f"{name}: example_weights must be a real array [B], got {x.dtype}.")
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype in (jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.result_type(float))  # exact counts: float32 up to 2^24
    return x


def loss_terms(w, loss_b):
    """``(w, w_b l_b)`` for the per-example losses ``loss_b``: an example of weight 0
    whose loss is not finite adds 0, and from here on its weight has no derivative (the
    engine gave it none: `differentiable`)."""
    bad = (w == 0) & ~jnp.isfinite(loss_b)
    w = jnp.where(bad, jax.lax.stop_gradient(w), w)
    return w, w.astype(loss_b.dtype) * jnp.where(bad, jnp.zeros((), loss_b.dtype), loss_b)


def weightless_zero(v, w):
    """Per-example values ``v [B, ...]`` reading 0 for the examples of weight 0."""
    keep = (w > 0).reshape((-1,) + (1,) * (jnp.ndim(v) - 1))
    return jnp.where(keep, v, jnp.zeros((), v.dtype))


def invalid(w):
    """A traced flag: some weight is negative, NaN or infinite."""
    return ~jnp.all(jnp.isfinite(w) & (w >= 0))


def poison(tree, bad):
    """Every floating leaf of ``tree`` NaN where ``bad`` (traced weights that would raise
    when concrete): a wrong weight never gives a number."""

    def one(x):
        if x is None or not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return x
        return jnp.where(bad, jnp.asarray(jnp.nan, jnp.result_type(x)), x)

    return jax.tree.map(one, tree)


class WeightSummary:
    """The example weights of several batches, summarised in a fixed shape (what
    `jaxpr_surgery.optim.accumulate` keeps of its micro-batches' weights): their total
    ``W``, the sum of their squares and the largest. A statistic whose ``finalize`` reads
    its ``weights`` only through `effective_size` and `max_weight` declares
    ``weight_summary = True``, and may then be given one in place of the weights."""

    def __init__(self, total, sum_sq, largest):
        self.total, self.sum_sq, self.largest = total, sum_sq, largest

    def __repr__(self):
        return f"WeightSummary(total={self.total}, sum_sq={self.sum_sq}, max={self.largest})"


jax.tree_util.register_pytree_node(
    WeightSummary,
    lambda s: ((s.total, s.sum_sq, s.largest), None),
    lambda _, c: WeightSummary(*c),
)


def effective_size(weights, count):
    """Kish's effective number of examples ``W^2 / sum_b w_b^2`` (the variance of the
    weighted mean is ``sigma^2 / B_eff``); ``count`` without weights. ``weights``: an
    array ``[B]`` or a `WeightSummary`."""
    if weights is None:
        return count
    if isinstance(weights, WeightSummary):
        dt = jnp.result_type(jnp.float32, weights.total)
        return jnp.square(weights.total.astype(dt)) / weights.sum_sq.astype(dt)
    w = weights.astype(jnp.result_type(jnp.float32, weights))
    return jnp.square(jnp.sum(w)) / jnp.sum(jnp.square(w))


def max_weight(weights):
    """The largest example weight (1 without weights); ``weights`` as `effective_size`'s."""
    if weights is None:
        return jnp.ones((), jnp.result_type(float))
    if isinstance(weights, WeightSummary):
        return weights.largest
    return jnp.max(weights)


# --------------------------------------------------------------------------- #
# Derivatives through weighted statistics
# --------------------------------------------------------------------------- #
# True while the engine traces the derivative of a weighted call (`differentiable`):
# an example of weight 0 whose inputs and cotangents at a layer are finite is then
# read as it is (its weight 0 removes its value; the derivative in its weight needs
# its gradient), and only one that is not finite there reads as zeros.
_OPEN = contextvars.ContextVar("jaxpr_surgery_open_weight_zero", default=False)


def is_open():
    """Whether the engine is tracing the derivative of a weighted call: examples of
    weight 0 that are finite take part (weighted by 0), so that the derivative with
    respect to their weights is exact (`kept`)."""
    return _OPEN.get()


@contextlib.contextmanager
def opened():
    """Within: `is_open` (merges and shifts keep the raw sums of parts of weight 0)."""
    token = _OPEN.set(True)
    try:
        yield
    finally:
        _OPEN.reset(token)


def kept(w, rows=()):
    """``[B]`` bool: the examples read as they are, where ``w [B]`` are their weights and
    ``rows`` the arrays ``[B, ...]`` they are read from (the others read as zeros).

    Outside derivatives: those of positive weight (a padded example's NaN never enters
    a value). Within them (`is_open`): also those of weight 0 whose ``rows`` are all
    finite, whose gradients the derivatives in their weights need (their value, times
    the weight 0, adds exact zeros)."""
    keep = w > 0
    if not is_open():
        return keep
    for x in rows:
        fin = jnp.isfinite(x).reshape(x.shape[0], -1)
        keep = keep | jnp.all(fin, axis=1)
    return keep


def live(w):
    """The examples whose per-example values are kept (`norms.live_examples`): those of
    positive weight, or every one within derivatives (a weight-0 example's norm then
    enters its clip factor, whose derivative in its weight needs it exact)."""
    return None if is_open() else w > 0


def differentiable(evaluate, diff, ex, other, consts, w):
    """``evaluate(diff, ex, other, consts, w) -> (values, loss_b, aux)`` (a weighted
    call of the engine on the per-example leaves ``ex [B, ...]``), with derivatives that
    no example of weight 0 spoils:

    * an example of weight 0 whose loss is not finite (a token mean over no tokens: NaN)
      is replaced, for the derivatives, by a copy of an example of finite loss (the
      "double where" on the examples: its NaN never enters a forward or backward pass
      that is differentiated, whose statistics it leaves unchanged since its weight is
      0). Its own derivatives (in its weight, its data, its loss and aux) are 0;
    * every other example of weight 0 is read as it is (`kept`) where the weights are
      differentiated, so that the derivative in its weight is exact,
      ``d mean / d w_k = (g_k - mean) / W`` (its value, times 0, adds exact zeros).

    Every traced input is an argument (``consts``: the loss jaxpr's constants): a
    custom_jvp cannot differentiate what its function closes over. The value is that of
    ``evaluate``; derivatives cost one more forward pass (the examples' losses, to find
    those not finite). The caller gives the weights of those examples no derivative in
    what it computes from them (`loss_terms`)."""

    @jax.custom_jvp
    def call(diff, ex, other, consts, w):
        return evaluate(diff, ex, other, consts, w)

    def rule(primals, tangents):
        diff, ex, other, consts, w = primals
        # the examples' losses (only the forward pass of this call runs: the rest is unused)
        _, loss_b, aux = evaluate(diff, ex, other, consts, w)
        bad = (w == 0) & ~jnp.isfinite(loss_b)
        # their stand-in: the first example of finite loss, of positive weight if any
        ok = jnp.isfinite(loss_b)
        j = jnp.where(jnp.any(ok & (w > 0)), jnp.argmax(ok & (w > 0)), jnp.argmax(ok))

        def rows(x, y):  # x with y at the bad examples
            return jnp.where(bad.reshape((-1,) + (1,) * (jnp.ndim(x) - 1)), y, x)

        def no_tangent(t):  # (none for the bad examples)
            if isinstance(t, SymbolicZero) or t.dtype == jax.dtypes.float0:
                return t
            return rows(t, jnp.zeros((), t.dtype))

        args = [diff, [rows(x, x[j][None]) for x in ex], other, consts, w]
        ts = list(tangents)
        ts[1] = [no_tangent(t) for t in ts[1]]
        ts[4] = no_tangent(ts[4])
        is_zero = lambda t: isinstance(t, SymbolicZero)  # noqa: E731
        flat_args, tree = jax.tree.flatten(args)
        flat_ts = jax.tree.leaves(ts, is_leaf=is_zero)
        assert len(flat_ts) == len(flat_args)
        moving = [i for i, t in enumerate(flat_ts) if not is_zero(t)]

        def f(*xs):
            full = list(flat_args)
            for i, x in zip(moving, xs):
                full[i] = x
            return evaluate(*jax.tree.unflatten(tree, full))

        token = _OPEN.set(not is_zero(ts[4]))  # (derivatives in the weights: `kept`)
        try:
            (values, _, _), (dvalues, dloss, daux) = jax.jvp(
                f, [flat_args[i] for i in moving], [flat_ts[i] for i in moving])
        finally:
            _OPEN.reset(token)
        return (values, loss_b, aux), (dvalues, no_tangent(dloss),
                                       jax.tree.map(no_tangent, daux))

    call.defjvp(rule, symbolic_zeros=True)
    return call(diff, ex, other, consts, w)

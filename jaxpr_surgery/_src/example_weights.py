"""``example_weights`` and ``is_padding_example``: the reserved keyword arguments of the
functions `per_example_stat` returns (never passed to the loss).

With weights ``w_b >= 0`` every statistic is the weighted one over the examples
(frequency weights: a weight 2 counts an example twice, a weight 0 removes it exactly),
``W = sum_b w_b`` taking the place of the number of examples. The engine carries them
through every route (`stats.Weighted`, `engine.run`); this module reads and checks them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def check_concrete(spec, name, ddofs=(), all_zero_ok=False):
    """Raises on bad concrete weights: negative, NaN or infinite, all zero, or a total
    weight not above a statistic's ``ddof`` (its estimate divides by ``W - ddof``).
    Traced weights are checked where the results are formed (`poison`)."""
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
    elif not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
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
            raise ValueError(
                f"{name}: every example has weight 0 ({kind}): no example is left to take "
                "statistics of. Skip the call for an all-padding batch."
            )
        for stat_name, ddof in ddofs:
            if W <= ddof:
                raise ValueError(
                    f"{name}: {stat_name}(ddof={ddof}) divides by W - ddof, but the examples' "
                    f"total weight is W = {W:g}: give more weight (examples) or ddof=0."
                )


def as_weights(spec, B, name):
    """The weights as a float array ``[B]`` (``B``: the examples of this call, on this
    device under ``axis_name``)."""
    kind, value = spec
    x = jnp.asarray(value)
    if x.shape != (B,):
        what = "is_padding_example" if kind == PADDING else "example_weights"
        raise ValueError(
            f"{name}: {what} must have shape ({B},), one entry per example of the batch "
            f"(axis 0 of the batch leaves{', on this device' if _is_traced(value) else ''}), "
            f"got shape {x.shape}."
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


def effective_size(weights, count):
    """Kish's effective number of examples ``W^2 / sum_b w_b^2`` (the variance of the
    weighted mean is ``sigma^2 / B_eff``); ``count`` without weights."""
    if weights is None:
        return count
    w = weights.astype(jnp.result_type(jnp.float32, weights))
    return jnp.square(jnp.sum(w)) / jnp.sum(jnp.square(w))

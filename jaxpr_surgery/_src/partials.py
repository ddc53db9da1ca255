"""Partials: the statistics of several calls, merged exactly.

A `Partial` holds what `per_example_stat` computes before any statistic's
``finalize``: every reduction's value per differentiated leaf (`reductions.py`), the
number of examples and their total weight, with the request (the statistics, their
reductions, the tree of the result and the layout of the parameters) as static data.
Two partials merge with each reduction's own `Reduction.merge` (the one rule for two
disjoint sets of examples: sums add, centred moments by Chan's rule, per-example
values concatenate), so `finalize_partial` of merged partials is what
`per_example_stat` returns on the concatenated batches. Nothing here knows a
statistic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import api, arguments
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src.fn_equality import equal_as_bool as _equal
from jaxpr_surgery._src.stats import same_statistic

PyTree = Any

__all__ = ["Partial", "per_example_partial", "merge_partials", "finalize_partial"]


# --------------------------------------------------------------------------- #
# The static part: the request and the parameters' layout
# --------------------------------------------------------------------------- #
def _short(text: str, n: int = 240) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    """The static data of a partial (its pytree aux data): the flattened request
    (`arguments.flatten_stats`) and the `arguments.LeafLayout` of the differentiated arguments.

    Equal for two calls of one request on parameters of one layout, also when the
    statistics were built afresh (``js.optim.stat_request`` inside a step), so such
    partials have one treedef (a ``lax.scan`` carry, an optimizer state)."""

    stats: tuple
    stat_tree: Any
    reqs: tuple
    reductions: tuple
    layout: arguments.LeafLayout

    @property
    def flat(self):
        return list(self.stats), self.stat_tree, list(self.reqs), list(self.reductions)

    def describe(self) -> str:
        return _short(str(jax.tree.unflatten(self.stat_tree, [repr(s) for s in self.stats])))

    def mismatch(self, other: _Spec) -> str | None:
        """Why ``other``'s partials cannot merge with this one's (None: they can)."""
        if self is other:
            return None
        if self.layout != other.layout:
            a, b = self.layout, other.layout
            if a.tree != b.tree or a.is_arr != b.is_arr:
                what = (f"parameters of another structure ({_short(str(b.tree))} instead of "
                        f"{_short(str(a.tree))})")
            else:
                k = next(i for i in range(len(a.shapes))
                         if (a.shapes[i], a.dtypes[i]) != (b.shapes[i], b.dtypes[i]))
                leaf = a.paths[k] if k < len(a.paths) else f"#{k}"
                what = (f"parameters of other shapes or dtypes (leaf {leaf}: "
                        f"{b.dtypes[k]}{list(b.shapes[k])} instead of "
                        f"{a.dtypes[k]}{list(a.shapes[k])})")
            return f"was computed for {what}"
        if (self.stat_tree != other.stat_tree or len(self.stats) != len(other.stats)
                or not all(same_statistic(x, y) for x, y in zip(self.stats, other.stats))):
            return (f"holds other statistics ({other.describe()}) than the first "
                    f"({self.describe()})")
        if len(self.reductions) != len(other.reductions) or not all(
            x is y or _equal(x, y) for x, y in zip(self.reductions, other.reductions)
        ):
            return (f"holds other reductions ({[r.describe() for r in other.reductions]}) than "
                    f"the first ({[r.describe() for r in self.reductions]})")
        return None

    def __eq__(self, other):
        return isinstance(other, _Spec) and self.mismatch(other) is None

    def __hash__(self):
        return hash((self.stat_tree, tuple(type(s) for s in self.stats), self.layout))


# --------------------------------------------------------------------------- #
# The partial
# --------------------------------------------------------------------------- #
class Partial:
    """The statistics of some examples before they are finalized: a pytree.

    Built by `per_example_partial`, merged by `merge_partials` and turned into what
    `per_example_stat` returns by `finalize_partial`. Its leaves are arrays; the request
    (statistics, reductions, the tree of the result) and the layout of the parameters
    are its static data, so two partials of one request on parameters of one structure,
    shapes and dtypes have the same treedef: they pass through ``jax.jit``, ride in a
    ``lax.scan`` carry or an optimizer state, and ``jax.tree.map`` reaches their arrays.

    Attributes:
      num_examples: the number of examples ``n`` the partial holds (int32 scalar;
        with ``axis_name``, over every device).
      total_weight: the total weight ``w`` of those examples, the count every merge
        and ``finalize`` receives (a float scalar: float64 where the values are,
        else float32). Without example weights it equals ``num_examples``.
      example_weights: the per-example weights, concatenated by merges like other
        per-example values, or None (every example weighs 1).
      statistics: the statistic (or pytree of statistics) requested.
      per_example: whether the partial holds per-example values (``sq_norms``,
        ``norms``, per-example dots, the norms of ``norm_quantiles``): their arrays
        ``[n]`` grow with every merge, so such a partial cannot be a fixed-shape
        ``lax.scan`` carry.
    """

    __slots__ = ("_spec", "_values", "_whole", "num_examples", "total_weight",
                 "example_weights")

    def __init__(self, spec, values, whole, num_examples, total_weight, example_weights=None):
        self._spec = spec
        self._values = values  # reduction index -> tuple per differentiated leaf
        self._whole = whole  # with axis_name: {reduction index: whole batch's [N] values}
        self.num_examples = num_examples
        self.total_weight = total_weight
        self.example_weights = example_weights

    @property
    def statistics(self) -> PyTree:
        return jax.tree.unflatten(self._spec.stat_tree, list(self._spec.stats))

    @property
    def per_example(self) -> bool:
        return (self.example_weights is not None or bool(self._whole)
                or any(r.per_example for r in self._spec.reductions))

    def _children_with_keys(self):
        K = jax.tree_util.GetAttrKey
        return (
            (K("values"), self._values),
            (K("whole_batch_values"), self._whole),
            (K("num_examples"), self.num_examples),
            (K("total_weight"), self.total_weight),
            (K("example_weights"), self.example_weights),
        )

    def __repr__(self):
        def show(x):
            try:
                return repr(np.asarray(x).item())
            except Exception:  # noqa: BLE001 - traced or abstract
                return f"{getattr(x, 'dtype', '?')}{list(getattr(x, 'shape', ()))}"

        weights = ("None" if self.example_weights is None
                   else f"[{np.shape(self.example_weights)[0]}]")
        return (f"Partial({self._spec.describe()}, num_examples={show(self.num_examples)}, "
                f"total_weight={show(self.total_weight)}, example_weights={weights})")


def _flatten_with_keys(p: Partial):
    return p._children_with_keys(), p._spec


def _flatten(p: Partial):
    return [c for _, c in p._children_with_keys()], p._spec


def _unflatten(spec, children):
    p = object.__new__(Partial)
    (p._values, p._whole, p.num_examples, p.total_weight, p.example_weights) = children
    p._spec = spec
    return p


jax.tree_util.register_pytree_with_keys(Partial, _flatten_with_keys, _unflatten, _flatten)


def _float_dtypes(values):
    return [x.dtype for x in jax.tree.leaves(values) if jnp.issubdtype(x.dtype, jnp.floating)]


def weight_dtype(values):
    """The dtype of a partial's total weight: the widest of float32 and its values'."""
    return jnp.result_type(jnp.float32, *_float_dtypes(values))


def _count_dtype(values):
    """The dtype of the count ``finalize`` receives: the narrowest of the values' float
    dtypes (at least float32), so that no statistic's dtype is widened by it."""
    dts = [d for d in _float_dtypes(values) if jnp.dtype(d).itemsize >= 4]
    return min(dts, key=lambda d: jnp.dtype(d).itemsize) if dts else jnp.dtype(jnp.float32)


def from_reduced(flat, layout, red: api.Reduced) -> Partial:
    """The partial of one call (`api.reduce_call`'s values)."""
    stats, tree, reqs, reductions = flat
    values = tuple(tuple(red.values[j]) for j in range(len(reductions)))
    whole = {j: tuple(v) for j, v in red.whole.items()}
    if red.bad is not None:  # bad traced weights: every value NaN (example_weights.py)
        values, whole = ew.poison((values, whole), red.bad)
    spec = _Spec(tuple(stats), tree, tuple(reqs), tuple(reductions), layout)
    return Partial(spec, values, whole, jnp.asarray(red.num_examples).astype(jnp.int32),
                   jnp.asarray(red.count).astype(weight_dtype(values)), red.weights)


# --------------------------------------------------------------------------- #
# Merging and finalizing
# --------------------------------------------------------------------------- #
def merge_value(r, a, wa, b, wb):
    """``r.merge`` of two values of one leaf, the counts (total weights) in the values'
    own dtype (a float32 leaf's counts in float32, a float64 leaf's in float64)."""
    leaves = jax.tree.leaves(a)
    if not leaves:  # a value without arrays (kron_moments of a 0-d leaf: ())
        return r.merge(a, wa, b, wb)
    dt = jnp.result_type(leaves[0])
    if jnp.issubdtype(dt, jnp.floating):
        wa, wb = jnp.asarray(wa).astype(dt), jnp.asarray(wb).astype(dt)
    return r.merge(a, wa, b, wb)


def merge_values(reductions, a, wa, b, wb):
    """Per reduction and leaf, the values of two disjoint sets of examples merged."""
    return tuple(
        tuple(merge_value(r, va, wa, vb, wb) for va, vb in zip(la, lb))
        for r, la, lb in zip(reductions, a, b)
    )


def _check_compatible(a: Partial, b: Partial, i: int, name: str):
    msg = a._spec.mismatch(b._spec)
    if msg is not None:
        raise ValueError(
            f"{name}: partial {i} {msg}. Only partials of one request merge: the same "
            "statistics (js.per_example_partial(fn, stat) with an equal stat) on parameters "
            "of one structure, shapes and dtypes."
        )
    if (a.example_weights is None) != (b.example_weights is None):
        raise ValueError(
            f"{name}: partial {i} "
            + ("has" if b.example_weights is not None else "has no")
            + " example_weights and the first "
            + ("has" if a.example_weights is not None else "has none")
            + ". Pass example_weights to every call or to none (weights of 1 are the "
            "unweighted statistics)."
        )
    if set(a._whole) != set(b._whole):
        raise ValueError(
            f"{name}: partial {i} was computed "
            + ("with" if b._whole else "without")
            + " axis_name and the first "
            + ("with" if a._whole else "without")
            + ": whole-batch per-example values (norm_quantiles, gradient_diversity across "
            "devices) exist only with axis_name (or example_weights). Compute every partial "
            "with the same axis_name."
        )


def _check_partial(p, i, name):
    if not isinstance(p, Partial):
        raise TypeError(
            f"{name}: argument {i} is of type {type(p).__name__}, not a partial. Build partials "
            "with js.per_example_partial(fn, stat)(params, batch)."
        )


def _merge_two(a: Partial, b: Partial) -> Partial:
    reductions = a._spec.reductions
    wa, wb = a.total_weight, b.total_weight
    values = merge_values(reductions, a._values, wa, b._values, wb)
    whole = {
        j: tuple(merge_value(reductions[j], x, wa, y, wb) for x, y in zip(v, b._whole[j]))
        for j, v in a._whole.items()
    }
    weights = None
    if a.example_weights is not None:
        weights = jnp.concatenate([a.example_weights, b.example_weights], axis=0)
    return Partial(a._spec, values, whole, a.num_examples + b.num_examples, wa + wb, weights)


def merge_partials(*partials: Partial) -> Partial:
    r"""Merges partials of disjoint sets of examples into the partial of their union.

    Every reduction merges by its own rule (`jaxpr_surgery.stats.Reduction.merge`):
    sums add, centred moments combine by Chan's rule (exact, no cancellation),
    per-example values (norms, dots) concatenate in the order of the arguments.
    `finalize_partial` of the result is what `per_example_stat` returns on the
    concatenated batches. Works eagerly, under ``jit`` and in ``lax.scan``.

    Args:
      *partials: one or more partials of one request (`per_example_partial` with equal
        statistics, on parameters of one structure, shapes and dtypes).

    Returns:
      A `Partial` with the same treedef as its arguments (per-example arrays longer).

    Raises:
      TypeError: if an argument is not a partial, or none is given.
      ValueError: if the partials hold other statistics, were computed for parameters
        of another structure, shapes or dtypes, one with and one without
        ``axis_name`` or example weights; the message says which.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> f = js.per_example_partial(loss, js.stats.variance())
      >>> a = f(jnp.zeros(2), {k: v[:1] for k, v in batch.items()})
      >>> b = f(jnp.zeros(2), {k: v[1:] for k, v in batch.items()})
      >>> print(np.asarray(js.finalize_partial(js.merge_partials(a, b))).round(4))
      [9.3333 9.3333]
    """
    name = "merge_partials"
    if not partials:
        raise TypeError(f"{name}: expected one or more partials, got none.")
    for i, p in enumerate(partials):
        _check_partial(p, i, name)
    out = partials[0]
    for i, p in enumerate(partials[1:], 1):
        _check_compatible(partials[0], p, i, name)
        out = _merge_two(out, p)
    return out


def finalize_partial(partial: Partial) -> PyTree:
    r"""What `per_example_stat` returns on the examples of a partial.

    Every statistic's ``finalize`` of the partial's values, with its total weight as
    the count: for merged partials, the statistics of the concatenated batches (the
    variance by Chan's rule, the noise scale, kurtosis, clipped sums, Kronecker
    moments, dots; per-example outputs such as ``sq_norms`` concatenated in the order
    of the merges; ``norm_quantiles`` and ``gradient_diversity`` over every example).
    With ``axis_name``, call it where the partial was made (inside the mapped function)
    or on a partial of whole-batch values: it is the same on every device except for
    per-example outputs, which stay with their device.

    Args:
      partial: a `Partial` (`per_example_partial`, `merge_partials`).

    Returns:
      The statistics, in the structure of the request.

    Raises:
      TypeError: if ``partial`` is not a partial.
      ValueError: where a statistic is undefined for the count (``variance`` with
        ``total_weight <= ddof``) and the count is concrete.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> f = js.per_example_partial(loss, {"m": js.stats.mean(), "n": js.stats.norms()})
      >>> parts = [f(jnp.zeros(2), {k: v[i:i + 1] for k, v in batch.items()}) for i in range(3)]
      >>> out = js.finalize_partial(js.merge_partials(*parts))
      >>> print(np.asarray(out["m"]).round(4), np.asarray(out["n"]).round(4))
      [-2.6667 -3.3333] [2.     4.     8.4853]
    """
    _check_partial(partial, 0, "finalize_partial")
    spec = partial._spec
    count = jnp.asarray(partial.total_weight).astype(_count_dtype(partial._values))
    whole = {j: list(v) for j, v in partial._whole.items()}
    return api.finalize_values(spec.layout, spec.flat, dict(enumerate(partial._values)),
                               whole, count, partial.example_weights)


# --------------------------------------------------------------------------- #
# The entry point
# --------------------------------------------------------------------------- #
def per_example_partial(
    fn: Callable[..., Any],
    stat: PyTree,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    has_aux: bool = False,
    chunk_size: int | str | None = "auto",
    strict: bool = False,
    axis_name: Any = None,
    memory_budget_bytes: int | None = None,
    check: bool = True,
) -> Callable[..., Partial]:
    r"""Like `per_example_stat`, but returns a *partial*: the statistics before they are
    finalized, to merge with those of other batches.

    ``js.per_example_partial(fn, stat)(params, batch)`` computes exactly what
    ``js.per_example_stat(fn, stat)(params, batch)`` computes (one forward and one
    backward pass, every option the same), and stops before the statistics'
    ``finalize``: the `Partial` holds every reduction's value per parameter leaf (sums,
    centred moments, per-example norms, ...), the number of examples and their total
    weight. `merge_partials` merges any number of them exactly and `finalize_partial`
    gives the statistics of all their examples: for micro-batches ``b1, b2, b3``,

        finalize_partial(merge_partials(p(b1), p(b2), p(b3)))
          == per_example_stat(fn, stat)(params, concatenate(b1, b2, b3))

    up to rounding (variances merge by Chan's rule, not as raw moments). A partial is
    a pytree whose static data is the request, so it passes through ``jit``, rides in
    a ``lax.scan`` carry over micro-batches and in an optimizer state
    (`jaxpr_surgery.optim.accumulate`). Per-example values (``sq_norms``, ``norms``,
    per-example dots, ``norm_quantiles``' norms) make its arrays grow with every
    merge: such a partial merges under ``jit`` but cannot be a ``scan`` carry.

    With ``axis_name`` (inside ``pmap``/``shard_map``, the batch split over the axis)
    every device holds the partial of the whole batch, combined across devices like
    `per_example_stat`'s statistics; per-example values stay with the device holding
    the example.

    Args:
      fn: as in `per_example_stat`.
      stat: as in `per_example_stat`.
      argnums: as in `per_example_stat`.
      batch_argnums: as in `per_example_stat`.
      keep_batch_dim: as in `per_example_stat`.
      has_aux: as in `per_example_stat` (``aux`` is computed and dropped).
      chunk_size: as in `per_example_stat`.
      strict: as in `per_example_stat`.
      axis_name: as in `per_example_stat`.
      memory_budget_bytes: as in `per_example_stat`.
      check: as in `per_example_stat`.

    Returns:
      A function with the signature of ``fn`` returning a `Partial`.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> stat = (js.stats.mean(), js.stats.variance())
      >>> f = jax.jit(js.per_example_partial(loss, stat))
      >>> a = f(jnp.zeros(2), {k: v[:2] for k, v in batch.items()})
      >>> b = f(jnp.zeros(2), {k: v[2:] for k, v in batch.items()})
      >>> mean, var = js.finalize_partial(js.merge_partials(a, b))
      >>> print(np.asarray(mean).round(4), np.asarray(var).round(4))
      [-2.6667 -3.3333] [9.3333 9.3333]
      >>> int(js.merge_partials(a, b).num_examples)
      3
    """
    opts = api.make_options(argnums, batch_argnums, keep_batch_dim, has_aux, chunk_size,
                            strict, axis_name, memory_budget_bytes, check)
    name = "per_example_partial"
    arguments.flatten_stats(stat)  # validate early
    if not callable(fn):
        raise TypeError(f"{name}: fn must be callable, got {fn!r}.")

    def body(prep, spec):
        flat = arguments.flatten_stats(stat)
        return from_reduced(flat, prep.layout(), api.reduce_call(prep, flat, prep.opts, name, spec))

    return api.entry(fn, opts, name, body, all_zero_ok=True)

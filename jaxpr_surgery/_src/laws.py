"""The laws of the `Reduction` protocol, checked on a reduction (`check_reduction`): what
the engine assumes of every reduction, so that one that breaks a law is caught here, by
name, rather than as a statistic off through tiles, chunks or devices.

Each law compares two ways to the same value on random per-example gradients: the value
over every example (`Reduction.from_examples`) against the value through the method under
test (a merge of parts, a running accumulator over tiles, a combination across a mapped
axis of devices, copies of a share), within a tolerance of the dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import reductions as R
from jaxpr_surgery._src.check import _Tolerance

_NAME = "check_reduction"
_AXIS = "jaxpr_surgery:check_reduction"


def check_reduction(reduction, shape=(4, 3), B=8, *, parts=4, dtype=None, seed=0,
                    rtol=None, atol=None) -> list[str]:
    r"""Checks that a `Reduction` keeps the laws the engine relies on; raises
    ``ValueError`` naming the method whose law breaks.

    On random per-example gradients ``G [B, *shape]`` (an offset from zero, a few exact
    ties), the value over all examples (``from_examples(G)``) must equal:

    * ``aval``: the value's structure, shapes and dtypes;
    * ``merge``: the merge of the values of ``G``'s first ``k`` and last ``B - k``
      examples, for several ``k``;
    * ``add_examples`` (with ``empty``, ``start_examples``, ``accumulate``,
      ``recentre``, ``finish``): a running accumulator over tiles of examples, as a tile
      loop and the chunks of a batch run it;
    * ``zeros``: the value of ``B`` zero gradients (against ``from_examples`` of zeros);
    * ``combine_axis``: every device's value, the batch split over ``parts`` devices of a
      mapped axis (a per-example value: each device's own examples');
    * ``combined_share`` (where the reduction defines it): each device's share is the same
      on every device, and their combination (``combine_axis``, ``combine_copies``) is the
      whole batch's value;
    * ``combine_copies`` (where defined): ``parts`` copies of one value, merged;
    * ``from_weighted`` (where defined): integer weights count an example that many
      times (the value of ``G`` with each example repeated).

    Args:
      reduction: the `Reduction` to check.
      shape: the shape of one example's gradient (of a leaf).
      B: the number of examples (a multiple of ``parts``).
      parts: the devices the batch is split over for the laws across devices.
      dtype: the gradients' dtype; ``None``: float64 where ``jax_enable_x64`` is on,
        else float32.
      seed: the random gradients' seed.
      rtol, atol: tolerances relative to (and beside) each value's largest entry;
        ``None``: ``1e-9`` / ``1e-12`` in float64, ``1e-4`` / ``1e-6`` in float32.

    Returns:
      The names of the laws checked (those the reduction defines).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxpr_surgery as js
      >>> class MaxAbs(js.stats.Reduction):
      ...     def aval(self, shape, dtype, B):
      ...         return jax.ShapeDtypeStruct(tuple(shape), dtype)
      ...     def from_examples(self, G):
      ...         return jnp.max(jnp.abs(G), axis=0)
      ...     def merge(self, a, na, b, nb):
      ...         return jnp.maximum(a, b)
      >>> js.extend.check_reduction(MaxAbs())
      ['aval', 'merge', 'add_examples', 'zeros', 'combine_axis']
    """
    if not isinstance(reduction, R.Reduction):
        raise TypeError(f"{_NAME}: reduction must be a js.stats.Reduction, got "
                        f"{type(reduction).__name__}.")
    if B < 2 or B % parts or parts < 2:
        raise ValueError(f"{_NAME}: B={B} must be a multiple of parts={parts} >= 2.")
    dtype = jnp.dtype(dtype or (jnp.float64 if jax.config.jax_enable_x64 else jnp.float32))
    tol = _Tolerance.for_dtype(dtype, rtol, atol)
    G = _gradients(shape, B, dtype, seed)
    r, shape = reduction, tuple(shape)
    whole = r.from_examples(G)
    check = _Checker(r, tol)

    avals = r.aval(shape, dtype, B)
    got = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), whole)
    want = jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), avals)
    if got != want:
        raise ValueError(f"{_NAME}: {r.describe()}.aval gives {want} for shape={shape}, "
                         f"B={B}, dtype={dtype}, but from_examples gives {got}.")
    check.laws.append("aval")

    for k in sorted({1, B // 2, B - 1}):
        check("merge", r.merge(r.from_examples(G[:k]), k, r.from_examples(G[k:]), B - k),
              whole, f"the first {k} examples' value merged with the last {B - k}'s")

    acc, n, first = r.empty(shape, dtype), 0, True
    for stop in _tile_stops(B):
        tile = G[n:stop]
        acc = (r.start_examples if first else r.add_examples)(acc, n, tile)
        n, first = stop, False
        if r.shift_bounded:
            acc = r.recentre(acc, n)
    check("add_examples", r.finish(acc, B), whole,
          "a running accumulator over tiles of examples (empty, start_examples, "
          "add_examples, accumulate, finish)")
    acc = r.add_examples(None, 0, G[:1])
    check("add_examples", r.finish(r.add_examples(acc, 1, G[1:]), B), whole,
          "a running accumulator started from no accumulator (acc=None)")

    check("zeros", r.zeros(shape, dtype, B), r.from_examples(jnp.zeros_like(G)),
          "the value of B zero gradients")

    n_local = B // parts
    split = G.reshape((parts, n_local) + shape)
    own = jax.vmap(r.from_examples)(split)

    def combined(v):
        return r.combine_axis(v, n_local, B, _AXIS)

    everyone = jax.vmap(combined, axis_name=_AXIS)(own)
    for d in range(parts):
        want = (jax.tree.map(lambda x, d=d: x[d], own) if r.per_example else whole)
        check("combine_axis", jax.tree.map(lambda x, d=d: x[d], everyone), want,
              f"device {d}'s value, the batch split over {parts} devices")

    def share(v):
        return R.combined_share(r, v, n_local, _AXIS, parts)

    shares = jax.vmap(share, axis_name=_AXIS)(own)
    if shares is not None:
        first = jax.tree.map(lambda x: x[0], shares)
        for d in range(1, parts):
            check("combined_share", jax.tree.map(lambda x, d=d: x[d], shares), first,
                  f"device {d}'s share against device 0's (a share is the same on every "
                  "device)")
        again = jax.vmap(combined, axis_name=_AXIS)(shares)
        check("combined_share", jax.tree.map(lambda x: x[0], again), whole,
              "combine_axis of every device's share")
        copies = R.combined_copies(r, first, parts)
        if copies is not None:
            check("combined_share", copies, whole, "combine_copies of a share")

    one = r.from_examples(G[:n_local])
    copies = R.combined_copies(r, one, parts)
    if copies is not None:
        want, m = one, n_local
        for _ in range(parts - 1):
            want, m = r.merge(want, m, one, n_local), m + n_local
        check("combine_copies", copies, want, f"{parts} copies of one value, merged")

    w = _weights(B, seed)
    Gw = G * (w > 0).reshape((B,) + (1,) * len(shape)).astype(dtype)
    try:
        weighted = r.from_weighted(Gw, w.astype(dtype))
    except NotImplementedError:
        weighted = None
    if weighted is not None and not r.per_example:
        check("from_weighted", weighted, r.from_examples(jnp.repeat(Gw, w, axis=0)),
              "integer example weights against the examples repeated as many times")
    return check.laws


class _Checker:
    def __init__(self, r, tol):
        self.r, self.tol, self.laws = r, tol, []

    def __call__(self, law, got, want, what):
        got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
        if len(got_l) != len(want_l) or jax.tree.structure(got) != jax.tree.structure(want):
            raise ValueError(f"{_NAME}: {self.r.describe()}.{law}: {what} has the structure "
                             f"{jax.tree.structure(got)}, the whole batch's value "
                             f"{jax.tree.structure(want)}.")
        for i, (g, x) in enumerate(zip(got_l, want_l)):
            g, x = np.asarray(g, np.float64), np.asarray(x, np.float64)
            finite = np.isfinite(x)
            scale = float(np.max(np.abs(x[finite]))) if finite.any() else 0.0
            same_nonfinite = np.array_equal(np.isnan(g), np.isnan(x)) and np.array_equal(
                np.where(finite, 0, g), np.where(finite, 0, x))
            err = float(np.max(np.abs(g - x)[finite])) if finite.any() else 0.0
            if g.shape != x.shape or not same_nonfinite or not self.tol.close(err, 0, scale):
                where = f" (field {i})" if len(got_l) > 1 else ""
                raise ValueError(
                    f"{_NAME}: {self.r.describe()}.{law} breaks its law: {what} differs "
                    f"from the value over every example (from_examples){where} by up to "
                    f"{err:.3g} (values up to {scale:.3g}; rtol={self.tol.rtol}, "
                    f"atol={self.tol.atol}). Statistics through tiles, chunks or devices "
                    "would be off: fix " + law + " (docs/extending.md, Add a reduction).")
        if law not in self.laws:
            self.laws.append(law)


def _gradients(shape, B, dtype, seed):
    """``[B, *shape]`` normal, offset from zero, with two examples equal (ties)."""
    rng = np.random.default_rng(seed)
    G = rng.normal(size=(B,) + tuple(shape)) + 0.5
    G[-1] = G[0]
    return jnp.asarray(G, dtype)


def _weights(B, seed):
    """Integer frequency weights in 0..3, none all zero."""
    w = np.random.default_rng(seed + 1).integers(0, 4, size=B)
    w[0] = max(w[0], 1)
    return jnp.asarray(w)


def _tile_stops(B):
    """Uneven tiles: 1, 2, then 3 at a time (the last a remainder)."""
    stops, n, size = [], 0, 1
    while n < B:
        n = min(B, n + size)
        stops.append(n)
        size = min(size + 1, 3)
    return stops

"""Per-example inner products with a reference gradient (``per_example_dots``/``cosines``).

`DotWith` is, per leaf, the ``[B]`` array ``<g_b, r>`` for a reference ``r`` shaped
like the parameters (e.g. a large-batch gradient). It is linear in ``g_b``, so a leaf
with several sites (a tied embedding) adds its sites' parts. At dense and einsum
sites it is ``sum_n x_n^T R dy_n`` per example and at embeddings
``sum_t R[id_t] . dy_t``: a contraction with the site's inputs, no per-example
gradient. Elsewhere (generic sites, layers inside ``lax.scan``, reshaped views) it
comes from tiles of exact per-example gradients. Values are per example: they
concatenate across chunks and stay with the device holding the example.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.norms import combine_norms, materialised_norms


class _PerExampleDots(S.Reduction):
    """``[B]`` inner products of the examples' gradients with a reference: per example
    (concatenated across chunks, local across devices), linear in ``g_b`` (the layers
    of a scan over stacked layers add)."""

    per_example: ClassVar[bool] = True
    carries: ClassVar[bool] = False

    def aval(self, shape, dtype, B):
        return jax.ShapeDtypeStruct((B,), dtype)

    def merge(self, a, na, b, nb):
        return jnp.concatenate([a, b], axis=0)

    def zeros(self, shape, dtype, B):
        return jnp.zeros((B,), dtype)

    def to_leaf(self, value, site, B):
        return value.reshape((-1, B)).sum(0) if site.depth else value

    def combine_shards(self, value, axes):  # each shard's part of the inner product
        return jax.lax.psum(value, axes)


@dataclasses.dataclass(frozen=True, eq=False)
class DotWith(_PerExampleDots):
    """Per leaf, the ``[B]`` per-example inner products ``<g_b, reference>``.

    Two `DotWith` of the same reference object are computed once. The engine binds it
    to each leaf's part of the reference (`BoundDot`) before any site computes it.
    """

    reference: object

    def __eq__(self, other):
        return isinstance(other, DotWith) and other.reference is self.reference

    def __hash__(self):
        return hash(("dot", id(self.reference)))

    def from_examples(self, G):
        raise TypeError("DotWith is bound to each leaf's reference (BoundDot) first.")

    def direct_ok(self, site):
        return False  # bound per leaf after the backward pass (leaves.leaf_dots)

    def per_leaf(self, flatten, leaf_avals):
        return [BoundDot(ref) for ref in _reference_leaves(flatten, self.reference, leaf_avals)]


@dataclasses.dataclass(frozen=True, eq=False)
class BoundDot(_PerExampleDots):
    """`DotWith` of one leaf, bound to that leaf's reference array (engine-internal)."""

    ref: jax.Array

    def from_examples(self, G):
        return jnp.einsum("b...,...->b", G, self.ref.astype(G.dtype), precision="highest")


def _reference_leaves(flatten, reference, leaf_avals):
    """A reference as one array per differentiated leaf, shapes checked."""
    try:
        leaves = flatten(reference)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "per_example_dots/cosines(reference=...): the reference must have the structure of "
            f"the differentiated arguments (e.g. their jax.grad): {e}"
        ) from e
    out = []
    for k, (x, aval) in enumerate(zip(leaves, leaf_avals)):
        if x is None:
            x = jnp.zeros(aval.shape, S.acc_dtype_for(aval.dtype))
        if jnp.shape(x) != tuple(aval.shape):
            raise ValueError(
                f"per_example_dots/cosines(reference=...): leaf {k} of the reference has shape "
                f"{jnp.shape(x)}, the parameter has {tuple(aval.shape)}."
            )
        out.append(jnp.asarray(x))
    return out


def dense_dots(x, dy, ref_canon):
    """``<X_b^T DY_b, R>`` per example from canonical ``x [B,K,N,C]``, ``dy [B,K,N,F]``,
    ``R [K, C, F]``: ``sum_n (x_n R) . dy_n`` (the smaller side contracted first)."""
    C, F = ref_canon.shape[1:]
    if C <= F:
        xr = jnp.einsum("bknc,kcf->bknf", x, ref_canon, precision="highest")
        return jnp.einsum("bknf,bknf->b", xr, dy)
    rd = jnp.einsum("kcf,bknf->bknc", ref_canon, dy, precision="highest")
    return jnp.einsum("bknc,bknc->b", x, rd)


def _statistic_refs(reference):
    return [jnp.asarray(x) for x in jax.tree.leaves(reference)]


class _Dots(S.Statistic):
    _name = "per_example_dots"
    defined_when_empty = True  # (per-example: 0 at a padded example)

    def __init__(self, reference, per_leaf):
        self.reduction = DotWith(reference)
        self.per_leaf = per_leaf

    def reductions(self):
        return {"d": self.reduction}

    def finalize(self, values, count):
        tree = values["d"]
        if self.per_leaf:
            return tree
        leaves = jax.tree.leaves(tree)
        return sum(leaves[1:], leaves[0])


class _Cosines(S.Statistic):
    _name = "per_example_cosines"
    defined_when_empty = True  # (per-example: 0 at a padded example)

    def __init__(self, reference):
        self.reduction = DotWith(reference)

    def reductions(self):
        return {"d": self.reduction, "n": S.Norms()}

    def finalize(self, values, count):
        dots = jax.tree.leaves(values["d"])
        dot = sum(dots[1:], dots[0])
        # norms, not their squares: a float32 gradient of norm 5e19 has the square inf
        g = combine_norms(jnp.stack([x.astype(dot.dtype) for x in jax.tree.leaves(values["n"])]))
        refs = [x.astype(dot.dtype).ravel() for x in _statistic_refs(self.reduction.reference)]
        r = materialised_norms(jnp.concatenate(refs)[None])[0]
        den = g * r
        pos = den > 0
        return jnp.where(pos, dot / jnp.where(pos, den, 1), 0.0)


def _check_reference(reference, name):
    leaves = jax.tree.leaves(reference)
    if not leaves:
        raise ValueError(f"{name}(reference=...): the reference has no arrays: pass a pytree "
                         "shaped like the differentiated parameters (e.g. a jax.grad).")
    for x in leaves:
        if not hasattr(x, "shape") or not jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact):
            raise TypeError(f"{name}(reference=...): leaves must be float arrays shaped like "
                            f"the parameters, got {type(x).__name__}.")


def per_example_dots(reference, per_leaf: bool = False) -> S.Statistic:
    r"""Per-example inner products \(\langle g_b, r\rangle\) with a reference gradient.

    ``reference`` is a pytree shaped like the differentiated parameters (for example a
    large-batch gradient from ``jax.grad``): how much each example's gradient points
    along it. The result is an array ``[B]`` (summed over leaves), or with
    ``per_leaf=True`` a pytree like the parameters of ``[B]`` arrays. Dense, einsum and
    embedding layers contract the reference with the layer's inputs; no per-example
    gradient is formed there.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> # per-example gradients at w = 0: [-2, 0], [0, -4], [-6, -6]
      >>> ref = jnp.array([1.0, -1.0])
      >>> out = js.per_example_stat(loss, js.stats.per_example_dots(ref))(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [-2.  4.  0.]
    """
    _check_reference(reference, "per_example_dots")
    return _Dots(reference, bool(per_leaf))


def per_example_cosines(reference) -> S.Statistic:
    r"""Per-example cosine similarity \(\langle g_b, r\rangle / (\|g_b\|\,\|r\|)\), ``[B]``.

    The alignment of each example's gradient (over all parameters) with a reference
    gradient ``reference`` shaped like the parameters; 0 where either norm is 0.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
      ...          "y": jnp.array([1.0, 2.0, 3.0])}
      >>> ref = jnp.array([-1.0, -1.0])
      >>> out = js.per_example_stat(loss, js.stats.per_example_cosines(ref))(jnp.zeros(2), batch)
      >>> print(np.asarray(out, float).round(4))
      [0.7071 0.7071 1.    ]
    """
    _check_reference(reference, "per_example_cosines")
    return _Cosines(reference)

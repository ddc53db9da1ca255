"""The Kronecker moments' reduction (`KronSum`): per leaf axis, the sum over the examples
of each example's gradient unfolded along that axis times its transpose. Its fast
forms, from token grams, are in kron.py."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import views
from jaxpr_surgery._src.reductions import SDS, Reduction, _per_example


def kron_value_shapes(shape, r):
    return tuple((n, n) if n <= r.max_dim else (n,) for n in shape)


@dataclasses.dataclass(frozen=True)
class KronSum(Reduction):
    """Per leaf, a tuple over its axes ``j``: ``sum_b U_j(g_b) U_j(g_b)^T`` (an
    ``[n_j, n_j]`` matrix), or its diagonal ``[n_j]`` when ``n_j > max_dim``."""

    max_dim: int
    carries: ClassVar[bool] = False
    weight_degree: ClassVar[int] = 2

    def aval(self, shape, dtype, B):
        return tuple(SDS(s, dtype) for s in kron_value_shapes(shape, self))

    def from_examples(self, G):
        out = []
        for j in range(1, G.ndim):
            n = G.shape[j]
            # explicit sizes: a zero-size axis makes a -1 in reshape ambiguous
            rest = math.prod(G.shape[1:j] + G.shape[j + 1 :])
            U = jnp.moveaxis(G, j, 1).reshape(G.shape[0], n, rest)
            if n <= self.max_dim:
                out.append(jnp.einsum("bir,bjr->ij", U, U, precision="highest"))
            else:
                out.append(jnp.sum(jnp.square(U), axis=(0, 2)))
        return tuple(out)

    def from_weighted(self, G, w):  # sum_b w_b U U^T = sum_b (sqrt(w_b) U)(sqrt(w_b) U)^T
        return self.from_examples(G * jnp.sqrt(_per_example(w, G)))

    def merge(self, a, na, b, nb):
        return tuple(x + y for x, y in zip(a, b))

    def zeros(self, shape, dtype, B):
        return self.empty(shape, dtype)

    def combine_axis(self, value, n_local, N, axis_name):
        return jax.lax.psum(value, axis_name)

    def direct_ok(self, site):
        return views.leaf_map(site) is not None

    def combine_shards(self, value, axes):
        raise NotImplementedError(
            f"kron_moments: a parameter leaf is sharded over mesh axes {tuple(axes)} "
            "inside shard_map (tensor parallelism); its Kronecker moments would need "
            "cross-shard products. Compute them on replicated parameters, or request "
            "elementwise statistics (exact per shard) for sharded ones."
        )

    def to_leaf(self, value, site, B):
        """The view's moments on the leaf's axes; an axis the view slices gets its
        moments (or their diagonal) at the kept indices, zeros elsewhere (a zero
        gradient there; the other axes' moments sum over the kept elements alone)."""
        lm = views.leaf_map(site)
        shape = views.leaf_shape(site)
        out = [None] * len(value)
        for i, (m, start, stride) in enumerate(lm):
            n, N = site.view_shape[i], shape[m]
            x = value[i]
            if n != N:
                idx = start + stride * jnp.arange(n)
                if N > self.max_dim:
                    d = jnp.diagonal(x) if x.ndim == 2 else x
                    x = jnp.zeros((N,), x.dtype).at[idx].set(d)
                else:
                    x = jnp.zeros((N, N), x.dtype).at[idx[:, None], idx[None, :]].set(x)
            out[m] = x
        return tuple(out)

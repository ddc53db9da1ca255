"""A dense site's canonical layout (`canonical`: the view's contraction as ``[K, C]`` x
``[K, F]`` over ``N`` tokens, axes as `canon` reads them) and the numerics its kernel
shares with its fast rules: groups of raw sums, the products, Gram matrices.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src.norms import exponent, pow2


def pow2_scale(a):
    """``[B]``: per example of ``a [B, ...]`` the power of two ``2^e <= max |a_b| < 2^(e+1)``
    (1 where that is 0 or not finite): dividing by it is exact."""
    m = jnp.max(jnp.abs(jax.lax.stop_gradient(a)).reshape(a.shape[0], -1), axis=1)
    return pow2(exponent(m), m.dtype)


class FoldSide(enum.Enum):
    """The factor of a dense site's per-example gradients ``x^T dy`` that takes its
    weight's elementwise constant factors (`dense_fold_side`)."""

    X = enum.auto()
    DY = enum.auto()


def dense_fold_side(eqn, pos, scales):
    """Where a dense site folds its view's elementwise constant factors (`pre_scales`):
    `FoldSide.DY` when they vary along the weight's free (and dot batch) axes only,
    `FoldSide.X` along its contracted (and dot batch) axes only, else None. No factors:
    `FoldSide.DY`."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    wc, wb = (lc, lb) if pos == 0 else (rc, rb)
    varying = set().union(*(a for _, _, a in scales)) if scales else set()
    wc, wb = {int(i) for i in wc}, {int(i) for i in wb}
    rank = len(eqn.invars[pos].aval.shape)
    wf = set(range(rank)) - wc - wb
    if varying <= wf | wb:
        return FoldSide.DY
    if varying <= wc | wb:
        return FoldSide.X
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseLayout:
    """A dense-family site in the canonical layout (`canon`): each example's gradient
    is ``G = x^T dy`` per dot-batch index, ``x [K, N, C]`` and ``dy [K, N, F]``, and the
    weight's view, its axes taken in the order ``canon_w`` (dot-batch, contracted, free),
    is ``[K, C, F]`` once flattened.

    ``kdims``, ``cdims``, ``fdims``: the view's dot-batch, contracted and free axes'
    sizes, ``K``, ``C``, ``F`` their products, ``N`` the tokens (the data's free axes'
    product); ``canon_shape`` the view's shape in the order ``canon_w``, ``inv_w`` its
    inverse permutation. A ``dot_general`` site also has ``x_perm`` and ``dy_perm`` (the
    permutations of the data operand and the cotangent into ``[K, N, C]`` and
    ``[K, N, F]``) and ``x_pos`` (the data operand's position); `ConvLayout` and
    `ragged.RaggedLayout` add what their sites need."""

    kdims: tuple
    cdims: tuple
    fdims: tuple
    canon_w: tuple
    K: int
    C: int
    F: int
    N: int
    canon_shape: tuple
    inv_w: tuple
    x_perm: tuple | None = None
    dy_perm: tuple | None = None
    x_pos: int | None = None


def canon(site) -> DenseLayout:
    """The `DenseLayout` of a ``dot_general`` site."""
    eqn = site.eqn
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    p = site.param_pos
    x_op = eqn.invars[1 - p]
    w_shape = tuple(eqn.invars[p].aval.shape)
    x_shape = tuple(x_op.aval.shape)
    wc, xc = (lc, rc) if p == 0 else (rc, lc)
    wb, xb = (lb, rb) if p == 0 else (rb, lb)
    wc, xc, wb, xb = map(lambda t: tuple(int(i) for i in t), (wc, xc, wb, xb))
    wf = tuple(i for i in range(len(w_shape)) if i not in wc and i not in wb)
    xf = tuple(i for i in range(len(x_shape)) if i not in xc and i not in xb)
    K = math.prod(w_shape[i] for i in wb)
    C = math.prod(w_shape[i] for i in wc)
    F = math.prod(w_shape[i] for i in wf)
    N = math.prod(x_shape[i] for i in xf)
    x_perm = xb + xf + xc
    # dy dims: batch, lhs free, rhs free
    nb = len(wb)
    if p == 0:  # lhs is the weight: dy = [K, F, N]
        dy_perm = (
            tuple(range(nb))
            + tuple(range(nb + len(wf), nb + len(wf) + len(xf)))
            + tuple(range(nb, nb + len(wf)))
        )
    else:
        dy_perm = tuple(range(nb + len(xf) + len(wf)))
    canon_w = wb + wc + wf
    canon_shape = tuple(w_shape[i] for i in canon_w)
    return DenseLayout(
        kdims=tuple(w_shape[i] for i in wb),
        cdims=tuple(w_shape[i] for i in wc),
        fdims=tuple(w_shape[i] for i in wf),
        canon_w=canon_w,
        K=K,
        C=C,
        F=F,
        N=N,
        x_perm=x_perm,
        dy_perm=dy_perm,
        canon_shape=canon_shape,
        inv_w=tuple(int(i) for i in np.argsort(canon_w)),
        x_pos=1 - p,
    )


class Tokens(NamedTuple):
    """The context of a dense-family site for a batch (`Kernel.prepare`): the two factors
    of each example's gradient ``G_b = x_b^T dy_b`` in the canonical layout (`canon`),
    ``x [B, K, N, C]`` (the site's input, or a factor standing for it: a LoRA adapter's
    projected input, a ragged site's rows with their group ids, a convolution's raw input)
    and ``dy [B, K, N, F]`` (the output cotangent, or its factor)."""

    x: Any
    dy: Any


def canonical(site, c, ext, dy, dtype):
    """The site's input and output cotangent in the canonical layout ``c`` (`canon`):
    ``X [B, K, N, C]`` and ``DY [B, K, N, F]`` in ``dtype``."""
    x = ext[site.ext_vars.index(site.eqn.invars[c.x_pos])]
    (dy,) = dy
    B = dy.shape[0]
    x = jnp.transpose(x, (0,) + tuple(1 + i for i in c.x_perm))
    x = x.reshape(B, c.K, c.N, c.C).astype(dtype)
    dy = jnp.transpose(dy, (0,) + tuple(1 + i for i in c.dy_perm))
    return Tokens(x, dy.reshape(B, c.K, c.N, c.F).astype(dtype))


HIGHEST = jax.lax.Precision.HIGHEST


FALLBACK_TILE_BYTES = 4 << 20  # tiles of the exact variance where the rank-one form cancels


# The raw variance sum x^2 d^2 - (sum x d)^2 / B (N == 1) is kept where its worst-case
# rounding error, however the sums are ordered, is at most sqrt(eps) of the result (half
# the digits; in practice the error is far smaller). So it is dropped where some element's
# mean exceeds about sqrt(1 / tau) of its spreads, tau = 3 (B + 2) sqrt(eps) (float32: 5 at
# B = 32, 2 at B = 200). tau grows with the examples summed, so larger batches take the raw
# form in groups of at most `raw_group_size` examples (float32: 128, tau 0.135), each held
# to its own bound, merged by Chan et al.'s pairwise update (the exact moments of the
# union, adding no cancellation of its own).
RAW_GROUP_TAU = 0.135


def raw_group_size(dtype):
    """The most examples one raw variance sum takes (its tau at most `RAW_GROUP_TAU`)."""
    return max(2, int(RAW_GROUP_TAU / (3 * math.sqrt(float(jnp.finfo(dtype).eps)))) - 2)


def raw_groups(B, dtype):
    """``[(count, size), ...]``: ``B`` examples in groups of sizes differing by at most one."""
    G = -(-B // raw_group_size(dtype))
    n, r = divmod(B, G)
    return [(c, m) for c, m in ((r, n + 1), (G - r, n)) if c]


def merge_raw_groups(x, d, w, acc, raw, merge):
    """``raw(x, d, w)`` of each group of `raw_groups` (the examples of ``x [B, ...]``,
    ``d [B, ...]`` and the weights ``w [B]`` of dtype ``acc``, or None), merged in order by
    ``merge(a, n_a, b, n_b)`` (``n``: a group's count, or the sum of its weights): the
    groups of one size in a ``lax.scan``, the first group starting the sums."""

    def groups(a, b0, count, size):  # [count, size, ...]; None stays None (unweighted)
        return None if a is None else a[b0 : b0 + count * size].reshape(
            (count, size) + a.shape[1:])

    def weight(wg, size):  # a group's count, or the sum of its weights
        return size if wg is None else jnp.sum(wg)

    sums, seen, b0 = None, 0, 0
    for count, size in raw_groups(x.shape[0], acc):
        gs = tuple(groups(a, b0, count, size) for a in (x, d, w))
        b0 += count * size
        if sums is None:  # the first group starts the sums
            first = jax.tree.map(lambda a: a[0], gs)
            sums, seen = raw(*first), weight(first[2], size)
            gs = jax.tree.map(lambda a: a[1:], gs)
            count -= 1
        if count == 0:
            continue

        def body(carry, g, size=size):
            (a, na), ng = carry, weight(g[2], size)
            return (merge(a, na, raw(*g), ng), na + ng), None

        sums = jax.lax.scan(body, (sums, jnp.asarray(seen, acc)), gs)[0][0]
        seen = seen + weight(gs[2], count * size)
    return sums


def naive_tau(B, dtype):
    """Least ``m2 / sum_b G_b^2`` at which the raw variance sum is kept (see above)."""
    return 3 * (B + 2) * math.sqrt(float(jnp.finfo(dtype).eps))


def example_products(x, dy):
    """``G [b, K, C, F]`` from canonical ``x [b, K, N, C]`` and ``dy [b, K, N, F]``.

    One example with one weight block is a plain 2-D matmul, and a token-free
    site (``N == 1``) an outer product: no batched ``dot_general`` for either.
    """
    b, K, N = x.shape[:3]
    if N == 1:
        return x[:, :, 0, :, None] * dy[:, :, 0, None, :]
    # lax.dot_general directly: traced for every tile loop of every site, so no
    # einsum spec to parse each time
    if b == 1 and K == 1:
        return jax.lax.dot_general(x[0, 0], dy[0, 0], (((0,), (0,)), ((), ())))[None, None]
    if b == 1:
        return jax.lax.dot_general(x[0], dy[0], (((1,), (1,)), ((0,), (0,))))[None]
    return jax.lax.dot_general(x, dy, (((2,), (2,)), ((0, 1), (0, 1))))


def gram_of(a, precision=None):
    """``[b, K, N, N]`` Gram matrices ``a_bk a_bk^T`` of ``a [b, K, N, X]``; for ``K = 1``
    a dot batched over the examples alone (XLA:CPU lays out a dot batched over a
    unit axis worse than the same dot without it)."""
    if a.shape[1] == 1:
        return jnp.einsum("bnc,bmc->bnm", a[:, 0], a[:, 0], precision=precision)[:, None]
    return jnp.einsum("bknc,bkmc->bknm", a, a, precision=precision)

"""The fast rules of a dense site (`DenseKernel.FAST`): elementwise sums, squared norms,
centred and central moments and Kronecker moments from ``x`` and ``dy``, each with its
cost (`Rule`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import cuts, kron, tiling
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src import stats_research as R
from jaxpr_surgery._src.sites.base import STREAMED, Rule
from jaxpr_surgery._src.sites.dense_layout import (
    FALLBACK_TILE_BYTES,
    merge_raw_groups,
    naive_tau,
    raw_groups,
)


# --------------------------------------------------------------------------- #
# The fast rules (`Kernel.FAST`): the others read tiles of ``G_b``
# --------------------------------------------------------------------------- #
def phi_applies(k, r):
    return r.linear or (r.multiplicative and k.c.N == 1)


def phi_value(k, ctx, r):
    x, dy = ctx
    if r.linear:
        return k.contract(x, dy)
    x0 = k.tokens(x)[:, :, 0]  # rank one: phi(x)^T phi(dy)
    return k.to_view(jnp.einsum("bkc,bkf->kcf", r.apply(x0), r.apply(dy[:, :, 0])))


def phi_rule(k, r, B):
    K, N, C, F = k.c.K, k.c.N, k.c.C, k.c.F
    if r.linear:
        return Rule(STREAMED, "contraction", float(2 * B * K * N * C * F), 0.0)
    return Rule(STREAMED, "rank-one phi(x)^T phi(dy)", float(2 * B * K * C * F), 0.0)


def norms_rule(k, r, B):
    K, N, C, F = k.c.K, k.c.N, k.c.C, k.c.F
    if N == 1:
        return Rule(STREAMED, "rank-one norms", float(2 * B * K * (C + F)), 0.0)
    it = jnp.dtype(k.acc).itemsize
    return Rule(
        STREAMED, "ghost norm", float(2 * B * K * N * N * (C + F)), float(2 * B * K * N * N * it)
    )


def centered_value(k, ctx, r):
    x, dy = ctx
    return k._centered_rank_one(k.tokens(x)[:, :, 0], dy[:, :, 0])


def weighted_phi_value(k, ctx, r, w):
    """``sum_b w_b phi(x_b)^T phi(dy_b)`` at a rank-one site (phi multiplicative): the
    weights after phi, for phis they do not fold into (sign)."""
    x, dy = ctx
    x0, d0 = k.tokens(x)[:, :, 0], dy[:, :, 0]
    wd = w.astype(d0.dtype)[:, None, None] * r.apply(d0)
    return k.to_view(jnp.einsum("bkc,bkf->kcf", r.apply(x0), wd))


def weighted_centered_value(k, ctx, r, w):
    x, dy = ctx
    return k._centered_rank_one(k.tokens(x)[:, :, 0], dy[:, :, 0], w)


def central_value(k, ctx, r, w=None):
    """`stats_research.CentralMoments` (kurtosis) at a rank-one site, as `_centered_rank_one`
    for the variance: per group of `raw_groups` the raw power sums ``sum_b w_b x_b^p
    d_b^p`` (``p <= 4``: five contractions) give the group's central sums, merged by
    Pébay's rule; where some element's central sum may have cancelled (its fourth or
    second below `naive_tau` of the magnitudes of its expansion: the mean dwarfs the
    spread), the exact sums over tiles of ``G`` instead."""
    x, dy = ctx
    x, d = k.tokens(x)[:, :, 0], dy[:, :, 0]
    hi = jax.lax.Precision.HIGHEST

    def raw(xg, dg, wg=None):  # one group: its central sums, whether they may have cancelled
        wd = dg if wg is None else dg * wg.astype(dg.dtype)[:, None, None]
        xp, dp = [xg], [wd]
        for _ in range(3):
            xp.append(xp[-1] * xg)
            dp.append(dp[-1] * dg)
        P1, P2, P3, P4 = (jnp.einsum("bkc,bkf->kcf", a, b, precision=hi) for a, b in zip(xp, dp))
        A3 = jnp.einsum("bkc,bkf->kcf", jnp.abs(xp[2]), jnp.abs(dp[2]), precision=hi)
        n = xg.shape[0] if wg is None else jnp.sum(wg).astype(P1.dtype)
        mu = P1 / (n if wg is None else jnp.where(n > 0, n, 1))
        mu2 = jnp.square(mu)
        m2 = P2 - P1 * mu
        m3 = P3 - 3 * mu * P2 + 2 * n * mu2 * mu
        m4 = P4 - 4 * mu * P3 + 6 * mu2 * P2 - 3 * n * jnp.square(mu2)
        scale = P4 + 4 * jnp.abs(mu) * A3 + 6 * mu2 * P2 + 3 * n * jnp.square(mu2)
        tau = naive_tau(xg.shape[0], k.acc)
        ill = jnp.any(m4 < tau * scale) | jnp.any(m2 < tau * P2)
        return R.CentralSums(mu, S.nonneg(m2), m3, S.nonneg(m4)), ill

    def merge(a, na, b, nb):
        return r.merge(a[0], na, b[0], nb), a[1] | b[1]

    w = None if w is None else w.astype(k.acc)
    sums, ill = merge_raw_groups(x, d, w, k.acc, raw, merge)

    def exact():  # rare: small tiles, so the branch costs little memory
        small = min(k.budget or tiling.DEFAULT_MEMORY_BUDGET_BYTES, FALLBACK_TILE_BYTES)
        return k.tiled(x[:, :, None], d[:, :, None], [r if w is None else S.Weighted(r, w)],
                       budget=small, tokens=lambda t: t)[0]  # (x is canonical already)

    out = jax.lax.cond(cuts.any_part(ill), exact, lambda: sums)
    return R.CentralSums(*(k.to_view(v) for v in out))


def central_rule(k, r, B):
    K, C, F = k.c.K, k.c.C, k.c.F
    it = jnp.dtype(k.acc).itemsize
    return Rule(STREAMED, "rank-one central sums", float(10 * B * K * C * F),
                float(9 * K * C * F * it))


def centered_rule(k, r, B):
    # two contractions and their [K, C, F] sums (a group's and the running ones where
    # the batch is taken in groups); the centred expansion runs only where they cancel
    K, C, F = k.c.K, k.c.C, k.c.F
    it = jnp.dtype(k.acc).itemsize
    grouped = sum(c for c, _ in raw_groups(B, k.acc)) > 1
    return Rule(
        STREAMED, "rank-one centered", float(4 * B * K * C * F),
        float((5 if grouped else 3) * K * C * F * it),
    )


def kron_value(k, ctx, r):
    """Kronecker moments from the site's token factors (kron.py)."""
    return kron.moments([k.kron_factors(ctx)], tuple(k.site.view_shape), r, k.acc, k.budget)

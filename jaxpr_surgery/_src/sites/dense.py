"""Dense sites: ``dot_general`` between a parameter view and example data.

Per example ``b`` the weight gradient is ``G_b = X_b^T DY_b`` in a canonical
layout ``X [K, N, C]``, ``DY [K, N, F]`` -> ``G [K, C, F]`` where ``K`` are dot
batch dims shared with the weight (per-head weights), ``N`` the data's free
dims (token positions), ``C`` the contracted dims and ``F`` the weight's free
dims. Rules:

* sum: one contraction ``sum_bn X DY``;
* multiplicative phi with ``N == 1``: ``phi(X)^T phi(DY)`` (rank one);
* squared norms: ghost form ``sum (X X^T) * (DY DY^T)`` when ``2 N^2 <= C F``,
  else materialised;
* centered moments with ``N == 1``: an exact expansion in centered ``X`` and
  ``DY`` (no cancellation);
* otherwise materialise ``G_b`` (``[B, K, C, F]``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.sites.base import Kernel, reduce_materialised, register


def _canon(site):
    """Static layout information of a dense site."""
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
    return dict(
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


@register("dense")
class DenseKernel(Kernel):
    def __init__(self, site, acc_dtype):
        super().__init__(site, acc_dtype)
        self.c = _canon(site)

    def use_ghost(self):
        c = self.c
        return 2 * c["N"] ** 2 <= c["C"] * c["F"]

    # canonical layout ----------------------------------------------------- #
    def prepare(self, w, ext, ext_batched, dy):
        c = self.c
        x = ext[self.site.ext_vars.index(self.site.eqn.invars[c["x_pos"]])]
        (dy,) = dy
        B = dy.shape[0]
        x = jnp.transpose(x, (0,) + tuple(1 + i for i in c["x_perm"]))
        x = x.reshape(B, c["K"], c["N"], c["C"]).astype(self.acc)
        dy = jnp.transpose(dy, (0,) + tuple(1 + i for i in c["dy_perm"]))
        dy = dy.reshape(B, c["K"], c["N"], c["F"]).astype(self.acc)
        return x, dy

    def to_view(self, g):
        """[..., K, C, F] -> [..., *w_shape]."""
        lead = g.shape[:-3]
        g = g.reshape(lead + self.c["canon_shape"])
        n = len(lead)
        return g.transpose(tuple(range(n)) + tuple(n + i for i in self.c["inv_w"]))

    # reductions ------------------------------------------------------------ #
    def direct(self, ctx, reduction):
        x, dy = ctx
        N = self.c["N"]
        if isinstance(reduction, S.PhiSum):
            if reduction.phi is None:
                return self.to_view(jnp.einsum("bknc,bknf->kcf", x, dy))
            if reduction.multiplicative and N == 1:
                return self.to_view(
                    jnp.einsum(
                        "bkc,bkf->kcf", reduction.apply(x[:, :, 0]), reduction.apply(dy[:, :, 0])
                    )
                )
        if isinstance(reduction, S.SqNorms):
            return self.sq_norms(ctx)
        if isinstance(reduction, S.Centered) and N == 1:
            return self._centered_rank_one(x[:, :, 0], dy[:, :, 0])
        return super().direct(ctx, reduction)

    def needs_materialise(self, r):
        N = self.c["N"]
        if isinstance(r, S.PhiSum):
            return not (r.phi is None or (r.multiplicative and N == 1))
        if isinstance(r, S.Centered):
            return N != 1
        if isinstance(r, S.SqNorms):
            return N != 1 and not self.use_ghost()
        return True

    def direct_all(self, ctx, reductions):
        if not any(self.needs_materialise(r) for r in reductions.values()):
            return super().direct_all(ctx, reductions)
        # G_b is formed once and every nonlinear reduction reads it. Measured on
        # XLA:CPU: each extra consumer of G costs about a pass over it, so the
        # sum and mean come from a contraction and sum g^2 = M2 + B mean^2 when
        # the centered moments are requested too.
        x, dy = ctx
        B = x.shape[0]
        G = jnp.einsum("bknc,bknf->bkcf", x, dy)
        out = {}
        centered = [k for k, r in reductions.items() if isinstance(r, S.Centered)]
        for k, r in reductions.items():
            if isinstance(r, S.PhiSum) and r.phi is None:
                out[k] = self.direct(ctx, r)
            elif isinstance(r, S.SqNorms):
                out[k] = jnp.sum(jnp.square(G), axis=(1, 2, 3))
            elif isinstance(r, S.Centered):
                mean = jnp.einsum("bknc,bknf->kcf", x, dy) / B
                m2 = jnp.sum(jnp.square(G - mean), axis=0)
                out[k] = S.Moments(self.to_view(mean), self.to_view(m2))
            elif not (r == S.SQUARE and centered):
                out[k] = self.to_view(reduce_materialised(G, r))
        for k, r in reductions.items():
            if r == S.SQUARE and centered:
                m = out[centered[0]]
                out[k] = m.m2 + B * jnp.square(m.mean)
        return out

    def _centered_rank_one(self, x, d):
        B = x.shape[0]
        xm, dm = jnp.mean(x, 0), jnp.mean(d, 0)
        u, v = x - xm, d - dm
        u2, v2 = jnp.square(u), jnp.square(v)
        M = jnp.einsum("bkc,bkf->kcf", u, v) / B
        xo = xm[:, :, None]
        do = dm[:, None, :]
        m2 = (
            jnp.square(xo) * jnp.sum(v2, 0)[:, None, :]
            + jnp.sum(u2, 0)[:, :, None] * jnp.square(do)
            + (jnp.einsum("bkc,bkf->kcf", u2, v2) - B * jnp.square(M))
            + 2 * B * xo * do * M
            + 2 * xo * jnp.einsum("bkc,bkf->kcf", u, v2)
            + 2 * do * jnp.einsum("bkc,bkf->kcf", u2, v)
        )
        return S.Moments(self.to_view(xo * do + M), self.to_view(jnp.maximum(m2, 0)))

    def materialise(self, ing):
        x, dy = ing
        return self.to_view(jnp.einsum("bknc,bknf->bkcf", x, dy))

    def sq_norms(self, ing):
        x, dy = ing
        if self.c["N"] == 1:
            return jnp.einsum(
                "bkc,bkc,bkf,bkf->b", x[:, :, 0], x[:, :, 0], dy[:, :, 0], dy[:, :, 0]
            )
        if self.use_ghost():
            gx = jnp.einsum("bknc,bkmc->bknm", x, x)
            gd = jnp.einsum("bknf,bkmf->bknm", dy, dy)
            return jnp.einsum("bknm,bknm->b", gx, gd)
        g = jnp.einsum("bknc,bknf->bkcf", x, dy)
        return jnp.sum(jnp.square(g), axis=(1, 2, 3))

    def weighted_sum(self, ing, c):
        x, dy = ing
        return self.to_view(jnp.einsum("bknc,bknf,b->kcf", x, dy, c.astype(x.dtype)))

    # reporting -------------------------------------------------------------- #
    def rule(self, reduction, B):
        c = self.c
        K, N, C, F = c["K"], c["N"], c["C"], c["F"]
        mat = 2 * B * K * N * C * F
        if isinstance(reduction, S.PhiSum):
            if reduction.phi is None:
                return "contraction", 2 * B * K * N * C * F
            if reduction.multiplicative and N == 1:
                return "rank-one phi(x)^T phi(dy)", 2 * B * K * C * F
            return "materialise per-example", mat
        if isinstance(reduction, (S.SqNorms, S.ClippedSum)):
            if N == 1:
                return "rank-one norms", 2 * B * K * (C + F)
            if self.use_ghost():
                return "ghost norm", 2 * B * K * N * N * (C + F)
            return "materialise per-example", mat
        if isinstance(reduction, S.Centered):
            if N == 1:
                return "rank-one centered", 12 * B * K * C * F
            return "materialise per-example", mat
        return "materialise per-example", mat

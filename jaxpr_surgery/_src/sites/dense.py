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
* centered moments with ``N == 1``: ``(X^2)^T (DY^2) - (X^T DY)^2 / B`` where it
  provably keeps its digits (checked at run time), else an exact expansion in
  centered ``X`` and ``DY``;
* otherwise materialise ``G_b`` (``[B, K, C, F]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, cuts, dots, fused, kron, tiling
from jaxpr_surgery._src import sink_keys as K
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src import stats_research as R
from jaxpr_surgery._src.clip_reductions import KeptExamples
from jaxpr_surgery._src.norms import (
    GHOST_TOLERANCE,
    gram_ghost_bound,
    staged_sum,
    untrusted,
)
from jaxpr_surgery._src.sites.base import (
    STREAMED,
    Candidate,
    Fast,
    Kernel,
    Rule,
    cheapest,
    example_norm,
    example_scale,
    pre_scales,
    recompute_flagged,
    register,
    scale_examples,
    sqrt0,
    times_examples,
    weighted_sum_materialised,
)
from jaxpr_surgery._src.sites.dense_layout import (
    FALLBACK_TILE_BYTES,
    HIGHEST,
    FoldSide,
    Tokens,
    canon,
    canonical,
    dense_fold_side,
    example_products,
    gram_of,
    merge_raw_groups,
    naive_tau,
    pow2_scale,
)
from jaxpr_surgery._src.sites.dense_rules import (
    centered_rule,
    centered_value,
    central_rule,
    central_value,
    kron_value,
    norms_rule,
    phi_applies,
    phi_rule,
    phi_value,
    weighted_centered_value,
    weighted_phi_value,
)
from jaxpr_surgery._src.views import Factor, Step

GHOST, PRODUCTS = "ghost norm", "per-example products"  # the forms of `norm_candidates`


@register
class DenseKernel(Kernel):
    """``dot_general`` with one parameter operand (a view of the weight, possibly
    multiplied elementwise by a constant per row or column)."""

    kind = "dense"
    anchors = (compat.dot_general_p,)

    @classmethod
    def matches(cls, eqn, tag, pos, patterns):
        if len(pos) != 1:
            return False
        if not tag.pre:
            return True
        # a per-row / per-column constant multiplier before the site folds into its
        # input or cotangent (`_fold`)
        folded = pre_scales(tag)
        return folded is not None and dense_fold_side(eqn, pos[0], folded) is not None

    def __init__(self, site, acc_dtype):
        super().__init__(site, acc_dtype)
        self.c = canon(site)
        # a constant elementwise factor of the weight (x @ (W * m), m per column or per
        # row): the gradient of W is m * X^T DY, i.e. m folded into DY or X
        folds = pre_scales(site) if site.pre else None
        # (static state only: kernels are keyed by it, fingerprint.site_key)
        self.fold_side = dense_fold_side(site.eqn, site.param_pos, folds) if folds else None

    def _fold(self, x, dy, ext):
        """``x``, ``dy`` (canonical) with the weight's elementwise factors folded in."""
        m = None
        for kind, v, _ in pre_scales(self.site):
            if kind is Factor.NEG:
                f = jnp.asarray(-1, self.acc)
            else:
                f = v.val if isinstance(v, compat.Literal) else ext[self.site.ext_vars.index(v)]
                f = jnp.asarray(f).astype(self.acc)
                if kind is Factor.DIV:
                    f = 1 / f
            m = f if m is None else m * f
        c = self.c
        m = jnp.broadcast_to(m, tuple(self.site.view_shape))
        m = jnp.transpose(m, c.canon_w).reshape(c.K, c.C, c.F)
        if self.fold_side is FoldSide.DY:  # constant along C
            return Tokens(x, dy * m[:, 0, :][None, :, None, :])
        return Tokens(x * m[:, :, 0][None, :, None, :], dy)

    def scale(self, ctx, c):
        return ctx._replace(dy=ctx.dy * c.astype(ctx.dy.dtype))

    def scale_examples(self, ctx, s):
        return ctx._replace(dy=times_examples(ctx.dy, s))

    def token_matmuls(self):
        return self.c.N > 1

    def dense_layout(self):
        return self.c

    def use_ghost(self):
        """Per-example squared norms by the ghost form (else from per-example products):
        the cheaper of the two by the cost model (`norm_candidates`)."""
        return self.c.N > 1 and self.norm_candidates()[0].how == GHOST

    def norm_candidates(self, B=1):
        """The two forms of the per-example squared norms at a site with a token axis,
        cheapest first (`base.cheapest`): the ghost form ``sum (X X^T) * (DY DY^T)``,
        ``2 N^2 (C + F)`` FLOPs per example and block, its two ``N x N`` grams through
        memory; and the per-example products ``G_b = X_b^T DY_b``, ``2 N C F`` FLOPs, ``G_b``
        through memory. The ghost form wins while ``N (C + F) < C F``: below about
        ``min(C, F)`` tokens, so at long sequences (``T`` beyond the width) the products,
        whose FLOPs are those of the weight gradient itself."""
        c = self.c
        K, N, C, F = c.K, c.N, c.C, c.F
        it = jnp.dtype(self.acc).itemsize
        io = B * K * N * (C + F) * it  # reading X and DY
        ghost = Candidate(
            GHOST, float(2 * B * K * N * N * (C + F) + 2 * B * K * N * N),
            float(io + 4 * B * K * N * N * it), float(2 * B * K * N * N * it),
        )
        t, ft = self.tile(B), self.feature_tile(B)
        products = Candidate(
            PRODUCTS, float(2 * B * K * N * C * F + 2 * B * K * C * F),
            float(io + 2 * B * K * C * F * it),
            float(tiling.tile_bytes(t, ft, (K, C, F), self.acc)),
        )
        return cheapest([ghost, products])

    # canonical layout ----------------------------------------------------- #
    def prepare(self, w, ext, ext_batched, dy):
        ctx = canonical(self.site, self.c, ext, dy, self.acc)
        if self.fold_side is not None:
            return self._fold(*ctx, ext)
        return ctx

    def ingredient_avals(self, B):
        if type(self) is not DenseKernel:  # subclasses keep other layouts
            return None
        c = self.c
        return Tokens(
            jax.ShapeDtypeStruct((B, c.K, c.N, c.C), self.acc),
            jax.ShapeDtypeStruct((B, c.K, c.N, c.F), self.acc),
        )

    def to_view(self, g):
        """[..., K, C, F] -> [..., *w_shape]."""
        lead = g.shape[:-3]
        g = g.reshape(lead + self.c.canon_shape)
        n = len(lead)
        return g.transpose(tuple(range(n)) + tuple(n + i for i in self.c.inv_w))

    FEATURE_AXES = (1, 2)  # canonical axes of G a feature block may cut (C, F)

    # what `prepare` keeps of the site's input, and the two uses of it that need no
    # per-example product; a conv site (conv.py) keeps its raw input and overrides both
    def tokens(self, x):
        """Canonical ``X [b, K, N, C]`` from what `prepare` kept (here: ``X`` itself)."""
        return x

    def contract(self, x, dy, c=None):
        """``sum_b c_b X_b^T DY_b`` (``c`` None: all ones) in the view's layout."""
        if x.shape[1] == 1:  # K = 1: no dot batched over a unit axis (as `gram_of`)
            ops = (x[:, 0], dy[:, 0]) + (() if c is None else (c.astype(x.dtype),))
            spec = "bnc,bnf->cf" if c is None else "bnc,bnf,b->cf"
            return self.to_view(jnp.einsum(spec, *ops)[None])
        if c is None:
            return self.to_view(jnp.einsum("bknc,bknf->kcf", x, dy))
        return self.to_view(jnp.einsum("bknc,bknf,b->kcf", x, dy, c.astype(x.dtype)))

    # reductions ------------------------------------------------------------ #
    # (the fast rules: `FAST`, after the class; the others read tiles of G_b)
    def from_examples(self, ctx, reduction):
        key = K.reduction(0)
        return self.direct_all(ctx, {key: reduction})[key]

    def kron_factors(self, ctx):
        """Token factors (kron.py): ``G_b[k, c, f] = sum_n X[b, k, n, c] DY[b, k, n, f]``."""
        x, dy = ctx
        x = self.tokens(x)
        c = self.c
        B, N = x.shape[0], c.N
        kd, cd, fd, cw = c.kdims, c.cdims, c.fdims, c.canon_w
        nk, nc = len(kd), len(cd)
        X = x.reshape((B,) + kd + (N,) + cd)
        D = dy.reshape((B,) + kd + (N,) + fd)
        return kron.Factors(cw[:nk], ((cw[nk : nk + nc], X), (cw[nk + nc :], D)))

    def kron_meta(self):
        """``((n_tokens, kdims, pdims, qdims), structure in leaf axes)`` for explain."""
        c = self.c
        nk, nc = len(c.kdims), len(c.cdims)
        cw = c.canon_w
        m = kron.view_leaf_axes(self.site)
        struct = kron.leaf_structure(cw[:nk], (cw[nk : nk + nc], cw[nk + nc :]), m)
        return (c.N, c.kdims, c.cdims, c.fdims), struct

    def dots(self, ctx, ref):
        """``[B]``: ``<X_b^T DY_b, ref>``, the reference contracted with the tokens."""
        x, dy = ctx
        x = self.tokens(x)
        c = self.c
        R = jnp.transpose(ref, c.canon_w).reshape(c.K, c.C, c.F)
        return dots.dense_dots(x, dy, R.astype(x.dtype))

    def needs_materialise(self, r):
        return self.fast_rule(r) is None

    def _in_tile_loop(self, reductions):
        """The keys of ``reductions`` that `direct_all` reads from tiles of ``G_b``
        (none where no reduction needs ``G_b``)."""
        if not any(self.needs_materialise(r) for r in reductions.values()):
            return []
        # the plain sum rides along in the tile loop (a hot add) rather than
        # costing a second contraction over the batch; centred sums take one
        # pass (tiling.py), so no mean is contracted beforehand either
        return [
            k for k, r in reductions.items()
            if self.needs_materialise(r) or (r.linear and self.c.N > 1)
        ]

    def carried_keys(self, reductions, B):
        # not in feature blocks: measured 5-15% slower than merging afterwards (on a
        # large-vocabulary tied table), as slicing the running values per block costs
        if self.feature_tile(B) is not None:
            return []
        return [k for k in self._in_tile_loop(reductions) if reductions[k].carries]

    def from_view(self, v):
        """[..., *w_shape] -> [..., K, C, F] (undoes `to_view`)."""
        c = self.c
        n = v.ndim - len(c.canon_shape)
        v = v.transpose(tuple(range(n)) + tuple(n + int(i) for i in c.canon_w))
        return v.reshape(v.shape[:n] + (c.K, c.C, c.F))

    def direct_all(self, ctx, reductions, carry=None):
        tiled = self._in_tile_loop(reductions)
        if not tiled:
            return super().direct_all(ctx, reductions)
        # Reductions that need G_b read it tile by tile (tiling.py): one loop
        # over examples serves all of them; G is never formed for the batch.
        x, dy = ctx
        out = {k: self.direct(ctx, r) for k, r in reductions.items() if k not in tiled}
        keys, reds = tiled, [reductions[k] for k in tiled]
        if carry is not None:
            inits = [carry.values.get(k) for k in keys]
            carry = S.Carry(
                [None if i is None else jax.tree.map(self.from_view, i) for i in inits], carry.n
            )
        vals = self.tiled(x, dy, reds, carry=carry)
        for k, r, v in zip(keys, reds, vals):
            # per-example values stay [B]; the others (Moments, or Shifted when carried)
            # go to the view's layout
            kept = isinstance(r, KeptExamples)  # [B, K, C, F] -> [B, *view]
            out[k] = v if r.per_example and not kept else jax.tree.map(self.to_view, v)
        return out

    # tiles ------------------------------------------------------------------ #
    def _tile_G(self, x, dy, b0, size, cut=None, tokens=None):
        """Canonical ``G [size, K, C, F]`` of examples ``b0 .. b0+size``; with a ``cut``
        (cuts.py) only its block on canonical axis 1 (C) or 2 (F). ``x`` as
        `prepare` keeps it, or canonical ``X`` with ``tokens`` the identity."""
        xs = (tokens or self.tokens)(compat.slice_at(x, b0, size, 0))
        ds = compat.slice_at(dy, b0, size, 0)
        if cut is not None:
            if cuts.axis_of(cut) == 1:
                xs = cuts.take(cut, xs, 3)
            else:
                ds = cuts.take(cut, ds, 3)
        return example_products(xs, ds)

    def tile(self, B, budget=None):
        """Examples per tile for a batch of ``B``."""
        c = self.c
        per_ex = c.N > 1 and tiling.prefer_per_example()
        nbytes = self.tile_bytes_per_example()
        budget = self.budget if budget is None else budget
        return tiling.tile_size(B, nbytes, budget, batched_ok=not per_ex)

    def tile_bytes_per_example(self):
        """Memory a tile takes per example: its ``G``, and what `tile_extra_bytes` adds."""
        c = self.c
        return tiling.bytes_of((c.K, c.C, c.F), self.acc) + self.tile_extra_bytes()

    def tile_extra_bytes(self):
        """Per example of a tile, memory besides ``G`` (a conv's patches); here none."""
        return 0

    def feature_tile(self, B, budget=None):
        """Blocks of one example's ``G [K, C, F]`` along ``C`` or ``F`` (tiling.py:
        cache-sized on CPU for few tokens, or where a reduction of the call asks), or
        None; only where a tile holds one example."""
        c = self.c
        budget = self.budget if budget is None else budget
        if self.tile(B, budget) != 1:
            return None
        return tiling.feature_tile((c.K, c.C, c.F), self.acc, self.FEATURE_AXES, budget,
                                   cache=tiling.cache_sized(self.cache_blocks, c.N),
                                   whole_under_split=not self.split_blocks)

    def tiled(self, x, dy, reds, budget=None, tokens=None, carry=None):
        c = self.c
        B = x.shape[0]
        ft = self.feature_tile(B, budget)
        features = ft and (
            *ft,
            lambda b0, size, cut: self._tile_G(x, dy, b0, size, cut, tokens),
        )
        return tiling.reduce_tiles(
            lambda b0, size: self._tile_G(x, dy, b0, size, tokens=tokens),
            B,
            reds,
            self.tile(B, budget),
            shape=(c.K, c.C, c.F),
            dtype=self.acc,
            features=features,
            carry=carry,
            factors=(x, dy) if tokens is None and self._canonical_tokens() else None,
        )

    def _canonical_tokens(self):
        """`tokens` is the identity: what `prepare` keeps is canonical ``X`` (not a
        conv's raw input, whose patches would be formed for the whole batch)."""
        return type(self).tokens is DenseKernel.tokens

    def _centered_rank_one(self, x, d, w=None):
        """Centred moments of ``G_b = x_b d_b^T`` (N == 1); with example weights ``w``
        the weighted ones (`Centered.from_weighted`: sums ``sum_b w_b ...`` and the
        groups merged by their weights; where they may have cancelled, the exact
        weighted sums over tiles of ``G``).

        First the raw form ``m2 = sum_b x_b^2 d_b^2 - (sum_b x_b d_b)^2 / B``: two
        contractions, about second_moment's cost. Its rounding error is at most
        ``3 (B + 2) eps sum_b G_b^2`` (every product is rounded, and each sum of ``B``
        terms adds ``B eps`` of its absolute sum; Cauchy-Schwarz bounds the square of
        the sum by ``B sum_b G_b^2``). Where some element's ``m2`` is below
        ``1 / sqrt(eps)`` times that bound (the mean dwarfs the spread), the raw terms
        may have cancelled: the centred expansion below instead. The bound grows with
        the examples summed, so larger batches take the raw form in groups
        (`raw_groups`), each tested against its own bound, merged pairwise (Chan et
        al.: ``m2 = m2_a + m2_b + delta^2 n_a n_b / n``, exact and cancellation-free)."""
        hi = jax.lax.Precision.HIGHEST  # the bound assumes products in the dtype's precision

        def raw(xg, dg, wg=None):  # one group: mean, m2, whether its terms may have cancelled
            wd = dg if wg is None else dg * wg.astype(dg.dtype)[:, None, None]
            s2 = jnp.einsum("bkc,bkf->kcf", jnp.square(xg), dg * wd, precision=hi)
            p = jnp.einsum("bkc,bkf->kcf", xg, wd, precision=hi)
            n = xg.shape[0] if wg is None else jnp.sum(wg).astype(p.dtype)
            mean = p / (n if wg is None else jnp.where(n > 0, n, 1))
            m2 = s2 - p * mean
            return mean, m2, jnp.any(m2 < naive_tau(xg.shape[0], self.acc) * s2)

        def merge(a, na, b, nb):
            m = S.merge_moments(S.Moments(*a[:2]), na, S.Moments(*b[:2]), nb)
            return m.mean, m.m2, a[2] | b[2]

        w = None if w is None else w.astype(self.acc)
        mean, m2, ill = merge_raw_groups(x, d, w, self.acc, raw, merge)
        return jax.lax.cond(
            cuts.any_part(ill),
            lambda: self._centered_expansion(x, d) if w is None else self._centered_tiles(
                x, d, w),
            lambda: S.Moments(self.to_view(mean), self.to_view(S.nonneg(m2))),
        )

    def _centered_tiles(self, x, d, w):
        """Weighted centred moments of ``G_b = x_b d_b^T`` from tiles of ``G`` (exact;
        where the raw weighted sums may have cancelled)."""
        small = min(self.budget or tiling.DEFAULT_MEMORY_BUDGET_BYTES, FALLBACK_TILE_BYTES)
        m = self.tiled(
            x[:, :, None], d[:, :, None], [S.Weighted(S.Centered(), w)], budget=small,
            tokens=lambda t: t,  # x is canonical already
        )[0]
        return S.Moments(self.to_view(m.mean), self.to_view(m.m2))

    def _centered_expansion(self, x, d):
        """Centred moments of ``G_b = x_b d_b^T`` by rank-one expansions in centred ``x``
        and ``d`` (four contractions); where the expansion's terms cancel (the variance
        is tiny against them), the exact two-pass sum over tiles of ``G`` instead."""
        B = x.shape[0]
        xm, dm = jnp.mean(x, 0), jnp.mean(d, 0)
        u, v = x - xm, d - dm
        u2, v2 = jnp.square(u), jnp.square(v)
        M = jnp.einsum("bkc,bkf->kcf", u, v) / B
        xo = xm[:, :, None]
        do = dm[:, None, :]
        uv2 = jnp.einsum("bkc,bkf->kcf", u, v2)
        u2v = jnp.einsum("bkc,bkf->kcf", u2, v)
        u2v2 = jnp.einsum("bkc,bkf->kcf", u2, v2)
        m2 = (
            jnp.square(xo) * jnp.sum(v2, 0)[:, None, :]
            + jnp.sum(u2, 0)[:, :, None] * jnp.square(do)
            + (u2v2 - B * jnp.square(M))
            + 2 * B * xo * do * M
            + 2 * xo * uv2
            + 2 * do * u2v
        )
        mean = xo * do + M
        # Every term above is at most (sum_b x_b^2)(sum_b d_b^2) in size (an outer
        # product: fused into the test, never stored); where the result is within
        # rounding of that, the terms may have cancelled: take the exact path.
        sx = jnp.sum(jnp.square(x), 0)[:, :, None]
        sd = jnp.sum(jnp.square(d), 0)[:, None, :]
        eps = jnp.finfo(m2.dtype).eps
        ill = jnp.any(m2 < 64 * eps * sx * sd)

        def exact():  # rare: small tiles, so the branch costs little memory
            small = min(self.budget or tiling.DEFAULT_MEMORY_BUDGET_BYTES, FALLBACK_TILE_BYTES)
            return self.tiled(
                x[:, :, None], d[:, :, None], [S.CenteredAbout(mean)], budget=small,
                tokens=lambda t: t,  # x is canonical already
            )[0].m2

        m2 = jax.lax.cond(cuts.any_part(ill), exact, lambda: S.nonneg(m2))
        return S.Moments(self.to_view(mean), self.to_view(m2))

    def materialise(self, ing):
        x, dy = ing
        return self.to_view(example_products(self.tokens(x), dy))

    def leaf_order(self):
        """The leaf's axes as indices into the canonical sub-axes ``kdims + cdims +
        fdims`` where the view chain only transposes (a tied ``table.T``); else None."""
        axes = list(self.c.inv_w)  # the view's axes
        for op in reversed(self.site.chain):
            if op.kind is Step.TRANSPOSE:
                axes = [axes[int(i)] for i in np.argsort(op.perm)]
            elif op.kind is Step.SCAN or op.kind is Step.IDENTITY or op.in_shape == op.out_shape:
                continue
            else:
                return None
        return tuple(axes)

    def leaf_cut_axes(self):
        axes = None if self.site.depth else self.leaf_order()
        return () if axes is None else tuple(range(len(axes)))

    def add_to_leaf(self, ing, total, to_leaf, cut=None):
        """``G`` produced by one contraction straight in the leaf's layout: a tied
        ``table.T`` gets ``dy^T x`` rather than ``x^T dy`` and a transpose per tile.
        A ``cut`` of a leaf axis slices the operand that carries it."""
        axes = None if self.site.depth else self.leaf_order()
        if axes is None:
            return super().add_to_leaf(ing, total, to_leaf, cut)
        x, dy = ing
        x = self.tokens(x)
        c = self.c
        b, N = x.shape[0], c.N
        nk, nc = len(c.kdims), len(c.cdims)
        letters = [chr(ord("c") + i) for i in range(len(c.canon_shape))]
        kl, cl, fl = letters[:nk], letters[nk : nk + nc], letters[nk + nc :]
        xs = x.reshape((b,) + c.kdims + (N,) + c.cdims)
        ds = dy.reshape((b,) + c.kdims + (N,) + c.fdims)
        if cut is not None:  # canonical sub-axis j of leaf axis `axis`
            j = axes[cuts.axis_of(cut)]
            cut_at = lambda a, pos: cuts.take(cut, a, pos)  # noqa: E731
            if j < nk:
                xs, ds = cut_at(xs, 1 + j), cut_at(ds, 1 + j)
            elif j < nk + nc:
                xs = cut_at(xs, 2 + j)
            else:
                ds = cut_at(ds, 2 + j - nc)
        # one example a tile (CPU): a contraction without the unit batch axis (a dot
        # batched over 1 gets a worse layout from XLA:CPU than the plain one)
        a = "" if b == 1 else "a"
        spec = "{},{}->{}".format(
            a + "".join(kl) + "b" + "".join(cl),
            a + "".join(kl) + "b" + "".join(fl),
            a + "".join(letters[i] for i in axes),
        )
        if b == 1:
            g = jnp.einsum(spec, xs[0], ds[0])[None].astype(self.acc)
        else:
            g = jnp.einsum(spec, xs, ds).astype(self.acc)
        return g if total is None else total + g

    def sq_norms(self, ing):
        x, dy = ing
        if self.c.N == 1:
            x0 = self.tokens(x)[:, :, 0]
            return jnp.einsum("bkc,bkc,bkf,bkf->b", x0, x0, dy[:, :, 0], dy[:, :, 0])
        if not self.use_ghost():
            return self.tiled(x, dy, [S.SqNorms()])[0]
        return self.ghost_sq_and_norms(ing)[0]

    def ghost_sq_and_norms(self, ing):
        """``(sq, norms)`` by the ghost form, with one loop over the examples it cannot
        give: where the worst-case bound of its rounding cannot exclude that the value is
        all rounding (`ghost_sq_bound`: cancelled terms), or it overflowed (float32
        norms past ``2^64``), those examples' ``G_b`` formed alone, its squares summed
        and its norm taken against its largest element (`base.example_norm`)."""
        return self._ghost(ing)[:2]

    def sq_norms_bound(self, ing):
        """The ghost form's bound where its value is kept (0 where ``G_b`` was formed)."""
        if self.c.N == 1 or not self.use_ghost():
            return super().sq_norms_bound(ing)
        sq, _, bound = self._ghost(ing)
        return sq, bound

    def _ghost(self, ing):
        """``(sq, norms, bound)``: `ghost_sq_and_norms` and the bound of the values kept
        (0 where ``G_b`` was formed), which clipping adds (`clip_reductions.ClipNorms`)."""
        sq, bound, bad = self.ghost_sq_bound(ing)
        x, dy = ing

        blocks = self._recompute_blocks(x.shape[0])

        def exact(xd, b):
            if blocks is not None:
                n = example_norm(lambda cut: self._tile_G(*xd, b, 1, cut), blocks)
                return jnp.stack([jnp.square(n), n])
            g = self._tile_G(*xd, b, 1)
            return jnp.stack([jnp.sum(jnp.square(g)), example_norm(lambda cut: g)])

        out = recompute_flagged(exact, (x, dy), jnp.stack([sq, sqrt0(sq)], -1), bad)
        return out[:, 0], out[:, 1], jnp.where(bad, 0, bound)

    def ghost_sq_bound(self, ing):
        """``(ghost, bound, untrusted)``, each ``[B]``: the ghost form ``sum_knm (x_n .
        x_m)(dy_n . dy_m)``, a bound on its rounding error whatever the order of its sums,
        and the examples where that bound exceeds `norms.GHOST_TOLERANCE` of it. Each Gram
        entry is off by at most ``rounding(C) |x_n| |x_m|`` (``F``: ``|dy_n| |dy_m|``), the
        sum of products by ``rounding(N + K N)`` of the sum of their magnitudes (over ``m``,
        then, after a barrier, over ``k, n``): the bound is these three sums, ``N^2`` per
        example and block beside the grams' ``N^2 (C + F)``. Grams at the highest
        precision (the bound assumes the dtype's own rounding of each product)."""
        x, dy = ing
        c = self.c
        K, N, C, F = c.K, c.N, c.C, c.F
        X = self.tokens(x)
        gx, gd = gram_of(X, HIGHEST), gram_of(dy, HIGHEST)
        # (products and sums, no dots: a dot batched over a unit axis is laid out badly
        # by XLA:CPU, and the examples' unit batch dims are squeezed everywhere else)
        ghost = staged_sum(jnp.sum(gx * gd, -1))
        # (the bound is a margin, not differentiated: a token whose dy is zero would
        # give its norm's square root a NaN derivative, `norms.no_derivative`)
        bound = gram_ghost_bound(X, dy, gx, gd, (C, F, N + K * N), (1, 2, 3), ghost.dtype)
        return ghost, bound, untrusted(ghost, bound, GHOST_TOLERANCE)

    def has_sq_and_norms(self):
        """The ghost form gives both in one loop (`direct_norms`)."""
        return self.c.N > 1 and self.use_ghost()

    def sq_and_norms(self, ing):
        return self.ghost_sq_and_norms(ing)

    def sq_and_norms_bound(self, ing):
        return self._ghost(ing)

    def weighted_sum(self, ing, c):
        if not isinstance(ing, tuple):  # G_b kept for the clip (`keeps_products_for_clip`)
            return weighted_sum_materialised(ing, c)
        x, dy = ing
        return self.contract(x, dy, c)

    def keeps_products_for_clip(self):
        """A clipped sum at a long-sequence site keeps each ``G_b`` from the tile loop
        of its norms (formed there anyway: products cost less than the ghost form,
        `use_ghost`) and sums ``c_b G_b`` once the global norms are known, instead of
        keeping ``x`` and ``dy`` for one more contraction ``x^T (c dy)``: that
        contraction's FLOPs (a weight gradient's) saved, and ``G_b`` (``C F``) takes
        less memory than ``x_b`` and ``dy_b`` (``N (C + F)``) wherever the products win
        on FLOPs. Plain dense sites only (the canonical layout)."""
        c = self.c
        return (
            type(self) is DenseKernel and c.N > 1 and not self.use_ghost()
            and c.C * c.F <= c.N * (c.C + c.F)
        )

    def has_scaled_sq_norms(self, alone=False):
        """Rank-one sites; and token sites whose norms come from tiles of the products
        (not the ghost form) where the norms are all the site reads from them."""
        c = self.c
        if c.N == 1:
            return True
        return alone and self._canonical_tokens() and not self.use_ghost()

    def scaled_sq_norms(self, ing):
        """Rank-one: ``||G_b||^2 = sum_k |x_bk|^2 |dy_bk|^2``, each factor's sum taken on
        the example scaled to unit size (two more reductions over ``x`` and ``dy``,
        which are the size of the layer's input and output).

        With a token axis: the tiles of the products of ``x_b`` and ``dy_b`` each scaled
        by a power of two to below 2 in magnitude (exact), whose entries are then below
        ``4 N``: no square overflows, so no example is recomputed where one would have
        (a loop of its own beside the tiles' in every layer of the program)."""
        x, dy = ing
        if self.c.N > 1:
            sx, sd = pow2_scale(x), pow2_scale(dy)
            (q,) = self.tiled(scale_examples(x, sx), scale_examples(dy, sd), [S.SqNorms()])
            return q, sx * sd
        x0, d0 = self.tokens(x)[:, :, 0], dy[:, :, 0]
        mx, md = example_scale(x0), example_scale(d0)
        sx = jnp.sum(jnp.square(scale_examples(x0, mx)), -1)
        sd = jnp.sum(jnp.square(scale_examples(d0, md)), -1)
        return jnp.sum(sx * sd, -1), mx * md

    def example_norm(self, ing, b):
        """Example ``b``'s ``G`` formed alone (in feature blocks where it is large)."""
        x, dy = ing
        blocks = self._recompute_blocks(x.shape[0])
        return example_norm(lambda cut: self._tile_G(x, dy, b, 1, cut), blocks)

    def _recompute_blocks(self, B):
        """``(axis, size, n)``: the feature blocks of one example's ``G`` formed alone
        (the tiles' own where they cut one example, else `tiling.recompute_tile`), or
        None."""
        shape = (self.c.K, self.c.C, self.c.F)
        ft = self.feature_tile(B)
        if ft is not None:
            return ft[0], ft[1], shape[ft[0]]
        return tiling.recompute_tile(shape, self.acc, self.FEATURE_AXES, self.budget)

    # reporting -------------------------------------------------------------- #
    def rule(self, reduction, B):
        if reduction.weighted_by_norm:  # a clipped sum: the site computes the norms
            reduction = S.SqNorms()
        fast = self.fast_rule(reduction)
        if fast is not None and fast.rule is not None:
            rule = fast.rule(self, reduction, B)
        else:
            rule = self.tiled_rule(reduction, B)
        if reduction == S.SqNorms() and self.c.N > 1:  # the cost model's choice
            rule = dataclasses.replace(rule, candidates=self.norm_candidates(B))
        return rule

    def tiled_rule(self, reduction, B):
        """The rule of a reduction read from tiles of ``G_b`` (or a fused kernel's)."""
        c = self.c
        K, N, C, F = c.K, c.N, c.C, c.F
        if self._canonical_tokens() and fused.applies([reduction], self.acc, ()):
            return Rule(
                STREAMED, "fused per-example products (Pallas kernel)",
                float(2 * B * K * N * C * F), 0.0,
            )
        t, ft, shape = self.tile(B), self.feature_tile(B), (K, C, F)
        return Rule(
            STREAMED,
            f"tiled per-example products ({tiling.describe(t, ft, shape)})",
            float(2 * B * K * N * C * F + 2 * B * K * C * F),
            float(tiling.tile_bytes(t, ft, shape, self.acc) + t * self.tile_extra_bytes()),
        )


DenseKernel.FAST = {
    S.PhiSum: Fast(phi_value, phi_applies, phi_rule),
    S.SqNorms: Fast(
        lambda k, ctx, r: k.sq_norms(ctx),
        lambda k, r: k.c.N == 1 or k.use_ghost(),
        norms_rule,
    ),
    S.Centered: Fast(centered_value, lambda k, r: k.c.N == 1, centered_rule),
    R.CentralMoments: Fast(central_value, lambda k, r: k.c.N == 1, central_rule),
    S.KronSum: Fast(kron_value),
}
# weighted rules where the weights do not fold into the cotangents (Kernel.FAST_WEIGHTED)
DenseKernel.FAST_WEIGHTED = {
    S.PhiSum: Fast(
        weighted_phi_value,
        lambda k, r: r.multiplicative and not r.linear and k.c.N == 1,
        phi_rule,
    ),
    S.Centered: Fast(weighted_centered_value, lambda k, r: k.c.N == 1, centered_rule),
    R.CentralMoments: Fast(central_value, lambda k, r: k.c.N == 1, central_rule),
}

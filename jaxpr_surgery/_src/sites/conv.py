"""Convolution sites as dense sites over im2col patches (the patches are the tokens).

Per example the kernel gradient is ``G = P^T DY`` with ``P`` the patches
``[N, prod(k) * C_in]`` (spatial offsets major, input channels minor) and ``DY``
the output cotangent ``[N, C_out]``, ``N`` the output positions. Every dense rule
then applies: tiled per-example products, ghost norms, rank-one rules for 1x1
outputs.

The site keeps its input as it is (a transpose at most, no padded copy), never
the patches of the whole batch: the tile loop (tiling.py) pads the input of one
tile of examples, slices its patches, multiplies, reduces and moves on, so
memory is one tile's and XLA:CPU runs a plain 2-D matmul per example (measured
2-3x faster than the per-example VJP, a grouped convolution). The plain sum (the
mean) needs no per-example product: one convolution's kernel gradient over the
batch, as ``jax.grad`` computes it. A weighted sum (clipping) also sums in the
tile loop, one matmul per tile with the examples' patches stacked: run after the
norms, with nothing left to overlap, the batch's kernel-gradient convolution
measured 2x slower than that loop on XLA:CPU. Grouped convolutions (feature or
batch groups) keep the exact per-example VJP.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, dots, tiling
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.sites.base import Fast, Kernel, register
from jaxpr_surgery._src.sites.dense import DenseKernel
from jaxpr_surgery._src.sites.dense_layout import DenseLayout, Tokens
from jaxpr_surgery._src.sites.dense_rules import kron_value
from jaxpr_surgery._src.sites.generic import GenericKernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvLayout(DenseLayout):
    """A convolution site as a dense one over patches: ``ks`` the kernel's spatial
    sizes, ``osp`` the output's, ``lhs_spec`` / ``out_spec`` the input's and output's
    dimension numbers (batch, feature, spatial...)."""

    ks: tuple
    osp: tuple
    lhs_spec: tuple
    out_spec: tuple


def conv_canon(site) -> ConvLayout | None:
    """The `ConvLayout` of a conv site, or None for grouped convs."""
    prm = site.eqn.params
    if prm["feature_group_count"] != 1 or prm["batch_group_count"] != 1:
        return None
    lhs_spec, rhs_spec, out_spec = (tuple(int(i) for i in t) for t in prm["dimension_numbers"])
    w_shape = tuple(site.eqn.invars[1].aval.shape)
    ks = tuple(w_shape[i] for i in rhs_spec[2:])
    cin, cout = w_shape[rhs_spec[1]], w_shape[rhs_spec[0]]
    out_shape = tuple(site.eqn.outvars[0].aval.shape)
    osp = tuple(out_shape[i] for i in out_spec[2:])
    n_out = out_shape[out_spec[0]] * math.prod(osp)
    canon_w = rhs_spec[2:] + (rhs_spec[1], rhs_spec[0])  # (k..., C_in, C_out)
    return ConvLayout(
        kdims=(),
        cdims=ks + (cin,),
        fdims=(cout,),
        canon_w=canon_w,
        K=1,
        C=cin * math.prod(ks),
        F=cout,
        N=n_out,
        ks=ks,
        osp=osp,
        lhs_spec=lhs_spec,
        out_spec=out_spec,
        canon_shape=tuple(w_shape[i] for i in canon_w),
        inv_w=tuple(int(i) for i in np.argsort(canon_w)),
    )


class PatchConvKernel(DenseKernel):
    """A dense kernel whose ``x`` is the conv input ``[B, n, *spatial, C_in]``; `tokens`
    turns any slice of it into patches."""

    # blocks of one example's G cut the output channels: every block forms its
    # example's patches anew, so cutting them (C) would cost as much and slice more
    FEATURE_AXES = (2,)

    def __init__(self, site, acc_dtype):
        Kernel.__init__(self, site, acc_dtype)
        self.c = conv_canon(site)

    def dense_layout(self):
        return None  # its ingredients hold the conv input, not the patches

    def prepare(self, w, ext, ext_batched, dy):
        c = self.c
        x = ext[self.site.ext_vars.index(self.site.eqn.invars[0])]
        (dy,) = dy
        B = dy.shape[0]
        ls, o = c.lhs_spec, c.out_spec
        x = jnp.transpose(x, (0, 1 + ls[0]) + tuple(1 + i for i in ls[2:]) + (1 + ls[1],))
        d = jnp.transpose(dy, (0, 1 + o[0]) + tuple(1 + i for i in o[2:]) + (1 + o[1],))
        return Tokens(x.astype(self.acc), d.reshape(B, 1, c.N, c.F).astype(self.acc))

    def tile_extra_bytes(self):
        """A tile holds its examples' patches as well as their ``G``."""
        return tiling.bytes_of((self.c.N, self.c.C), self.acc)

    def _patches_exceed_G(self):
        """Where one example's patches are larger than its ``G`` (many output positions,
        few channels), statistics that would read the whole batch's patches (Kronecker
        factors, dots with a reference) read tiles of ``G`` instead."""
        return self.c.N > self.c.F

    def _view_tiles(self, ctx, r):
        x, dy = ctx
        return tiling.reduce_tiles(
            lambda b0, size: self.to_view(self._tile_G(x, dy, b0, size)),
            x.shape[0], [r], self.tile(x.shape[0]),
            shape=tuple(self.site.view_shape), dtype=self.acc,
        )[0]


    def dots(self, ctx, ref):
        if self._patches_exceed_G():
            return self._view_tiles(ctx, dots.BoundDot(ref))
        return super().dots(ctx, ref)

    def tokens(self, x):
        """Patches ``[b, 1, N, prod(k) * C_in]`` of ``x [b, n, *spatial, C_in]``: one
        strided slice per kernel offset, concatenated on channels."""
        c, prm = self.c, self.site.eqn.params
        b, n = x.shape[:2]
        pads = tuple(
            (int(lo), int(hi), int(d) - 1)
            for (lo, hi), d in zip(prm["padding"], prm["lhs_dilation"])
        )
        xs = jax.lax.pad(
            x.reshape((b * n,) + x.shape[2:]), jnp.zeros((), x.dtype),
            ((0, 0, 0),) + pads + ((0, 0, 0),),
        )
        strides, rdil = tuple(prm["window_strides"]), tuple(prm["rhs_dilation"])
        cols = []
        for off in itertools.product(*(range(k) for k in c.ks)):
            start = tuple(o * r for o, r in zip(off, rdil))
            limit = tuple(s + (m - 1) * st + 1 for s, m, st in zip(start, c.osp, strides))
            cols.append(
                jax.lax.slice(
                    xs, (0,) + start + (0,), (b * n,) + limit + (xs.shape[-1],),
                    (1,) + strides + (1,),
                )
            )
        P = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=-1)
        return P.reshape(b, 1, c.N, c.C)

    def contract(self, x, dy, c=None):
        """``sum_b c_b G_b``. The plain sum: the kernel gradient of one convolution over
        the batch (the transpose of the conv in its kernel), no patches. Weighted: tiles
        of examples, each one matmul of their stacked patches and scaled cotangents."""
        if c is not None:
            return self._weighted_tiles(x, dy * c.astype(dy.dtype)[:, None, None, None])
        cc, prm = self.c, self.site.eqn.params
        b, n = x.shape[:2]
        nsp = len(cc.ks)
        xs = x.reshape((b * n,) + x.shape[2:])
        d = dy.reshape((b * n,) + cc.osp + (cc.F,))
        sp = tuple(range(1, nsp + 1))
        dn = jax.lax.ConvDimensionNumbers(
            (0, nsp + 1) + sp, (nsp + 1, nsp) + tuple(range(nsp)), (0, nsp + 1) + sp
        )

        def conv(w):
            return jax.lax.conv_general_dilated(
                xs, w, tuple(prm["window_strides"]), tuple(map(tuple, prm["padding"])),
                lhs_dilation=tuple(prm["lhs_dilation"]), rhs_dilation=tuple(prm["rhs_dilation"]),
                dimension_numbers=dn,
            )

        # (typed inside shard_map as the data vary: the transpose of an invariant kernel
        # would sum each device's gradient over the devices; a zero only for its type)
        w = compat.make_varying(
            jnp.zeros(cc.ks + (cc.C // math.prod(cc.ks), cc.F), d.dtype),
            compat.vma_of(xs) | compat.vma_of(d))
        (g,) = jax.linear_transpose(conv, w)(d)
        return self.to_view(g.reshape(1, cc.C, cc.F))

    def _weighted_tiles(self, x, dy):
        B = x.shape[0]

        def tile_sum(b0, size):  # sum_b P_b^T DY_b of the tile, as one 2-D matmul
            P = self.tokens(compat.slice_at(x, b0, size, 0))
            d = compat.slice_at(dy, b0, size, 0)
            return jax.lax.dot_general(
                P.reshape(-1, self.c.C), d.reshape(-1, self.c.F), (((0,), (0,)), ((), ()))
            )

        return self.to_view(tiling.sum_tiles(tile_sum, B, self.tile(B))[None])


def _conv_kron(k, ctx, r):
    # where one example's patches are larger than its G: tiles of G, not the factors
    if k._patches_exceed_G():
        return k._view_tiles(ctx, r)
    return kron_value(k, ctx, r)


PatchConvKernel.FAST = {**DenseKernel.FAST, S.KronSum: Fast(_conv_kron)}


@register
class ConvKernel(Kernel):
    """Dense-over-patches, or the exact per-example VJP for grouped convolutions."""

    kind = "conv"
    anchors = (compat.conv_p,)

    @classmethod
    def matches(cls, eqn, tag, pos, patterns):
        return pos == [1] and not tag.pre  # the parameter is the kernel

    def __new__(cls, site, acc_dtype):
        lhs_batched = site.ext_batched[site.ext_vars.index(site.eqn.invars[0])]
        patches = conv_canon(site) is not None and lhs_batched
        k = (PatchConvKernel if patches else GenericKernel)(site, acc_dtype)
        k.kind = cls.kind  # (a dense or generic kernel, reported as a conv)
        return k

"""Convolution sites as dense sites over im2col patches (the patches are the tokens).

Per example the kernel gradient is ``G = P^T DY`` with ``P`` the patches
``[N, C_in * prod(k)]`` (channel-major, as ``lax.conv_general_dilated_patches``
orders them) and ``DY`` the output cotangent ``[N, C_out]``, ``N`` the output
positions. Every dense rule then applies: tiled per-example products, ghost
norms, rank-one rules for 1x1 outputs.

The patches take ``N * C_in * prod(k)`` per example against the exact
per-example VJP's ``C_in * prod(k) * C_out`` (the kernel's size), so a site uses
patches where ``N <= C_out`` (deep layers: few positions, many channels) and the
per-example VJP elsewhere (early layers, where the kernel is small). Grouped
convolutions (feature or batch groups) keep the exact per-example VJP.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src.sites.base import Kernel, register
from jaxpr_surgery._src.sites.dense import DenseKernel
from jaxpr_surgery._src.sites.generic import GenericKernel


def conv_canon(site):
    """Static layout of a conv site as a dense one, or None for grouped convs."""
    prm = site.eqn.params
    if prm["feature_group_count"] != 1 or prm["batch_group_count"] != 1:
        return None
    lhs_spec, rhs_spec, out_spec = (tuple(int(i) for i in t) for t in prm["dimension_numbers"])
    w_shape = tuple(site.eqn.invars[1].aval.shape)
    ks = tuple(w_shape[i] for i in rhs_spec[2:])
    cin, cout = w_shape[rhs_spec[1]], w_shape[rhs_spec[0]]
    out_shape = tuple(site.eqn.outvars[0].aval.shape)
    n_out = out_shape[out_spec[0]] * math.prod(out_shape[i] for i in out_spec[2:])
    canon_w = (rhs_spec[1],) + rhs_spec[2:] + (rhs_spec[0],)
    return dict(
        kdims=(),
        cdims=tuple(w_shape[i] for i in canon_w[:-1]),
        fdims=(cout,),
        canon_w=canon_w,
        K=1,
        C=cin * math.prod(ks),
        F=cout,
        N=n_out,
        ks=ks,
        lhs_spec=lhs_spec,
        out_spec=out_spec,
        canon_shape=tuple(w_shape[i] for i in canon_w),
        inv_w=tuple(int(i) for i in np.argsort(canon_w)),
    )


class _PatchConvKernel(DenseKernel):
    def __init__(self, site, acc_dtype):
        Kernel.__init__(self, site, acc_dtype)
        self.c = conv_canon(site)

    def prepare(self, w, ext, ext_batched, dy):
        c, prm = self.c, self.site.eqn.params
        x = ext[self.site.ext_vars.index(self.site.eqn.invars[0])]
        (dy,) = dy
        B = dy.shape[0]
        lhs = jnp.transpose(x.reshape((-1,) + x.shape[2:]), c["lhs_spec"])  # [n, C, *spatial]
        P = jax.lax.conv_general_dilated_patches(
            lhs,
            c["ks"],
            prm["window_strides"],
            prm["padding"],
            lhs_dilation=prm["lhs_dilation"],
            rhs_dilation=prm["rhs_dilation"],
        )  # [n, C_in * prod(k), *out spatial]
        P = jnp.moveaxis(P, 1, -1).reshape(B, 1, c["N"], c["C"])
        o = c["out_spec"]
        d = jnp.transpose(dy.reshape((-1,) + dy.shape[2:]), (o[0],) + o[2:] + (o[1],))
        return P.astype(self.acc), d.reshape(B, 1, c["N"], c["F"]).astype(self.acc)


@register("conv")
class ConvKernel(Kernel):
    """Dense-over-patches, or the exact per-example VJP for grouped convolutions."""

    def __new__(cls, site, acc_dtype):
        c = conv_canon(site)
        patches = c is not None and c["N"] <= c["F"]
        k = (_PatchConvKernel if patches else GenericKernel)(site, acc_dtype)
        k.kind = "conv"
        return k

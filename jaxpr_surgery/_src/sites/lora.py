"""Merged low-rank weights: a ``dot_general`` of the data with ``W + c * (L @ R)``.

A merged LoRA layer ``y = x @ (W + c * A @ B)`` (``W`` a constant or a trained leaf,
``A [d, r]`` and ``B [r, f]`` the adapters, or the transposed forms frameworks store)
has, per example ``b``, the merged weight's gradient ``G_b = X_b^T DY_b`` (dense.py), so

    g_A,b = c G_b B^T = X_b^T (c DY_b B^T),      g_B,b = c A^T G_b = (X_b A)^T (c DY_b):

each adapter is a dense site of its own whose input or cotangent is projected to the
rank ``r`` (``N x r`` per example). Every dense rule (contraction, rank-one forms,
ghost norms, tiles of ``[d, r]``) applies unchanged, and no per-example ``[d, f]``
tensor is formed. A trained base weight is a dense site of ``X`` and ``DY`` in its own
layout. The analysis (`analysis_types.Merged`) records the equation as a site of each leaf:
the first evaluates it, the others tap its cotangent (`analysis_types.Site.tap_of`).

In the product's axes ``P[u, v] = sum_k L[u, k] R[k, v]``, the site contracts the data
with one of ``u``, ``v``: with ``u`` (``x @ (W + A @ B)``) the rows ``U = X`` and the
columns ``V = DY``; with ``v`` (``x @ (W + B @ A).T``, weights stored ``[out, in]``)
``U = DY`` and ``V = X``. Then ``g_L = U^T (V R^T)`` and ``g_R = (U L)^T V``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jaxpr_surgery._src import compat
from jaxpr_surgery._src.sites.base import Kernel, MergedUse, register
from jaxpr_surgery._src.sites.dense import DenseKernel
from jaxpr_surgery._src.sites.dense_layout import DenseLayout, Tokens, canon, canonical


class LowRankLayout(NamedTuple):
    """A leaf's place in a merged low-rank weight at its site (`lowrank_layout`)."""

    role: str  # "L", "R" or "W": the product's left or right operand, or the base weight
    rows_in: bool  # the site contracts the data with the product's rows ``u``
    dims: tuple  # the product's contracted axes ``(lc, rc)`` (``(None, None)``: "W")
    canon_w: tuple  # the view's axes in its dense site's canonical order (`canon`)


def lowrank_layout(eqn, pre, base, pos):
    """Static layout of the site ``eqn`` (the weight at operand ``pos``) of a merged
    weight's leaf whose view ``base`` the steps ``pre`` carry to it, or None where it is
    not of the form served: a 2-D weight with no dot batch axes, reached from the
    product (first in ``pre``, for its factors) or the base weight by constant factors,
    one addition and transposes.

    Returns a `LowRankLayout`, or None."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    w_op = eqn.invars[pos]
    if lb or rb or len(w_op.aval.shape) != 2 or not pre:
        return None
    wc = int((lc if pos == 0 else rc)[0])
    prod = pre[0] if pre[0].primitive is compat.dot_general_p else None
    if prod is None:
        role, steps, dims = "W", pre, (None, None)
    elif base is prod.invars[0] or base is prod.invars[1]:
        role = "L" if base is prod.invars[0] else "R"
        (plc, prc), _ = prod.params["dimension_numbers"]
        steps, dims = pre[1:], (int(plc[0]), int(prc[0]))
    else:
        return None
    m = [0, 1]  # the product's (or base weight's) axis of each axis of the data
    for e in steps:
        if e.primitive is compat.transpose_p:
            m = [m[int(i)] for i in e.params["permutation"]]
    rows_in = m[wc] == 0
    if role == "W":
        canon_w = (m[wc], m[1 - wc])
    elif role == "L":  # canonical (u, k): L's free axis, then its contracted one
        canon_w = (1 - dims[0], dims[0])
    else:  # (k, v)
        canon_w = (dims[1], 1 - dims[1])
    return LowRankLayout(role, rows_in, dims, canon_w)


@register
class MergedLoraKernel(DenseKernel):
    """A site of a leaf of a merged low-rank weight ``W + c * (A @ B)``: a dense
    kernel over the data and the cotangent projected through the other factor."""

    kind = "merged-lora"
    anchors = (compat.dot_general_p,)
    priority = 1  # asked before the dense kernel (whose rules it reuses)

    @classmethod
    def matches(cls, eqn, tag, pos, patterns):
        pat = patterns.get(eqn.invars[pos[0]]) if len(pos) == 1 else None
        return (
            isinstance(pat, MergedUse)
            and lowrank_layout(eqn, tag.pre, tag.base, pos[0]) is not None
        )

    def __init__(self, site, acc_dtype):
        Kernel.__init__(self, site, acc_dtype)
        self.fold_side = None
        self.merged = canon(site)  # the dense site of the merged weight
        lay = lowrank_layout(site.eqn, site.pre, site.base, site.param_pos)
        self.role, self.rows_in, self.dims = lay.role, lay.rows_in, lay.dims
        canon_w = lay.canon_w
        shape = tuple(site.view_shape)
        canon_shape = tuple(shape[i] for i in canon_w)
        self.c = DenseLayout(
            kdims=(),
            cdims=canon_shape[:1],
            fdims=canon_shape[1:],
            canon_w=canon_w,
            K=1,
            C=canon_shape[0],
            F=canon_shape[1],
            N=self.merged.N,
            canon_shape=canon_shape,
            inv_w=tuple(int(i) for i in np.argsort(canon_w)),
        )

    def _other_factor(self, ext):
        """The product's other operand, as ``[k, v]`` (``R``) or ``[u, k]`` (``L``)."""
        prod = self.site.pre[0]
        if self.role == "L":
            r = ext[self.site.ext_vars.index(prod.invars[1])].astype(self.acc)
            return r if self.dims[1] == 0 else r.T
        left = ext[self.site.ext_vars.index(prod.invars[0])].astype(self.acc)
        return left if self.dims[0] == 1 else left.T

    def prepare(self, w, ext, ext_batched, dy):
        x, dy = canonical(self.site, self.merged, ext, dy, self.acc)  # of the merged weight
        if self.role == "W":
            return Tokens(x, dy)
        u, v = (x, dy) if self.rows_in else (dy, x)
        other = self._other_factor(ext)
        if self.role == "L":  # g_L = U^T (V R^T)
            return Tokens(u, v @ other.T)
        return Tokens(u @ other, v)  # g_R = (U L)^T V

    def ingredient_avals(self, B):
        c = self.c
        return Tokens(
            jax.ShapeDtypeStruct((B, 1, c.N, c.C), self.acc),
            jax.ShapeDtypeStruct((B, 1, c.N, c.F), self.acc),
        )

    def rule(self, reduction, B):
        """The dense rule of the adapter's site, plus its projection (``N x r`` per
        example, through the other factor)."""
        rl = super().rule(reduction, B)
        if self.role == "W":
            return rl
        m = self.merged
        big = m.F if self.rows_in == (self.role == "L") else m.C  # the side projected
        r = self.c.F if self.role == "L" else self.c.C
        return dataclasses.replace(
            rl, how=rl.how + " on a rank-r projection",
            flops=rl.flops + float(2 * B * m.N * big * r),
        )

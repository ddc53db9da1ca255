"""Generic sites: exact per-example VJP of the one op where the parameter meets data.

Covers scale-shift (layernorm / rmsnorm gain and bias, biases, positional
embeddings: a broadcast parameter multiplied or added), convolutions and any
other first-order op. Per-example gradients ``[B, *view]`` are materialised,
which is cheap when the parameter is small (gains, biases, kernels).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, flops
from jaxpr_surgery._src.sites.base import (
    Kernel,
    batches_every_operand,
    broadcast_unbatched,
    example_scale,
    register,
    register_default,
    scale_examples,
)


def composite(site):
    """``f(w, *ext) -> outs`` for one example: the absorbed pre-ops, then the site eqn."""
    eqn, pre, base, ext_vars = site.eqn, site.pre, site.base, site.ext_vars

    def f(w, *ext):
        env = {base: w}
        env.update(zip(ext_vars, ext))

        def read(v):
            return v.val if isinstance(v, compat.Literal) else env[v]

        for e in (*pre, eqn):
            outs = compat.bind_eqn(e, [read(v) for v in e.invars])
            env.update(zip(e.outvars, outs))
        return tuple(read(v) for v in eqn.outvars)

    return f


def per_example_vjp(site, w, ext, ext_batched, dy):
    """G [B, *w.shape]: per-example gradient of the site output w.r.t. ``w``.

    Where jax maps the site's primitive only with every operand batched
    (`base.batches_every_operand`: ``ragged_dot``), the view and the unbatched inputs
    are broadcast to the batch first (the result is ``B`` views anyway)."""
    f = composite(site)
    dys = dy if isinstance(dy, tuple) else (dy,)

    def one(w_b, ext_b, dy_b):
        _, pull = jax.vjp(lambda w_: f(w_, *ext_b), w_b)
        return pull(tuple(dy_b))[0]

    w_axis = None
    if batches_every_operand(site):
        B = jax.tree.leaves(dys)[0].shape[0]
        w, *ext = broadcast_unbatched((w, *ext), (False, *ext_batched), B)
        w_axis, ext_batched = 0, (True,) * len(ext)
    in_axes = (w_axis, tuple(0 if b else None for b in ext_batched), 0)
    return jax.vmap(one, in_axes=in_axes)(w, tuple(ext), dys)


@register_default
class GenericKernel(Kernel):
    """The exact per-example VJP of the site's equation: any site no other kernel
    serves."""

    kind = "generic"

    def prepare(self, w, ext, ext_batched, dy):
        return per_example_vjp(self.site, w, ext, ext_batched, dy).astype(self.acc)

    def materialise(self, ing):
        return ing

    def ingredient_avals(self, B):
        return jax.ShapeDtypeStruct((B,) + tuple(self.site.view_shape), self.acc)

    def rule(self, reduction, B):
        """The reduction from the materialised gradients (`Kernel.rule`), which the
        per-example VJP forms first: its FLOPs too (a fused dense layer's ``x_b^T dy_b``
        per example, as a dense site's tiles form them)."""
        rl = super().rule(reduction, B)
        vjp = B * flops.vjp_flops((*self.site.pre, self.site.eqn))
        return dataclasses.replace(rl, flops=rl.flops + vjp)

    def has_scaled_sq_norms(self, alone=False):
        return True

    def scaled_sq_norms(self, G):
        """Squares of ``G`` scaled to unit size per example: one more read of ``G``,
        which is small where it is materialised (gains, biases), no branch to compile."""
        s = example_scale(G)
        return jnp.sum(jnp.square(scale_examples(G, s)), axis=tuple(range(1, G.ndim))), s


# parameter-only steps a scale-shift site absorbs before it meets the data
_ABSORBABLE = (
    compat.broadcast_p,
    compat.reshape_p,
    compat.convert_p,
    compat.squeeze_p,
    compat.slice_p,
    compat.dynamic_slice_p,
)


@register
class ScaleShiftKernel(GenericKernel):
    """A gain, bias or positional embedding: the parameter (broadcast, reshaped,
    sliced) multiplied by or added to the data; the generic per-example VJP, named
    apart for explain."""

    kind = "scale-shift"
    anchors = (compat.mul_p, compat.add_p, compat.sub_p)

    @classmethod
    def matches(cls, eqn, tag, pos, patterns):
        return all(e.primitive in _ABSORBABLE for e in tag.pre)

"""The call the interpreter makes at each site (`make_site_fn`): the layer's forward, and a
backward pass that computes the site's requested reductions, or keeps its ingredients,
into its sink (a ``custom_vjp`` whose cotangent of the sink carries them out). Also the
reweighted site of a clipped sum's second pass (`make_weighted_site_fn`). The sink's
keys are `sink_keys.Key`s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, tiling
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src import sink_keys as K
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.norms import live_examples


def _site_key(sk, direct, want_ing, sink, combined=()):
    if sk is None:
        return None
    return (
        "site",
        sk,
        fp.value_key(direct),
        want_ing,
        jax.tree.structure(sink),
        tuple((tuple(x.shape), x.dtype) for x in jax.tree.leaves(sink)),
        combined,
    )


def _custom_vjp_tap(stats_impl, keep_sink=False):
    """A tap's custom_vjp: the identity on the equation's outputs, whose backward pass
    passes their cotangent on and emits the tap site's statistics (``stats_impl(w, ext,
    dy, sink)``) as the sink's cotangent; its view and inputs are read, not
    differentiated (the equation's own site gives their cotangents)."""

    @jax.custom_vjp
    def call(outs, w, ext, sink):
        return outs

    def fwd(outs, w, ext, sink):
        return outs, (w, ext, sink if keep_sink else None)

    def bwd(res, dy):
        w, ext, sink = res
        dy, out = stats_impl(w, ext, dy, sink)
        return dy, None, None, out

    call.defvjp(fwd, bwd)
    return call


def _custom_vjp_call(fwd_impl, bwd_impl, keep_sink=False):
    """The site's custom_vjp: the forward value, and the backward pass that also
    emits the statistics as the sink's cotangent. ``keep_sink``: the backward pass
    also reads the sink's value (running statistics of earlier chunks, `carried`)."""

    @jax.custom_vjp
    def call(w, ext, sink):
        return fwd_impl(w, ext)

    def fwd(w, ext, sink):
        return fwd_impl(w, ext), (w, ext, sink if keep_sink else None)

    def bwd(res, dy):
        w, ext, sink = res
        return bwd_impl(w, ext, dy, sink)

    call.defvjp(fwd, bwd)
    return call


def mask_examples(w, ext, ext_batched, dy):
    """The site's batched inputs and its cotangents with the examples of weight 0 read
    as zeros (a padded example's loss may be NaN: a token mean over no tokens), so that
    nothing computed from them at the site (statistics, norms, clip sums) sees it
    (`example_weights.kept`: within derivatives, only those that are not finite)."""
    rows = [x for x, b in zip(ext, ext_batched) if b] + jax.tree.leaves(dy)
    keep = ew.kept(w, rows)

    def mask(x):
        k = keep.reshape((-1,) + (1,) * (jnp.ndim(x) - 1))
        return jnp.where(k, x, jnp.zeros((), x.dtype))

    ext = tuple(mask(x) if b else x for x, b in zip(ext, ext_batched))
    return ext, jax.tree.map(mask, dy)


def weigh(direct, w, n0=0, W0=0.0):
    """``direct``'s reductions over examples weighted by ``w`` (`stats.Weighted`, counted
    from ``n0`` examples of weight ``W0``)."""
    return {k: S.Weighted(r, w, n0, W0) if S.weighs(r) else r for k, r in direct.items()}


def carried(kernel, ctx, direct, sink, B):
    """A site's statistics continuing the running ones of earlier chunks (api.py).

    The sink holds them (each `stats.carries` reduction of ``direct``, in the view's
    layout) and their count under `K.CARRY_COUNT`. The kernel starts its tile loops
    from those it names in `carried_keys`; the rest are merged here. The cotangent of
    the count is zero."""
    n = sink[K.CARRY_COUNT]
    init = {k: sink[k] for k, r in direct.items() if r.carries}
    keys = set(kernel.carried_keys(direct, B)) & set(init)
    run, after = direct, direct
    if K.EX_WEIGHTS in sink:  # tile loops from the carry count from it, the others from 0
        w, W0 = sink[K.EX_WEIGHTS], sink[K.CARRY_WEIGHT]
        after = weigh(direct, w, n, W0)  # (counted from the carry's first example)
        run = {k: after[k] if k in keys else r for k, r in weigh(direct, w).items()}
    out = kernel.direct_all(ctx, run, S.Carry({k: init[k] for k in keys}, n) if keys else None)
    for k in set(init) - keys:
        out[k] = after[k].accumulate(init[k], n, out[k], B)
    out[K.CARRY_COUNT] = compat.zeros_like_varying(n)
    return out


def make_site_fn(reduction_plan, cache, finish_first=False, combined=None):
    """Builds the custom_vjp-wrapped call for a site.

    ``reduction_plan(site) -> (direct_reductions: dict key->Reduction, want_ingredients)``.
    A site's custom_vjp, with its forward and backward computations as ``jax.jit``
    functions, is cached by `_site_key`, so the sites of repeated layers are traced once.

    ``combined(site) -> {key: (fn, reduction, combiner)}``: direct values combined
    across the devices at the site, ``fn(value, B)`` (`plans.combined_at_site`), before
    the barrier below, so that XLA combines them there.

    ``finish_first``: a site outside any scan finishes its statistics before the
    backward pass goes on to the layers below; otherwise XLA's scheduler may keep what
    they read (the site's input and cotangent) alive into those layers. Two
    optimization barriers order it:

    * the site's inputs and its cotangent pass one together before the statistics,
      so nothing computed from the input alone (a convolution's patches, ``x²``) is
      hoisted ahead into the backward pass of the layers above and kept alive
      through it;
    * the cotangent passes one with the statistics before the data cotangents, so
      the layer below's cotangent is allocated only once the statistics (and their
      scratch, and the input where nothing else reads it) are done.

    Measured, temp memory against grad: a barrier after the data cotangents alone took
    cnn E[g^2] 1.13x -> 0.99x and variance 1.38x -> 1.22x, MLP E[g^2] 1.87x -> 1.38x,
    long-sequence clipping 1.13x -> 0.96x. The two above then took the cnn (B=32)
    variance 8.32 -> 7.44 MiB (1.24x grad) and, in chunks of 8, E[g^2] 1.96 -> 1.59
    MiB (micro_grad at that memory: 1.62); no time lost. But scan-over-layers with
    remat 0.58x -> 0.77x for norms, so the engine sets it only for losses without
    ``jax.checkpoint``.
    """
    from jaxpr_surgery._src.sites.base import direct_norms
    from jaxpr_surgery._src.sites.generic import composite

    def build(site, kernel, ext_batched, direct, want_ing, sink_dtypes, key, fin, vmas):
        finish = finish_first and not site.scan_lengths

        def stats_impl(w, ext, dy, sink):
            """``(dy, statistics)``: the statistics start once the cotangent is there
            (x and dy through one barrier), and the data cotangents once they are done
            (dy and them)."""
            sx, sdy = jax.lax.optimization_barrier((ext, dy)) if finish else (ext, dy)
            ex_w = None if sink is None else sink.get(K.EX_WEIGHTS)
            if ex_w is not None:
                sx, sdy = mask_examples(ex_w, sx, ext_batched, sdy)
            ctx = kernel.prepare_site(w, sx, ext_batched, sdy)
            B = jax.tree.leaves(dy)[0].shape[0]

            def compute(req):
                if sink is not None and K.CARRY_COUNT in sink:
                    return carried(kernel, ctx, req, sink, B)
                return kernel.direct_all(ctx, req if ex_w is None else weigh(req, ex_w))

            with live_examples(None if ex_w is None else ew.live(ex_w)), tiling.anchored(
                    jax.tree.leaves(sdy)[0]):
                out = direct_norms(kernel, ctx, direct, compute)
            # (under a device split; with example weights, over the weighted examples)
            out = tiling.shared_values(direct if ex_w is None else weigh(direct, ex_w), out, B)
            for k, (fn, _, _) in fin.items():  # (typed as the sink: varying over its axes)
                out[k] = jax.tree.map(compat.make_varying, fn(out[k], B), vmas[k])
            if want_ing and not K.kept_as_ingredients(out):  # (else the tile loop's kept ones)
                out[K.INGREDIENTS] = (kernel.ingredients(ctx) if want_ing is K.Kept.ALL
                                      else tuple(sx) if want_ing is K.Kept.X else tuple(sdy))
            for k in (K.EX_WEIGHTS, K.CARRY_WEIGHT):  # (inputs: no cotangent)
                if sink is not None and k in sink:
                    out[k] = compat.zeros_like_varying(sink[k])
            out = jax.tree.map(lambda o, d: o.astype(d), out, sink_dtypes)
            if finish:
                # (a value combined at the site keeps its own axes: at jax 0.10, where a
                # barrier types its outputs by their union, `ordering_barrier` parts it
                # from dy; one element of it, typed as dy, keeps dy waiting on it)
                axes = frozenset().union(*map(compat.vma_of, jax.tree.leaves(dy)))
                ties = [compat.make_varying(jnp.ravel(x)[:1], axes)
                        for k in fin for x in jax.tree.leaves(out[k])]
                (dy, _), out = compat.ordering_barrier(((dy, ties), out))
            return dy, out

        keep = K.CARRY_COUNT in sink_dtypes or K.EX_WEIGHTS in sink_dtypes
        jit = (lambda f: f) if key is None else jax.jit  # no exact key: traced alone
        if site.tap_of is not None:
            return _custom_vjp_tap(jit(stats_impl), keep)
        F = kernel.forward(composite(site), ext_batched)

        def fwd_impl(w, ext):
            return F(w, *ext)

        def bwd_impl(w, ext, dy, sink):
            _, pull = jax.vjp(F, w, *ext)
            dy, out = stats_impl(w, ext, dy, sink)
            cts = pull(dy)
            return cts[0], tuple(cts[1:]), out

        return _custom_vjp_call(jit(fwd_impl), jit(bwd_impl), keep)

    def finishing(site, sink):
        fin = combined(site) if combined is not None else {}
        vmas = {k: jax.tree.map(compat.vma_of, sink[k]) for k in fin}
        axes = {k: tuple(tuple(sorted(compat.vma_of(x), key=str))
                         for x in jax.tree.leaves(sink[k])) for k in fin}
        return fin, vmas, tuple((k, at.key, axes[k]) for k, (_, _, at) in fin.items())

    def call_of(site, kernel, ext_batched, sink):
        direct, want_ing = reduction_plan(site)
        fin, vmas, fkey = finishing(site, sink)
        sk = cache.site_key(site, kernel)
        key = fp.keyed(lambda: _site_key(sk, direct, want_ing, sink, fkey))
        sink_dtypes = jax.tree.map(lambda s: s.dtype, sink)
        return cache.value(
            key, lambda: build(site, kernel, ext_batched, direct, want_ing, sink_dtypes, key,
                               fin, vmas)
        )

    def site_fn(site, kernel, w, ext, ext_batched, sink):
        return call_of(site, kernel, ext_batched, sink)(w, ext, sink)

    def tap(site, outs, kernel, w, ext, ext_batched, sink):
        """``outs`` (the outputs of the equation ``site`` taps), its statistics from
        their cotangent."""
        return call_of(site, kernel, ext_batched, sink)(outs, w, ext, sink)

    def key_of(site, kernel, sink):
        """The structural key of the call ``site_fn`` makes (None: not keyable)."""
        direct, want_ing = reduction_plan(site)
        fkey = finishing(site, sink)[2]
        sk = cache.site_key(site, kernel)
        return fp.keyed(lambda: _site_key(sk, direct, want_ing, sink, fkey))

    site_fn.key_of = key_of
    site_fn.tap = tap
    return site_fn


def make_weighted_site_fn(cache):
    """Builds the site call of a clipped sum's second pass (`engine.run` with remat).

    The sink holds, per clipped sum, the examples' weights ``c`` (``[B]``) under
    `K.WEIGHTS` and zeros in the site's view under `K.SUMS`; the backward pass, seeded with
    ones like the first, forms ``sum_b c_b G_b`` from the site's ``x`` and ``dy`` (the
    kernel's `weighted_sum`, in its accumulation dtype) and returns it as the cotangent
    of the zeros. So the weights meet the per-example gradients where the parameters
    meet the data, as in one pass, never at the loss: a float32 step of a float64
    model (an RNN scan accumulated in float32) rounds the same cotangents as the
    first pass, and a bfloat16 loss never rounds the weights. Only the weights are kept
    from the forward pass."""
    from jaxpr_surgery._src.sites.generic import composite

    def build(site, kernel, ext_batched, out_dtypes):
        def sums_of(w, ext, dy, weights, ex_w):
            if ex_w is not None:  # (the examples of weight 0 read as zeros)
                ext, dy = mask_examples(ex_w, ext, ext_batched, dy)
            ing = kernel.ingredients(kernel.prepare_site(w, ext, ext_batched, dy))
            return [kernel.weighted_sum(ing, c).astype(d) for c, d in zip(weights, out_dtypes)]

        def zeros(weights):
            return [compat.zeros_like_varying(c) for c in weights]

        if site.tap_of is not None:  # (interpreter._custom_vjp_tap)
            sums_j = jax.jit(sums_of)

            def stats(w, ext, dy, sink):
                ex_w = sink.get(K.EX_WEIGHTS)
                out = {K.WEIGHTS: zeros(sink[K.WEIGHTS]),
                       K.SUMS: sums_j(w, ext, dy, sink[K.WEIGHTS], ex_w)}
                if ex_w is not None:
                    out[K.EX_WEIGHTS] = zeros([ex_w])[0]
                return dy, out

            return _custom_vjp_tap(stats, keep_sink=True)
        F = kernel.forward(composite(site), ext_batched)

        def fwd_impl(w, ext):
            return F(w, *ext)

        def bwd_impl(w, ext, dy, weights, ex_w):
            _, pull = jax.vjp(F, w, *ext)
            sums = sums_of(w, ext, dy, weights, ex_w)
            cts = pull(dy)
            return cts[0], tuple(cts[1:]), sums

        fwd_j, bwd_j = jax.jit(fwd_impl), jax.jit(bwd_impl)

        @jax.custom_vjp
        def call(w, ext, sink):
            return fwd_j(w, ext)

        def fwd(w, ext, sink):
            return fwd_j(w, ext), (w, ext, sink[K.WEIGHTS], sink.get(K.EX_WEIGHTS))

        def bwd(res, dy):
            w, ext, weights, ex_w = res
            ct_w, ct_ext, sums = bwd_j(w, ext, dy, weights, ex_w)
            out = {K.WEIGHTS: zeros(weights), K.SUMS: sums}
            if ex_w is not None:
                out[K.EX_WEIGHTS] = zeros([ex_w])[0]
            return ct_w, ct_ext, out

        call.defvjp(fwd, bwd)
        return call

    def key_of(site, kernel, sink):
        sk = cache.site_key(site, kernel)
        return fp.keyed(lambda: sk and (
            "weighted-site", sk, jax.tree.structure(sink),
            tuple((tuple(x.shape), x.dtype) for x in jax.tree.leaves(sink)),
        ))

    def call_of(site, kernel, ext_batched, sink):
        key = key_of(site, kernel, sink)
        out_dtypes = [s.dtype for s in sink[K.SUMS]]
        return cache.value(key, lambda: build(site, kernel, ext_batched, out_dtypes))

    def site_fn(site, kernel, w, ext, ext_batched, sink):
        return call_of(site, kernel, ext_batched, sink)(w, ext, sink)

    def tap(site, outs, kernel, w, ext, ext_batched, sink):
        return call_of(site, kernel, ext_batched, sink)(outs, w, ext, sink)

    site_fn.key_of = key_of
    site_fn.tap = tap
    return site_fn


def traced_ingredient_avals(site, kernel, B):
    """The shapes of a site's ingredients for ``B`` examples, by tracing its kernel."""
    w = jax.ShapeDtypeStruct(site.view_shape, site.base.aval.dtype)
    ext = tuple(
        jax.ShapeDtypeStruct(((B,) if b else ()) + tuple(v.aval.shape), v.aval.dtype)
        for v, b in zip(site.ext_vars, site.ext_batched)
    )
    dy = tuple(jax.ShapeDtypeStruct((B,) + tuple(v.aval.shape), v.aval.dtype)
               for v in site.eqn.outvars)

    def f(w, ext, dy):
        return kernel.ingredients(kernel.prepare_site(w, ext, site.ext_batched, dy))

    return jax.eval_shape(f, w, ext, dy)

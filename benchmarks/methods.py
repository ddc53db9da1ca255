"""The methods compared, each a function ``(params, batch) -> statistic``.

``grad`` (the baseline), ``js`` (`jaxpr_surgery.per_example_stat`), ``js_chunk`` and
``js_fused`` (``js`` in chunks of B/4; with the fused Pallas kernel), ``vmap``
(``jax.vmap(jax.grad(per_example_loss))`` then the same reduction), ``micro_grad`` and
``micro_grad_mb`` (`optax.microbatching.micro_grad`, whole and in 4 microbatches) and
``grad_chunk`` (``jax.grad`` alone in chunks of B/4: the floor of the equal-memory methods).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import jaxpr_surgery as js
from benchmarks import models
from jaxpr_surgery._src import fused

CLIP_NORM = 1.0
ALL_STATS = ["mean", "second_moment", "variance", "sign_mean", "sq_norms", "clipped_mean",
             "mean+second_moment"]
# js_chunk: per_example_stat with chunk_size = B // 4, the memory of micro_grad_mb
BASELINES = ["js_chunk", "vmap", "micro_grad", "micro_grad_mb", "js_fused"]
N_MICROBATCHES = 4
KRON_MAX_DIM = 1024


def js_stat(name):
    return {
        "mean": js.stats.mean,
        "second_moment": js.stats.second_moment,
        "variance": js.stats.variance,
        "sign_mean": js.stats.sign_mean,
        "sq_norms": js.stats.sq_norms,
        "clipped_mean": lambda: js.stats.clipped_mean(CLIP_NORM),
        "mean+second_moment": lambda: (js.stats.mean(), js.stats.second_moment()),
        "kron_moments": lambda: js.stats.kron_moments(KRON_MAX_DIM),
        "kurtosis": js.stats.kurtosis,
    }[name]()


def kron_of(g):
    """One example's Kronecker moments from its materialised gradient (the contract)."""
    def leaf(x):
        out = []
        for j, n in enumerate(x.shape):
            u = jnp.moveaxis(x, j, 0).reshape(n, -1)
            out.append(u @ u.T if n <= KRON_MAX_DIM else jnp.sum(u * u, axis=1))
        return tuple(out)
    return jax.tree.map(leaf, g)


def _global_sq_norm(tree):
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


def reduce_stacked(name, G, B):
    """The statistic from stacked per-example gradients G (leaves [B, ...])."""
    tm = jax.tree.map
    if name == "mean":
        return tm(lambda g: jnp.mean(g, 0), G)
    if name == "second_moment":
        return tm(lambda g: jnp.mean(jnp.square(g), 0), G)
    if name == "variance":
        return tm(lambda g: jnp.var(g, 0, ddof=1), G)
    if name == "sign_mean":
        return tm(lambda g: jnp.mean(jnp.sign(g), 0), G)
    sq = sum(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), 1) for g in jax.tree.leaves(G))
    if name == "sq_norms":
        return sq
    if name == "clipped_mean":
        f = jnp.minimum(1.0, CLIP_NORM / jnp.sqrt(jnp.maximum(sq, 1e-30)))
        return tm(lambda g: jnp.mean(g * f.reshape((-1,) + (1,) * (g.ndim - 1)), 0), G)
    if name == "mean+second_moment":
        return (tm(lambda g: jnp.mean(g, 0), G), tm(lambda g: jnp.mean(jnp.square(g), 0), G))
    if name == "kron_moments":
        return tm(lambda x: jnp.mean(x, 0), jax.vmap(kron_of)(G))
    raise ValueError(name)


def _micro_transform(name):
    """(transform_fn, metrics_fn, finalize(result, metrics, B)) for micro_grad."""
    tm = jax.tree.map
    ident = lambda r, m, B: r  # noqa: E731
    if name == "mean":
        return (lambda g: g), (lambda g: None), ident
    if name == "second_moment":
        return (lambda g: tm(jnp.square, g)), (lambda g: None), ident
    if name == "variance":
        def fin(r, m, B):
            mu, m2 = r
            return tm(lambda a, b: (b - jnp.square(a)) * (B / (B - 1)), mu, m2)
        return (lambda g: (g, tm(jnp.square, g))), (lambda g: None), fin
    if name == "sign_mean":
        return (lambda g: tm(jnp.sign, g)), (lambda g: None), ident
    if name == "sq_norms":
        return (lambda g: jnp.zeros((), jnp.float32)), _global_sq_norm, (lambda r, m, B: m)
    if name == "clipped_mean":
        def clip(g):
            n = jnp.sqrt(jnp.maximum(_global_sq_norm(g), 1e-30))
            f = jnp.minimum(1.0, CLIP_NORM / n)
            return tm(lambda x: x * f, g)
        return clip, (lambda g: None), ident
    if name == "mean+second_moment":
        return (lambda g: (g, tm(jnp.square, g))), (lambda g: None), ident
    if name == "kron_moments":
        return kron_of, (lambda g: None), ident
    raise ValueError(name)


def microbatch_size_for(B):
    return max(1, B // N_MICROBATCHES)


def _chunked_grad(loss, B, mb):
    """``jax.grad`` of the mean loss computed over chunks of ``mb`` examples in a
    ``lax.scan`` (the memory of ``micro_grad_mb`` and ``js_chunk``, no statistics):
    what running the model a chunk at a time costs by itself."""
    if B % mb:
        raise ValueError(f"grad_chunk: batch {B} is not a multiple of the chunk {mb}")
    n = B // mb

    def f(p, b):
        chunks = jax.tree.map(lambda x: x.reshape((n, mb) + x.shape[1:]), b)

        def body(acc, chunk):
            g = jax.grad(loss)(p, chunk)
            return jax.tree.map(jnp.add, acc, g), None

        total = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), chunks)[0]
        return jax.tree.map(lambda t: t / n, total)
    return f


def make_method(model: models.Model, method: str, stat: str, B: int,
                microbatch_size: int | None = None, chunk_size: int | str | None = "auto"):
    loss = model.loss
    # the chunk of the equal-memory methods (grad_chunk, js_chunk, micro_grad_mb)
    mb = microbatch_size if microbatch_size is not None else microbatch_size_for(B)
    if method == "grad":
        return jax.grad(loss)
    if method == "js":
        return js.per_example_stat(loss, js_stat(stat), chunk_size=chunk_size)
    if method == "grad_chunk":  # the plain gradient, one chunk of B/4 at a time
        return _chunked_grad(loss, B, mb)
    if method == "js_chunk":  # equal memory to micro_grad_mb: the same chunk
        return js.per_example_stat(loss, js_stat(stat), chunk_size=mb)
    if method == "js_fused":  # js with the fused Pallas tile kernel (GPU only)
        inner = js.per_example_stat(loss, js_stat(stat), chunk_size=chunk_size)

        def fused_call(p, b):
            with fused.selected("pallas"):  # read while the call is traced
                return inner(p, b)
        return fused_call
    if method == "vmap":
        def per_example_loss(p, ex):
            return loss(p, jax.tree.map(lambda x: x[None], ex))

        def f(p, b):
            G = jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0))(p, b)
            return reduce_stacked(stat, G, B)
        return f
    if method in ("micro_grad", "micro_grad_mb"):
        transform, metrics, fin = _micro_transform(stat)
        mg = optax.microbatching.micro_grad(
            loss, argnums=0, batch_argnums=1, keep_batch_dim=True,
            microbatch_size=mb if method == "micro_grad_mb" else None,
            accumulator=optax.microbatching.AccumulationType.MEAN,
            transform_fn=transform, metrics_fn=metrics)

        def f(p, b):
            r, aux = mg(p, b)
            return fin(r, aux.metrics, B)
        return f
    raise ValueError(method)

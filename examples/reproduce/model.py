"""A small decoder-only byte-level transformer LM in plain JAX.

Learned positional embeddings, pre-LayerNorm blocks with causal multi-head
attention (einsum, per-head weights) and a GELU MLP (4d), a final LayerNorm and
a tied output embedding; the loss is next-token cross-entropy averaged over the
positions of each example, then over examples -- a mean of independent
per-example losses, as ``js.value_and_per_example_stat`` requires.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["init_params", "loss_fn", "n_params"]


def init_params(key, *, vocab=256, seq_len=64, d=64, heads=4, layers=2, mlp_ratio=4):
    """Parameters of the LM (GPT-2-like init: N(0, 0.02), residual outputs scaled)."""
    keys = iter(jax.random.split(key, 8 * layers + 4))
    dh = d // heads
    mlp = mlp_ratio * d
    res = 0.02 / np.sqrt(2 * layers)

    def normal(*shape, s=0.02):
        return s * jax.random.normal(next(keys), shape, jnp.float32)

    return {
        "embed": normal(vocab, d),
        "pos": normal(seq_len, d),
        "blocks": [
            {
                "ln1": {"g": jnp.ones(d), "b": jnp.zeros(d)},
                "wq": normal(d, heads, dh),
                "wk": normal(d, heads, dh),
                "wv": normal(d, heads, dh),
                "wo": normal(heads, dh, d, s=res),
                "ln2": {"g": jnp.ones(d), "b": jnp.zeros(d)},
                "w1": normal(d, mlp),
                "b1": jnp.zeros(mlp),
                "w2": normal(mlp, d, s=res),
                "b2": jnp.zeros(d),
            }
            for _ in range(layers)
        ],
        "ln_f": {"g": jnp.ones(d), "b": jnp.zeros(d)},
    }


def n_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def _layernorm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = jnp.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def _block(x, p):
    T = x.shape[1]
    h = _layernorm(x, p["ln1"])
    q = jnp.einsum("btd,dhk->bthk", h, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", h, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    a = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, axis=-1), v)
    x = x + jnp.einsum("bthk,hkd->btd", a, p["wo"])
    h = _layernorm(x, p["ln2"])
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss_fn(params, batch):
    """Mean over examples of each example's mean next-byte cross-entropy (nats)."""
    ids = batch["ids"]
    x = params["embed"][ids[:, :-1]] + params["pos"][: ids.shape[1] - 1]
    for p in params["blocks"]:
        x = _block(x, p)
    logits = _layernorm(x, params["ln_f"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll)

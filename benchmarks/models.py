"""Benchmark models, written the ordinary way: ``loss(params, batch)`` is the mean
over the batch of per-example losses, with no cross-example interaction.

Every builder takes the model's hyper-parameters and returns a :class:`Model`
whose ``make_batch(B)`` draws a batch of ``B`` examples and whose
``batch_spec(B)`` gives the same batch as ``jax.ShapeDtypeStruct`` leaves (used
to compile at large batch sizes without allocating anything).

Regimes (see ``benchmarks/run.py`` for the sizes actually used):

* ``mlp`` -- token-free MLP, 784 -> 1024 -> 10, ReLU, softmax cross-entropy.
* ``cnn`` -- small CNN on 28x28x1 images: conv3x3(16, SAME) -> conv3x3(32,
  stride 2, VALID) -> dense(10).
* ``transformer`` -- decoder-only LM: learned positions, pre-LayerNorm blocks
  with causal multi-head attention and a GELU MLP (4d), tied input/output
  embedding, next-token cross-entropy averaged over positions then examples.
  Used for the ``short`` (T < d), ``long`` (T >= d) and ``vocab`` (V >> d)
  regimes.
* ``scan_remat`` -- the same transformer with its layers stacked on a leading
  ``[L]`` axis, a ``lax.scan`` over layers and the block wrapped in
  ``jax.checkpoint`` (rematerialisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PyTree = Any

__all__ = ["Model", "mlp", "cnn", "transformer", "scan_remat", "lora", "n_params"]


class Model(NamedTuple):
    name: str
    loss: Callable[[PyTree, PyTree], jax.Array]
    params: PyTree
    make_batch: Callable[[int], PyTree]
    batch_spec: Callable[[int], PyTree]
    info: dict


def n_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


class _Rand:
    """numpy RNG (no XLA compilation for initialisation; eager jax.random ops each
    compile a kernel, which costs seconds on a loaded machine)."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def normal(self, shape, scale=1.0, offset=0.0):
        x = self.rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
        return jnp.asarray(x + np.float32(offset))

    def dense(self, fan_in, fan_out):
        return self.normal((fan_in, fan_out), 1.0 / math.sqrt(fan_in))


def _zeros(n):
    return jnp.asarray(np.zeros((n,), np.float32))


def _ones(n):
    return jnp.asarray(np.ones((n,), np.float32))


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def _layernorm(x, g, b, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + eps) * g + b


def _attention(h, wq, wk, wv, wo):
    q = jnp.einsum("btd,dhk->bthk", h, wq)
    k = jnp.einsum("btd,dhk->bthk", h, wk)
    v = jnp.einsum("btd,dhk->bthk", h, wv)
    t = q.shape[1]
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.asarray(-1e9, scores.dtype))
    w = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhts,bshk->bthk", w, v)
    return jnp.einsum("bthk,hkd->btd", out, wo)


def _spec(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# --------------------------------------------------------------------------- #
# Token-free models
# --------------------------------------------------------------------------- #
def mlp(din=784, hidden=1024, nclass=10, seed=0) -> Model:
    r = _Rand(seed)
    params = {
        "l1": {"w": r.dense(din, hidden), "b": _zeros(hidden)},
        "l2": {"w": r.dense(hidden, nclass), "b": _zeros(nclass)},
    }

    def loss(params, batch):
        h = jax.nn.relu(batch["x"] @ params["l1"]["w"] + params["l1"]["b"])
        logits = h @ params["l2"]["w"] + params["l2"]["b"]
        return jnp.mean(_xent(logits, batch["y"]))

    def make_batch(B, seed=1):
        g = np.random.default_rng(seed)
        return {"x": jnp.asarray(g.standard_normal((B, din), dtype=np.float32)),
                "y": jnp.asarray(g.integers(0, nclass, (B,), dtype=np.int32))}

    def batch_spec(B):
        return {"x": jax.ShapeDtypeStruct((B, din), jnp.float32),
                "y": jax.ShapeDtypeStruct((B,), jnp.int32)}

    info = {"model": "mlp", "din": din, "hidden": hidden, "nclass": nclass,
            "n_params": n_params(params)}
    return Model("mlp", loss, params, make_batch, batch_spec, info)


def cnn(size=28, c1=16, c2=32, nclass=10, seed=0) -> Model:
    r = _Rand(seed)
    s2 = (size - 3) // 2 + 1
    params = {
        "conv1": {"w": r.normal((3, 3, 1, c1), 1 / 3.0), "b": _zeros(c1)},
        "conv2": {"w": r.normal((3, 3, c1, c2), 1 / math.sqrt(9 * c1)), "b": _zeros(c2)},
        "head": {"w": r.dense(s2 * s2 * c2, nclass), "b": _zeros(nclass)},
    }
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(params, batch):
        h = lax.conv_general_dilated(batch["x"], params["conv1"]["w"], (1, 1), "SAME",
                                     dimension_numbers=dn)
        h = jax.nn.relu(h + params["conv1"]["b"])
        h = lax.conv_general_dilated(h, params["conv2"]["w"], (2, 2), "VALID",
                                     dimension_numbers=dn)
        h = jax.nn.relu(h + params["conv2"]["b"])
        h = h.reshape(h.shape[0], -1)
        logits = h @ params["head"]["w"] + params["head"]["b"]
        return jnp.mean(_xent(logits, batch["y"]))

    def make_batch(B, seed=1):
        g = np.random.default_rng(seed)
        return {"x": jnp.asarray(g.standard_normal((B, size, size, 1), dtype=np.float32)),
                "y": jnp.asarray(g.integers(0, nclass, (B,), dtype=np.int32))}

    def batch_spec(B):
        return {"x": jax.ShapeDtypeStruct((B, size, size, 1), jnp.float32),
                "y": jax.ShapeDtypeStruct((B,), jnp.int32)}

    info = {"model": "cnn", "size": size, "c1": c1, "c2": c2, "nclass": nclass,
            "n_params": n_params(params)}
    return Model("cnn", loss, params, make_batch, batch_spec, info)


# --------------------------------------------------------------------------- #
# Transformers
# --------------------------------------------------------------------------- #
def _token_batch_fns(T, V):
    def make_batch(B, seed=1):
        ids = np.random.default_rng(seed).integers(0, V, (B, T + 1), dtype=np.int32)
        return {"ids": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:])}

    def batch_spec(B):
        s = jax.ShapeDtypeStruct((B, T), jnp.int32)
        return {"ids": s, "targets": s}

    return make_batch, batch_spec


def _layer_params(r, d, heads, ff):
    k = d // heads
    return {
        "ln1_g": _ones(d), "ln1_b": _zeros(d),
        "wq": r.normal((d, heads, k), 1 / math.sqrt(d)),
        "wk": r.normal((d, heads, k), 1 / math.sqrt(d)),
        "wv": r.normal((d, heads, k), 1 / math.sqrt(d)),
        "wo": r.normal((heads, k, d), 1 / math.sqrt(d)),
        "ln2_g": _ones(d), "ln2_b": _zeros(d),
        "w1": r.dense(d, ff), "b1": _zeros(ff),
        "w2": r.dense(ff, d), "b2": _zeros(d),
    }


def _block(h, lp):
    a = _layernorm(h, lp["ln1_g"], lp["ln1_b"])
    h = h + _attention(a, lp["wq"], lp["wk"], lp["wv"], lp["wo"])
    m = _layernorm(h, lp["ln2_g"], lp["ln2_b"])
    return h + jax.nn.gelu(m @ lp["w1"] + lp["b1"]) @ lp["w2"] + lp["b2"]


def _lm_head(params, h, targets):
    h = _layernorm(h, params["lnf_g"], params["lnf_b"])
    logits = h @ params["embed"].T  # tied output embedding
    return jnp.mean(_xent(logits, targets))


def _lookup(embed, ids, out_sharding):
    """Rows ``ids`` of ``embed``; with ``out_sharding`` (a PartitionSpec of the result),
    typed for Explicit mesh axes, where a gather's output sharding must be said."""
    if out_sharding is None:
        return embed[ids]
    return embed.at[ids].get(out_sharding=out_sharding)


def _constrained(h, spec):
    """``h`` with the sharding constraint ``spec`` (a PartitionSpec, under the mesh of
    ``jax.set_mesh``), as MaxText constrains activations by logical axis rules; None: ``h``."""
    return h if spec is None else jax.lax.with_sharding_constraint(h, spec)


def transformer(T=32, d=256, V=8192, layers=2, heads=4, ff_mult=4, seed=0,
                name="transformer", lookup_sharding=None, activation_sharding=None) -> Model:
    """Decoder-only LM, Python loop over layers, tied embeddings, learned positions.
    ``lookup_sharding``: the embedding lookup's PartitionSpec, for Explicit mesh axes.
    ``activation_sharding``: a PartitionSpec the residual stream ``[B, T, d]`` is
    constrained to after the lookup and each block (`_constrained`)."""
    r = _Rand(seed)
    params = {
        "embed": r.normal((V, d), 0.02),
        "pos": r.normal((T, d), 0.02),
        "layers": [_layer_params(r, d, heads, ff_mult * d) for _ in range(layers)],
        "lnf_g": _ones(d), "lnf_b": _zeros(d),
    }

    def loss(params, batch):
        ids = batch["ids"]
        h = _lookup(params["embed"], ids, lookup_sharding) + params["pos"][: ids.shape[1]]
        h = _constrained(h, activation_sharding)
        for lp in params["layers"]:
            h = _constrained(_block(h, lp), activation_sharding)
        return _lm_head(params, h, batch["targets"])

    make_batch, batch_spec = _token_batch_fns(T, V)
    info = {"model": "transformer", "T": T, "d": d, "V": V, "layers": layers, "heads": heads,
            "ff": ff_mult * d, "tied": True, "n_params": n_params(params)}
    return Model(name, loss, params, make_batch, batch_spec, info)


def scan_remat(T=32, d=128, V=2048, layers=4, heads=4, ff_mult=4, seed=0,
               lookup_sharding=None, activation_sharding=None) -> Model:
    """Same transformer, layers stacked on [L], lax.scan over jax.checkpoint(block)
    (``activation_sharding``: as `transformer`'s, inside the checkpointed block)."""
    r = _Rand(seed)
    per_layer = [_layer_params(r, d, heads, ff_mult * d) for _ in range(layers)]
    params = {
        "embed": r.normal((V, d), 0.02),
        "pos": r.normal((T, d), 0.02),
        "layers": jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *per_layer),
        "lnf_g": _ones(d), "lnf_b": _zeros(d),
    }
    block = jax.checkpoint(lambda h, lp: _constrained(_block(h, lp), activation_sharding))

    def loss(params, batch):
        ids = batch["ids"]
        h = _lookup(params["embed"], ids, lookup_sharding) + params["pos"][: ids.shape[1]]
        h = _constrained(h, activation_sharding)
        h, _ = lax.scan(lambda c, lp: (block(c, lp), None), h, params["layers"])
        return _lm_head(params, h, batch["targets"])

    make_batch, batch_spec = _token_batch_fns(T, V)
    info = {"model": "scan_remat", "T": T, "d": d, "V": V, "layers": layers, "heads": heads,
            "ff": ff_mult * d, "tied": True, "scan": True, "remat": True,
            "n_params": n_params(params)}
    return Model("scan_remat", loss, params, make_batch, batch_spec, info)


# --------------------------------------------------------------------------- #
# LoRA adapters on a frozen weight (issue 36)
# --------------------------------------------------------------------------- #
def lora(T=32, D=256, F=1024, r=8, merged=True, seed=0) -> Model:
    """One LoRA layer on tokens, adapters only (``W`` frozen, closed over):
    ``tanh(x @ (W + (alpha / r) A @ B))`` (``merged``) or ``tanh(x @ W + (alpha / r) (x @ A)
    @ B)``, squared error against a target."""
    r_ = _Rand(seed)
    w = r_.dense(D, F)  # frozen
    params = {"A": r_.normal((D, r), 1.0 / math.sqrt(D)), "B": r_.normal((r, F), 0.02)}
    scale = 16.0 / r  # alpha / r

    def loss(params, batch):
        x = batch["x"]
        if merged:
            y = x @ (w + scale * (params["A"] @ params["B"]))
        else:
            y = x @ w + scale * ((x @ params["A"]) @ params["B"])
        return jnp.mean(jnp.square(jnp.tanh(y) - batch["y"]))

    def make_batch(B, seed=1):
        g = np.random.default_rng(seed)
        return {"x": jnp.asarray(g.standard_normal((B, T, D), dtype=np.float32)),
                "y": jnp.asarray(g.standard_normal((B, T, F), dtype=np.float32) * 0.5)}

    def batch_spec(B):
        return {"x": jax.ShapeDtypeStruct((B, T, D), jnp.float32),
                "y": jax.ShapeDtypeStruct((B, T, F), jnp.float32)}

    name = "merged_lora" if merged else "lora"
    info = {"model": name, "T": T, "D": D, "F": F, "r": r, "merged": merged,
            "n_params": n_params(params)}
    return Model(name, loss, params, make_batch, batch_spec, info)

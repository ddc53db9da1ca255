"""A zoo of small models for testing per-example gradient statistics.

Every entry is ``make_<name>(dtype=jnp.float32, key=...) -> ZooCase`` where
``case.loss_fn(params, batch)`` is a scalar *mean over the batch* of per-example
losses with no cross-example interaction, and every leaf of ``batch`` carries
examples on axis 0.

Random values are drawn in float32 and then cast to ``dtype``, so the float32
and float64 instances of a case hold the same values (the float64 instance is a
high-precision reference for the float32 one). Build a float64 case inside
``with x64():`` (``jax.enable_x64(True)``) and use it only inside such a block.

``per_example_loss(case)`` and ``per_example_grads(case)`` give the reference
per-example quantities, and ``oracle(case, stat_name, **kw)`` computes every
statistic of ``api.md`` from ``jax.vmap(jax.grad(per_example_loss))`` with the
reduction done in numpy float64.

Framework models (flax linen / nnx, equinox, haiku) import their framework
lazily, so this module imports with plain JAX alone.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PyTree = Any

__all__ = [
    "ZooCase",
    "ZOO",
    "CORE_ZOO",
    "FRAMEWORK_ZOO",
    "LOW_PRECISION",
    "x64",
    "get_case",
    "per_example_loss",
    "per_example_grads",
    "oracle",
    "oracle_scale",
    "STAT_NAMES",
]


class ZooCase(NamedTuple):
    name: str
    loss_fn: Callable[[PyTree, PyTree], jax.Array]
    params: PyTree
    batch: PyTree


def x64():
    """Context manager enabling 64-bit types (``jax.enable_x64(True)`` in jax 0.10)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is not None:
        return enable(True)
    from jax.experimental import enable_x64  # older jax

    return enable_x64()


def _is_f64(tree) -> bool:
    return any(getattr(x, "dtype", None) == np.float64 for x in jax.tree.leaves(tree))


def _maybe_x64(tree):
    return x64() if _is_f64(tree) else contextlib.nullcontext()


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
class _Rand:
    """Draws float32 normals / ints (numpy, so no compilation), cast to ``dtype``.

    ``key`` is an int seed or a ``jax.random`` key (its data seeds numpy).
    """

    def __init__(self, key, dtype):
        if not isinstance(key, (int, np.integer)):
            key = [int(k) for k in np.asarray(jax.random.key_data(key)).ravel()]
        self.rng = np.random.default_rng(key)
        self.dtype = dtype

    def _next(self):
        """A fresh ``jax.random`` key (for framework initialisers)."""
        return jax.random.PRNGKey(int(self.rng.integers(0, 2**31 - 1)))

    def normal(self, shape, scale=1.0, offset=0.0):
        x = (self.rng.standard_normal(shape) * scale + offset).astype(np.float32)
        return jnp.asarray(x, dtype=self.dtype)

    def dense(self, fan_in, fan_out, scale=1.0):
        return self.normal((fan_in, fan_out), scale / math.sqrt(fan_in))

    def ints(self, shape, high):
        return jnp.asarray(self.rng.integers(0, high, size=shape), dtype=jnp.int32)


def _xent(logits, labels):
    """Per-position softmax cross-entropy (computed in float32 or wider)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def _layernorm(x, g, b, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + eps) * g + b


def _rmsnorm(x, g, eps=1e-6):
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * lax.rsqrt(ms + eps) * g


def _causal_attention(h, wq, wk, wv, wo):
    """Multi-head causal self-attention; projections as einsums."""
    q = jnp.einsum("btd,dhk->bthk", h, wq)
    k = jnp.einsum("btd,dhk->bthk", h, wk)
    v = jnp.einsum("btd,dhk->bthk", h, wv)
    return _attend(q, k, v, wo)


def _attend(q, k, v, wo):
    t = q.shape[1]
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.asarray(-1e9, scores.dtype))
    w = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhts,bshk->bthk", w, v)
    return jnp.einsum("bthk,hkd->btd", out, wo)


# --------------------------------------------------------------------------- #
# Plain JAX models
# --------------------------------------------------------------------------- #
def make_mlp(dtype=jnp.float32, key=0) -> ZooCase:
    """Three dense layers with bias (tanh, relu), softmax cross-entropy."""
    r = _Rand(key, dtype)
    B, D, H, C = 6, 5, 8, 4
    params = {
        "l1": {"w": r.dense(D, H), "b": r.normal((H,), 0.3)},
        "l2": {"w": r.dense(H, H), "b": r.normal((H,), 0.3)},
        "l3": {"w": r.dense(H, C), "b": r.normal((C,), 0.3)},
    }
    batch = {"x": r.normal((B, D)), "y": r.ints((B,), C)}

    def loss_fn(params, batch):
        h = jnp.tanh(batch["x"] @ params["l1"]["w"] + params["l1"]["b"])
        h = jax.nn.relu(h @ params["l2"]["w"] + params["l2"]["b"])
        logits = h @ params["l3"]["w"] + params["l3"]["b"]
        return jnp.mean(_xent(logits, batch["y"]))

    return ZooCase("mlp", loss_fn, params, batch)


def make_cnn(dtype=jnp.float32, key=1) -> ZooCase:
    """2-D convs: NHWC/HWIO SAME, then NCHW/OIHW strided VALID; dense head, cross-entropy."""
    r = _Rand(key, dtype)
    B, S, Cin, C1, C2, K = 5, 6, 2, 4, 3, 3
    params = {
        "conv1": {
            "w": r.normal((3, 3, Cin, C1), 1 / math.sqrt(9 * Cin)),
            "b": r.normal((C1,), 0.3),
        },
        # OIHW layout
        "conv2": {"w": r.normal((C2, C1, 3, 3), 1 / math.sqrt(9 * C1)), "b": r.normal((C2,), 0.3)},
        "head": {"w": r.dense(2 * 2 * C2, K), "b": r.normal((K,), 0.3)},
    }
    batch = {"x": r.normal((B, S, S, Cin)), "y": r.ints((B,), K)}

    def loss_fn(params, batch):
        x = batch["x"]
        h = lax.conv_general_dilated(
            x, params["conv1"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        h = jnp.tanh(h + params["conv1"]["b"])
        h = jnp.transpose(h, (0, 3, 1, 2))  # NCHW
        h = lax.conv_general_dilated(
            h, params["conv2"]["w"], (2, 2), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        h = jnp.tanh(h + params["conv2"]["b"][:, None, None])  # [B, C2, 2, 2]
        h = h.reshape(h.shape[0], -1)
        logits = h @ params["head"]["w"] + params["head"]["b"]
        return jnp.mean(_xent(logits, batch["y"]))

    return ZooCase("cnn", loss_fn, params, batch)


def make_cnn1d(dtype=jnp.float32, key=2) -> ZooCase:
    """1-D convs (NWC): grouped + dilated, transposed (lhs-dilated), SAME; params a list,
    batch a tuple ``(x, y)``."""
    r = _Rand(key, dtype)
    B, W, Cin, C1, C2, K = 4, 10, 3, 6, 4, 3
    params = [
        # feature_group_count=3: kernel in-features = Cin / 3 = 1
        {"w": r.normal((3, 1, C1), 0.6), "b": r.normal((C1,), 0.3)},
        {"w": r.normal((2, C1, C1), 1 / math.sqrt(2 * C1))},  # transposed conv
        {"w": r.normal((3, C1, C2), 1 / math.sqrt(3 * C1))},
        {"w": r.dense(C2, K), "b": r.normal((K,), 0.3)},
    ]
    batch = (r.normal((B, W, Cin)), r.ints((B,), K))
    dn = ("NWC", "WIO", "NWC")

    def loss_fn(params, batch):
        x, y = batch
        p1, p2, p3, head = params
        h = lax.conv_general_dilated(
            x,
            p1["w"],
            (1,),
            "VALID",
            rhs_dilation=(2,),
            dimension_numbers=dn,
            feature_group_count=3,
        )
        h = jax.nn.relu(h + p1["b"])  # [B, 6, C1]
        h = lax.conv_general_dilated(
            h, p2["w"], (1,), [(1, 1)], lhs_dilation=(2,), dimension_numbers=dn
        )
        h = jnp.tanh(h)  # [B, 12, C1]
        h = lax.conv_general_dilated(h, p3["w"], (2,), "SAME", dimension_numbers=dn)
        h = jnp.mean(jnp.tanh(h), axis=1)
        logits = h @ head["w"] + head["b"]
        return jnp.mean(_xent(logits, y))

    return ZooCase("cnn1d", loss_fn, params, batch)


def _token_batch(r, B, T, V, with_mask):
    ids = r.ints((B, T + 1), V)
    batch = {"ids": ids[:, :-1], "targets": ids[:, 1:]}
    if with_mask:
        # example b keeps its first `lengths[b]` tokens (>= 1), the rest is padding
        lengths = jnp.array([T, 2, T - 1, 1, 4, T][:B], dtype=jnp.int32)
        batch["mask"] = jnp.arange(T)[None, :] < lengths[:, None]
    return batch


def make_transformer(dtype=jnp.float32, key=3) -> ZooCase:
    """Decoder-only LM: table[ids] + pos[:T], pre-LN blocks, tied output, padding mask."""
    r = _Rand(key, dtype)
    B, T, V, D, H, K, F, L, MAXLEN = 6, 6, 11, 8, 2, 4, 16, 2, 8
    layers = []
    for _ in range(L):
        layers.append(
            {
                "ln1": {"g": r.normal((D,), 0.1, 1.0), "b": r.normal((D,), 0.1)},
                "wq": r.normal((D, H, K), 1 / math.sqrt(D)),
                "wk": r.normal((D, H, K), 1 / math.sqrt(D)),
                "wv": r.normal((D, H, K), 1 / math.sqrt(D)),
                "wo": r.normal((H, K, D), 1 / math.sqrt(H * K)),
                "ln2": {"g": r.normal((D,), 0.1, 1.0), "b": r.normal((D,), 0.1)},
                "w1": r.dense(D, F),
                "b1": r.normal((F,), 0.1),
                "w2": r.dense(F, D),
                "b2": r.normal((D,), 0.1),
            }
        )
    params = {
        "embed": r.normal((V, D), 0.5),
        "pos": r.normal((MAXLEN, D), 0.3),
        "layers": layers,
        "lnf": {"g": r.normal((D,), 0.1, 1.0), "b": r.normal((D,), 0.1)},
    }
    batch = _token_batch(r, B, T, V, with_mask=True)

    def loss_fn(params, batch):
        ids = batch["ids"]
        t = ids.shape[1]
        table = params["embed"]
        h = table[ids] + params["pos"][:t]
        for lp in params["layers"]:
            a = _layernorm(h, lp["ln1"]["g"], lp["ln1"]["b"])
            h = h + _causal_attention(a, lp["wq"], lp["wk"], lp["wv"], lp["wo"])
            m = _layernorm(h, lp["ln2"]["g"], lp["ln2"]["b"])
            h = h + jax.nn.gelu(m @ lp["w1"] + lp["b1"]) @ lp["w2"] + lp["b2"]
        h = _layernorm(h, params["lnf"]["g"], params["lnf"]["b"])
        logits = h @ table.T  # tied output embedding
        nll = _xent(logits, batch["targets"])
        mask = batch["mask"].astype(nll.dtype)
        per_example = jnp.sum(nll * mask, axis=1) / jnp.sum(mask, axis=1)
        return jnp.mean(per_example)

    return ZooCase("transformer", loss_fn, params, batch)


def make_transformer_rms_swiglu(dtype=jnp.float32, key=4) -> ZooCase:
    """RMSNorm (gain only) + SwiGLU, fused QKV einsum, per-head output projection with the
    head as a dot batch dim, scalar gate ``alpha`` and scalar ``logit_scale`` (used through
    exp), jnp.take embedding, untied head."""
    r = _Rand(key, dtype)
    B, T, V, D, H, K, F = 5, 5, 13, 8, 2, 4, 12
    params = {
        "embed": r.normal((V, D), 0.5),
        "block": {
            "norm1": r.normal((D,), 0.1, 1.0),
            "wqkv": r.normal((D, 3, H, K), 1 / math.sqrt(D)),
            "wo": r.normal((H, K, D), 1 / math.sqrt(H * K)),
            "norm2": r.normal((D,), 0.1, 1.0),
            "w_gate": r.dense(D, F),
            "w_up": r.dense(D, F),
            "w_down": r.dense(F, D),
            "alpha": r.normal((), 0.1, 0.8),
        },
        "norm_f": r.normal((D,), 0.1, 1.0),
        "head": r.dense(D, V),
        "logit_scale": r.normal((), 0.1),
    }
    batch = _token_batch(r, B, T, V, with_mask=False)

    def loss_fn(params, batch):
        p = params["block"]
        h = jnp.take(params["embed"], batch["ids"], axis=0)
        a = _rmsnorm(h, p["norm1"])
        qkv = jnp.einsum("btd,dchk->btchk", a, p["wqkv"])
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        t = q.shape[1]
        scores = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(K)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        w = jax.nn.softmax(jnp.where(causal, scores, jnp.asarray(-1e9, scores.dtype)), axis=-1)
        out = jnp.einsum("bhts,bshk->bthk", w, v)
        # per-head projection: h is a batch dimension of the dot_general, summed after
        h = h + jnp.einsum("bthk,hkd->bthd", out, p["wo"]).sum(axis=2)
        m = _rmsnorm(h, p["norm2"])
        h = h + p["alpha"] * ((jax.nn.silu(m @ p["w_gate"]) * (m @ p["w_up"])) @ p["w_down"])
        logits = (_rmsnorm(h, params["norm_f"]) @ params["head"]) * jnp.exp(params["logit_scale"])
        return jnp.mean(_xent(logits, batch["targets"]))

    return ZooCase("transformer_rms_swiglu", loss_fn, params, batch)


def make_transformer_scan_remat(dtype=jnp.float32, key=5) -> ZooCase:
    """Layers stacked on a leading [L] axis, lax.scan over layers, body in jax.checkpoint."""
    r = _Rand(key, dtype)
    B, T, V, D, H, K, F, L = 4, 5, 9, 8, 2, 4, 16, 3
    params = {
        "embed": r.normal((V, D), 0.5),
        "pos": r.normal((T, D), 0.3),
        "layers": {
            "ln1_g": r.normal((L, D), 0.1, 1.0),
            "ln1_b": r.normal((L, D), 0.1),
            "wq": r.normal((L, D, H, K), 1 / math.sqrt(D)),
            "wk": r.normal((L, D, H, K), 1 / math.sqrt(D)),
            "wv": r.normal((L, D, H, K), 1 / math.sqrt(D)),
            "wo": r.normal((L, H, K, D), 1 / math.sqrt(H * K)),
            "ln2_g": r.normal((L, D), 0.1, 1.0),
            "ln2_b": r.normal((L, D), 0.1),
            "w1": r.normal((L, D, F), 1 / math.sqrt(D)),
            "b1": r.normal((L, F), 0.1),
            "w2": r.normal((L, F, D), 1 / math.sqrt(F)),
            "b2": r.normal((L, D), 0.1),
        },
        "lnf": {"g": r.normal((D,), 0.1, 1.0), "b": r.normal((D,), 0.1)},
        "head": {"w": r.dense(D, V), "b": r.normal((V,), 0.1)},
    }
    batch = _token_batch(r, B, T, V, with_mask=False)

    @jax.checkpoint
    def block(h, lp):
        a = _layernorm(h, lp["ln1_g"], lp["ln1_b"])
        h = h + _causal_attention(a, lp["wq"], lp["wk"], lp["wv"], lp["wo"])
        m = _layernorm(h, lp["ln2_g"], lp["ln2_b"])
        return h + jnp.tanh(m @ lp["w1"] + lp["b1"]) @ lp["w2"] + lp["b2"]

    def loss_fn(params, batch):
        h = params["embed"][batch["ids"]] + params["pos"]
        h, _ = lax.scan(lambda c, lp: (block(c, lp), None), h, params["layers"])
        h = _layernorm(h, params["lnf"]["g"], params["lnf"]["b"])
        logits = h @ params["head"]["w"] + params["head"]["b"]
        return jnp.mean(_xent(logits, batch["targets"]))

    return ZooCase("transformer_scan_remat", loss_fn, params, batch)


def make_rnn(dtype=jnp.float32, key=6) -> ZooCase:
    """GRU over T steps with lax.scan (weights closed over as scan constants), MSE head."""
    r = _Rand(key, dtype)
    B, T, D, Hd, O = 5, 6, 3, 5, 2
    params = {
        "W": r.normal((D, 3 * Hd), 1 / math.sqrt(D)),
        "U": r.normal((Hd, 3 * Hd), 1 / math.sqrt(Hd)),
        "b": r.normal((3 * Hd,), 0.2),
        "h0": r.normal((Hd,), 0.3),
        "out": {"w": r.dense(Hd, O), "b": r.normal((O,), 0.2)},
    }
    batch = {"x": r.normal((B, T, D)), "y": r.normal((B, O))}

    def loss_fn(params, batch):
        x = batch["x"]
        W, U, b = params["W"], params["U"], params["b"]

        def step(h, xt):
            gx = xt @ W + b
            gh = h @ U
            z = jax.nn.sigmoid(gx[:, :Hd] + gh[:, :Hd])
            rr = jax.nn.sigmoid(gx[:, Hd : 2 * Hd] + gh[:, Hd : 2 * Hd])
            n = jnp.tanh(gx[:, 2 * Hd :] + rr * gh[:, 2 * Hd :])
            h = (1 - z) * n + z * h
            return h, h

        h0 = jnp.broadcast_to(params["h0"], (x.shape[0], Hd))
        h, hs = lax.scan(step, h0, jnp.swapaxes(x, 0, 1))
        pred = jnp.mean(hs, axis=0) @ params["out"]["w"] + params["out"]["b"]
        return jnp.mean(jnp.sum(jnp.square(pred - batch["y"]), axis=-1))

    return ZooCase("rnn", loss_fn, params, batch)


def make_mlp_bf16(dtype=jnp.float32, key=7) -> ZooCase:
    """Master params in ``dtype`` cast to bfloat16 in the loss; loss returned in float32."""
    r = _Rand(key, dtype)
    B, D, H, C = 6, 8, 16, 5
    params = {
        "l1": {"w": r.dense(D, H), "b": r.normal((H,), 0.3)},
        "l2": {"w": r.dense(H, C), "b": r.normal((C,), 0.3)},
    }
    batch = {"x": r.normal((B, D)), "y": r.ints((B,), C)}

    def loss_fn(params, batch):
        p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
        x = batch["x"].astype(jnp.bfloat16)
        h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
        logits = (h @ p["l2"]["w"] + p["l2"]["b"]).astype(jnp.float32)
        return jnp.mean(_xent(logits, batch["y"]))

    return ZooCase("mlp_bf16", loss_fn, params, batch)


def make_onehot_embedding(dtype=jnp.float32, key=8) -> ZooCase:
    """Embedding as one_hot(ids) @ table, mean-pooled; head weight on the left of its
    einsum; params a tuple ``(table, head)``."""
    r = _Rand(key, dtype)
    B, T, V, D, C = 6, 4, 10, 6, 3
    params = (
        r.normal((V, D), 0.7),
        {"w": r.normal((C, D), 1 / math.sqrt(D)), "b": r.normal((C,), 0.3)},
    )
    batch = {"ids": r.ints((B, T), V), "y": r.ints((B,), C)}

    def loss_fn(params, batch):
        table, head = params
        e = jax.nn.one_hot(batch["ids"], table.shape[0], dtype=table.dtype) @ table
        h = jnp.tanh(jnp.mean(e, axis=1))
        logits = jnp.einsum("cd,bd->bc", head["w"], h) + head["b"]
        return jnp.mean(_xent(logits, batch["y"]))

    return ZooCase("onehot_embedding", loss_fn, params, batch)


def make_weight_decay_lora(dtype=jnp.float32, key=9) -> ZooCase:
    """x @ (W + A @ B) + b, weight decay 1e-2 * sum(W**2) in the loss, and a matrix ``S``
    shared by two dense layers."""
    r = _Rand(key, dtype)
    Bn, D, H, R, C = 5, 6, 7, 2, 4
    params = {
        "W": r.dense(D, H),
        "A": r.normal((D, R), 0.3),
        "B": r.normal((R, H), 0.3),
        "b": r.normal((H,), 0.3),
        "S": r.dense(H, H),
        "head": {"w": r.dense(H, C), "b": r.normal((C,), 0.3)},
    }
    batch = {"x": r.normal((Bn, D)), "y": r.ints((Bn,), C)}

    def loss_fn(params, batch):
        w = params["W"] + params["A"] @ params["B"]
        h = jnp.tanh(batch["x"] @ w + params["b"])
        h = jnp.tanh(h @ params["S"])
        h = jnp.tanh(h @ params["S"])  # the same weight at a second site
        logits = h @ params["head"]["w"] + params["head"]["b"]
        return jnp.mean(_xent(logits, batch["y"])) + 1e-2 * jnp.sum(jnp.square(params["W"]))

    return ZooCase("weight_decay_lora", loss_fn, params, batch)


def make_merged_lora(dtype=jnp.float32, key=17) -> ZooCase:
    """Merged LoRA on tokens: ``x @ (W1 + (alpha / r) * A1 @ B1)`` with ``W1`` a frozen
    constant, then the ``[out, in]`` form ``h @ (W2 + s * B2 @ A2).T`` with ``W2`` trained
    (three leaves at one site), dense head."""
    r = _Rand(key, dtype)
    Bn, T, D, H, R, C = 5, 3, 6, 7, 2, 4
    w1 = r.dense(D, H)  # frozen: closed over, not differentiated
    params = {
        "A1": r.normal((D, R), 0.4),
        "B1": r.normal((R, H), 0.4),
        "W2": r.dense(H, H),  # [out, in]
        "B2": r.normal((H, R), 0.4),  # [out, r]
        "A2": r.normal((R, H), 0.4),  # [r, in]
        "head": r.dense(H, C),
    }
    batch = {"x": r.normal((Bn, T, D)), "y": r.ints((Bn, T), C)}

    def loss_fn(params, batch):
        h = jnp.tanh(batch["x"] @ (w1 + (8.0 / R) * (params["A1"] @ params["B1"])))
        h = jnp.tanh(h @ (params["W2"] + 0.5 * (params["B2"] @ params["A2"])).T)
        return jnp.mean(_xent(h @ params["head"], batch["y"]))

    return ZooCase("merged_lora", loss_fn, params, batch)


def make_embedding_modes(dtype=jnp.float32, key=16) -> ZooCase:
    """Embedding lookups with out-of-range / negative ids: ``jnp.take(mode="clip")``,
    ``.at[ids].get(mode="fill", fill_value=0)``, negative ids through ``table[ids]``."""
    r = _Rand(key, dtype)
    B, T, V, D, C = 6, 5, 7, 4, 3
    params = {
        "t_clip": r.normal((V, D), 0.7),
        "t_fill": r.normal((V, D), 0.7),
        "t_neg": r.normal((V, D), 0.7),
        "head": {"w": r.dense(D, C), "b": r.normal((C,), 0.3)},
    }
    ids = r.rng.integers(0, V + 3, size=(B, T)) - 1  # in [-1, V + 1]: some out of range
    ids[:, 0] = np.arange(B) % V  # every example has a valid id
    batch = {"ids": jnp.asarray(ids, dtype=jnp.int32), "y": r.ints((B,), C)}

    def loss_fn(params, batch):
        ids = batch["ids"]
        e = jnp.take(params["t_clip"], ids, axis=0, mode="clip")
        e = e + params["t_fill"].at[ids].get(mode="fill", fill_value=0)
        e = e + params["t_neg"][jnp.clip(ids, -V, V - 1)]  # -1 -> last row
        h = jnp.tanh(jnp.mean(e, axis=1))
        logits = h @ params["head"]["w"] + params["head"]["b"]
        return jnp.mean(_xent(logits, batch["y"]))

    return ZooCase("embedding_modes", loss_fn, params, batch)


@jax.custom_vjp
def _tanh_dense(x, w):
    return jnp.tanh(x @ w)


def _tanh_dense_fwd(x, w):
    y = jnp.tanh(x @ w)
    return y, (x, w, y)


def _tanh_dense_bwd(res, g):
    x, w, y = res
    dz = g * (1 - jnp.square(y))
    return dz @ w.T, x.T @ dz


_tanh_dense.defvjp(_tanh_dense_fwd, _tanh_dense_bwd)


def make_custom_vjp_and_cond(dtype=jnp.float32, key=10) -> ZooCase:
    """A param in a custom_vjp function, one in lax.cond, a data-only while_loop, fori_loop."""
    r = _Rand(key, dtype)
    B, D, H, C = 6, 5, 6, 3
    params = {
        "w_custom": r.dense(D, H),
        "w_cond": r.dense(H, H),
        "w_loop": r.dense(H, H, 0.8),
        "head": {"w": r.dense(H, C), "b": r.normal((C,), 0.3)},
    }
    batch = {"x": r.normal((B, D), 2.0), "y": r.ints((B,), C)}

    def loss_fn(params, batch):
        x = batch["x"]

        # data-only while_loop with a per-example trip count: halve each example
        # until its norm is <= 1 (no example influences another).
        def cond_fn(c):
            return jnp.any(jnp.sum(jnp.square(c), axis=-1) > 1.0)

        def body_fn(c):
            big = jnp.sum(jnp.square(c), axis=-1, keepdims=True) > 1.0
            return jnp.where(big, 0.5 * c, c)

        x = lax.while_loop(cond_fn, body_fn, x)
        h = _tanh_dense(x, params["w_custom"])
        w_cond = params["w_cond"]
        h = lax.cond(
            jnp.sum(w_cond) > 0,
            lambda h, w: jnp.tanh(h @ w),
            lambda h, w: jnp.sin(h @ w),
            h,
            w_cond,
        )
        h = lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ params["w_loop"] + 0.1 * h), h)
        logits = h @ params["head"]["w"] + params["head"]["b"]
        return jnp.mean(_xent(logits, batch["y"]))

    return ZooCase("custom_vjp_and_cond", loss_fn, params, batch)


# --------------------------------------------------------------------------- #
# Framework models
# --------------------------------------------------------------------------- #
def _perturb(tree, r: _Rand, scale=0.2):
    """Adds noise to every float leaf (bias inits are zero, LN scales one) and casts."""

    def one(p):
        noise = (r.rng.standard_normal(p.shape) * scale).astype(np.float32)
        return jnp.asarray(np.asarray(p, dtype=np.float32) + noise, dtype=r.dtype)

    return jax.tree.map(one, tree)


def make_flax_linen_mlp(dtype=jnp.float32, key=11) -> ZooCase:
    import flax.linen as nn

    r = _Rand(key, dtype)
    B, D, H, C = 6, 5, 8, 4

    # dtype=None everywhere: computation follows the (cast) params' dtype.
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jnp.tanh(nn.Dense(H)(x))
            x = nn.gelu(nn.Dense(H)(x))
            return nn.Dense(C)(x)

    model = MLP()
    batch = {"x": r.normal((B, D)), "y": r.ints((B,), C)}
    # init in float32 so every dtype gets the same values, then perturb and cast
    params = _perturb(model.init(r._next(), batch["x"].astype(jnp.float32))["params"], r)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return jnp.mean(_xent(logits, batch["y"]))

    return ZooCase("flax_linen_mlp", loss_fn, params, batch)


def make_flax_linen_transformer(dtype=jnp.float32, key=12) -> ZooCase:
    import flax.linen as nn

    r = _Rand(key, dtype)
    B, T, V, D, H = 4, 5, 11, 8, 2

    class Block(nn.Module):
        @nn.compact
        def __call__(self, ids):
            # dtype=None everywhere: computation follows the (cast) params' dtype.
            embed = nn.Embed(V, D)
            h = embed(ids)
            a = nn.LayerNorm()(h)
            mask = nn.make_causal_mask(ids)
            # note: the key bias gets an exactly-zero gradient mathematically
            # (softmax shift invariance); numerically it is rounding noise.
            h = h + nn.MultiHeadDotProductAttention(num_heads=H, deterministic=True)(
                a, a, mask=mask
            )
            m = nn.LayerNorm()(h)
            h = h + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(m)))
            h = nn.LayerNorm()(h)
            return embed.attend(h)  # tied output embedding

    model = Block()
    batch = _token_batch(r, B, T, V, with_mask=False)
    params = _perturb(model.init(r._next(), batch["ids"])["params"], r, 0.1)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["ids"])
        return jnp.mean(_xent(logits, batch["targets"]))

    return ZooCase("flax_linen_transformer", loss_fn, params, batch)


def make_flax_nnx_mlp(dtype=jnp.float32, key=13) -> ZooCase:
    from flax import nnx

    r = _Rand(key, dtype)
    B, D, H, C = 5, 4, 8, 3
    seed = int(r.rng.integers(0, 2**20))
    rngs = nnx.Rngs(seed)
    # float32 init (same values for every dtype), dtype=None: computation
    # follows the (cast) params' dtype.
    kw = dict(param_dtype=jnp.float32, rngs=rngs)
    model = nnx.Sequential(
        nnx.Linear(D, H, **kw), nnx.LayerNorm(H, **kw), jnp.tanh, nnx.Linear(H, C, **kw)
    )
    graphdef, params = nnx.split(model, nnx.Param)
    params = _perturb(params, r)
    batch = {"x": r.normal((B, D)), "y": r.ints((B,), C)}

    def loss_fn(params, batch):
        m = nnx.merge(graphdef, params)
        return jnp.mean(_xent(m(batch["x"]), batch["y"]))

    return ZooCase("flax_nnx_mlp", loss_fn, params, batch)


def make_equinox_mlp(dtype=jnp.float32, key=14) -> ZooCase:
    import equinox as eqx

    r = _Rand(key, dtype)
    B, D, H, C = 5, 4, 7, 3
    model = eqx.nn.MLP(
        D, C, width_size=H, depth=2, activation=jnp.tanh, dtype=jnp.float32, key=r._next()
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params = _perturb(params, r, 0.1)
    batch = {"x": r.normal((B, D)), "y": r.ints((B,), C)}

    def loss_fn(params, batch):
        m = eqx.combine(params, static)
        logits = jax.vmap(m)(batch["x"])
        return jnp.mean(_xent(logits, batch["y"]))

    return ZooCase("equinox_mlp", loss_fn, params, batch)


def make_haiku_mlp(dtype=jnp.float32, key=15) -> ZooCase:
    import haiku as hk

    r = _Rand(key, dtype)
    B, D, H, C = 6, 5, 8, 4

    def forward(x):
        h = hk.Linear(H)(x)
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
        h = jax.nn.relu(h)
        h = jnp.tanh(hk.Linear(H)(h))
        return hk.Linear(C)(h)

    fwd = hk.without_apply_rng(hk.transform(forward))
    batch = {"x": r.normal((B, D)), "y": r.ints((B,), C)}
    params = _perturb(fwd.init(r._next(), batch["x"].astype(jnp.float32)), r)

    def loss_fn(params, batch):
        return jnp.mean(_xent(fwd.apply(params, batch["x"]), batch["y"]))

    return ZooCase("haiku_mlp", loss_fn, params, batch)


# --------------------------------------------------------------------------- #
# Registry
# --------------------------------------------------------------------------- #
ZOO: dict[str, Callable[..., ZooCase]] = {
    "mlp": make_mlp,
    "cnn": make_cnn,
    "cnn1d": make_cnn1d,
    "transformer": make_transformer,
    "transformer_rms_swiglu": make_transformer_rms_swiglu,
    "transformer_scan_remat": make_transformer_scan_remat,
    "rnn": make_rnn,
    "mlp_bf16": make_mlp_bf16,
    "onehot_embedding": make_onehot_embedding,
    "weight_decay_lora": make_weight_decay_lora,
    "merged_lora": make_merged_lora,
    "embedding_modes": make_embedding_modes,
    "custom_vjp_and_cond": make_custom_vjp_and_cond,
    "flax_linen_mlp": make_flax_linen_mlp,
    "flax_linen_transformer": make_flax_linen_transformer,
    "flax_nnx_mlp": make_flax_nnx_mlp,
    "equinox_mlp": make_equinox_mlp,
    "haiku_mlp": make_haiku_mlp,
}

FRAMEWORK_ZOO: list[str] = [
    "flax_linen_mlp",
    "flax_linen_transformer",
    "flax_nnx_mlp",
    "equinox_mlp",
    "haiku_mlp",
]

CORE_ZOO: list[str] = [n for n in ZOO if n not in FRAMEWORK_ZOO]

# Cases whose internal computation is low precision (loose tolerances).
LOW_PRECISION = frozenset({"mlp_bf16"})


@functools.cache
def _get_case(name: str, dtype_name: str) -> ZooCase:
    dtype = jnp.dtype(dtype_name)
    if dtype == jnp.float64:
        with x64():
            return ZOO[name](dtype=dtype)
    return ZOO[name](dtype=dtype)


def get_case(name: str, dtype=jnp.float32) -> ZooCase:
    """Cached ``ZOO[name](dtype)``; a float64 case is built inside ``x64()``."""
    return _get_case(name, jnp.dtype(dtype).name)


# --------------------------------------------------------------------------- #
# Reference per-example quantities and statistics
# --------------------------------------------------------------------------- #
def per_example_loss(case: ZooCase) -> Callable[[PyTree, PyTree], jax.Array]:
    """``l(params, example) = loss_fn(params, example[None])`` (batch axis kept, size 1)."""

    def loss_one(params, example):
        return case.loss_fn(params, jax.tree.map(lambda x: x[None], example))

    return loss_one


_GRADS_CACHE: dict[int, tuple[ZooCase, np.ndarray, PyTree]] = {}


def _per_example_value_and_grads(case: ZooCase):
    hit = _GRADS_CACHE.get(id(case))
    if hit is not None and hit[0] is case:
        return hit[1], hit[2]
    with _maybe_x64(case.params):
        f = jax.jit(jax.vmap(jax.value_and_grad(per_example_loss(case)), in_axes=(None, 0)))
        v, g = f(case.params, case.batch)
        v = np.asarray(v)
        g = jax.tree.map(lambda a: np.asarray(a), g)
    _GRADS_CACHE[id(case)] = (case, v, g)
    return v, g


def vmap_grads(loss, params, batch) -> PyTree:
    """``jax.vmap(jax.grad(per-example loss))`` of any ``loss(params, batch)`` (a mean over
    the batch): leaves ``[B, *leaf]``, in the params' dtype, as jax arrays."""
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    return jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0)))(params, batch)


def in_x64(fn):
    """``fn()`` with float64 enabled (``with x64(): return fn()``)."""
    with x64():
        return fn()


def per_example_grads(case: ZooCase) -> PyTree:
    """``vmap(grad(per_example_loss))`` as a pytree of numpy arrays ``[B, *leaf]``.

    Cached per case object; computed in the case's dtype (float64 cases inside
    ``x64()``), returned as numpy arrays of that dtype.
    """
    return _per_example_value_and_grads(case)[1]


def per_example_losses(case: ZooCase) -> np.ndarray:
    """``vmap(per_example_loss)``: the ``[B]`` per-example losses (cached with the grads)."""
    return _per_example_value_and_grads(case)[0]


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, dtype=np.float64), tree)


def _global_sq_norms(g, xp=np) -> np.ndarray:
    leaves = jax.tree.leaves(g)
    return sum(xp.sum(xp.square(x).reshape(x.shape[0], -1), axis=1) for x in leaves)


def safe_ratio(num, den, xp=np):
    """``num / den`` as the package's statistics define it (stats.safe_ratio): ``x/0 = inf``
    for ``x > 0``, ``0/0 = 0``, a non-positive denominator gives ``inf``, NaN in, NaN out."""
    pos = den > 0
    out = xp.where(pos, num / xp.where(pos, den, 1.0), xp.where(num > 0, xp.inf, 0.0))
    return xp.where(xp.isnan(num) | xp.isnan(den), xp.nan, out)


def _apply_phi(phi, x: np.ndarray) -> np.ndarray:
    """``phi`` on a float64 numpy array (a jnp-only phi runs under ``x64()``)."""
    with x64():
        return np.asarray(phi(np.asarray(x, dtype=np.float64)), dtype=np.float64)


STAT_NAMES = (
    "mean",
    "sum",
    "second_moment",
    "variance",
    "sign_mean",
    "abs_mean",
    "sq_norms",
    "norms",
    "clipped_mean",
    "clipped_sum",
    "elementwise",
    "snr",
    "gradient_noise_scale",
    "fourth_moment",
    "kurtosis",
    "gradient_diversity",
    "norm_quantiles",
    "kron_moments",
    "per_example_dots",
    "per_example_cosines",
)


def kron_np(x, max_dim=1024):
    """Per axis ``j`` of one leaf's ``x [B, *shape]``: ``(1/B) sum_b U_j U_j^T`` (its
    diagonal where the axis is longer than ``max_dim``), numpy float64."""
    x = np.asarray(x, np.float64)
    B = x.shape[0]
    out = []
    for j in range(1, x.ndim):
        n = x.shape[j]
        u = np.moveaxis(x, j, 1).reshape(B, n, int(np.prod(x.shape[1:j] + x.shape[j + 1:])))
        out.append(np.einsum("bir,bjr->ij", u, u) / B if n <= max_dim
                   else np.sum(u * u, axis=(0, 2)) / B)
    return tuple(out)


def oracle_from_grads(g: PyTree, stat_name: str, *, xp=np, **kw) -> PyTree:
    """Every statistic of ``api.md`` from per-example grads ``g`` (leaves ``[B, ...]``).

    The one oracle of the test suite. ``xp=np`` (default): reduced in numpy float64,
    returns numpy arrays (pytree like params, a ``[B]`` array, a pytree of ``[B]``
    arrays, or a scalar as the statistic says). ``xp=jnp``: the same formulas in JAX in
    the gradients' own dtype, differentiable (the second-order tests differentiate the
    oracle); ``elementwise``, ``norm_quantiles``, ``kron_moments`` and the dots and
    cosines are numpy only. Options as the constructors in ``js.stats`` take them
    (``clip_norm``, ``ddof``, ``per_leaf``, ``phi``, ``q``, ``max_dim``, ``reference``).
    ``weights`` (``[B]``, w_b >= 0): the weighted statistic of api.md (`_weighted_oracle`).
    """
    if xp is np:
        g = _f64(g)
        quiet = functools.partial(np.errstate, divide="ignore", invalid="ignore")
    else:
        quiet = contextlib.nullcontext
    if kw.get("weights") is not None:
        w = kw.pop("weights")
        return _weighted_oracle(g, np.asarray(w, np.float64) if xp is np else w, stat_name,
                                xp, quiet, **kw)
    leaves = jax.tree.leaves(g)
    B = leaves[0].shape[0]
    tm = jax.tree.map
    if stat_name == "mean":
        return tm(lambda x: x.mean(0), g)
    if stat_name == "sum":
        return tm(lambda x: x.sum(0), g)
    if stat_name == "second_moment":
        return tm(lambda x: xp.square(x).mean(0), g)
    if stat_name == "variance":
        ddof = kw.get("ddof", 1)
        return tm(lambda x: xp.square(x - x.mean(0)).sum(0) / (B - ddof), g)
    if stat_name == "sign_mean":
        return tm(lambda x: xp.sign(x).mean(0), g)
    if stat_name == "abs_mean":
        return tm(lambda x: xp.abs(x).mean(0), g)
    if stat_name in ("sq_norms", "norms"):
        if kw.get("per_leaf", False):
            out = tm(lambda x: xp.sum(xp.square(x).reshape(B, -1), axis=1), g)
        else:
            out = _global_sq_norms(g, xp)
        return tm(xp.sqrt, out) if stat_name == "norms" else out
    if stat_name in ("clipped_mean", "clipped_sum"):
        c = kw["clip_norm"]
        n = xp.sqrt(_global_sq_norms(g, xp))
        with quiet():
            factor = xp.where(n > 0, xp.minimum(1.0, c / xp.where(n > 0, n, 1.0)), 1.0)
        out = tm(lambda x: xp.tensordot(factor, x, axes=(0, 0)), g)
        return tm(lambda x: x / B, out) if stat_name == "clipped_mean" else out
    if stat_name == "elementwise":
        phi = kw["phi"]
        if xp is not np:
            return tm(lambda x: phi(x).mean(0), g)
        return tm(lambda x: _apply_phi(phi, x).mean(0), g)
    if stat_name == "snr":
        ddof = kw.get("ddof", 1)

        def one(x):
            m = x.mean(0)
            with quiet():
                return safe_ratio(xp.square(m), xp.square(x - m).sum(0) / (B - ddof), xp)

        return tm(one, g)
    if stat_name == "gradient_noise_scale":
        ddof = kw.get("ddof", 1)
        tr = sum(xp.square(x - x.mean(0)).sum() for x in leaves) / (B - ddof)
        g2 = sum(xp.square(x.mean(0)).sum() for x in leaves) - tr / B  # unbiased |G|^2
        with quiet():
            return xp.asarray(safe_ratio(tr, g2, xp))
    if stat_name == "fourth_moment":
        return tm(lambda x: (x**4).mean(0), g)
    if stat_name == "kurtosis":  # population moments; NaN where the variance is 0

        def kurt(x):
            c = x - x.mean(0)
            var = xp.mean(c**2, 0)
            with quiet():
                return xp.where(var > 0, xp.mean(c**4, 0) / xp.where(var > 0, var, 1) ** 2,
                                xp.nan)

        return tm(kurt, g)
    if stat_name == "gradient_diversity":
        num = _global_sq_norms(g, xp).sum()
        den = sum(xp.sum(x.sum(0) ** 2) for x in leaves)
        with quiet():
            return xp.asarray(safe_ratio(num, den, xp))
    if stat_name == "norm_quantiles":
        q = kw.get("q", (0.1, 0.5, 0.9))
        if kw.get("per_leaf", True):
            return tm(lambda x: np.quantile(np.sqrt(np.sum(x.reshape(B, -1) ** 2, 1)), q), g)
        return np.quantile(np.sqrt(_global_sq_norms(g)), q)
    if stat_name == "kron_moments":
        return tm(lambda x: kron_np(x, kw.get("max_dim", 1024)), g)
    if stat_name in ("per_example_dots", "per_example_cosines"):
        # kw["reference"]: a pytree like the gradients' leaves (None where a leaf has none)
        refs = [np.asarray(r, np.float64) for r in jax.tree.leaves(kw["reference"])]
        assert len(refs) == len(leaves), (len(refs), len(leaves))
        per_leaf = [x.reshape(B, -1) @ r.reshape(-1) for x, r in zip(leaves, refs, strict=True)]
        dots = sum(per_leaf)
        if stat_name == "per_example_dots":
            if kw.get("per_leaf", False):
                return jax.tree.unflatten(jax.tree.structure(g), per_leaf)
            return dots
        den = np.sqrt(_global_sq_norms(g)) * np.sqrt(sum(np.sum(r**2) for r in refs))
        with quiet():
            return np.where(den > 0, dots / np.where(den > 0, den, 1.0), 0.0)
    raise ValueError(f"unknown statistic {stat_name!r}; known: {STAT_NAMES}")


def _weighted_oracle(g, w, stat_name, xp, quiet, **kw):
    """The statistics of api.md with example weights ``w`` (W = sum_b w_b), written with
    the weights explicit (differentiable in ``w`` with ``xp=jnp``): weighted means,
    the frequency-weighted variance ``sum_b w_b (g_b - m_w)^2 / (W - ddof)``, population
    moments for the kurtosis, clipped sums of the weighted clipped ``g_b``, and 0 for the
    per-example norms of an example of weight 0."""
    tm = jax.tree.map
    leaves = jax.tree.leaves(g)
    W = xp.sum(w)

    def wsum(x):  # sum_b w_b x_b
        return xp.tensordot(w.astype(x.dtype), x, axes=(0, 0))

    def wmean(x):
        return wsum(x) / W

    sq = _global_sq_norms(g, xp)
    if stat_name == "mean":
        return tm(wmean, g)
    if stat_name == "sum":
        return tm(wsum, g)
    if stat_name == "second_moment":
        return tm(lambda x: wmean(xp.square(x)), g)
    if stat_name == "variance":
        ddof = kw.get("ddof", 1)
        return tm(lambda x: wsum(xp.square(x - wmean(x))) / (W - ddof), g)
    if stat_name == "sign_mean":
        return tm(lambda x: wmean(xp.sign(x)), g)
    if stat_name == "abs_mean":
        return tm(lambda x: wmean(xp.abs(x)), g)
    if stat_name == "fourth_moment":
        return tm(lambda x: wmean(x**4), g)
    if stat_name == "kurtosis":  # population moments; NaN where the variance is 0

        def kurt(x):
            c = x - wmean(x)
            var = wmean(c**2)
            with quiet():
                return xp.where(var > 0, wmean(c**4) / xp.square(xp.where(var > 0, var, 1)),
                                xp.nan)

        return tm(kurt, g)
    if stat_name == "gradient_diversity":  # (0/0 = 0: every gradient zero)
        return safe_ratio(xp.sum(w * sq), sum(xp.sum(xp.square(wsum(x))) for x in leaves), xp)
    if stat_name in ("clipped_mean", "clipped_sum"):
        c = xp.minimum(1.0, kw["clip_norm"] / xp.sqrt(sq))
        out = tm(lambda x: wsum(c.reshape((-1,) + (1,) * (x.ndim - 1)) * x), g)
        return tm(lambda x: x / W, out) if stat_name == "clipped_mean" else out
    if stat_name == "sq_norms":
        return xp.where(w > 0, sq, 0.0)
    raise ValueError(f"no weighted oracle for {stat_name!r}")


def oracle(case: ZooCase, stat_name: str, **kw) -> PyTree:
    """The reference value of statistic ``stat_name`` for ``case`` (numpy float64).

    Per-example grads come from ``jax.vmap(jax.grad(per_example_loss(case)))`` in
    the case's own dtype; the reduction is done in float64.
    """
    return oracle_from_grads(per_example_grads(case), stat_name, **kw)


def oracle_scale(case: ZooCase, stat_name: str, **kw) -> PyTree:
    """Magnitude against which absolute errors of ``stat_name`` are measured, per leaf.

    For statistics linear in the gradients (mean, sum, clipped) this is the
    largest *absolute* summand-scale of the leaf (the terms can cancel, and
    rounding errors scale with the terms, not with the result); otherwise the
    largest magnitude of the value itself. Returns a pytree of python floats
    shaped like the oracle's value (one float per leaf).
    """
    g = _f64(per_example_grads(case))
    B = jax.tree.leaves(g)[0].shape[0]
    if stat_name in ("mean", "sum", "clipped_mean", "clipped_sum", "sign_mean"):
        absval = jax.tree.map(lambda x: np.abs(x).mean(0), g)
        if stat_name in ("sum", "clipped_sum"):
            absval = jax.tree.map(lambda x: x * B, absval)
        return jax.tree.map(lambda x: float(np.max(x)), absval)
    if stat_name == "elementwise":
        phi = kw["phi"]
        return jax.tree.map(lambda x: float(np.max(np.abs(_apply_phi(phi, x)))), g)
    val = oracle_from_grads(g, stat_name, **kw)
    return jax.tree.map(lambda x: float(np.max(np.abs(x))) if np.size(x) else 0.0, val)


# --------------------------------------------------------------------------- #
# Round 3 (issue 51): architectures reported off the oracle in models by others.
# Registered in ZOO (so conftest's `reference` and oracle helpers take them) but not
# in CORE_ZOO: tests/test_zoo_round3.py checks them, every statistic in one request.
# --------------------------------------------------------------------------- #
def make_llama_scan_long(dtype=jnp.float32, key=18) -> ZooCase:
    """penzai's Llama layout: decoder layers stacked on a leading [L] axis and applied by
    ``lax.scan`` (no remat), RMSNorm gains, attention, a gated (SwiGLU) MLP, untied
    head. The sequence is longer than the width (T = 12 > D = 4), so each scanned dense
    site forms its per-example products (not the ghost form) for norms."""
    r = _Rand(key, dtype)
    B, T, V, D, H, K, F, L = 4, 12, 7, 4, 2, 2, 6, 2
    params = {
        "embed": r.normal((V, D), 0.5),
        "layers": {
            "norm1": r.normal((L, D), 0.1, 1.0),
            "wq": r.normal((L, D, H, K), 1 / math.sqrt(D)),
            "wk": r.normal((L, D, H, K), 1 / math.sqrt(D)),
            "wv": r.normal((L, D, H, K), 1 / math.sqrt(D)),
            "wo": r.normal((L, H, K, D), 1 / math.sqrt(H * K)),
            "norm2": r.normal((L, D), 0.1, 1.0),
            "w_gate": r.normal((L, D, F), 1 / math.sqrt(D)),
            "w_up": r.normal((L, D, F), 1 / math.sqrt(D)),
            "w_down": r.normal((L, F, D), 1 / math.sqrt(F)),
        },
        "norm_f": r.normal((D,), 0.1, 1.0),
        "head": r.dense(D, V),
    }
    batch = _token_batch(r, B, T, V, with_mask=False)

    def block(h, lp):
        a = _rmsnorm(h, lp["norm1"])
        h = h + _causal_attention(a, lp["wq"], lp["wk"], lp["wv"], lp["wo"])
        m = _rmsnorm(h, lp["norm2"])
        return h + (jax.nn.silu(m @ lp["w_gate"]) * (m @ lp["w_up"])) @ lp["w_down"]

    def loss_fn(params, batch):
        h = params["embed"][batch["ids"]]
        h, _ = lax.scan(lambda c, lp: (block(c, lp), None), h, params["layers"])
        logits = _rmsnorm(h, params["norm_f"]) @ params["head"]
        return jnp.mean(_xent(logits, batch["targets"]))

    return ZooCase("llama_scan_long", loss_fn, params, batch)


def _batchnorm_eval(h, mean, var, scale, bias, eps=1e-5):
    """Eval-mode batch norm as Flax's ``BatchNorm(use_running_average=True)`` computes it
    (``flax.linen.normalization._normalize``): ``(h - mean) * (rsqrt(var + eps) * scale)
    + bias``, ``rsqrt(var + eps)`` in the running statistics' own dtype (float32 ones in
    a float64 model: a float32 step on constants alone)."""
    y = h - mean
    mul = lax.rsqrt(var + eps)
    mul = mul * scale
    return y * mul + bias


def make_resnet_bn_eval(dtype=jnp.float32, key=19) -> ZooCase:
    """A ResNet basic block in eval mode (Flax's ResNet example, Hugging Face's
    ResNet/RegNet): stem conv + BN + relu, then conv-BN-relu-conv-BN plus the identity,
    relu, global average pool, dense head. The stem's and the block's first BN read
    running statistics closed over as float32 constants whatever the model's dtype (as
    Flax keeps ``batch_stats``); the block's second BN's running statistics are
    differentiated parameters (a ``grad`` of the whole variables dict)."""
    r = _Rand(key, dtype)
    B, S, Cin, C, K = 4, 5, 2, 3, 3
    f32 = _Rand(key + 1000, jnp.float32)

    def stats(c):  # running mean and (positive) variance
        return f32.normal((c,), 0.3), jnp.abs(f32.normal((c,), 0.3, 1.0)) + 0.1

    const = {"stem": stats(C), "bn1": stats(C)}
    m2, v2 = stats(C)
    params = {
        "stem": {"w": r.normal((3, 3, Cin, C), 1 / math.sqrt(9 * Cin)),
                 "scale": r.normal((C,), 0.1, 1.0), "bias": r.normal((C,), 0.1)},
        "conv1": r.normal((3, 3, C, C), 1 / math.sqrt(9 * C)),
        "bn1": {"scale": r.normal((C,), 0.1, 1.0), "bias": r.normal((C,), 0.1)},
        "conv2": r.normal((3, 3, C, C), 1 / math.sqrt(9 * C)),
        "bn2": {"scale": r.normal((C,), 0.1, 1.0), "bias": r.normal((C,), 0.1),
                "mean": m2.astype(dtype), "var": v2.astype(dtype)},
        "head": {"w": r.dense(C, K), "b": r.normal((K,), 0.1)},
    }
    batch = {"x": r.normal((B, S, S, Cin)), "y": r.ints((B,), K)}
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(h, w):
        return lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=dn)

    def loss_fn(params, batch):
        p = params
        h = conv(batch["x"], p["stem"]["w"])
        h = jax.nn.relu(_batchnorm_eval(h, *const["stem"], p["stem"]["scale"], p["stem"]["bias"]))
        y = conv(h, p["conv1"])
        y = jax.nn.relu(_batchnorm_eval(y, *const["bn1"], p["bn1"]["scale"], p["bn1"]["bias"]))
        y = conv(y, p["conv2"])
        b2 = p["bn2"]
        y = _batchnorm_eval(y, b2["mean"], b2["var"], b2["scale"], b2["bias"])
        h = jax.nn.relu(h + y)
        logits = jnp.mean(h, axis=(1, 2)) @ p["head"]["w"] + p["head"]["b"]
        return jnp.mean(_xent(logits, batch["y"]))

    return ZooCase("resnet_bn_eval", loss_fn, params, batch)


@jax.custom_vjp
def _sqrt_bound_derivative(x):
    """recurrentgemma's ``SqrtBoundDerivative``: sqrt whose derivative is capped."""
    return jnp.sqrt(x)


def _sqrt_bound_fwd(x):
    return jnp.sqrt(x), x


def _sqrt_bound_bwd(x, g):
    return (g / jnp.sqrt(jnp.maximum(x, 1.0 / 1000.0**2)) / 2,)


_sqrt_bound_derivative.defvjp(_sqrt_bound_fwd, _sqrt_bound_bwd)


def make_griffin_block(dtype=jnp.float32, key=20, scan_acc=None) -> ZooCase:
    """A Griffin / Hawk residual block (recurrentgemma): RMSNorm, a GeLU gate branch and a
    recurrent branch (linear, temporal depthwise conv1d written as recurrentgemma's
    shifted sum, RG-LRU with block-diagonal input and recurrence gates, ``a =
    exp(-8 r softplus(Lambda))`` and the input scaled by ``sqrt(1 - a^2)`` with a bounded
    derivative), the gated product projected out; then RMSNorm and a gated MLP. The
    recurrence is a ``lax.scan`` in the first block and a ``lax.associative_scan`` in
    the second. ``scan_acc``: the recurrence's accumulation dtype (recurrentgemma's
    ``acc_float_dtype``, float32 whatever the model's dtype; None: the model's)."""
    r = _Rand(key, dtype)
    B, T, V, D, W, NH, CW, F = 4, 6, 9, 4, 4, 2, 3, 6
    bw = W // NH  # block width of the block-diagonal gates

    def block_params():
        return {
            "norm": r.normal((D,), 0.1, 1.0),
            "linear_y": r.dense(D, W), "linear_x": r.dense(D, W),
            "conv_w": r.normal((CW, W), 1 / math.sqrt(CW)), "conv_b": r.normal((W,), 0.1),
            "gate_x_w": r.normal((NH, bw, bw), 1 / math.sqrt(bw)),
            "gate_x_b": r.normal((NH, bw), 0.1),
            "gate_a_w": r.normal((NH, bw, bw), 1 / math.sqrt(bw)),
            "gate_a_b": r.normal((NH, bw), 0.1),
            "a_param": r.normal((W,), 0.5, 0.5),
            "linear_out": r.dense(W, D),
            "mlp_norm": r.normal((D,), 0.1, 1.0),
            "ffw_up": r.normal((2, D, F), 1 / math.sqrt(D)), "ffw_up_b": r.normal((2, F), 0.1),
            "ffw_down": r.dense(F, D), "ffw_down_b": r.normal((D,), 0.1),
        }

    params = {"embed": r.normal((V, D), 0.5), "blocks": [block_params(), block_params()],
              "norm_f": r.normal((D,), 0.1, 1.0)}
    batch = _token_batch(r, B, T, V, with_mask=False)

    def block_diag(x, w, b):  # recurrentgemma's BlockDiagonalLinear
        x = x.reshape(x.shape[:-1] + (NH, bw))
        y = jnp.einsum("...hi,hij->...hj", x, w) + b
        return y.reshape(y.shape[:-2] + (W,))

    def conv1d(x, w, b):  # recurrentgemma's Conv1D (no cache): a sum of shifted copies
        out = jnp.zeros_like(x)
        for shift in range(CW):
            xs = jnp.pad(x[:, : x.shape[1] - shift], ((0, 0), (shift, 0), (0, 0)))
            out = out + xs * w[CW - shift - 1]
        return out + b

    def rg_lru(x, p, associative):
        gate_x = jax.nn.sigmoid(block_diag(x, p["gate_x_w"], p["gate_x_b"]))
        gate_a = jax.nn.sigmoid(block_diag(x, p["gate_a_w"], p["gate_a_b"]))
        log_a = -8.0 * gate_a * jax.nn.softplus(p["a_param"])
        a = jnp.exp(log_a)
        mult = _sqrt_bound_derivative(1 - jnp.exp(2 * log_a))
        mult = mult.at[:, 0].set(1.0)  # the first position starts a segment
        nx = x * gate_x * mult
        out_dtype = x.dtype
        if scan_acc is not None:  # recurrentgemma's lru_*_scan: h in acc_float_dtype
            a, nx = a.astype(scan_acc), nx.astype(scan_acc)
        if associative:
            def comb(u, v):
                return u[0] * v[0], u[1] * v[0] + v[1]

            _, h = lax.associative_scan(comb, (a, nx), axis=1)
            return h.astype(out_dtype)

        def step(h, an):
            h = an[0] * h + an[1]
            return h, h

        h0 = jnp.zeros((x.shape[0], W), nx.dtype)
        _, hs = lax.scan(step, h0, (jnp.swapaxes(a, 0, 1), jnp.swapaxes(nx, 0, 1)))
        return jnp.swapaxes(hs, 0, 1).astype(out_dtype)

    def residual_block(h, p, associative):
        x = _rmsnorm(h, p["norm"])
        y = jax.nn.gelu(x @ p["linear_y"])
        x = conv1d(x @ p["linear_x"], p["conv_w"], p["conv_b"])
        x = rg_lru(x, p, associative)
        h = h + (x * y) @ p["linear_out"]
        m = _rmsnorm(h, p["mlp_norm"])
        up = jnp.einsum("btd,cdf->cbtf", m, p["ffw_up"]) + p["ffw_up_b"][:, None, None]
        return h + (jax.nn.gelu(up[0]) * up[1]) @ p["ffw_down"] + p["ffw_down_b"]

    def loss_fn(params, batch):
        h = params["embed"][batch["ids"]] * math.sqrt(D)
        for i, p in enumerate(params["blocks"]):
            h = residual_block(h, p, associative=i == 1)
        logits = _rmsnorm(h, params["norm_f"]) @ params["embed"].T  # tied, as Griffin
        return jnp.mean(_xent(logits, batch["targets"]))

    name = "griffin_block" if scan_acc is None else "griffin_block_f32_scan"
    return ZooCase(name, loss_fn, params, batch)


ZOO["llama_scan_long"] = make_llama_scan_long
ZOO["resnet_bn_eval"] = make_resnet_bn_eval
ZOO["griffin_block"] = make_griffin_block
# recurrentgemma's default: the RG-LRU recurrence in float32 whatever the model's dtype
ZOO["griffin_block_f32_scan"] = functools.partial(make_griffin_block, scan_acc=jnp.float32)

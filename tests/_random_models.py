"""Random models built from the layers people write, checked against the oracle.

`make_model(seed)` composes one to three blocks drawn from the ways models meet their
parameters (dense layers written eight ways, attention with a heads axis, layer norm,
scale-shift, a weight used twice, a scan over stacked layers, an RNN scanning the tokens,
``jax.checkpoint``, ``custom_vjp``, convolutions, mixture-of-experts gathers of weights,
one-hot lookups, ``cond``, ``fori_loop``, gated units, ``vmap`` over weights, jitted
layers, a weight used both densely and elementwise, a weight through a nonlinearity; with
``kinds=KINDS + MORE_KINDS`` also merged LoRA, positional tables, columns gathered by the
data, a weight as matmul's left operand, weight normalisation, a scaled second lookup,
a layer in a lower precision, weights times constant masks and per-row or per-column
constants, ``.at[].set``, a window at a start the example picks, concatenated and
stacked leaves, ``jax.nn.dot_product_attention``, ``lax.map`` over the examples, a scalar
temperature, a use behind ``stop_gradient``, a remat policy, ``named_call``, a
``custom_jvp`` layer, one weight twice in an einsum, layers chosen by ``jnp.where``), an
optional embedding (tied to the head or not), a head (squared error or cross-entropy) and
an optional L2 penalty. `check(seed)` draws a batch size (1 to 5), a chunk size, a memory
budget (tiny ones force tiles), example weights (zeros included), three statistics and
whether the loss is written for one example (``keep_batch_dim=False``),
and compares `per_example_stat` against ``vmap(grad)`` reduced by `zoo.oracle_from_grads`.
"""

from __future__ import annotations

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import zoo

import jaxpr_surgery as js

S = js.stats


class _Builder:
    def __init__(self, rng, T, dtype, widths, kinds):
        self.r, self.T, self.dtype, self.widths, self.kinds = rng, T, dtype, widths, kinds
        self.p = {}
        self.np = np.random.default_rng(rng.randrange(1 << 30))

    def param(self, *shape, scale=None):
        name = f"p{len(self.p)}"
        s = 1.0 / np.sqrt(shape[0]) if scale is None else scale
        self.p[name] = jnp.asarray(self.np.normal(size=shape) * s, self.dtype)
        return name


def _dense(b, d):
    d2 = b.r.choice(b.widths)
    form = b.r.choice(["mm", "T", "einsum", "view", "slice", "scaled", "bias", "dot_general"])
    if form == "mm":
        w = b.param(d, d2)
        return (lambda p, h: h @ p[w]), d2, form
    if form == "T":
        w = b.param(d2, d)
        return (lambda p, h: h @ p[w].T), d2, form
    if form == "einsum":
        w = b.param(d, d2)
        return (lambda p, h: jnp.einsum("io,...i->...o", p[w], h)), d2, form
    if form == "view":  # stored [d, 2, d2], used as [d, 2 d2]
        w = b.param(d, 2, d2)
        return (lambda p, h: h @ p[w].reshape(d, 2 * d2)), 2 * d2, form
    if form == "slice":
        w = b.param(d, d2 + 2)
        return (lambda p, h: h @ p[w][:, 1:d2 + 1]), d2, form
    if form == "scaled":
        w = b.param(d, d2)
        return (lambda p, h: h @ (0.5 * p[w])), d2, form
    if form == "dot_general":
        w = b.param(d, d2)
        return (lambda p, h: jax.lax.dot_general(
            h, p[w], (((h.ndim - 1,), (0,)), ((), ())))), d2, form
    w, bias = b.param(d, d2), b.param(d2, scale=0.1)
    return (lambda p, h: h @ p[w] + p[bias]), d2, form


KINDS = ("dense", "act", "layer_norm", "scale", "tied", "attention", "scan", "remat",
         "custom_vjp", "conv", "residual", "moe", "mixed", "cond", "fori_loop", "glu",
         "bias_only", "jit", "rnn", "vmap_weights", "one_hot", "nonlinear_weight")


def _block(b, d, depth=0):
    """``(f(params, h), width after, description)`` of one block on ``h [..., d]``."""
    kind = b.r.choice(b.kinds)
    if kind in MORE_KINDS:
        return _more(b, d, kind)
    if kind in ("attention", "conv", "rnn") and not b.T or kind in (
            "scan", "remat", "layer_stack") and depth:
        kind = "dense"
    if kind == "layer_stack":
        return _layer_stack(b, d)
    if kind == "dense":
        f, d2, form = _dense(b, d)
        return f, d2, "dense:" + form
    if kind == "act":
        a = b.r.choice([jnp.tanh, jax.nn.gelu, jax.nn.sigmoid])
        return (lambda p, h: a(h)), d, kind
    if kind == "layer_norm":
        g, bias = b.param(d, scale=1.0), b.param(d, scale=0.1)
        return (lambda p, h: _norm(h, p[g], p[bias])), d, kind
    if kind == "scale":
        g = b.param(d, scale=1.0)
        return (lambda p, h: h * p[g]), d, kind
    if kind == "tied":
        w = b.param(d, d)
        return (lambda p, h: jnp.tanh(h @ p[w]) @ p[w]), d, kind
    if kind == "attention":
        H, k = 2, b.r.choice([2, 3])
        q, kk, v, o = b.param(d, H, k), b.param(d, H, k), b.param(d, H, k), b.param(H, k, d)

        def f(p, h):
            Q = jnp.einsum("...td,dhk->...thk", h, p[q])
            K = jnp.einsum("...td,dhk->...thk", h, p[kk])
            V = jnp.einsum("...td,dhk->...thk", h, p[v])
            a = jax.nn.softmax(jnp.einsum("...thk,...shk->...hts", Q, K), -1)
            return h + jnp.einsum("...thk,hkd->...td", jnp.einsum("...hts,...shk->...thk", a, V),
                                  p[o])
        return f, d, kind
    if kind == "scan":
        L = b.r.choice([2, 3])
        w, g = b.param(L, d, d, scale=1 / np.sqrt(d)), b.param(L, d, scale=1.0)

        def f(p, h):
            def body(c, wg):
                return jnp.tanh(c @ wg[0]) * wg[1] + c, None
            return jax.lax.scan(body, h, (p[w], p[g]))[0]
        return f, d, kind
    if kind == "remat":
        f0, d2, desc = _block(b, d, depth + 1)
        return jax.checkpoint(f0), d2, f"remat({desc})"
    if kind == "custom_vjp":
        w = b.param(d, d)  # (zoo's: a 2-D input; tokens folded into the rows)
        return (lambda p, h: zoo._tanh_dense(h.reshape(-1, d), p[w]).reshape(h.shape)), d, kind
    if kind == "conv":
        kw = b.param(3, d, d, scale=1 / np.sqrt(3 * d))

        def f(p, h):
            lhs = h if h.ndim == 3 else h[None]
            out = jax.lax.conv_general_dilated(lhs, p[kw], (1,), "SAME",
                                               dimension_numbers=("NWC", "WIO", "NWC"))
            return out if h.ndim == 3 else out[0]
        return f, d, kind
    if kind == "residual":
        f0, d2, form = _dense(b, d)
        if d2 != d:
            return f0, d2, "dense:" + form
        return (lambda p, h: h + f0(p, h)), d, f"residual({form})"
    if kind == "moe":  # each token's expert weight gathered by a data-dependent id
        E = 3
        w = b.param(E, d, d)

        def f(p, h):
            gate = jnp.argmax(jnp.concatenate([h] * E, -1)[..., :E], -1)
            return jnp.einsum("...i,...io->...o", h, p[w][gate])
        return f, d, kind
    if kind == "mixed":  # one weight read densely and elementwise
        w = b.param(d, d)
        return (lambda p, h: h @ p[w] + h * jnp.diag(p[w])), d, kind
    if kind == "cond":
        w = b.param(d, d)
        return (lambda p, h: jax.lax.cond(h.shape[-1] > 0, lambda: h @ p[w], lambda: h)), d, kind
    if kind == "fori_loop":
        w = b.param(d, d)
        return (lambda p, h: jax.lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c @ p[w]), h)), d, kind
    if kind == "glu":
        w1, w2 = b.param(d, d), b.param(d, d)
        return (lambda p, h: jax.nn.silu(h @ p[w1]) * (h @ p[w2])), d, kind
    if kind == "bias_only":
        bias = b.param(d, scale=0.3)
        return (lambda p, h: jnp.tanh(h + p[bias])), d, kind
    if kind == "jit":
        f0, d2, form = _dense(b, d)
        return jax.jit(f0), d2, f"jit({form})"
    if kind == "rnn":  # the weight closed over by a scan over the tokens
        w = b.param(d, d)

        def f(p, h):
            hT = jnp.moveaxis(h, -2, 0)

            def body(c, x):
                c = jnp.tanh(c @ p[w] + x)
                return c, c
            return jnp.moveaxis(jax.lax.scan(body, jnp.zeros_like(hT[0]), hT)[1], 0, -2)
        return f, d, kind
    if kind == "vmap_weights":
        w = b.param(2, d, d)
        return (lambda p, h: jax.vmap(lambda W: h @ W)(p[w]).sum(0)), d, kind
    if kind == "one_hot":
        w = b.param(7, d)

        def f(p, h):
            ids = (jnp.abs(h[..., 0]) * 5).astype(jnp.int32) % 7
            return h + jax.nn.one_hot(ids, 7, dtype=h.dtype) @ p[w]
        return f, d, kind
    w = b.param(d, d)  # nonlinear_weight
    return (lambda p, h: h @ jnp.tanh(p[w])), d, kind


# A second family (`make_model(..., kinds=KINDS + MORE_KINDS)`; the first family's seeds
# keep their models): weights merged, masked, normalised, concatenated, indexed by data,
# cast to a lower precision, and jax.nn's attention.
MORE_KINDS = ("lora", "positional", "column_gather", "left", "weight_norm", "scaled_lookup",
              "cast", "masked", "col_scaled", "row_scaled", "at_set", "dyn_slice", "concat",
              "stack", "dpa", "lax_map", "temperature", "stop_grad", "remat_policy", "named",
              "custom_jvp", "einsum_twice", "where_select")


# A third family (`make_model(..., kinds=LAYER_KINDS)`): stacks of transformer layers
# under ``lax.scan`` (pre-norm attention and MLP, biases, with or without
# ``jax.checkpoint``), whose inner inputs and cotangents clipped sums under a device
# split recompute one layer at a time (segments.py), among a few plain blocks.
LAYER_KINDS = ("layer_stack", "layer_stack", "layer_stack", "dense", "layer_norm", "act")


def _norm(h, g, c):
    """Layer norm of ``h``'s last axis, gain ``g`` and bias ``c``."""
    m = h.mean(-1, keepdims=True)
    v = ((h - m) ** 2).mean(-1, keepdims=True)
    return (h - m) * jax.lax.rsqrt(v + 1e-5) * g + c


def _layer_stack(b, d):
    """`_block` of kind ``layer_stack``: ``L`` stacked pre-norm layers under ``lax.scan``,
    attention (separate ``wq``/``wk``/``wv``, ``wo``; with tokens, drawn) then an MLP
    (``w1``, ``b1``, an activation, ``w2``, ``b2``); the body under ``jax.checkpoint``
    or not, the layers' leaves in the scan's ``xs`` or closed over and indexed."""
    L, H, k, f = b.r.choice([2, 3]), 2, b.r.choice([2, 4]), b.r.choice(b.widths)
    attn = bool(b.T) and b.r.random() < 0.7
    remat, act = b.r.random() < 0.5, b.r.choice([jax.nn.gelu, jnp.tanh, jax.nn.relu])
    names = {"g2": b.param(L, d, scale=1.0), "c2": b.param(L, d, scale=0.1),
             "w1": b.param(L, d, f, scale=1 / np.sqrt(d)), "b1": b.param(L, f, scale=0.1),
             "w2": b.param(L, f, d, scale=1 / np.sqrt(f)), "b2": b.param(L, d, scale=0.1)}
    if attn:
        names.update(g1=b.param(L, d, scale=1.0), c1=b.param(L, d, scale=0.1),
                     wq=b.param(L, d, H, k, scale=1 / np.sqrt(d)),
                     wk=b.param(L, d, H, k, scale=1 / np.sqrt(d)),
                     wv=b.param(L, d, H, k, scale=1 / np.sqrt(d)),
                     wo=b.param(L, H, k, d, scale=1 / np.sqrt(H * k)))

    def layer(h, q):
        if attn:
            x = _norm(h, q["g1"], q["c1"])
            Q, K, V = (jnp.einsum("...td,dhk->...thk", x, q[n]) for n in ("wq", "wk", "wv"))
            a = jax.nn.softmax(jnp.einsum("...thk,...shk->...hts", Q, K) / np.sqrt(k), -1)
            h = h + jnp.einsum("...thk,hkd->...td", jnp.einsum("...hts,...shk->...thk", a, V),
                               q["wo"])
        x = _norm(h, q["g2"], q["c2"])
        u = act(x @ q["w1"] + q["b1"])
        return h + u @ q["w2"] + q["b2"], (jnp.mean(u, -1) if read else None)

    closed = b.r.random() < 0.3
    # (an inner value, the MLP's hidden mean per layer, stacked by the scan and read
    # again after it: its layer's sites are then not recomputed)
    read = not closed and b.r.random() < 0.3
    body = jax.checkpoint(layer) if remat else layer

    def f(p, h):
        stack = {n: p[v] for n, v in names.items()}
        if closed:  # the stack closed over, each layer's slice taken by the loop's index
            return jax.lax.fori_loop(
                0, L, lambda i, c: body(c, jax.tree.map(lambda t: t[i], stack))[0], h)
        h, ys = jax.lax.scan(body, h, stack)
        return h + 0.1 * jnp.mean(ys, 0)[..., None] if read else h

    desc = f"layer_stack(L={L}{', attention' if attn else ''}{', remat' if remat else ''}" \
           f"{', closed' if closed else ''}{', inner value read' if read else ''})"
    return f, d, desc


@jax.custom_jvp
def _softsign_dense(x, w):  # (a layer with a derivative of its own, forward mode)
    z = x @ w
    return z / (1 + jnp.abs(z))


@_softsign_dense.defjvp
def _softsign_dense_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    z = x @ w
    dz = dx @ w + x @ dw
    return z / (1 + jnp.abs(z)), dz / (1 + jnp.abs(z)) ** 2


def _more(b, d, kind):
    """`_block` of a kind of `MORE_KINDS`."""
    d2 = b.r.choice(b.widths)
    if kind == "lora":  # merged low-rank adapter: W + s A B
        w, a, c = b.param(d, d2), b.param(d, 2), b.param(2, d2)
        return (lambda p, h: h @ (p[w] + 0.5 * p[a] @ p[c])), d2, kind
    if kind == "positional":  # a slice of a longer table, added
        pos = b.param(max(b.T, 1) + 2, d, scale=0.3)
        return (lambda p, h: h + (p[pos][:h.shape[-2]] if b.T else p[pos][1])), d, kind
    if kind == "column_gather":  # columns of a weight picked by the data
        w = b.param(d, 7, scale=0.3)

        def f(p, h):
            ids = (jnp.abs(h[..., 0]) * 5).astype(jnp.int32) % 7
            return h + jnp.moveaxis(jnp.take(p[w], ids, axis=1), 0, -1)
        return f, d, kind
    if kind == "left":  # the weight as the left operand, broadcast by matmul
        w = b.param(d2, d)
        return (lambda p, h: jnp.matmul(p[w], h[..., None])[..., 0]), d2, kind
    if kind == "weight_norm":
        v, g = b.param(d, d2), b.param(d2, scale=1.0)
        return (lambda p, h: h @ (p[v] / jnp.linalg.norm(p[v], axis=0, keepdims=True)) * p[g]
                ), d2, kind
    if kind == "scaled_lookup":  # a second table looked up by the data, scaled
        E2 = b.param(9, d, scale=0.3)

        def f(p, h):
            ids = (jnp.abs(h[..., 0]) * 4).astype(jnp.uint8) % 9
            return h + np.sqrt(d) * p[E2][ids]
        return f, d, kind
    if kind == "cast":  # mixed precision: the dense layer computed a precision lower
        w = b.param(d, d2)

        def f(p, h):
            lo = jnp.float32 if h.dtype == jnp.float64 else jnp.bfloat16
            return (h.astype(lo) @ p[w].astype(lo)).astype(h.dtype)
        return f, d2, kind
    if kind in ("masked", "col_scaled", "row_scaled"):  # times a constant array
        w = b.param(d, d2)
        m = b.np.choice([0.0, 1.0, 2.5], size=(d, d2))
        if kind == "col_scaled":
            m = m[:1]
        elif kind == "row_scaled":
            m = m[:, :1]
        return (lambda p, h: h @ (p[w] * m)), d2, kind
    if kind == "at_set":  # a row of the weight replaced
        w = b.param(d, d2)
        return (lambda p, h: h @ p[w].at[0].set(0.25)), d2, kind
    if kind == "dyn_slice":  # a window of the weight at a start the example decides
        w = b.param(d + 1, d2)

        def f(p, h):
            def one(x):
                start = (jnp.abs(x).mean() > 0.6).astype(jnp.int32)
                return x @ jax.lax.dynamic_slice(p[w], (start, 0 * start), (d, d2))
            return jax.vmap(one)(h) if h.ndim >= 2 else one(h)
        return f, d2, kind
    if kind == "concat":  # a fused projection built from two leaves
        w1, w2 = b.param(d, d2), b.param(d, 2)
        return (lambda p, h: h @ jnp.concatenate([p[w1], p[w2]], axis=1)), d2 + 2, kind
    if kind == "stack":
        w1, w2 = b.param(d, d2), b.param(d, d2)
        return (lambda p, h: jnp.einsum("...i,kio->...o", h, jnp.stack([p[w1], p[w2]]))
                ), d2, kind
    if kind == "lax_map":  # a loop over the leading axis (the examples, batched)
        w = b.param(d, d2)
        return (lambda p, h: jax.lax.map(lambda x: jnp.tanh(x @ p[w]), h)), d2, kind
    if kind == "temperature":  # a scalar the logits are divided by
        t = b.param(scale=1.0)
        return (lambda p, h: h / (1.5 + jnp.tanh(p[t]))), d, kind
    if kind == "stop_grad":  # a second use of the weight that passes no gradient
        w = b.param(d, d2)
        return (lambda p, h: h @ p[w] + 0.5 * h @ jax.lax.stop_gradient(p[w])), d2, kind
    if kind == "remat_policy":
        w1, w2 = b.param(d, d), b.param(d, d2)
        pol = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return (jax.checkpoint(lambda p, h: jnp.tanh(h @ p[w1]) @ p[w2], policy=pol)
                ), d2, kind
    if kind == "named":
        w = b.param(d, d2)
        return jax.named_call(lambda p, h: jnp.tanh(h @ p[w]), name="named_layer"), d2, kind
    if kind == "custom_jvp":
        w = b.param(d, d2)
        return (lambda p, h: _softsign_dense(h, p[w])), d2, kind
    if kind == "einsum_twice":  # one weight twice in one contraction
        w = b.param(d, d, scale=0.5 / np.sqrt(d))
        return (lambda p, h: jnp.einsum("...i,ij,jk->...k", h, p[w], p[w])), d, kind
    if kind == "where_select":  # two layers, chosen element by element by the data
        w1, w2 = b.param(d, d2), b.param(d, d2)
        return (lambda p, h: jnp.where(h[..., :1] > 0, h @ p[w1], jnp.tanh(h @ p[w2]))
                ), d2, kind
    # dpa: jax.nn.dot_product_attention between projections (tokens)
    if not b.T:
        w = b.param(d, d2)
        return (lambda p, h: jnp.tanh(h @ p[w])), d2, "dense:tanh"
    H, k = 2, 2
    q, kk, v, o = b.param(d, H, k), b.param(d, H, k), b.param(d, H, k), b.param(H, k, d)

    def f(p, h):
        Q, K, V = (jnp.einsum("...td,dhk->...thk", h, p[x]) for x in (q, kk, v))
        a = jax.nn.dot_product_attention(Q, K, V, is_causal=True)
        return h + jnp.einsum("...thk,hkd->...td", a, p[o])
    return f, d, kind


def make_model(seed, dtype=jnp.float64, widths=(3, 4, 5, 7), kinds=KINDS, constrain=None):
    """``(loss, params, batch_of(B), description)`` of random model ``seed``; its layers'
    widths drawn from ``widths`` (the first three: the input's). ``constrain``: applied
    to the activations after the input and each block (a sharding constraint, as MaxText
    constrains them; `_random_sharded`)."""
    r = random.Random(seed)
    tokens = r.random() < 0.7
    T = r.choice([3, 4]) if tokens else 0
    d0, V = r.choice(widths[:3]), 11
    b = _Builder(r, T, dtype, widths, kinds)
    emb = tokens and r.random() < 0.5
    desc = []
    if emb:
        E = b.param(V, d0, scale=1.0)
        tied_head = r.random() < 0.5
        desc.append("embedding")
    fs, d = [], d0
    for _ in range(r.choice([1, 2, 3])):
        f, d, what = _block(b, d)
        fs.append(f)
        desc.append(what)
    head = "tied_xent" if emb and tied_head else r.choice(["mse", "xent"])
    if head == "mse":
        wo = b.param(d, 1)
    elif head == "xent":
        wo = b.param(d, 5)
    elif d != d0:
        wh = b.param(d, d0)
    l2 = r.random() < 0.15
    desc += [head] + (["l2"] if l2 else [])
    n_labels = V if head == "tied_xent" else 5

    def loss(p, batch):
        c = constrain or (lambda h: h)
        h = c(p[E][batch["ids"]] if emb else batch["x"])
        for f in fs:
            h = c(f(p, h))
        if head == "mse":
            terms = ((h @ p[wo])[..., 0] - batch["y"]) ** 2
        else:
            z = h @ p[wo] if head == "xent" else (h if d == d0 else h @ p[wh]) @ p[E].T
            terms = -jnp.take_along_axis(jax.nn.log_softmax(z), batch["lab"][..., None], -1)[..., 0]
        out = jnp.mean(terms)
        return out + 1e-2 * jnp.sum(jnp.square(p["p0"])) if l2 else out

    def batch_of(B):
        g = np.random.default_rng(seed)
        shape = (B, T) if tokens else (B,)
        return {"x": jnp.asarray(g.normal(size=shape + (d0,)), dtype),
                "ids": jnp.asarray(g.integers(0, V, shape), jnp.uint8),
                "y": jnp.asarray(g.normal(size=shape), dtype),
                "lab": jnp.asarray(g.integers(0, n_labels, shape))}

    return loss, b.p, batch_of, desc


_PLAIN = {"mean": S.mean, "sum": S.sum, "second_moment": S.second_moment,
          "variance": S.variance, "sign_mean": S.sign_mean, "abs_mean": S.abs_mean,
          "sq_norms": S.sq_norms, "norms": S.norms, "kurtosis": js.stats.kurtosis,
          "fourth_moment": js.stats.fourth_moment, "snr": S.snr,
          "gradient_noise_scale": S.gradient_noise_scale,
          "gradient_diversity": js.stats.gradient_diversity}
_WEIGHTED_ORACLE = {"mean", "sum", "second_moment", "variance", "sign_mean", "abs_mean",
                    "fourth_moment", "kurtosis", "gradient_diversity", "clipped_mean",
                    "clipped_sum", "sq_norms"}
_NEEDS_TWO = {"variance", "kurtosis", "snr", "gradient_noise_scale"}
_RATIOS = {"snr", "gradient_noise_scale", "gradient_diversity", "kurtosis"}


def draw_call(seed):
    """The call's options for model ``seed``: ``(B, chunk_size, budget, weights, request,
    oracle keyword arguments per statistic)``."""
    r = random.Random(seed * 7919 + 1)
    B = r.choice([1, 2, 3, 5])
    chunk = r.choice([None, None, 1, 2, 3, "auto"])
    budget = r.choice([None, None, 64, 512])
    names = r.sample([*_PLAIN, "clipped_mean", "clipped_sum", "sq_norms_per_leaf"], 3)
    weights = None
    if r.random() < 0.4:
        weights = np.random.default_rng(seed + 5).choice([0.0, 0.5, 1.0, 2.0], size=B)
        if weights.sum() <= 1.0:
            weights[0] = 2.0
    req, kws = {}, {}
    for n in names:
        if n in ("clipped_mean", "clipped_sum"):
            clip = 0.05 * r.choice([0.1, 1.0, 10.0, 1000.0])
            req[n] = getattr(S, n)(clip)
            kws[n] = (n, {"clip_norm": clip})
        elif n == "sq_norms_per_leaf":
            req[n] = S.sq_norms(per_leaf=True)
            kws[n] = ("sq_norms", {"per_leaf": True})
        else:
            req[n] = _PLAIN[n]()
            kws[n] = (n, {})
    keep = [n for n in req
            if not (weights is not None and kws[n][0] not in _WEIGHTED_ORACLE)
            and not (B == 1 and kws[n][0] in _NEEDS_TWO)
            and not (weights is not None and kws[n] == ("sq_norms", {"per_leaf": True}))]
    return B, chunk, budget, weights, {n: req[n] for n in keep}, {n: kws[n] for n in keep}


def _at(tree, path):
    return functools.reduce(lambda t, k: t[k.key] if hasattr(k, "key") else t[k.idx], path, tree)


def per_example_grads(loss, p, batch):
    """``vmap(grad)`` of the batch-of-one losses: the oracle's per-example gradients."""
    return jax.vmap(jax.grad(lambda p, ex: loss(p, jax.tree.map(lambda t: t[None], ex))),
                    (None, 0))(p, batch)


def _moments(x, weights):
    """The weighted mean and population variance over the examples (axis 0) of ``x``."""
    w = np.ones(x.shape[0]) if weights is None else np.asarray(weights, np.float64)
    w = w.reshape((-1,) + (1,) * (x.ndim - 1))
    m = np.sum(w * x, 0) / np.sum(w)
    return m, np.sum(w * (x - m) ** 2, 0) / np.sum(w)


def resized(weights, B):
    """Drawn example weights (`draw_call`) for a batch of ``B``: repeated, the first 2."""
    if weights is None:
        return None
    weights = np.resize(weights, B)
    weights[0] = 2.0
    return weights


def _agree(g, path, weights):
    """Where the examples' gradients agree to rounding (a variance under 1e-12 of the
    squared mean): per entry of the leaf at ``path``, or over every leaf (``()``)."""
    x = (np.asarray(_at(g, path), np.float64) if path else
         np.concatenate([np.asarray(v, np.float64).reshape(v.shape[0], -1)
                         for v in jax.tree.leaves(g)], axis=1))
    m, var = _moments(x, weights)
    if not path:
        return np.asarray(var.sum() <= 1e-12 * np.sum(m**2))
    return var <= 1e-12 * m**2


def mismatches(got, g, kws, weights, f64=True, bf16=False):
    """Where ``got`` (the call's values, keyed as ``kws``) differs from the oracle of the
    per-example gradients ``g``: a list of strings, empty where every value agrees.
    ``f64``: float64's tolerance (else float32's); ``bf16``: a layer computed in bfloat16
    (a tolerance of its rounding)."""
    bad = []
    for n, v in got.items():
        name, okw = kws[n]
        want = zoo.oracle_from_grads(g, name, weights=weights, **okw)
        for path, a in jax.tree_util.tree_leaves_with_path(want):
            a, bv = np.asarray(a, np.float64), np.asarray(_at(v, path) if path else v, np.float64)
            if name == "gradient_noise_scale" and _agree(g, (), weights).all():
                continue  # (a ratio over a variance at rounding level: both are rounding)
            if name == "snr" and path:
                a = np.where(_agree(g, path, weights), bv, a)
            if name in ("sign_mean", "kurtosis") and path:
                # (a tie at a zero gradient may round either way; a kurtosis where the
                # examples agree to rounding is the ratio of two roundings)
                gl = np.asarray(_at(g, path), np.float64)
                top = max(np.abs(gl).max(), 1e-300)
                if name == "sign_mean":
                    doubtful = np.abs(gl).min(0) < (1e-12 if f64 else 1e-5) * top
                else:  # (over the examples the weights keep)
                    doubtful = _moments(gl, weights)[1] < (1e-20 if f64 else 1e-8) * top**2
                a = np.where(doubtful, bv, a)
            if not f64 and name in _RATIOS:
                continue
            fin = np.abs(a[np.isfinite(a)])
            scale = float(fin.max()) if fin.size else 1.0
            rtol, atol = ((1e-7, 1e-10 * max(scale, 1.0)) if f64 else (3e-2, 3e-2 * scale)
                          if bf16 else (2e-3, 2e-4 * scale))
            if not np.allclose(bv, a, rtol=rtol, atol=atol, equal_nan=True):
                err = np.nanmax(np.abs(bv - a))
                bad.append(f"{n}{jax.tree_util.keystr(path)}: error {err:.3g} of {scale:.3g}")
    return bad


def lower_precision(desc):
    """Whether a block of the model computes a precision below its parameters' (``cast``;
    ``dpa``: jax.nn.dot_product_attention's softmax is float32's whatever the inputs)."""
    return any("cast" in x or "dpa" in x for x in desc)


def check(seed, dtype=jnp.float64, kinds=KINDS):
    """Mismatches of random model ``seed`` (its blocks drawn from ``kinds``) against the
    oracle (`mismatches`), and the model's description."""
    loss, p, batch_of, desc = make_model(seed, dtype, kinds=kinds)
    B, chunk, budget, weights, req, kws = draw_call(seed)
    if not req:
        return [], desc
    batch = batch_of(B)
    kw = {} if weights is None else {"example_weights": jnp.asarray(weights, dtype)}
    one = random.Random(seed * 31 + 7).random() < 0.2  # written for one example
    if one:
        fn = js.per_example_stat(lambda p, ex: loss(p, jax.tree.map(lambda t: t[None], ex)), req,
                                 keep_batch_dim=False, chunk_size=chunk,
                                 memory_budget_bytes=budget)
    else:
        fn = js.per_example_stat(loss, req, chunk_size=chunk, memory_budget_bytes=budget)
    got = jax.jit(fn)(p, batch, **kw)
    bad = mismatches(got, per_example_grads(loss, p, batch), kws, weights,
                     dtype == jnp.float64 and not lower_precision(desc),
                     bf16=any("cast" in x for x in desc) and dtype != jnp.float64)
    return bad, desc + (["keep_batch_dim=False"] if one else [])


def check_shard_map(seed, n_devices, kinds=KINDS):
    """`check` of model ``seed`` with its batch split over ``n_devices`` by
    ``jax.shard_map`` (``axis_name``; the parameters replicated; one to three examples a
    device): the statistics that reduce over the examples (per-example outputs stay on
    their devices)."""
    from jax.sharding import PartitionSpec as P

    r = random.Random(seed + 77)
    mesh = jax.make_mesh((n_devices,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    loss, p, batch_of, desc = make_model(seed, kinds=kinds)
    _, chunk, budget, weights, req, kws = draw_call(seed)
    B = n_devices * r.choice([1, 2, 3])
    weights = resized(weights, B)
    req = {k: v for k, v in req.items()
           if kws[k][0] not in ("sq_norms", "norms") and (B > 1 or kws[k][0] not in _NEEDS_TWO)}
    if not req:
        return [], desc
    batch = batch_of(B)
    fn = js.per_example_stat(loss, req, chunk_size=chunk, memory_budget_bytes=budget,
                             axis_name="d")
    if weights is None:
        sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
        got = jax.jit(sm)(p, batch)
    else:
        sm = jax.shard_map(lambda p, b, w: fn(p, b, example_weights=w), mesh=mesh,
                           in_specs=(P(), P("d"), P("d")), out_specs=P())
        got = jax.jit(sm)(p, batch, jnp.asarray(weights))
    bad = mismatches(got, per_example_grads(loss, p, batch), kws, weights,
                     not lower_precision(desc))
    return bad, desc + [f"{n_devices} devices", f"B {B}", f"chunk_size {chunk}",
                        f"budget {budget}", "weights" if weights is not None else "no weights"]


def main(argv=None):
    """A fuzz run: ``python tests/_random_models.py START STOP [--more] [--float32]
    [--shard-map N] [--minutes M]`` checks the models of seeds ``START..STOP-1`` (both
    families of blocks with ``--more``; split over ``N`` devices by ``jax.shard_map``,
    which sets the device count before jax starts) until the time is up, printing each
    mismatch or crash; exit status 1 if any. Seeds the suite does not use find what it
    does not (the suite uses seeds below 72 and 1000-1105)."""
    import argparse
    import sys
    import time

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    ap.add_argument("start", type=int)
    ap.add_argument("stop", type=int)
    ap.add_argument("--more", action="store_true", help="both families of blocks")
    ap.add_argument("--layers", action="store_true",
                    help="the third family: stacks of transformer layers under lax.scan")
    ap.add_argument("--float32", action="store_true", help="float32 (else float64)")
    ap.add_argument("--shard-map", type=int, default=0, metavar="N",
                    help="the batch split over N devices by jax.shard_map (float64)")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long")
    a = ap.parse_args(argv)
    kinds = LAYER_KINDS if a.layers else KINDS + MORE_KINDS if a.more else KINDS
    t0, n, failed = time.time(), 0, 0
    for seed in range(a.start, a.stop):
        if a.minutes is not None and time.time() - t0 > 60 * a.minutes:
            break
        n += 1
        try:
            if a.shard_map:
                with zoo.x64():
                    bad, desc = check_shard_map(seed, a.shard_map, kinds=kinds)
            elif a.float32:
                bad, desc = check(seed, jnp.float32, kinds=kinds)
            else:
                with zoo.x64():
                    bad, desc = check(seed, jnp.float64, kinds=kinds)
        except Exception as e:  # noqa: BLE001 - a crash is a finding too
            bad, desc = [f"crash: {type(e).__name__}: {str(e)[:300]}"], []
        if bad:
            failed += 1
            print(f"seed {seed} ({', '.join(desc)}): " + "; ".join(bad), flush=True)
    print(f"{n} models from seed {a.start}, {failed} with mismatches or crashes, "
          f"{time.time() - t0:.0f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    import os
    import sys

    # (the device count, set before jax's backend starts: `--shard-map N` or `=N`)
    args = " ".join(sys.argv[1:]).replace("--shard-map=", "--shard-map ").split()
    if "--shard-map" in args:
        n = args[args.index("--shard-map") + 1]
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={n}").strip()
    main(args)

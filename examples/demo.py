"""Demo: statistics of per-example gradients of a small transformer LM, in one pass.

    python examples/demo.py

Builds a decoder-only transformer in plain JAX (token + learned positional
embeddings, layernorm, multi-head attention written with einsum, MLP, tied
output embedding, cross-entropy with a padding mask), then

1. prints the ``explain`` table: the layer kind detected for every parameter
   and the rule each statistic uses;
2. computes mean, E[g^2], variance, per-example norms, the DP clipped mean and
   the gradient noise scale in ONE call, and checks them against
   ``jax.vmap(jax.grad(per_example_loss))``;
3. times the call against plain ``jax.grad`` and ``vmap(grad)``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxpr_surgery as js


def init_params(key, vocab=512, seq=32, d=64, heads=4, layers=2, mlp=256):
    keys = iter(jax.random.split(key, 8 * layers + 4))
    normal = lambda *shape, s=0.02: s * jax.random.normal(next(keys), shape)  # noqa: E731
    dh = d // heads
    return {
        "embed": normal(vocab, d),
        "pos": normal(seq, d),
        "blocks": [
            {
                "ln1": {"g": jnp.ones(d), "b": jnp.zeros(d)},
                "wq": normal(d, heads, dh), "wk": normal(d, heads, dh), "wv": normal(d, heads, dh),
                "wo": normal(heads, dh, d),
                "ln2": {"g": jnp.ones(d), "b": jnp.zeros(d)},
                "w1": normal(d, mlp), "b1": jnp.zeros(mlp),
                "w2": normal(mlp, d), "b2": jnp.zeros(d),
            }
            for _ in range(layers)
        ],
        "ln_f": {"g": jnp.ones(d), "b": jnp.zeros(d)},
    }


def layernorm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = jnp.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def block(x, p):
    T = x.shape[1]
    h = layernorm(x, p["ln1"])
    q = jnp.einsum("btd,dhk->bthk", h, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", h, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    a = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, axis=-1), v)
    x = x + jnp.einsum("bthk,hkd->btd", a, p["wo"])
    h = layernorm(x, p["ln2"])
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss_fn(params, batch):
    """Mean over examples of each example's masked next-token cross-entropy."""
    ids, mask = batch["ids"], batch["mask"]
    x = params["embed"][ids[:, :-1]] + params["pos"][: ids.shape[1] - 1]
    for p in params["blocks"]:
        x = block(x, p)
    logits = layernorm(x, params["ln_f"]) @ params["embed"].T  # tied output embedding
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    m = mask[:, 1:]
    return jnp.mean(jnp.sum(nll * m, 1) / jnp.maximum(jnp.sum(m, 1), 1.0))


def make_batch(key, batch_size, seq, vocab):
    k1, k2 = jax.random.split(key)
    ids = jax.random.randint(k1, (batch_size, seq), 0, vocab)
    lengths = jax.random.randint(k2, (batch_size, 1), seq // 2, seq + 1)
    mask = (jnp.arange(seq)[None] < lengths).astype(jnp.float32)
    return {"ids": ids, "mask": mask}


def _time(f, *args, repeats=5):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="tiny model, no timing")
    args = ap.parse_args(argv)
    d, vocab = (32, 128) if args.quick else (64, 512)

    key = jax.random.PRNGKey(0)
    params = init_params(key, vocab=vocab, seq=args.seq + 1, d=d)
    batch = make_batch(jax.random.PRNGKey(1), args.batch_size, args.seq + 1, vocab)

    print("== explain: what was detected, and the rule per statistic ==")
    print(js.explain(loss_fn)(params, batch))

    request = {
        "mean": js.stats.mean(),
        "second_moment": js.stats.second_moment(),
        "variance": js.stats.variance(),
        "norms": js.stats.norms(),
        "clipped_mean": js.stats.clipped_mean(1.0),
        "noise_scale": js.stats.gradient_noise_scale(),
    }
    stat_fn = jax.jit(js.value_and_per_example_stat(loss_fn, request))
    loss, out = stat_fn(params, batch)
    print(f"\nloss = {float(loss):.4f}")
    print("per-example gradient norms:", np.array2string(np.asarray(out["norms"]), precision=3))
    print(
        "gradient noise scale tr(Sigma)/|G|^2 (unbiased pieces) = "
        f"{float(out['noise_scale']):.2f}"
    )

    # the oracle: materialise every per-example gradient
    per_example = lambda p, ex: loss_fn(p, jax.tree.map(lambda x: x[None], ex))  # noqa: E731
    vmap_grad = jax.jit(jax.vmap(jax.grad(per_example), in_axes=(None, 0)))
    G = vmap_grad(params, batch)
    B = args.batch_size

    def reference(G):
        """The same six statistics from materialised per-example gradients."""
        sq = sum(jnp.sum(g.reshape(B, -1) ** 2, 1) for g in jax.tree.leaves(G))
        clip = jnp.minimum(1.0, 1.0 / jnp.sqrt(sq))
        var = jax.tree.map(lambda g: g.var(0, ddof=1), G)
        tr = sum(jnp.sum(v) for v in jax.tree.leaves(var))
        g2 = sum(jnp.sum(g.mean(0) ** 2) for g in jax.tree.leaves(G)) - tr / B
        return {
            "mean": jax.tree.map(lambda g: g.mean(0), G),
            "second_moment": jax.tree.map(lambda g: (g**2).mean(0), G),
            "variance": var,
            "norms": jnp.sqrt(sq),
            "clipped_mean": jax.tree.map(lambda g: jnp.tensordot(clip, g, (0, 0)) / B, G),
            "noise_scale": jnp.where(g2 > 0, tr / g2, jnp.inf),
        }

    ref = reference(G)
    vmap_stats = jax.jit(lambda p, b: reference(vmap_grad(p, b)))
    print("\n== check against jax.vmap(jax.grad(per_example_loss)) ==")
    for name, r in ref.items():
        err = max(
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(jax.tree.leaves(out[name]), jax.tree.leaves(r))
        )
        print(f"{name:14s} max relative error {err:.1e}")
        assert err < 1e-4 or (name == "noise_scale" and not np.isfinite(float(r))), name

    if not args.quick:
        print("\n== time (median of 5, this machine) ==")
        t_grad = _time(jax.jit(jax.grad(loss_fn)), params, batch)
        t_ours = _time(stat_fn, params, batch)
        t_vmap = _time(vmap_stats, params, batch)
        print(f"jax.grad (the mean only)            {t_grad * 1e3:8.2f} ms  1.00x")
        print(f"jaxpr_surgery, 6 statistics         {t_ours * 1e3:8.2f} ms  {t_ours / t_grad:.2f}x")
        print(f"vmap(grad) + reductions, same 6     {t_vmap * 1e3:8.2f} ms  {t_vmap / t_grad:.2f}x")


if __name__ == "__main__":
    main()

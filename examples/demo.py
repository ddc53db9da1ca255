"""Demo: statistics of per-example gradients in one pass, and where that pays.

    python examples/demo.py            # about half a minute on 2 CPU cores
    python examples/demo.py --quick    # tiny sizes, one timing call (a smoke test)

Builds a decoder-only transformer in plain JAX (token + learned positional
embeddings, layernorm, multi-head attention written with einsum, MLP, tied
output embedding, cross-entropy with a padding mask), then

1. prints the ``explain`` table: the layer kind detected for every parameter
   and the rule each requested statistic uses;
2. computes mean, E[g^2], variance, per-example norms, the DP clipped mean and
   the pieces of the gradient noise scale in ONE call, prints the noise scale (or
   why this batch leaves it undefined), and checks them against
   ``jax.vmap(jax.grad(per_example_loss))``;
3. measures, in this process, the time and XLA's temporary memory of the same
   six statistics by jaxpr_surgery, by ``vmap(grad)`` plus reductions and by
   ``optax.microbatching.micro_grad`` (a ``transform_fn`` per example), against
   plain ``jax.grad``, on two regimes: this transformer, and a token-free MLP,
   where every per-example gradient of a dense layer is rank-one. There
   jaxpr_surgery never forms one (a few extra matmuls), while ``vmap(grad)`` and
   ``micro_grad`` hold ``B`` copies of the weights. Every ratio printed is measured
   here; nothing is hard-coded.
"""

from __future__ import annotations

import argparse
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpr_surgery as js


# --------------------------------------------------------------------------- #
# The models (numpy initialisation: nothing compiles before the demo starts)
# --------------------------------------------------------------------------- #
def init_params(seed=0, vocab=512, seq=32, d=64, heads=4, layers=2, mlp=256):
    rng = np.random.default_rng(seed)

    def normal(*shape, s=0.02):
        return jnp.asarray(s * rng.standard_normal(shape, dtype=np.float32))

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


def make_batch(seed, batch_size, seq, vocab):
    """Token ids drawn from a Zipf law (frequency of the k-th token ~ 1/k, as in text)
    and a padding mask. The model at initialisation predicts nearly uniform tokens, so
    the batch carries a signal (the token frequencies); with uniformly random ids it
    would carry none, and the gradient noise scale would be undefined (noise only)."""
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, vocab + 1)
    ids = jnp.asarray(rng.choice(vocab, (batch_size, seq), p=zipf / zipf.sum()), jnp.int32)
    lengths = rng.integers(seq // 2, seq + 1, (batch_size, 1))
    mask = jnp.asarray(np.arange(seq)[None] < lengths, jnp.float32)
    return {"ids": ids, "mask": mask}


def transformer_problem(batch_size=16, seq=32, quick=False):
    """``(params, batch)`` of the demo's transformer (``quick``: tiny sizes)."""
    d, vocab, layers = (16, 64, 1) if quick else (64, 512, 2)
    params = init_params(0, vocab=vocab, seq=seq + 1, d=d, layers=layers, mlp=4 * d)
    return params, make_batch(1, batch_size, seq + 1, vocab)


def mlp_loss(params, batch):
    """Softmax cross-entropy of a ReLU MLP: no token axis, so each example's gradient
    of a dense weight is the outer product x_b^T dy_b (rank one)."""
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    logp = jax.nn.log_softmax(h @ params["w2"] + params["b2"])
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def mlp_problem(batch_size, din=784, hidden=512, nclass=10, seed=2):
    rng = np.random.default_rng(seed)

    def dense(i, o):
        return jnp.asarray(rng.standard_normal((i, o), dtype=np.float32) / np.sqrt(i))

    params = {"w1": dense(din, hidden), "b1": jnp.zeros(hidden),
              "w2": dense(hidden, nclass), "b2": jnp.zeros(nclass)}
    batch = {"x": jnp.asarray(rng.standard_normal((batch_size, din), dtype=np.float32)),
             "y": jnp.asarray(rng.integers(0, nclass, batch_size), jnp.int32)}
    return params, batch


# --------------------------------------------------------------------------- #
# The six statistics, three ways
# --------------------------------------------------------------------------- #
CLIP = 1.0


def six_statistics():
    return {
        "mean": js.stats.mean(),
        "second_moment": js.stats.second_moment(),
        "variance": js.stats.variance(),
        "norms": js.stats.norms(),
        "clipped_mean": js.stats.clipped_mean(CLIP),
        "noise_scale": js.stats.noise_scale_components(),  # .noise_scale: the value
    }


def _global_sq_norm(g):
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g))


def _noise_scale(mean, var, B):
    """The unbiased pieces of the simple noise scale: |G|^2 = |mean|^2 - tr(Sigma) / B
    and tr(Sigma) (``.noise_scale`` divides them)."""
    tr = sum(jnp.sum(v) for v in jax.tree.leaves(var))
    return js.stats.NoiseScaleComponents(_global_sq_norm(mean) - tr / B, tr,
                                         jnp.asarray(B, jnp.float32))


def reference(G, B):
    """The six statistics from materialised per-example gradients ``G`` (leaves [B, ...])."""
    sq = sum(jnp.sum(g.reshape(B, -1) ** 2, 1) for g in jax.tree.leaves(G))
    clip = jnp.minimum(1.0, CLIP / jnp.sqrt(sq))
    mean = jax.tree.map(lambda g: g.mean(0), G)
    var = jax.tree.map(lambda g: g.var(0, ddof=1), G)
    return {
        "mean": mean,
        "second_moment": jax.tree.map(lambda g: (g**2).mean(0), G),
        "variance": var,
        "norms": jnp.sqrt(sq),
        "clipped_mean": jax.tree.map(lambda g: jnp.tensordot(clip, g, (0, 0)) / B, G),
        "noise_scale": _noise_scale(mean, var, B),
    }


def vmap_statistics(loss, B):
    """``jax.vmap(jax.grad(per_example_loss))``, then the reductions."""
    per_example = lambda p, ex: loss(p, jax.tree.map(lambda x: x[None], ex))  # noqa: E731
    grads = jax.vmap(jax.grad(per_example), in_axes=(None, 0))
    return lambda p, b: reference(grads(p, b), B)


def micro_grad_statistics(loss, B):
    """The six statistics with ``optax.microbatching.micro_grad``: per example, the
    gradient, its square and its clipped value are averaged, and its squared norm is
    a metric. ``None`` where the installed optax has no ``micro_grad``."""
    mb = getattr(optax, "microbatching", None)
    if getattr(mb, "micro_grad", None) is None:
        return None

    def transform(g):
        c = jnp.minimum(1.0, CLIP / jnp.sqrt(_global_sq_norm(g)))
        return g, jax.tree.map(jnp.square, g), jax.tree.map(lambda x: x * c, g)

    mg = mb.micro_grad(loss, argnums=0, batch_argnums=1, keep_batch_dim=True,
                       accumulator=mb.AccumulationType.MEAN, transform_fn=transform,
                       metrics_fn=_global_sq_norm)

    def f(p, b):
        (mean, m2, clipped), aux = mg(p, b)
        var = jax.tree.map(lambda a, s: (s - a * a) * (B / (B - 1)), mean, m2)
        return {"mean": mean, "second_moment": m2, "variance": var,
                "norms": jnp.sqrt(aux.metrics), "clipped_mean": clipped,
                "noise_scale": _noise_scale(mean, var, B)}

    return f


# --------------------------------------------------------------------------- #
# Measuring
# --------------------------------------------------------------------------- #
def compile_(f, *args):
    """``(compiled, XLA's temporary bytes or None)``: one compile, used for both."""
    compiled = jax.jit(f).lower(*args).compile()
    try:
        temp = compiled.memory_analysis().temp_size_in_bytes
    except Exception:  # noqa: BLE001 - no memory analysis on this backend
        temp = None
    return compiled, temp


def _time(f, *args, repeats=5, cap_s=3.0):
    """Median seconds of ``repeats`` calls after a warm-up (fewer past ``cap_s``)."""
    jax.block_until_ready(f(*args))
    ts, start = [], time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
        if time.perf_counter() - start > cap_s:
            break
    return float(np.median(ts))


def compare(title, loss, params, batch, repeats, compiled=None):
    """Times ``jax.grad``, jaxpr_surgery, ``vmap(grad)`` and ``micro_grad`` computing the
    six statistics (``compiled``: ``(fn, temp bytes)`` already compiled, by method)."""
    B = jax.tree.leaves(batch)[0].shape[0]
    methods = {
        "jax.grad (the mean only)": jax.grad(loss),
        "jaxpr_surgery, 6 statistics": js.per_example_stat(loss, six_statistics()),
        "vmap(grad) + reductions, same 6": vmap_statistics(loss, B),
        "optax micro_grad, same 6": micro_grad_statistics(loss, B),
    }
    compiled = dict(compiled or {})
    print(f"\n{title}")
    print(f"  {'method':34s} {'time':>10s} {'vs grad':>8s} {'temp memory':>12s}")
    rows = {}
    for name, f in methods.items():
        if f is None:
            print(f"  {name:34s} skipped: optax {optax.__version__} has no "
                  "optax.microbatching.micro_grad")
            continue
        fn, temp = compiled[name] if name in compiled else compile_(f, params, batch)
        rows[name] = _time(fn, params, batch, repeats=repeats)
        grad_t = rows["jax.grad (the mean only)"]
        mem = "?" if temp is None else f"{temp / 2**20:.1f} MiB"
        print(f"  {name:34s} {rows[name] * 1e3:7.1f} ms {rows[name] / grad_t:7.2f}x {mem:>12s}")
    ours = rows["jaxpr_surgery, 6 statistics"]
    short = {"vmap(grad) + reductions, same 6": "vmap(grad)",
             "optax micro_grad, same 6": "micro_grad"}
    for k, v in short.items():
        if k in rows:
            print(f"  jaxpr_surgery takes {_ratio(ours / rows[k])} the time of {v} for the same "
                  "statistics")


def _ratio(x):
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes and one timing call (a smoke test of every step)")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else 5
    params, batch = transformer_problem(args.batch_size, args.seq, args.quick)
    B = args.batch_size

    request = six_statistics()
    print("== explain: what was detected, and the rule per statistic ==")
    print(js.explain(loss_fn, request)(params, batch))

    stat_fn, stat_temp = compile_(js.value_and_per_example_stat(loss_fn, request), params, batch)
    loss, out = stat_fn(params, batch)
    print(f"\nloss = {float(loss):.4f}")
    print("per-example gradient norms:", np.array2string(np.asarray(out["norms"]), precision=3))
    print("gradient noise scale (B_simple of McCandlish et al.), or why it is undefined here:")
    # NoiseScaleComponents: its str gives the value with its pieces, or the reason
    print(textwrap.fill(str(out["noise_scale"]), 96, initial_indent="  ", subsequent_indent="  "))

    # the oracle: materialise every per-example gradient
    vmap_fn, vmap_temp = compile_(vmap_statistics(loss_fn, B), params, batch)
    ref = vmap_fn(params, batch)
    print("\n== check against jax.vmap(jax.grad(per_example_loss)) ==")
    for name, r in ref.items():
        scales = [jnp.max(jnp.abs(b)) for b in jax.tree.leaves(r)]
        if name == "noise_scale":  # |G|^2 is a difference: relative to |mean|^2, its first term
            scales[0] = r.grad_sq_norm + r.trace_cov / r.batch_size
        err = max(
            float(jnp.max(jnp.abs(a - b)) / (s + 1e-30))
            for a, b, s in zip(jax.tree.leaves(out[name]), jax.tree.leaves(r), scales)
        )
        print(f"{name:14s} max relative error {err:.1e}")
        assert err < 1e-4, name

    print("\n== time and XLA temporary memory, measured here (median of "
          f"{repeats}{', tiny sizes' if args.quick else ''}) ==")
    compare(
        f"the transformer above, B={B}, {args.seq} tokens: per-example products of its "
        "token-axis layers,\n  formed and reduced a tile of examples at a time",
        loss_fn, params, batch, repeats,
        compiled={"jaxpr_surgery, 6 statistics": (stat_fn, stat_temp),
                  "vmap(grad) + reductions, same 6": (vmap_fn, vmap_temp)},
    )
    mlp_b, din, hidden = (8, 32, 16) if args.quick else (64, 784, 512)
    mlp_params, mlp_batch = mlp_problem(mlp_b, din, hidden)
    compare(
        f"a token-free MLP {din}-{hidden}-10, B={mlp_b}: each per-example gradient is "
        "rank-one;\n  vmap(grad) and micro_grad hold B copies of the weights, "
        "jaxpr_surgery none",
        mlp_loss, mlp_params, mlp_batch, repeats,
    )


if __name__ == "__main__":
    main()

"""Models sharded by XLA's partitioner (``jax.jit`` with ``NamedSharding``): FSDP, tensor
parallelism, both on a 2-D mesh, a scan-over-layers stack sharded on a feature axis.
Run by tests/test_gspmd.py in a subprocess with 8 fake CPU devices, in float64; prints
one JSON object per case.

The oracle is JAX's own: ``jax.vmap(jax.grad(per-example loss))`` on one device, reduced
in numpy. A case is exact (every statistic within ``TOL`` of the oracle), or refused
with the error's message; anything else is a silent wrong number. Each case also
reports the executed collective bytes of E[g^2] against jax.grad's (the loops that
slice the batch no longer gather it: tests/test_gspmd.py bounds the ratio loosely;
the benchmark measures it, benchmarks/shard_bench.py).
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpr_surgery as js  # noqa: E402

TOL = 1e-9
CLIP = 0.05


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #
def lm(B=16, T=8, d=32, L=2, V=128, H=2, seed=0, constrained=None):
    """A GPT-style model: tied embedding, attention, MLP, layer norms. ``constrained``: a
    setup of `MESHES` whose batch axes the residual stream ``[B, T, d]`` is constrained
    to after the lookup and each block (``with_sharding_constraint``, as MaxText's logical
    axis rules constrain activations)."""
    r = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(r.normal(size=s) * 0.2)  # noqa: E731
    p = {"emb": n(V, d), "pos": n(T, d), "lnf_g": 1 + n(d), "lnf_b": n(d), "blocks": []}
    for _ in range(L):
        p["blocks"].append({"ln_g": 1 + n(d), "ln_b": n(d), "qkv": n(d, 3 * d),
                            "proj": n(d, d), "fc": n(d, 4 * d), "fc_b": n(4 * d),
                            "out": n(4 * d, d)})
    batch = {"tok": jnp.asarray(r.integers(0, V, (B, T))),
             "tgt": jnp.asarray(r.integers(0, V, (B, T)))}

    def ln(x, g, b):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * g + b

    if constrained is None:
        c = lambda x: x  # noqa: E731
    else:
        shape, names = MESHES[constrained]
        mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 2)
        act = NamedSharding(mesh, P(specs(constrained, {})[1][0], None, None))
        c = lambda x: jax.lax.with_sharding_constraint(x, act)  # noqa: E731

    def loss(p, b):
        x = c(p["emb"][b["tok"]] + p["pos"][None])
        Bq, Tq, _ = x.shape
        mask = jnp.tril(jnp.ones((Tq, Tq), bool))
        for blk in p["blocks"]:
            h = ln(x, blk["ln_g"], blk["ln_b"])
            q, k, v = jnp.split(h @ blk["qkv"], 3, axis=-1)
            sh = lambda t: t.reshape(Bq, Tq, H, d // H)  # noqa: E731
            a = jnp.einsum("bthk,bshk->bhts", sh(q), sh(k)) / np.sqrt(d // H)
            a = jax.nn.softmax(jnp.where(mask, a, -1e9), -1)
            o = jnp.einsum("bhts,bshk->bthk", a, sh(v)).reshape(Bq, Tq, d)
            x = x + o @ blk["proj"]
            x = c(x + jax.nn.gelu(h @ blk["fc"] + blk["fc_b"]) @ blk["out"])
        z = ln(x, p["lnf_g"], p["lnf_b"]) @ p["emb"].T
        lp = jax.nn.log_softmax(z)
        return -jnp.mean(jnp.take_along_axis(lp, b["tgt"][..., None], -1))

    return loss, p, batch


def scan_mlp(B=16, d=16, L=3, seed=0):
    """Layers stacked ``[L, d, d]`` and run by ``lax.scan`` over ``jax.checkpoint``."""
    r = np.random.default_rng(seed)
    p = {"w": jnp.asarray(r.normal(size=(L, d, d)) / np.sqrt(d)),
         "b": jnp.asarray(r.normal(size=(L, d)) * 0.1),
         "head": jnp.asarray(r.normal(size=(d, 4)) / np.sqrt(d))}
    batch = {"x": jnp.asarray(r.normal(size=(B, d))), "y": jnp.asarray(r.normal(size=(B, 4)))}

    def loss(p, b):
        @jax.checkpoint  # (rematerialised, as large models' stacks are)
        def layer(h, wb):
            return jnp.tanh(h @ wb[0] + wb[1]), None
        h, _ = jax.lax.scan(layer, b["x"], (p["w"], p["b"]))
        return jnp.mean((h @ p["head"] - b["y"]) ** 2)

    return loss, p, batch


def batchnorm(B=16, d=8, seed=0):
    """Examples interact (a batch-norm over the batch): must be refused."""
    r = np.random.default_rng(seed)
    p = {"w": jnp.asarray(r.normal(size=(d, d)))}
    batch = {"x": jnp.asarray(r.normal(size=(B, d)))}

    def loss(p, b):
        h = b["x"] @ p["w"]
        h = (h - h.mean(0)) / (h.std(0) + 1e-3)
        return jnp.mean(h ** 2 * jnp.arange(d))

    return loss, p, batch


def heads(B=16, T=8, d=32, H=4, V=64, seed=0):
    """Attention as Flax and Equinox write it: separate query, key, value and output
    weights with a heads axis (``[d, H, k]``, ``[H, k, d]``), one normalised input
    for three projections, uint8 token ids, an untied head."""
    r = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(r.normal(size=s) * 0.3)  # noqa: E731
    k = d // H
    p = {"emb": n(V, d), "wq": n(d, H, k), "wk": n(d, H, k), "wv": n(d, H, k),
         "wo": n(H, k, d), "ln_g": 1 + n(d), "ln_b": n(d), "head": n(d, V)}
    batch = {"tok": jnp.asarray(r.integers(0, V, (B, T)), jnp.uint8),
             "tgt": jnp.asarray(r.integers(0, V, (B, T)))}

    def loss(p, b):
        x = p["emb"][b["tok"]]
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        h = (x - m) * jax.lax.rsqrt(v + 1e-5) * p["ln_g"] + p["ln_b"]
        q, kk, vv = (jnp.einsum("btd,dhk->bthk", h, p[w]) for w in ("wq", "wk", "wv"))
        a = jax.nn.softmax(jnp.einsum("bthk,bshk->bhts", q, kk) / np.sqrt(k), -1)
        x = x + jnp.einsum("bhts,bshk,hkd->btd", a, vv, p["wo"])
        lp = jax.nn.log_softmax(x @ p["head"])
        return -jnp.mean(jnp.take_along_axis(lp, b["tgt"][..., None], -1))

    return loss, p, batch


def cnn(B=16, seed=0):
    """Two convolutions (SAME and VALID, NHWC) with a bias, and a dense head."""
    r = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(r.normal(size=s) * 0.3)  # noqa: E731
    p = {"k1": n(3, 3, 2, 8), "b1": n(8), "k2": n(3, 3, 8, 8), "fc": n(8 * 6 * 6, 4)}
    batch = {"x": jnp.asarray(r.normal(size=(B, 8, 8, 2))),
             "y": jnp.asarray(r.integers(0, 4, (B,)))}
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(p, b):
        h = jax.lax.conv_general_dilated(b["x"], p["k1"], (1, 1), "SAME", dimension_numbers=dn)
        h = jax.lax.conv_general_dilated(jax.nn.relu(h + p["b1"]), p["k2"], (1, 1), "VALID",
                                         dimension_numbers=dn)
        lp = jax.nn.log_softmax(jnp.tanh(h).reshape(h.shape[0], -1) @ p["fc"])
        return -jnp.mean(jnp.take_along_axis(lp, b["y"][:, None], -1))

    return loss, p, batch


def twice(B=16, d=16, seed=0):
    """One weight used by two layers in a row (its per-example gradient the sum of two
    sites'), over a token axis."""
    r = np.random.default_rng(seed)
    p = {"w2d": jnp.asarray(r.normal(size=(d, d)) / np.sqrt(d)),
         "readout": jnp.asarray(r.normal(size=(d, 2)))}
    batch = {"x": jnp.asarray(r.normal(size=(B, 4, d))), "y": jnp.asarray(r.normal(size=(B, 2)))}

    def loss(p, b):
        h = jnp.tanh(jnp.tanh(b["x"] @ p["w2d"]) @ p["w2d"])
        return jnp.mean((h.mean(1) @ p["readout"] - b["y"]) ** 2)

    return loss, p, batch


# --------------------------------------------------------------------------- #
# Shardings
# --------------------------------------------------------------------------- #
def specs(setup, params):
    """FSDP: matrices over 'fsdp' on their largest axis that 4 divides; TP (Megatron):
    qkv/fc by columns, proj/out/emb by rows over 'model'; 2d: both; scan: the stack's
    feature axis. Vectors replicated."""
    def fsdp(x):
        if x.ndim < 2:
            return P()
        axes = sorted(range(x.ndim), key=lambda a: -x.shape[a])
        a = next((a for a in axes if x.shape[a] % 4 == 0), None)
        return P(*[("fsdp" if i == a else None) for i in range(x.ndim)])

    def tp(path, x, axis="model"):
        name = str(path[-1].key) if hasattr(path[-1], "key") else ""
        if name in ("qkv", "fc", "wq", "wk", "wv", "head", "w2d"):
            return P(None, axis)
        if name in ("proj", "out", "emb", "wo", "b1"):
            return P(axis)
        if name in ("k1", "k2"):  # convolution kernels [h, w, in, out]: by output channels
            return P(None, None, None, axis)
        if name == "w":  # a scan stack [L, d, d]: its output features
            return P(None, None, axis)
        return P()

    if setup == "fsdp":
        return jax.tree.map(fsdp, params), P(("data", "fsdp"))
    if setup == "tp":
        return jax.tree_util.tree_map_with_path(tp, params), P("data")
    if setup == "2d":  # batch over 'fsdp', weights over 'model'
        return jax.tree_util.tree_map_with_path(tp, params), P("fsdp")
    raise ValueError(setup)


MESHES = {"fsdp": ((2, 4), ("data", "fsdp")), "tp": ((2, 4), ("data", "model")),
          "2d": ((4, 2), ("fsdp", "model"))}


def place(setup, params, batch, batch_spec=None):
    shape, names = MESHES[setup]
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ps, bs = specs(setup, params)
    bs = bs if batch_spec is None else batch_spec
    ns = lambda s: NamedSharding(mesh, s)  # noqa: E731
    pshard = jax.tree.map(ns, ps, is_leaf=lambda s: isinstance(s, P))
    return (jax.device_put(params, pshard), jax.device_put(batch, ns(bs)), pshard, ns(bs))


# --------------------------------------------------------------------------- #
# Oracle
# --------------------------------------------------------------------------- #
STATS = {
    "mean": js.stats.mean, "second_moment": js.stats.second_moment,
    "variance": js.stats.variance, "sign_mean": js.stats.sign_mean,
    "sq_norms": js.stats.sq_norms, "norms_per_leaf": lambda: js.stats.norms(per_leaf=True),
    "clipped_mean": lambda: js.stats.clipped_mean(CLIP), "kurtosis": js.stats.kurtosis,
}
PER_LAYER = "clipped_per_layer"  # (a bound per leaf: built in run_case from the params)


def per_example_grads(loss, params, batch):
    one = lambda p, ex: loss(p, jax.tree.map(lambda v: v[None], ex))  # noqa: E731
    g = jax.jit(jax.vmap(jax.grad(one), (None, 0)))(params, batch)
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(g)], jax.tree.structure(params)


def oracle(G, tree, w=None):
    N = G[0].shape[0]
    w = np.ones(N) if w is None else np.asarray(w, np.float64)
    W = w.sum()
    wb = lambda g: w.reshape((-1,) + (1,) * (g.ndim - 1))  # noqa: E731
    un = lambda xs: jax.tree.unflatten(tree, xs)  # noqa: E731
    mean = [np.sum(wb(g) * g, 0) / W for g in G]
    sq = sum(np.sum(g.reshape(N, -1) ** 2, 1) for g in G)
    c = np.minimum(1.0, CLIP / np.sqrt(sq))
    live = (w > 0).astype(np.float64)  # (per-example values read 0 at weight 0)
    var = [np.sum(wb(g) * (g - m) ** 2, 0) / (W - 1) for g, m in zip(G, mean)]
    m2c = [np.sum(wb(g) * (g - m) ** 2, 0) / W for g, m in zip(G, mean)]
    m4c = [np.sum(wb(g) * (g - m) ** 4, 0) / W for g, m in zip(G, mean)]
    return {
        "mean": un(mean),
        "second_moment": un([np.sum(wb(g) * g ** 2, 0) / W for g in G]),
        "variance": un(var),
        "sign_mean": un([np.sum(wb(g) * np.sign(g), 0) / W for g in G]),
        "sq_norms": sq * live,
        "norms_per_leaf": un([live * np.sqrt(np.sum(g.reshape(N, -1) ** 2, 1)) for g in G]),
        "clipped_mean": un([np.tensordot(w * c, g, 1) / W for g in G]),
        PER_LAYER: un([np.tensordot(w * np.minimum(1.0, CLIP / np.sqrt(np.sum(
            g.reshape(N, -1) ** 2, 1))), g, 1) / W for g in G]),
        "kurtosis": un([np.where(v > 1e-12 * np.max(v), k / np.where(v > 0, v, 1) ** 2, np.nan)
                        for k, v in zip(m4c, m2c)]),
    }


def error(got, want, stat, N):
    errs = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return float("inf")
        err = np.abs(g - w)
        if stat == "sign_mean":  # (one sign within rounding of 0 may flip)
            err = np.where(err <= 2.0 / N + 1e-9, 0.0, err)
        if stat == "kurtosis":  # (ill-conditioned where the variance is ~0)
            err = np.where(np.isnan(w), 0.0, err)
            w = np.where(np.isnan(w), 0.0, w)
        errs.append(float(np.max(err) / max(np.max(np.abs(w)), 1e-30)))
    return max(errs)


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
# (the default tier's cases skip these: the same reductions as second_moment and sq_norms
# through the same sites, and compute the others in one call; the extended cases take
# every statistic, each alone)
LIGHT = ("sign_mean", "norms_per_leaf")


def run_case(name, model, setup, chunk, weights=False, light=False, budget=None,
             batch_spec=None, reference=None):
    """``reference``: a model of the same values for the oracle (one without the
    sharding constraints that jax 0.10 cannot vmap over one example's unit axis)."""
    loss, params, batch = model()
    ref_loss = loss if reference is None else reference()[0]
    G, tree = per_example_grads(ref_loss, params, batch)
    N = G[0].shape[0]
    w = None
    if weights:
        w = np.random.default_rng(3).integers(0, 3, N).astype(np.float64)
        w[0] = 0.0
    want = oracle(G, tree, w)
    p, b, pshard, bshard = place(setup, params, batch, batch_spec)
    kw = {} if w is None else {"example_weights": jax.device_put(jnp.asarray(w), bshard)}
    opts = {"chunk_size": chunk, "memory_budget_bytes": budget}
    errs = {}
    per_leaf = jax.tree.map(lambda _: CLIP, params)
    stats = {**STATS, PER_LAYER: lambda: js.stats.clipped_mean(per_leaf)}
    todo = {k: mk for k, mk in stats.items()
            if not ((w is not None and k in ("kurtosis",)) or (light and k in LIGHT))}
    if light:  # (the default tier: every statistic in one call, one program to compile)
        f = jax.jit(js.per_example_stat(loss, {k: mk() for k, mk in todo.items()}, **opts))
        outs = f(p, b, **kw)
    else:  # (each statistic alone, its own plan)
        outs = {k: jax.jit(js.per_example_stat(loss, mk(), **opts))(p, b, **kw)
                for k, mk in todo.items()}
    for k, out in outs.items():
        errs[k] = error(out, want[k], k, N)
        if k == "mean":  # typed like the parameters where jit places them
            errs["mean_sharded"] = 0.0 if all(
                len(x.sharding.device_set) == 8 for x in jax.tree.leaves(out)) else 1.0
    vf = jax.jit(js.value_and_per_example_stat(loss, js.stats.mean(), chunk_size=chunk))
    val, _ = vf(p, b, **kw)
    ref = np.sum((np.ones(N) if w is None else w) * np.asarray(
        jax.vmap(lambda ex: ref_loss(params, jax.tree.map(lambda v: v[None], ex)))(batch)))
    errs["loss"] = abs(float(val) - ref / (N if w is None else w.sum())) / abs(ref / N)
    return {"case": name, "errors": errs}


def run_refusal(name, model, setup):
    loss, params, batch = model()
    p, b, _, _ = place(setup, params, batch)
    try:
        jax.jit(js.per_example_stat(loss, js.stats.mean()))(p, b)
    except Exception as e:  # noqa: BLE001
        return {"case": name, "refused": type(e).__name__, "message": str(e)[:300]}
    return {"case": name, "refused": None}


def run_comms(name, model, setup):
    """Executed collective bytes of E[g^2] (whole batch) over jax.grad's, and per-device
    temporary memory of E[g^2], the variance and the kurtosis over jax.grad's."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.shard_bench import collective_bytes as cb  # noqa: PLC0415

    loss, params, batch = model()
    _, _, pshard, bshard = place(setup, params, batch)
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    ap = jax.tree.map(sds, params, pshard)
    ab = jax.tree.map(lambda x: sds(x, bshard), batch)
    def cost(f):
        c = jax.jit(f, out_shardings=pshard).lower(ap, ab).compile()
        return cb(c.as_text())[1], c.memory_analysis().temp_size_in_bytes

    g, gt = cost(jax.grad(loss))
    out = {"case": name}
    for k in ("second_moment", "variance", "kurtosis"):
        c, t = cost(js.per_example_stat(loss, getattr(js.stats, k)(), chunk_size=None))
        if k == "second_moment":
            out["ratio"] = c / max(g, 1)
        out[f"temp_{k}"] = t / max(gt, 1)
    return out


def run_dp(name, setup, layers=2):
    """One ``dp_sgd`` and one ``dp_adam`` step under the sharding against one device's,
    for the same key: the noise is drawn where each shard lives (jax's partitionable
    threefry), never replicated or correlated across shards."""
    import optax  # noqa: PLC0415

    loss, params, batch = lm(L=layers)
    p, b, pshard, _ = place(setup, params, batch)
    errs, sharded = {}, {}
    for oname, opt in (("dp_sgd", js.optim.dp_sgd(0.1, CLIP, 1.1, momentum=0.9)),
                       ("dp_adam", js.optim.dp_adam(1e-2, CLIP, 1.1))):
        req = js.optim.stat_request(opt)

        def step(params, state, batch, key, opt=opt, req=req):
            stats = js.per_example_stat(loss, req)(params, batch)
            upd, state = opt.update(stats["mean"], state, params,
                                    **js.optim.update_kwargs(stats, key=key))
            return optax.apply_updates(params, upd)

        key = jax.random.key(7)
        ref = jax.jit(step)(params, opt.init(params), batch, key)
        got = jax.jit(step, out_shardings=pshard)(p, opt.init(p), b, key)
        moved = jax.tree.map(lambda a, r, q: np.max(np.abs(np.asarray(a) - np.asarray(r)))
                             / np.max(np.abs(np.asarray(r) - np.asarray(q)) + 1e-30),
                             got, ref, params)
        errs[oname] = float(max(jax.tree.leaves(moved)))
        sharded[oname] = all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(got))
    return {"case": name, "errors": errs, "sharded": sharded}


def run_explicit(name, L=3, d=64, T=8, B=16):
    """FSDP written for sharding in types (each weight gathered with
    ``jax.sharding.reshard``, activations annotated with ``out_sharding=``): the
    statistics against the oracle of its unannotated twin, and the executed collective
    bytes of the per-example norms and the variance over jax.grad's. The batch is split by
    device in Auto mode as under GSPMD (before, the Explicit call ran whole: 2.5x)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.shard_bench import collective_bytes as cb  # noqa: PLC0415

    rng = np.random.default_rng(5)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d)) for i in range(L)}
    batch = {k: jnp.asarray(rng.normal(size=(B, T, d))) for k in ("x", "y")}

    def typed(p, b):
        h = b["x"]
        for i in range(L):
            w = jax.sharding.reshard(p[f"w{i}"], P())
            h = jnp.tanh(jnp.matmul(h, w, out_sharding=P(("data", "fsdp"), None, None)))
        return jnp.mean((h - b["y"]) ** 2)

    def plain(p, b):
        h = b["x"]
        for i in range(L):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean((h - b["y"]) ** 2)

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    pshard = jax.tree.map(lambda _: NamedSharding(mesh, P("fsdp", None)), params)
    bshard = NamedSharding(mesh, P(("data", "fsdp")))
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    ap, ab = jax.tree.map(sds, params, pshard), jax.tree.map(lambda x: sds(x, bshard), batch)
    stats = {"mean": js.stats.mean(), "variance": js.stats.variance(),
             "sq_norms": js.stats.sq_norms()}
    with jax.set_mesh(mesh):
        def cost(f):
            return cb(jax.jit(f).lower(ap, ab).compile().as_text())[1]

        g = cost(jax.grad(typed))
        ratios = {k: cost(js.per_example_stat(typed, st, chunk_size=None)) / max(g, 1)
                  for k, st in stats.items() if k != "mean"}
        got = jax.jit(js.per_example_stat(typed, stats))(
            jax.device_put(params, pshard), jax.device_put(batch, bshard))
    want = oracle(*per_example_grads(plain, params, batch))
    errors = {k: error(got[k], want[k], k, B) for k in stats}
    return {"case": name, "errors": errors, "ratios": ratios}


def run_explicit_scan(name, L=4, d=64, T=8, B=16):
    """FSDP written for sharding in types over a scan stack: the stack gathered by
    ``jax.sharding.reshard(ws, P())`` before the scan, as the loss says. The statistics
    against the oracle of its unannotated twin, and their executed collective bytes over
    jax.grad's. Before, the statistics dropped the gather (an annotation: explicit.py)
    and XLA's partitioner moved the activations over the stack's sharded axis instead:
    the mean at 1.5x grad's bytes, the clipped mean at 2.2x (the benchmark's scan stack)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.shard_bench import collective_bytes as cb  # noqa: PLC0415

    rng = np.random.default_rng(7)
    params = {"ws": jnp.asarray(rng.normal(size=(L, d, d)) / np.sqrt(d)),
              "out": jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d))}
    batch = {k: jnp.asarray(rng.normal(size=(B, T, d))) for k in ("x", "y")}

    def body(p, b):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["ws"])
        return jnp.mean((h @ p["out"] - b["y"]) ** 2)

    def typed(p, b):
        return body(jax.tree.map(lambda w: jax.sharding.reshard(w, P()), p), b)

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    pshard = {"ws": NamedSharding(mesh, P(None, "fsdp", None)),
              "out": NamedSharding(mesh, P("fsdp", None))}
    bshard = NamedSharding(mesh, P(("data", "fsdp")))
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    ap, ab = jax.tree.map(sds, params, pshard), jax.tree.map(lambda x: sds(x, bshard), batch)
    stats = {"mean": js.stats.mean(), "sq_norms": js.stats.sq_norms(),
             "clipped_mean": js.stats.clipped_mean(CLIP)}
    with jax.set_mesh(mesh):
        def cost(f):
            return cb(jax.jit(f).lower(ap, ab).compile().as_text())[1]

        g = cost(jax.grad(typed))
        ratios = {k: cost(js.per_example_stat(typed, st, chunk_size=None)) / max(g, 1)
                  for k, st in stats.items()}
        got = jax.jit(js.per_example_stat(typed, stats))(
            jax.device_put(params, pshard), jax.device_put(batch, bshard))
    want = oracle(*per_example_grads(body, params, batch))
    errors = {k: error(got[k], want[k], k, B) for k in stats}
    return {"case": name, "errors": errors, "ratios": ratios}


def run_memory_tied(name, setup="2d"):
    """Per-device temporary memory (``memory_analysis``) of E[g^2] and the kurtosis of a
    one-layer scan stack with a tied table of 16384 rows (benchmarks.models.scan_remat)
    on the 2-D mesh (benchmarks.shard_bench's ``setup``: ``2d``, XLA's partitioner, or
    ``2d-constrained``, the model's activations constrained to the batch's axis), over
    jax.grad's."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tempfile  # noqa: PLC0415

    from benchmarks import models, shard_bench  # noqa: PLC0415

    extra = ({"activation_sharding": shard_bench.CONSTRAINED[setup][1]}
             if setup in shard_bench.CONSTRAINED else {})
    m = models.scan_remat(T=32, d=128, V=16384, layers=1, heads=4, **extra)
    with tempfile.TemporaryDirectory() as t:
        res = shard_bench.measure(m.loss, m.params, m.batch_spec(16), setup,
                                  {"second_moment": js.stats.second_moment(),
                                   "kurtosis": js.stats.kurtosis()}, None,
                                  os.path.join(t, "log"))
    return {"case": name, **{f"temp_{s}": res[s]["temp_mib"] / res["grad"]["temp_mib"]
                             for s in ("second_moment", "kurtosis")}}


def run_segments(name, setup="tp", weights=False):
    """A scan-over-``checkpoint`` transformer (benchmarks.models.scan_remat) whose clipped
    mean, global and per layer, recomputes each layer's attention and MLP inner values
    from its kept input and cotangent, and the tied head's cotangent from the loss
    (segments.py): against the oracle (float64), equal to the form that keeps every
    site's values, and with less per-device temporary memory than it
    (``memory_analysis``, the same model in float32)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import models, shard_bench  # noqa: PLC0415
    from jaxpr_surgery._src import segments  # noqa: PLC0415

    m = models.scan_remat(T=8, d=32, V=64, layers=3, heads=4)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), m.params)
    batch = m.make_batch(16)
    G, tree = per_example_grads(m.loss, params, batch)
    w = None
    if weights:
        w = np.random.default_rng(5).integers(0, 3, 16).astype(np.float64)
        w[1] = 0.0
    want = oracle(G, tree, w)
    shape, names = shard_bench.MESHES[setup]
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    pspec, bspec = shard_bench.specs(setup, params)
    pshard = jax.tree.map(lambda s: NamedSharding(mesh, s), pspec,
                          is_leaf=lambda s: isinstance(s, P))
    bshard = NamedSharding(mesh, bspec)
    p, b = jax.device_put(params, pshard), jax.device_put(batch, bshard)
    kw = {} if w is None else {"example_weights": jax.device_put(jnp.asarray(w), bshard)}
    stats = {"clipped_mean": js.stats.clipped_mean(CLIP),
             PER_LAYER: js.stats.clipped_mean(jax.tree.map(lambda _: CLIP, params))}
    got, temp = {}, {}
    for on in (True, False):
        segments.ENABLED = on
        try:
            f = jax.jit(js.per_example_stat(m.loss, stats, chunk_size=None))
            got[on] = f(p, b, **kw)
            p32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32,
                                                              sharding=x.sharding), p)
            b32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                              sharding=x.sharding), b)
            k32 = {k: jax.ShapeDtypeStruct(v.shape, jnp.float32, sharding=v.sharding)
                   for k, v in kw.items()}
            c = jax.jit(js.per_example_stat(m.loss, stats["clipped_mean"],
                                            chunk_size=None)).lower(p32, b32, **k32).compile()
            temp[on] = c.memory_analysis().temp_size_in_bytes
        finally:
            segments.ENABLED = True
    errors = {k: error(got[True][k], want[k], k, 16) for k in stats}
    errors.update({f"{k}_vs_kept": error(got[True][k], got[False][k], k, 16) for k in stats})
    notes = js.explain(m.loss, stats["clipped_mean"])(p, b).notes
    note = next((n for n in notes if n.startswith("Clipped sums recompute")), "")
    return {"case": name, "errors": errors, "temp_ratio": temp[True] / temp[False],
            "explained": ["wo" in note and "w2" in note and "the input of ['layers']['wq']"
                          in note, "['embed'] (the loss's tail" in note]}


def run_segments_reader(name, B=16, T=4, d=16, f=32, L=3):
    """A scan stack ``h + tanh(h @ wq) @ wo`` under tensor parallelism, alone and with its
    loss also reading each layer's inner value ``tanh(h @ wq)`` (the scan's stacked
    output): a segment is recomputed in the first (`explain` says so), not in the second,
    where the VJP from ``wo``'s cotangent would miss that reader's part of ``wq``'s; the
    clipped mean equals the oracle in both."""
    rng = np.random.default_rng(4)
    params = {"wq": jnp.asarray(rng.normal(size=(L, d, f)) / np.sqrt(d)),
              "wo": jnp.asarray(rng.normal(size=(L, f, d)) / np.sqrt(f)),
              "head": jnp.asarray(rng.normal(size=(d, 3)) / np.sqrt(d))}
    batch = {"x": jnp.asarray(rng.normal(size=(B, T, d))),
             "y": jnp.asarray(rng.normal(size=(B, T, 3)))}

    def make(read):
        def loss(p, b):
            @jax.checkpoint
            def layer(h, w):
                s = jnp.tanh(h @ w[0])
                return h + s @ w[1], (jnp.mean(s ** 2) if read else None)
            h, inner = jax.lax.scan(layer, b["x"], (p["wq"], p["wo"]))
            out = jnp.mean((h @ p["head"] - b["y"]) ** 2)
            return out + 0.5 * jnp.sum(inner) if read else out
        return loss

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs = {"wq": P(None, None, "model"), "wo": P(None, "model", None), "head": P()}
    pshard = jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs,
                          is_leaf=lambda sp: isinstance(sp, P))
    p = jax.device_put(params, pshard)
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    errors, recomputed = {}, {}
    for read in (False, True):
        loss = make(read)
        want = oracle(*per_example_grads(loss, params, batch))["clipped_mean"]
        st = js.stats.clipped_mean(CLIP)
        got = jax.jit(js.per_example_stat(loss, st, chunk_size=None))(p, b)
        errors[f"read={read}"] = error(got, want, "clipped_mean", B)
        notes = js.explain(loss, st)(p, b).notes
        recomputed[f"read={read}"] = any(
            n.startswith("Clipped sums recompute") and "['wq']" in n for n in notes)
    return {"case": name, "errors": errors, "recomputed": recomputed}


def run_explicit_tp(name, B=6, T=8, d=32, V=64):
    """Tensor parallelism written for sharding in types: the lookup and the matmuls
    annotated with ``out_sharding=`` (the hidden layer over 'model'), an elementwise gain;
    six examples on the (2, 4) mesh's 'data', in chunks of 3 with example weights. Every
    statistic against the oracle of the unannotated twin, and the mean typed like
    jax.grad's gradients."""
    rng = np.random.default_rng(9)
    params = {"emb": jnp.asarray(rng.normal(size=(V, d)) * 0.3),
              "w1": jnp.asarray(rng.normal(size=(d, 4 * d)) / np.sqrt(d)),
              "w2": jnp.asarray(rng.normal(size=(4 * d, d)) / np.sqrt(4 * d)),
              "g": jnp.asarray(1 + 0.1 * rng.normal(size=(d,)))}
    batch = {"tok": jnp.asarray(rng.integers(0, V, (B, T))),
             "y": jnp.asarray(rng.normal(size=(B, T, d)))}

    def typed(p, b):
        x = p["emb"].at[b["tok"]].get(out_sharding=P("data", None, None)) * p["g"]
        h = jnp.tanh(jnp.matmul(x, p["w1"], out_sharding=P("data", None, "model")))
        return jnp.mean((jnp.matmul(h, p["w2"], out_sharding=P("data", None, None))
                         - b["y"]) ** 2)

    def plain(p, b):
        x = p["emb"][b["tok"]] * p["g"]
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    w = np.resize(np.asarray([0.0, 1.0, 2.0, 1.0, 3.0, 1.0]), B)  # (one example removed)
    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    specs = {"emb": P(), "w1": P(None, "model"), "w2": P("model", None), "g": P()}
    pshard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                          is_leaf=lambda s: isinstance(s, P))
    bshard = NamedSharding(mesh, P("data"))
    todo = {k: mk for k, mk in STATS.items() if k != "kurtosis"}
    with jax.set_mesh(mesh):
        p, b = jax.device_put(params, pshard), jax.device_put(batch, bshard)
        ew = jax.device_put(jnp.asarray(w), bshard)
        got = jax.jit(js.per_example_stat(typed, {k: mk() for k, mk in todo.items()},
                                          chunk_size=3))(p, b, example_weights=ew)
        g = jax.jit(jax.grad(typed))(p, b)
    want = oracle(*per_example_grads(plain, params, batch), w)
    errors = {k: error(got[k], want[k], k, B) for k in todo}
    errors["mean_typed"] = 0.0 if all(
        x.sharding.spec == y.sharding.spec
        for x, y in zip(jax.tree.leaves(got["mean"]), jax.tree.leaves(g))) else 1.0
    return {"case": name, "errors": errors}


def flagged(B=16, T=32, d=64, F=64):
    """A dense layer over tokens whose ghost norms cancel in float32 on some examples
    (their second half of tokens undoes the first: `tests/test_precision.py`'s case),
    placed at different places within the parts of a batch split by device (part ``p``
    holds examples ``2p, 2p + 1``: one part both, one neither, others the first or the
    second). The float64 oracle's model is the same one in float64."""
    r = np.random.default_rng(4)
    x = r.standard_normal((B, T // 2, d))
    c = r.standard_normal((B, T // 2, F))
    undo = np.isin(np.arange(B), FLAGGED)
    x = np.concatenate([x, x + 1e-4 * r.standard_normal(x.shape)], 1)
    c = np.concatenate([c, np.where(undo[:, None, None], -c, c)], 1)
    w = r.standard_normal((d, F)) / 8

    def make(dtype):
        def loss(p, b):
            return jnp.mean(jnp.sum(jnp.tanh(b["x"] @ p["w2d"]) * b["c"], axis=(-1, -2)))

        return loss, {"w2d": jnp.asarray(w, dtype)}, {"x": jnp.asarray(x, dtype),
                                                     "c": jnp.asarray(c, dtype)}
    return make


FLAGGED = (1, 2, 4, 5, 11, 14)


def run_flagged(name, setup="2d"):
    """Norms and clipped mean in float32 where some examples' ghost norms cancel, under a
    batch split by device, against the float64 oracle (to float32's cancellation: the
    examples' ``G_b`` cancel to ~1e-4 of their terms, in the oracle too) and against the
    same call on one device. Each flagged example is formed alone (norms.py), in a loop
    over the examples' places within a part that every part takes at once."""
    make = flagged()
    loss, params, batch = make(jnp.float32)
    want = oracle(*per_example_grads(*make(jnp.float64)))
    todo = {"sq_norms": js.stats.sq_norms(), "clipped_mean": js.stats.clipped_mean(CLIP)}
    one = jax.jit(js.per_example_stat(loss, todo, chunk_size=None))(params, batch)
    p, b, _, _ = place(setup, params, batch)
    got = jax.jit(js.per_example_stat(loss, todo, chunk_size=None))(p, b)
    errors = {k: error(got[k], want[k], k, 16) for k in todo}
    errors.update({k + "_one_device": error(got[k], one[k], k, 16) for k in todo})
    errors["sq_norms_each"] = _each(got["sq_norms"], want["sq_norms"])
    # (the ghost form's values, nothing flagged: how far the loop's examples are without it)
    from jaxpr_surgery._src.sites import dense  # noqa: PLC0415

    dense.GHOST_TOLERANCE, saved = float("inf"), dense.GHOST_TOLERANCE
    try:
        ghost = jax.jit(js.per_example_stat(loss, js.stats.sq_norms(), chunk_size=None))(p, b)
    finally:
        dense.GHOST_TOLERANCE = saved
    return {"case": name, "errors": errors,
            "unflagged": _each(ghost, want["sq_norms"])}


def _each(got, want):
    """The largest relative error of an example's value."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want) / np.abs(want)))


CASES = {
    "fsdp": lambda: run_case("fsdp", lm, "fsdp", None),
    "fsdp:3": lambda: run_case("fsdp:3", lambda: lm(L=1), "fsdp", 3, light=True),
    "fsdp:auto": lambda: run_case("fsdp:auto", lm, "fsdp", "auto"),
    "fsdp:weights": lambda: run_case("fsdp:weights", lm, "fsdp", None, weights=True),
    "fsdp:B12": lambda: run_case("fsdp:B12", lambda: lm(B=12), "2d", None),
    "tp": lambda: run_case("tp", lambda: lm(L=1), "tp", None, light=True),
    "tp:3": lambda: run_case("tp:3", lm, "tp", 3),
    "2d": lambda: run_case("2d", lm, "2d", None),
    "scan:tp": lambda: run_case("scan:tp", scan_mlp, "tp", None),
    "scan:fsdp:5": lambda: run_case("scan:fsdp:5", scan_mlp, "fsdp", 5, light=True),
    # (a budget under the table's 4 MiB G: blocks under the split, SPLIT_TILE_BYTES above it)
    "blocks:tp": lambda: run_case("blocks:tp", lambda: lm(V=8192, d=64, L=1), "tp", None,
                                  light=True, budget=1 << 20),
    "blocks:fsdp:3": lambda: run_case("blocks:fsdp:3", lambda: lm(V=8192, d=64, L=1), "fsdp", 3,
                                      budget=1 << 20),
    "dp:fsdp": lambda: run_dp("dp:fsdp", "fsdp", layers=1),
    "dp:tp": lambda: run_dp("dp:tp", "tp"),
    "batchnorm": lambda: run_refusal("batchnorm", lambda: batchnorm(B=8), "fsdp"),
    "explicit:fsdp": lambda: run_explicit("explicit:fsdp"),
    "explicit:scan": lambda: run_explicit_scan("explicit:scan"),
    "explicit:tp": lambda: run_explicit_tp("explicit:tp"),
    "memory:tied:2d": lambda: run_memory_tied("memory:tied:2d"),
    "memory:constrained:2d": lambda: run_memory_tied("memory:constrained:2d",
                                                     "2d-constrained"),
    # (models written by others' conventions: heads axes, convolutions, a weight used
    # twice; odd batches)
    "heads:tp": lambda: run_case("heads:tp", heads, "tp", None, light=True),
    "heads:2d:B3": lambda: run_case("heads:2d:B3", lambda: heads(B=3), "2d", None,
                                    batch_spec=P()),
    "heads:fsdp:weights:3": lambda: run_case("heads:fsdp:weights:3", heads, "fsdp", 3,
                                             weights=True),
    "cnn:tp": lambda: run_case("cnn:tp", cnn, "tp", None),
    "cnn:2d:auto": lambda: run_case("cnn:2d:auto", cnn, "2d", "auto"),
    "twice:tp": lambda: run_case("twice:tp", twice, "tp", None),
    "scan:layers:fsdp": lambda: run_case("scan:layers:fsdp", lambda: scan_mlp(d=8, L=16),
                                         "fsdp", None),
    "comms:fsdp": lambda: run_comms(
        "comms:fsdp", lambda: lm(B=16, T=32, d=128, L=2, V=2048), "fsdp"),
    # (activations constrained to the batch's axes, as MaxText writes models)
    "constrained:fsdp": lambda: run_case("constrained:fsdp",
                                         lambda: lm(L=1, constrained="fsdp"), "fsdp", None,
                                         light=True, reference=lambda: lm(L=1)),
    # (a clipped sum's layers recomputed from kept values: segments.py)
    "segments:tp": lambda: run_segments("segments:tp"),
    "segments:2d:weights": lambda: run_segments("segments:2d:weights", "2d", weights=True),
    "segments:reader": lambda: run_segments_reader("segments:reader"),
    # (examples whose ghost norms cancel, at different places in the split's parts)
    "flagged:2d": lambda: run_flagged("flagged:2d"),
    "comms:constrained:tp": lambda: run_comms(
        "comms:constrained:tp", lambda: lm(B=16, T=32, d=128, L=2, V=2048, constrained="tp"),
        "tp"),
}

if __name__ == "__main__":
    import time

    for name in (sys.argv[1:] or CASES):
        t0 = time.perf_counter()
        try:
            out = CASES[name]()
        except Exception as e:  # noqa: BLE001
            out = {"case": name, "crash": f"{type(e).__name__}: {str(e)[:400]}"}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(out), flush=True)

"""Parameters sharded over the batch's own mesh axis inside ``shard_map`` (hand-written
FSDP), and other collectives on a parameter: run by tests/test_fsdp.py in a subprocess
with 8 fake CPU devices, which prints one JSON object per case.

Each case is a loss written for one device (its parameter shards, its examples) and the
same loss on whole parameters. The oracle is JAX's own: the per-example gradients of
the shards by ``jax.grad`` under the same ``shard_map`` of the loss of one example at a
time (a one-hot weight over the whole batch), reduced in numpy float64. A case is either
exact (every statistic within ``tol`` of the oracle, and of ``per_example_stat`` on the
whole parameters where there is one) or refused at trace time with the error's message;
anything else is a silent wrong number.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8"
                               + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpr_surgery as js  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

NDEV, N, CLIP = 8, 32, 0.5
D, H, C = 8, 16, 8


def _params(seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    return {"w1": f(D, H) / 2, "b1": f(H) / 4, "w2": f(H, C) / 3}


def _batch(seed=1):
    r = np.random.default_rng(seed)
    return {"x": jnp.asarray(r.normal(size=(N, D)), jnp.float32),
            "y": jnp.asarray(r.normal(size=(N, C)), jnp.float32)}


def body(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


STATS = {
    "mean": lambda: js.stats.mean(),
    "sum": lambda: js.stats.sum(),
    "second_moment": lambda: js.stats.second_moment(),
    "variance": lambda: js.stats.variance(),
    "sign_mean": lambda: js.stats.sign_mean(),
    "sq_norms": lambda: js.stats.sq_norms(),
    "norms_per_leaf": lambda: js.stats.norms(per_leaf=True),
    "clipped_mean": lambda: js.stats.clipped_mean(CLIP),
    "clipped_sum": lambda: js.stats.clipped_sum(CLIP),
    "kurtosis": lambda: js.stats.kurtosis(),
}
PER_EXAMPLE = ("sq_norms", "norms_per_leaf")


def _oracle(G):
    """Every statistic of per-example gradients ``G`` (a dict of ``[N, ...]``), float64."""
    G = {k: np.asarray(v, np.float64) for k, v in G.items()}
    sq = {k: np.sum(v.reshape(N, -1) ** 2, axis=1) for k, v in G.items()}
    total = sum(sq.values())
    c = np.minimum(1.0, CLIP / np.sqrt(total))
    clip = {k: np.tensordot(c, v, axes=1) for k, v in G.items()}
    return {
        "mean": {k: v.mean(0) for k, v in G.items()},
        "sum": {k: v.sum(0) for k, v in G.items()},
        "second_moment": {k: (v ** 2).mean(0) for k, v in G.items()},
        "variance": {k: v.var(0, ddof=1) for k, v in G.items()},
        "sign_mean": {k: np.sign(v).mean(0) for k, v in G.items()},
        "sq_norms": total,
        "norms_per_leaf": {k: np.sqrt(v) for k, v in sq.items()},
        "clipped_mean": {k: v / N for k, v in clip.items()},
        "clipped_sum": clip,
        "kurtosis": {k: N * np.sum((v - v.mean(0)) ** 4, 0) / np.sum((v - v.mean(0)) ** 2, 0) ** 2
                     for k, v in G.items()},
    }


def _close(got, want, stat):
    """Max error of ``got`` over ``want``'s scale, per leaf; sign_mean forgives one
    flipped sign per coordinate (a gradient within rounding of 0)."""
    pairs = [(got[k], want[k]) for k in want] if isinstance(want, dict) else [(got, want)]
    errs = []
    for g, w in pairs:
        g = np.asarray(g, np.float64)
        if g.shape != np.shape(w):
            return float("inf")
        err = np.abs(g - w)
        if stat == "sign_mean":
            err = np.where(err <= 2.0 / N + 1e-6, 0.0, err)
        errs.append(float(err.max() / max(np.abs(w).max(), 1e-30)))
    return max(errs)


def _mesh(shape=(NDEV,), names=("fsdp",)):
    return jax.make_mesh(shape, names)


def _per_example_grads(local_one, params, batch, specs, mesh, data="fsdp"):
    """JAX's per-example gradients of the parameters (sharded like ``specs``) under
    ``shard_map``: ``jax.grad`` of one example's loss at a time (one-hot weights)."""
    def masked(p, b, m):
        losses = jax.vmap(lambda x: local_one(p, jax.tree.map(lambda v: v[None], x)))(b)
        return jnp.sum(m * losses)

    g = jax.jit(jax.shard_map(jax.grad(masked), mesh=mesh,
                              in_specs=(specs, P(data), P(data)), out_specs=specs))
    eye = np.eye(N, dtype=np.float32)
    params, batch = _place(mesh, params, specs), _place(mesh, batch, P(data))
    outs = [g(params, batch, _place(mesh, jnp.asarray(eye[k]), P(data))) for k in range(N)]
    return {k: np.stack([np.asarray(o[k]) for o in outs]) for k in params}


def _place(mesh, tree, specs):
    if isinstance(specs, P):
        return jax.device_put(tree, NamedSharding(mesh, specs))
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs,
                        is_leaf=lambda s: isinstance(s, P))


# --------------------------------------------------------------------------- #
# The cases: (local loss, params, parameter specs, whole-parameter loss or None, mesh)
# --------------------------------------------------------------------------- #
def _gather_all(axis=0, tiled=True):
    def local(p, b):
        g = {}
        for k, w in p.items():
            if w.ndim == 2 or axis == 0:
                full = jax.lax.all_gather(w, "fsdp", axis=axis if w.ndim == 2 else 0,
                                          tiled=tiled)
                if not tiled:  # [8, *shard] -> the whole weight
                    a = axis if w.ndim == 2 else 0
                    full = jnp.moveaxis(full, 0, a)
                    shape = list(w.shape)
                    shape[a] *= NDEV
                    full = full.reshape(shape)
                g[k] = full
            else:
                g[k] = w
        return body(g, b)
    return local


def case_gather(axis=0, tiled=True):
    params = _params()
    if axis == 0:
        specs = {"w1": P("fsdp"), "b1": P("fsdp"), "w2": P("fsdp")}
    else:
        specs = {"w1": P(None, "fsdp"), "b1": P(), "w2": P(None, "fsdp")}
    return _gather_all(axis, tiled), params, specs, body, _mesh()


def _scan_body(p, b):
    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None
    h, _ = jax.lax.scan(layer, b["x"], {"w": p["ws"], "b": p["bs"]})
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def case_gather_scan(axis=2):
    """A layer stack under lax.scan, each stacked weight gathered over 'fsdp' on a
    feature axis (its layers' sums combined in each iteration, gathers.AtSite) or on
    the layers' axis (``axis=0``: combined after the backward pass)."""
    r = np.random.default_rng(2)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    params = {"ws": f(NDEV, D, D) / 3, "bs": f(NDEV, D) / 4, "w2": f(D, C) / 3}
    ax = {"ws": axis, "bs": min(axis, 1), "w2": 1}
    specs = {k: P(*[("fsdp" if i == ax[k] else None) for i in range(v.ndim)])
             for k, v in params.items()}

    def local(p, b):
        return _scan_body({k: jax.lax.all_gather(v, "fsdp", axis=ax[k], tiled=True)
                           for k, v in p.items()}, b)
    return local, params, specs, _scan_body, _mesh()


def case_gather_some():
    """Only w1 gathered; b1 and w2 replicated (mixed FSDP and data parallelism)."""
    def local(p, b):
        return body({**p, "w1": jax.lax.all_gather(p["w1"], "fsdp", tiled=True)}, b)
    return local, _params(), {"w1": P("fsdp"), "b1": P(), "w2": P()}, body, _mesh()


def case_psum_parts():
    """The weight is the sum of every device's part (each holds a whole-sized one)."""
    params = _params()
    params = {k: jnp.concatenate([v / NDEV] * NDEV) for k, v in params.items()}

    def local(p, b):
        return body({k: jax.lax.psum(v, "fsdp") for k, v in p.items()}, b)
    return local, params, {k: P("fsdp") for k in params}, None, _mesh()


def case_psum_replicated():
    def local(p, b):
        return body({**p, "w1": jax.lax.psum(p["w1"], "fsdp") / NDEV}, b)
    return local, _params(), {k: P() for k in ("w1", "b1", "w2")}, body, _mesh()


def case_ppermute():
    """Each device uses its neighbour's rows of w1 (and its own w2, gathered)."""
    perm = [(i, (i + 1) % NDEV) for i in range(NDEV)]

    def local(p, b):
        w1 = jax.lax.all_gather(jax.lax.ppermute(p["w1"], "fsdp", perm), "fsdp", tiled=True)
        return body({**p, "w1": w1}, b)
    return local, _params(), {"w1": P("fsdp"), "b1": P(), "w2": P()}, None, _mesh()


def case_all_to_all():
    def local(p, b):
        w1 = jax.lax.all_to_all(p["w1"], "fsdp", 0, 1, tiled=True)  # [8, 2] -> [1, 16]
        return body({**p, "w1": jnp.tile(w1, (8, 1))}, b)
    return local, _params(), {"w1": P(None, "fsdp"), "b1": P(), "w2": P()}, None, _mesh()


def case_psum_scatter():
    """ZeRO-style: a replicated weight reduce-scattered, the shards gathered again."""
    def local(p, b):
        w1 = jax.lax.psum_scatter(jax.lax.pvary(p["w1"], "fsdp") if hasattr(jax.lax, "pvary")
                                  else p["w1"], "fsdp", tiled=True) / NDEV
        return body({**p, "w1": jax.lax.all_gather(w1, "fsdp", tiled=True)}, b)
    return local, _params(), {k: P() for k in ("w1", "b1", "w2")}, body, _mesh()


def case_custom_vjp_gather(bwd_kind="transpose"):
    """A gather whose backward pass is written by hand (ZeRO-style): the transpose
    (``psum_scatter`` of the gradient: lifted as a gather), or one that is not
    (scaled, cast to bfloat16 for the reduce-scatter, zero: refused)."""
    @jax.custom_vjp
    def gather(w):
        return jax.lax.all_gather(w, "fsdp", tiled=True)

    def fwd(w):
        return gather(w), None

    def bwd(_, ct):
        if bwd_kind == "scaled":
            return (2.0 * jax.lax.psum_scatter(ct, "fsdp", tiled=True),)
        if bwd_kind == "zero":  # (the gradient dropped: a constant cotangent)
            return (jnp.zeros(ct.shape[:0] + (ct.shape[0] // NDEV,) + ct.shape[1:], ct.dtype),)
        if bwd_kind == "bf16":
            return (jax.lax.psum_scatter(ct.astype(jnp.bfloat16), "fsdp", tiled=True)
                    .astype(ct.dtype),)
        return (jax.lax.psum_scatter(ct, "fsdp", tiled=True),)

    gather.defvjp(fwd, bwd)

    def local(p, b):
        return body({k: gather(v) for k, v in p.items()}, b)
    return local, _params(), {k: P("fsdp") for k in ("w1", "b1", "w2")}, body, _mesh()


def case_gather_2d():
    """The batch over ('data', 'fsdp'), the weights sharded over 'fsdp' and gathered
    over it alone (replicated over 'data')."""
    local, params, specs, whole, _ = case_gather(0, True)
    return local, params, specs, whole, _mesh((2, 4), ("data", "fsdp")), {"data": ("data", "fsdp")}


def body_tied(p, b):
    return body(p, b) + 0.1 * jnp.mean(jnp.tanh(b["x"] @ p["w1"]) ** 2)


def case_gather_twice():
    """w1 gathered twice (two uses, each behind its own gather: one whole weight)."""
    def local(p, b):
        g = {k: jax.lax.all_gather(v, "fsdp", tiled=True) for k, v in p.items()}
        w1b = jax.lax.all_gather(p["w1"], "fsdp", tiled=True)
        return body(g, b) + 0.1 * jnp.mean(jnp.tanh(b["x"] @ w1b) ** 2)
    return local, _params(), {k: P("fsdp") for k in ("w1", "b1", "w2")}, body_tied, _mesh()


def case_gather_and_use():
    """w1 gathered and also used as the shard itself: not a view of the whole weight."""
    def local(p, b):
        g = {k: jax.lax.all_gather(v, "fsdp", tiled=True) for k, v in p.items()}
        return body(g, b) + jnp.sum(p["w1"] ** 2)
    return local, _params(), {k: P("fsdp") for k in ("w1", "b1", "w2")}, None, _mesh()


def case_gather_in_jit():
    """The gather inside a jitted helper the leaf is passed to: hoisted out of it
    (`gathers.lift`)."""
    gather = jax.jit(lambda w: jax.lax.all_gather(w, "fsdp", tiled=True))

    def local(p, b):
        return body({**p, "w1": gather(p["w1"])}, b)
    return local, _params(), {"w1": P("fsdp"), "b1": P(), "w2": P()}, body, _mesh()


def case_gather_per_layer(remat=False, shard_too=False):
    """MaxText's FSDP under lax.scan: the stacked shards scanned, each layer's gathered
    inside the body (and the layer under jax.checkpoint): hoisted out of the loop.
    ``shard_too``: the body also uses a layer's shard itself (refused)."""
    local_scan, params, specs, whole, mesh = case_gather_scan()

    def layer(h, w):
        out = jnp.tanh(h @ jax.lax.all_gather(w["w"], "fsdp", axis=1, tiled=True)
                       + jax.lax.all_gather(w["b"], "fsdp", tiled=True))
        return out + (0.01 * jnp.sum(w["w"]) if shard_too else 0.0), None

    def local(p, b):
        h, _ = jax.lax.scan(jax.checkpoint(layer) if remat else layer, b["x"],
                            {"w": p["ws"], "b": p["bs"]})
        w2 = jax.lax.all_gather(p["w2"], "fsdp", axis=1, tiled=True)
        return jnp.mean((h @ w2 - b["y"]) ** 2)
    return local, params, specs, None if shard_too else whole, mesh


def case_gather_in_body():
    """Weights the scan's body closes over, gathered inside the body at every step (w1
    also gathered after the loop)."""
    def whole(p, b):
        def step(h, _):
            return jnp.tanh(h @ p["w1"][:, :D] + p["b1"].reshape(2, D).sum(0)), None
        h, _ = jax.lax.scan(step, b["x"], None, length=3)
        return jnp.mean((h @ p["w1"] @ p["w2"] - b["y"]) ** 2)

    def local(p, b):
        g = lambda k: jax.lax.all_gather(p[k], "fsdp", tiled=True)  # noqa: E731

        def step(h, _):
            return jnp.tanh(h @ g("w1")[:, :D] + g("b1").reshape(2, D).sum(0)), None
        h, _ = jax.lax.scan(step, b["x"], None, length=3)
        return jnp.mean((h @ g("w1") @ g("w2") - b["y"]) ** 2)
    return local, _params(), {k: P("fsdp") for k in ("w1", "b1", "w2")}, whole, _mesh()


def case_gather_kron():
    local, params, specs, whole, mesh = case_gather(0, True)
    return local, params, specs, whole, mesh, {"stats": {"kron": js.stats.kron_moments()}}


def case_gather_no_axis_name():
    local, params, specs, whole, mesh = case_gather(0, True)
    return local, params, specs, whole, mesh, {"axis_name": None}


def case_gather_unchecked():
    """Untyped (check_vma=False): every statistic but the clipped ones (`untyped.py`:
    refused there, case ``gather_unchecked_clipped``)."""
    local, params, specs, whole, mesh = case_gather(0, True)
    req = {s: STATS[s]() for s in STATS if not s.startswith("clipped")}
    return local, params, specs, whole, mesh, {"check_vma": False, "stats": req}


def case_gather_unchecked_clipped():
    """A clipped sum of gathered leaves, untyped: its shards would take the same DP
    noise."""
    local, params, specs, whole, mesh = case_gather(0, True)
    return local, params, specs, whole, mesh, {"check_vma": False,
                                               "stats": {"clipped_sum": STATS["clipped_sum"]()}}


def case_gather_model_axis():
    """Tensor parallelism: w1 sharded and gathered over 'model', the batch over 'data'
    (a gather over an axis the examples are not split on)."""
    def local(p, b):
        return body({**p, "w1": jax.lax.all_gather(p["w1"], "model", axis=1, tiled=True)}, b)
    return (local, _params(), {"w1": P(None, "model"), "b1": P(), "w2": P()}, body,
            _mesh((2, 4), ("data", "model")))


def case_tied_blocks(axis=0):
    """A tied embedding table (a lookup and the logits: two sites) large enough to be
    read in blocks of rows under a small memory budget, gathered over 'fsdp' on its rows
    (``axis=0``: strided blocks, each device's share combined block by block) or its
    columns (``axis=1``: contiguous blocks, each combined to the device's columns):
    `leaves.block_combined`."""
    V, E = 512, 256
    r = np.random.default_rng(3)
    params = {"table": jnp.asarray(r.normal(size=(V, E)) / 4, jnp.float32),
              "w": jnp.asarray(r.normal(size=(E, E)) / 16, jnp.float32)}

    def whole(p, b):
        ids = (jnp.abs(b["x"]) * 97).astype(jnp.int32) % V  # [n, D] tokens
        h = jnp.tanh(p["table"][ids] @ p["w"])
        logits = h @ p["table"].T
        return jnp.mean((logits[..., :C] - b["y"][:, None, :]) ** 2) + jnp.mean(
            jnp.cos(logits))

    def local(p, b):
        return whole({"table": jax.lax.all_gather(p["table"], "fsdp", axis=axis, tiled=True),
                      "w": jax.lax.all_gather(p["w"], "fsdp", tiled=True)}, b)
    specs = {"table": P(*(("fsdp", None) if axis == 0 else (None, "fsdp"))), "w": P("fsdp")}
    # (against the oracle alone: the kurtosis of this model's float32 gradients differs
    # by 6e-5 between two summation orders, the unsharded call's and the shards'; the
    # clipped sums divide by each norm plus the bound of its ghost terms' rounding,
    # 8e-5 here, and take no block loop)
    req = {s: STATS[s]() for s in STATS if not s.startswith("clipped")}
    return local, params, specs, None, _mesh(), {
        "kwargs": {"memory_budget_bytes": 300 << 10}, "stats": req}


CASES = {
    "gather_tiled": lambda: case_gather(0, True),
    "gather_untiled": lambda: case_gather(0, False),
    "gather_axis1": lambda: case_gather(1, True),
    "gather_some": case_gather_some,
    "gather_scan": case_gather_scan,
    "gather_scan_layers": lambda: case_gather_scan(0),
    "gather_2d": case_gather_2d,
    "gather_twice": case_gather_twice,
    "gather_unchecked": case_gather_unchecked,
    "gather_unchecked_clipped": case_gather_unchecked_clipped,
    "gather_and_use": case_gather_and_use,
    "gather_kron": case_gather_kron,
    "gather_in_jit": case_gather_in_jit,
    "gather_per_layer": case_gather_per_layer,
    "gather_per_layer_remat": lambda: case_gather_per_layer(remat=True),
    "gather_per_layer_shard_too": lambda: case_gather_per_layer(shard_too=True),
    "gather_in_body": case_gather_in_body,
    "gather_no_axis_name": case_gather_no_axis_name,
    "psum_parts": case_psum_parts,
    "psum_replicated": case_psum_replicated,
    "ppermute": case_ppermute,
    "all_to_all": case_all_to_all,
    "psum_scatter": case_psum_scatter,
    "custom_vjp_gather": case_custom_vjp_gather,
    "custom_vjp_gather_scaled": lambda: case_custom_vjp_gather("scaled"),
    "custom_vjp_gather_bf16": lambda: case_custom_vjp_gather("bf16"),
    "custom_vjp_gather_zero": lambda: case_custom_vjp_gather("zero"),
    "gather_model_axis": case_gather_model_axis,
    "tied_blocks_rows": case_tied_blocks,
    "tied_blocks_cols": lambda: case_tied_blocks(1),
}


def _out_specs(req, specs, data):
    """Each statistic's out_specs: per-example values like the batch, the rest like the
    parameters."""
    return {s: (P(data) if s == "sq_norms" else {k: P(data) for k in specs}
                if s in PER_EXAMPLE else specs) for s in req}


def run_case(name, chunk=None):
    local, params, specs, whole, mesh, *opt = CASES[name]()
    opt = opt[0] if opt else {}
    data = opt.get("data", mesh.axis_names[0])
    axis_name = opt.get("axis_name", data)
    batch = _batch()
    req = opt.get("stats") or {s: STATS[s]() for s in STATS}
    out_specs = _out_specs(req, specs, data)
    fn = js.per_example_stat(local, req, axis_name=axis_name, chunk_size=chunk,
                             **opt.get("kwargs", {}))
    sm = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, P(data)), out_specs=out_specs,
                               check_vma=opt.get("check_vma", True)))
    res = {"case": name + (f":{chunk}" if chunk else "")}
    try:
        got = sm(_place(mesh, params, specs), _place(mesh, batch, P(data)))
    except (NotImplementedError, ValueError) as e:
        res["refused"] = f"{type(e).__name__}: {e}"
        return res
    want = _oracle(_per_example_grads(local, params, batch, specs, mesh, data))
    res["err"] = {s: _close(got[s], want[s], s) for s in req}
    if whole is not None:
        ref = js.per_example_stat(whole, req, **opt.get("kwargs", {}))(params, batch)
        res["err_whole"] = {s: _close(got[s], jax.tree.map(np.asarray, ref[s]), s)
                            for s in req}
    return res


def run_weighted(name="weighted_2d"):
    """``gather_2d`` (the batch over ('data', 'fsdp'), each weight gathered over 'fsdp')
    with ``example_weights`` (some 0, a whole device of them among them): the gathered
    leaves' weighted sums and the moments' weighted merge are reduce-scattered like the
    unweighted ones. Against ``per_example_stat`` of the whole parameters, one device,
    the same weights (its weighted values are checked against numpy elsewhere:
    tests/test_example_weights.py)."""
    local, params, specs, whole, mesh, opt = case_gather_2d()
    data = opt["data"]
    batch = _batch()
    r = np.random.default_rng(7)
    w = r.uniform(0.2, 2.0, size=N).astype(np.float32)
    w[[3, 17, 30]] = 0.0
    w[8:12] = 0.0  # (the batch's examples 8..11 are one device's: all of weight 0)
    w = jnp.asarray(w)
    req = {s: STATS[s]() for s in STATS}
    out_specs = _out_specs(req, specs, data)
    fn = js.per_example_stat(local, req, axis_name=data)
    sm = jax.jit(jax.shard_map(lambda p, b, w: fn(p, b, example_weights=w), mesh=mesh,
                               in_specs=(specs, P(data), P(data)), out_specs=out_specs))
    got = sm(_place(mesh, params, specs), _place(mesh, batch, P(data)), _place(mesh, w, P(data)))
    ref = js.per_example_stat(whole, req)(params, batch, example_weights=w)
    return {"case": name, "err_whole": {
        s: _close(got[s], jax.tree.map(np.asarray, ref[s]), s) for s in req}}


def run_dp_noise(name="dp_noise"):
    """A DP-SGD step written inside the ``shard_map`` of hand-written FSDP on a (2, 4)
    mesh (the batch over ('data', 'fsdp'), each weight sharded over 'fsdp', the update
    sharded like it): the noise, the update less the same step's without noise, in
    units of its standard deviation ``z C / B``, per shard of each weight. Each shard
    must draw its own (with one key everywhere every shard drew the same noise: the
    difference of two shards' updates was then free of noise), and the noiseless
    update equal one device's."""
    local, params, specs, whole, mesh, opt = case_gather_2d()
    data = opt["data"]
    batch = _batch()
    z = 1.0

    def update(loss, p, b, key, noise, **kw):
        o = js.optim.dp_sgd(learning_rate=1.0, clip_norm=CLIP, noise_multiplier=noise)
        stats = js.per_example_stat(loss, js.optim.stat_request(o), **kw)(p, b)
        u, _ = o.update(stats["mean"], o.init(p), p, **js.optim.update_kwargs(stats, key=key))
        return u

    def sharded(noise):
        sm = jax.jit(jax.shard_map(lambda p, b, k: update(local, p, b, k, noise, axis_name=data),
                                   mesh=mesh,
                                   in_specs=(specs, P(data), P()), out_specs=specs))
        return sm(_place(mesh, params, specs), _place(mesh, batch, P(data)), jax.random.key(3))

    noisy, clean = sharded(z), sharded(0.0)
    ref = jax.jit(lambda p, b, k: update(whole, p, b, k, 0.0))(params, batch, jax.random.key(3))
    out = {"case": name, "clean_err": _close(clean, jax.tree.map(np.asarray, ref), "mean"),
           "shards": {}}
    for k in params:
        eps = (np.asarray(noisy[k], np.float64) - np.asarray(clean[k], np.float64)) * N / (z * CLIP)
        shards = np.split(eps, NDEV // 2, axis=0)  # (the 4 shards over 'fsdp', on axis 0)
        out["shards"][k] = {
            "std": float(eps.std()),
            "min_pair_diff": min(float(np.abs(a - b).max()) for i, a in enumerate(shards)
                                 for b in shards[i + 1:]),
        }
    return out


def run_comms(name="comms_2d"):
    """The executed collective bytes of the statistics of ``gather_2d`` (the batch over
    ('data', 'fsdp'), each weight gathered over 'fsdp') over jax.grad's under the same
    shard_map: each device's sums are reduce-scattered over 'fsdp' first, so only its
    shard crosses 'data' (the moments' sums too; before, whole sums crossed 'data' and
    the variance's and kurtosis' were merged whole, then sliced)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.shard_bench import collective_bytes  # noqa: PLC0415

    local, params, specs, _, mesh, opt = case_gather_2d()
    data = opt["data"]
    batch = _batch()
    ap = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=NamedSharding(mesh, s)),
                      params, specs, is_leaf=lambda s: isinstance(s, P))
    ab = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=NamedSharding(mesh, P(data))),
                      batch)

    def cost(f):
        sm = jax.shard_map(f, mesh=mesh, in_specs=(specs, P(data)), out_specs=specs)
        return collective_bytes(jax.jit(sm).lower(ap, ab).compile().as_text())[1]

    g = cost(jax.grad(local))
    return {"case": name, "ratios": {
        s: cost(js.per_example_stat(local, STATS[s](), axis_name=data)) / g
        for s in ("mean", "variance", "kurtosis")}}


def run_memory(name="memory_written"):
    """Per-device temporary memory (``memory_analysis``) of the variance and kurtosis of a small
    transformer and its scan-over-layers twin written as hand-written FSDP (benchmarks.shard_bench's
    ``fsdp-shard_map``: the (2, 4) mesh, each weight gathered over 'fsdp'), over
    jax.grad's under the same shard_map. The moments' whole mean was one all-reduce per
    leaf, which XLA merged into one for all leaves at the end of the backward pass:
    every leaf's moments held whole until then (1.33x grad's)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tempfile  # noqa: PLC0415

    from benchmarks import models, shard_bench  # noqa: PLC0415

    out = {"case": name}
    for kind in ("transformer", "scan_remat"):
        m = getattr(models, kind)(T=32, d=128, V=2048, layers=3, heads=4)
        with tempfile.TemporaryDirectory() as t:
            res = shard_bench.measure(m.loss, m.params, m.batch_spec(16), "fsdp-shard_map",
                                      {"variance": js.stats.variance(),
                                       "kurtosis": js.stats.kurtosis()}, None,
                                      os.path.join(t, "log"))
        out.update({f"{kind}_{s}": res[s]["temp_mib"] / res["grad"]["temp_mib"]
                    for s in ("variance", "kurtosis")})
    return out


RUNS = {"comms_2d": run_comms, "weighted_2d": run_weighted, "dp_noise": run_dp_noise,
        "memory_written": run_memory}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    for spec in names:
        if spec in RUNS:
            print(json.dumps(RUNS[spec]()), flush=True)
            continue
        name, _, chunk = spec.partition(":")
        print(json.dumps(run_case(name, chunk=int(chunk) if chunk else None)), flush=True)

"""The clipped mean of a scan-over-``checkpoint`` stack under tensor parallelism: what
keeping each layer's site inputs and cotangents costs, against recomputing a block's
inner ones (issue 59, measured on a prototype written by hand, not the package).

A clipped sum needs every example's norm before its weighted sums ``sum_b c_b x_b^T dy_b``,
so the package keeps each site's ``x`` and ``dy`` from the backward pass until the clip
factors are known (one pass; a second pass would repeat the model's collectives). Under
tensor parallelism (Megatron: the column-parallel layers' inputs and the row-parallel
layers' cotangents are the residual stream, replicated over 'model') that is one
activation-sized stack per layer and kept value, whole on every device: `shard_bench`'s
scan stack takes 1.50x grad's per-device memory there. The alternative measured here:
keep the residual stream's values only (the inputs of ``wq``/``wk``/``wv`` and ``w1``,
the cotangents of ``wo`` and ``w2``) and recompute the rest per layer in the weighted
sums' loop: ``wo``'s input and ``wq``/``wk``/``wv``'s cotangents from attention's
forward and VJP, ``w2``'s input and ``w1``'s cotangent from the MLP's — local under
tensor parallelism (each device's heads and hidden columns), at the cost of the blocks'
FLOPs again. Under FSDP the recompute gathers the weights again.

The prototype: the per-example losses' one backward pass with zeros added to every
site's output (their cotangents: each site's ``dy``, stacked over the layers), each
site's ``x`` the blocks' outputs, norms by the ghost form, then the weighted sums; both
forms equal ``vmap(grad)``'s clipped mean (``--quick`` checks it, and a test). Compile
only, 8 simulated devices, against ``jax.grad`` of the same model: per-device temporary
memory (``memory_analysis()``) and collective bytes executed (`shard_bench`).

    python -m benchmarks.tp_recompute [--quick] [--sizes default,issue]
        [--setups tp,fsdp] [--out benchmarks/results/cpu_tp_recompute.json]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# (B, T, d, heads, layers, V): shard_bench's default and issue sizes, and a tiny one
SIZES = {"default": (16, 128, 512, 8, 4, 16384), "issue": (16, 256, 1024, 16, 4, 32768),
         "tiny": (4, 16, 32, 4, 2, 64)}
WEIGHTS = ("wq", "wk", "wv", "wo", "w1", "w2")
CLIP = 1.0


class Model:
    """A pre-norm transformer stack (no biases or gains: the sites that matter here), its
    layers under ``lax.scan`` over ``jax.checkpoint``, an untied head."""

    def __init__(self, B, T, d, H, L, V):
        self.B, self.T, self.d, self.H, self.L, self.V, self.k = B, T, d, H, L, V, d // H
        self.mask = jnp.tril(jnp.ones((T, T), bool))
        self.shapes = {"wq": (L, d, H, self.k), "wk": (L, d, H, self.k),
                       "wv": (L, d, H, self.k), "wo": (L, H, self.k, d),
                       "w1": (L, d, 4 * d), "w2": (L, 4 * d, d), "head": (d, V)}

    def attention(self, q, k, v):
        s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(self.k)
        p = jax.nn.softmax(jnp.where(self.mask, s, -1e9), -1)
        return jnp.einsum("bhts,bshk->bthk", p, v)

    def projections(self, a, lp):
        """The attention's query, key and value of the normalised stream ``a``."""
        return [jnp.einsum("btd,dhk->bthk", a, lp[w]) for w in ("wq", "wk", "wv")]

    def block(self, h, lp, z):
        """One layer; ``z``: zeros added to each site's output. Returns the layer's output
        and its sites' inputs (``a``: of wq, wk, wv; ``o``: of wo; ``m``: of w1; ``g``:
        of w2)."""
        a = _ln(h)
        q, k, v = (p + z[w] for p, w in zip(self.projections(a, lp), ("wq", "wk", "wv")))
        o = self.attention(q, k, v)
        h = h + jnp.einsum("bthk,hkd->btd", o, lp["wo"]) + z["wo"]
        m = _ln(h)
        g = jax.nn.gelu(m @ lp["w1"] + z["w1"])
        return h + g @ lp["w2"] + z["w2"], (a, o, m, g)

    def loss(self, params, batch):
        lp = {w: params[w] for w in WEIGHTS}
        zero = {w: 0.0 for w in WEIGHTS}
        blk = jax.checkpoint(lambda h, lp: self.block(h, lp, zero)[0])
        h, _ = jax.lax.scan(lambda h, lp: (blk(h, lp), None), batch["x"], lp)
        logits = _ln(h) @ params["head"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                             batch["y"][..., None], -1))

    def site_values(self, params, batch):
        """Every site's ``x`` and ``dy`` for each example's loss (the token mean): the
        blocks' inputs, and the cotangents of zeros added to the sites' outputs."""
        B, T, L, H, k, d = self.B, self.T, self.L, self.H, self.k, self.d
        lp = {w: params[w] for w in WEIGHTS}
        out = {"wq": (H, k), "wk": (H, k), "wv": (H, k), "wo": (d,), "w1": (4 * d,),
               "w2": (d,)}
        z0 = {w: jnp.zeros((L, B, T) + s) for w, s in out.items()}

        def f(z0, zh):
            blk = jax.checkpoint(self.block)
            h, xs = jax.lax.scan(lambda h, a: blk(h, a[0], a[1]), batch["x"], (lp, z0))
            hf = _ln(h)
            logits = hf @ params["head"] + zh
            lse = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)
            return -jnp.sum(lse) / T, (xs, hf)

        grad = jax.grad(f, argnums=(0, 1), has_aux=True)
        (dz, dzh), (xs, hf) = grad(z0, jnp.zeros((B, T, self.V)))
        return xs, dz, hf, dzh

    def inner(self, lp, a, m, do, d2):
        """The inner sites' values of one layer from the residual stream's: ``wo``'s and
        ``w2``'s inputs, ``wq``/``wk``/``wv``'s and ``w1``'s cotangents."""
        o, pull = jax.vjp(self.attention, *self.projections(a, lp))
        dq, dk, dv = pull(jnp.einsum("btd,hkd->bthk", do, lp["wo"]))
        g, pull = jax.vjp(jax.nn.gelu, m @ lp["w1"])
        (d1,) = pull(d2 @ lp["w2"].T)
        return o, g, dq, dk, dv, d1

    def clipped_mean(self, params, batch, recompute):
        """``sum_b c_b g_b / B``, ``c_b = min(1, C / |g_b|)``: keeping every site's ``x``
        and ``dy`` (``recompute`` False) or the residual stream's only."""
        B, T = self.B, self.T
        (a, o, m, g), dz, hf, dzh = self.site_values(params, batch)
        lp = {w: params[w] for w in WEIGHTS}
        flat = lambda t: t.reshape(B, T, -1)  # noqa: E731
        if recompute:
            o = g = None
            dz = {w: dz[w] if w in ("wo", "w2") else None for w in WEIGHTS}

        def sites(i):
            lpi = jax.tree.map(lambda t: t[i], lp)
            if recompute:
                oi, gi, dq, dk, dv, d1 = self.inner(lpi, a[i], m[i], dz["wo"][i], dz["w2"][i])
            else:
                oi, gi = o[i], g[i]
                dq, dk, dv, d1 = (dz[w][i] for w in ("wq", "wk", "wv", "w1"))
            return {"wq": (a[i], flat(dq)), "wk": (a[i], flat(dk)), "wv": (a[i], flat(dv)),
                    "wo": (flat(oi), dz["wo"][i]), "w1": (m[i], d1), "w2": (gi, dz["w2"][i])}

        def norms(acc, i):
            return acc + sum(_ghost_sq(x, dy) for x, dy in sites(i).values()), None

        sq, _ = jax.lax.scan(norms, _ghost_sq(hf, dzh), jnp.arange(self.L))
        c = jnp.minimum(1.0, CLIP / jnp.sqrt(sq)) / B

        def sums(_, i):
            return None, {w: jnp.einsum("b,bnc,bnf->cf", c, x, dy)
                          for w, (x, dy) in sites(i).items()}

        _, out = jax.lax.scan(sums, None, jnp.arange(self.L))
        out = {w: v.reshape(self.shapes[w]) for w, v in out.items()}
        out["head"] = jnp.einsum("b,bnc,bnf->cf", c, hf, dzh)
        return out


def _ln(h):
    m = h.mean(-1, keepdims=True)
    return (h - m) * jax.lax.rsqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def _ghost_sq(x, dy):
    """Per-example ``|x_b^T dy_b|^2`` by the ghost form (``x [B, N, C]``, ``dy [B, N, F]``)."""
    return jnp.sum(jnp.einsum("bnc,bmc->bnm", x, x) * jnp.einsum("bnf,bmf->bnm", dy, dy), (1, 2))


def values(model, seed=0):
    r = np.random.default_rng(seed)
    fan_in = {"w2": 4 * model.d}  # (every other weight reads d features)
    params = {w: jnp.asarray(r.standard_normal(s) / np.sqrt(fan_in.get(w, model.d)), jnp.float32)
              for w, s in model.shapes.items()}
    batch = {"x": jnp.asarray(r.standard_normal((model.B, model.T, model.d)), jnp.float32),
             "y": jnp.asarray(r.integers(0, model.V, (model.B, model.T)), jnp.int32)}
    return params, batch


def check(size="tiny"):
    """Each form's largest error relative to the largest entry, per weight, against
    ``vmap(grad)``'s clipped mean (float32): ``{form: error}``."""
    model = Model(*SIZES[size])
    params, batch = values(model)
    one = lambda p, ex: model.loss(p, jax.tree.map(lambda t: t[None], ex))  # noqa: E731
    G = jax.jit(jax.vmap(jax.grad(one), (None, 0)))(params, batch)
    n = jnp.sqrt(sum(jnp.sum(g.reshape(model.B, -1) ** 2, 1) for g in jax.tree.leaves(G)))
    c = jnp.minimum(1.0, CLIP / n) / model.B
    want = jax.tree.map(lambda g: jnp.tensordot(c, g, 1), G)
    out = {}
    for form, rc in (("keep", False), ("recompute", True)):
        got = jax.jit(lambda p, b, rc=rc: model.clipped_mean(p, b, rc))(params, batch)
        out[form] = max(float(jnp.max(jnp.abs(got[w] - want[w])) / jnp.max(jnp.abs(want[w])))
                        for w in want)
    return out


def shardings(model, setup, mesh):
    """``(params', batch')`` shardings: ``tp`` Megatron over 'model' (heads, w1's columns,
    w2's rows, the head's vocabulary), the batch over 'data'; ``fsdp`` every weight over
    'model' on its largest axis, the batch over both axes."""
    ns = lambda *s: NamedSharding(mesh, P(*s))  # noqa: E731
    if setup == "tp":
        spec = {"wq": (None, None, "model", None), "wk": (None, None, "model", None),
                "wv": (None, None, "model", None), "wo": (None, "model", None, None),
                "w1": (None, None, "model"), "w2": (None, "model", None), "head": (None, "model")}
        batch = "data"
    else:
        spec = {w: tuple("model" if i == int(np.argmax(s)) else None for i in range(len(s)))
                for w, s in model.shapes.items()}
        batch = ("data", "model")
    return {w: ns(*s) for w, s in spec.items()}, ns(batch)


def measure(size, setup):
    """Collective bytes executed and per-device temp memory of grad and each form."""
    from benchmarks.shard_bench import collective_bytes

    model = Model(*SIZES[size])
    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ps, bs = shardings(model, setup, mesh)
    ap = {w: jax.ShapeDtypeStruct(s, jnp.float32, sharding=ps[w])
          for w, s in model.shapes.items()}
    ab = {"x": jax.ShapeDtypeStruct((model.B, model.T, model.d), jnp.float32, sharding=bs),
          "y": jax.ShapeDtypeStruct((model.B, model.T), jnp.int32, sharding=bs)}
    rows = []
    forms = (("grad", jax.grad(model.loss)),
             ("keep", lambda p, b: model.clipped_mean(p, b, False)),
             ("recompute", lambda p, b: model.clipped_mean(p, b, True)))
    for form, fn in forms:
        with jax.set_mesh(mesh):
            c = jax.jit(fn, out_shardings=ps).lower(ap, ab).compile()
        rows.append({"size": size, "setup": setup, "form": form,
                     "collective_mib": collective_bytes(c.as_text())[1] / 2**20,
                     "temp_mib": c.memory_analysis().temp_size_in_bytes / 2**20})
    g = rows[0]
    for r in rows:
        r["collective_ratio"] = r["collective_mib"] / g["collective_mib"]
        r["temp_ratio"] = r["temp_mib"] / g["temp_mib"]
    return rows


def main(argv=None):
    from benchmarks import output

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="check both forms, tiny size")
    ap.add_argument("--sizes", default="default,issue", help="default and/or issue")
    ap.add_argument("--setups", default="tp,fsdp")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    errors = check()
    print("against vmap(grad), largest relative error:", errors, flush=True)
    if a.quick:
        return {"check": errors}
    if jax.device_count() < 8:
        raise SystemExit("tp_recompute: needs 8 devices; run it as python -m "
                         "benchmarks.tp_recompute (it sets XLA_FLAGS itself).")
    rows, sizes = [], a.sizes.split(",")
    for size in sizes:
        for setup in a.setups.split(","):
            for r in measure(size, setup):
                rows.append(r)
                print(f"{size:7s} {setup:5s} {r['form']:10s} collectives "
                      f"{r['collective_mib']:8.1f} MiB ({r['collective_ratio']:.2f}x)  temp "
                      f"{r['temp_mib']:8.1f} MiB ({r['temp_ratio']:.2f}x)", flush=True)
    names = "B T d heads layers V".split()
    result = {"machine": output.machine_info(), "check": errors, "rows": rows,
              "sizes": {s: dict(zip(names, SIZES[s])) for s in sizes}}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

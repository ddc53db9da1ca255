"""A fused dense layer behind ``jax.custom_vjp``: its statistics unregistered (the exact
per-example route through the op's own backward) and registered with its reference
(``js.extend.register_custom_op``: the dense rules), against ``jax.grad`` and
``vmap(grad)``, in one process.

The model: tokens ``[B, T, d]`` through two fused dense layers (``d -> 4d -> d``, tanh
between) and a squared error, B=32 T=128 d=256 (issue 60's newcomer). Time ratios are
medians over rounds of the ratio to ``jax.grad`` within a round (every form runs back to
back in each round); FLOPs and temporary memory from XLA's ``cost_analysis`` /
``memory_analysis``. ``plain/`` rows: the same model written without the op.

    python -m benchmarks.custom_op [--quick] [--out benchmarks/results/cpu_custom_op.json]
"""

from __future__ import annotations

import json
import platform

import jax
import jax.numpy as jnp
import numpy as np

import jaxpr_surgery as js
from benchmarks import output
from benchmarks.weights import _compiled, _paired_ratio, _time

STATS = {
    "second_moment": js.stats.second_moment(),
    "sq_norms": js.stats.sq_norms(),
    "clipped_mean": js.stats.clipped_mean(1.0),
    "variance": js.stats.variance(),
}


@jax.custom_vjp
def fused_dense(w, x):
    return x @ w


def _fwd(w, x):
    return x @ w, (w, x)


def _bwd(res, dy):
    w, x = res
    return jnp.einsum("...i,...j->ij", x, dy), dy @ w.T


fused_dense.defvjp(_fwd, _bwd)


def _loss_with(dense):
    def loss(p, batch):
        h = jnp.tanh(dense(p["up"], batch["x"]))
        out = dense(p["down"], h)
        return jnp.mean(jnp.sum((out - batch["y"]) ** 2, axis=(1, 2)))

    return loss


loss = _loss_with(fused_dense)
plain_loss = _loss_with(lambda w, x: x @ w)  # the same model without the op


def _case(B, T, d):
    r = np.random.default_rng(0)
    p = {"up": jnp.asarray(r.normal(size=(d, 4 * d)) / np.sqrt(d), jnp.float32),
         "down": jnp.asarray(r.normal(size=(4 * d, d)) / np.sqrt(4 * d), jnp.float32)}
    batch = {"x": jnp.asarray(r.normal(size=(B, T, d)), jnp.float32),
             "y": jnp.asarray(r.normal(size=(B, T, d)), jnp.float32)}
    return p, batch


def _vmap_grad(p, batch):
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    g = jax.vmap(jax.grad(one), (None, 0))(p, batch)
    return jax.tree.map(lambda v: jnp.mean(v**2, 0), g)


def run(quick=False, reps=None):
    B, T, d = (8, 16, 32) if quick else (32, 128, 256)
    reps = reps or (3 if quick else 11)
    p, batch = _case(B, T, d)
    forms = {"grad": jax.grad(loss), "vmap_grad_second_moment": _vmap_grad}
    rules = {}
    for name, stat in STATS.items():
        forms[f"unregistered/{name}"] = js.per_example_stat(loss, stat)
        rules[f"unregistered/{name}"] = sorted({lf.rule for lf in
                                                js.explain(loss, stat)(p, batch).leaves})
    for name, stat in STATS.items():
        forms[f"plain/{name}"] = js.per_example_stat(plain_loss, stat)
    compiled = {k: _compiled(f, p, batch) for k, f in forms.items()}
    with js.extend.register_custom_op(fused_dense, lambda w, x: x @ w):
        js.extend.check_rule(loss)(p, batch)
        for name, stat in STATS.items():
            f = js.per_example_stat(loss, stat)
            compiled[f"registered/{name}"] = _compiled(f, p, batch)
            rules[f"registered/{name}"] = sorted({lf.rule for lf in
                                                  js.explain(loss, stat)(p, batch).leaves})
    names = list(compiled)
    calls = [compiled[k][0] for k in names]
    for c in calls:  # (warm up)
        jax.block_until_ready(c(p, batch))
    samples = dict(zip(names, _time(calls, (p, batch), reps)))
    rows = []
    for k in names:
        _, flops, temp = compiled[k]
        rows.append({
            "form": k,
            "rules": rules.get(k),
            "time_vs_grad": _paired_ratio(samples[k], samples["grad"]),
            "flops_vs_grad": flops / compiled["grad"][1],
            "temp_bytes": temp,
            "temp_vs_grad": temp / max(compiled["grad"][2], 1.0),
        })
        print(f"{k:32s} time {rows[-1]['time_vs_grad']:6.2f}x  flops "
              f"{rows[-1]['flops_vs_grad']:6.2f}x  temp {rows[-1]['temp_vs_grad']:6.2f}x  "
              f"{rows[-1]['rules'] or ''}", flush=True)
    return {"B": B, "T": T, "d": d, "reps": reps, "rows": rows}


def main():
    ap = output.parser(__doc__)
    a = ap.parse_args()
    doc = run(a.quick, a.reps)
    doc["machine"] = {"jax": jax.__version__, "python": platform.python_version(),
                      "cpus": jax.device_count(), "platform": jax.default_backend()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()

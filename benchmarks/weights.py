"""The cost of ``example_weights``: each statistic with weights against the same statistic
without, on the transformer regimes (short, long, vocab), in one process.

Weights are integers 0-2 (10 of the 32 examples of weight 0, padding). Time ratios are
medians over rounds of the ratio within a round (the two forms and ``jax.grad`` run
back to back in each, so load on the machine hits all alike); FLOPs and temporary
memory come from XLA's ``cost_analysis`` / ``memory_analysis`` of the compiled calls.
Issue 36's target: weighted / unweighted <= 1.05 on every statistic.

    python -m benchmarks.weights [--quick] [--out benchmarks/results/cpu_weights.json]
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxpr_surgery as js
from benchmarks import models, output
from benchmarks.methods import js_stat

STATS = ["mean", "second_moment", "variance", "sign_mean", "sq_norms", "clipped_mean"]


def _regimes(quick):
    if quick:
        return {"short": (lambda: models.transformer(T=8, d=32, V=64, layers=1, heads=2,
                                                     name="short"), 8)}
    return {
        "short": (lambda: models.transformer(T=32, d=256, V=8192, layers=2, heads=4,
                                             name="short"), 32),
        "long": (lambda: models.transformer(T=128, d=64, V=1024, layers=2, heads=4,
                                            name="long"), 32),
        "vocab": (lambda: models.transformer(T=16, d=64, V=32768, layers=1, heads=4,
                                             name="vocab"), 32),
    }


def _compiled(fn, *args):
    c = jax.jit(fn).lower(*args).compile()
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = c.memory_analysis()
    return c, float((cost or {}).get("flops", float("nan"))), float(
        getattr(mem, "temp_size_in_bytes", float("nan")))


def _time(calls, args, reps):
    """Each call's seconds over ``reps`` interleaved rounds: ``[[s, ...] per call]``."""
    samples = [[] for _ in calls]
    for _ in range(reps):
        for k, c in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            samples[k].append(time.perf_counter() - t0)
    return samples


def _paired_ratio(num, den):
    """The median over rounds of ``num / den`` within a round: the two calls of a round
    run back to back, so a slow stretch of the machine hits both (the ratio of the two
    medians moved by 0.2-0.3 between idle runs where this moves by a few percent)."""
    return statistics.median(a / b for a, b in zip(num, den))


def run(quick=False, reps=None):
    reps = reps or (3 if quick else 21)
    rows = []
    for name, (build, B) in _regimes(quick).items():
        model = build()
        params, batch = model.params, model.make_batch(B)
        w = jnp.asarray(np.random.default_rng(0).integers(0, 3, size=B), jnp.float32)
        w = w.at[0].set(1.0)
        grad_c, grad_flops, grad_mem = _compiled(jax.grad(model.loss), params, batch)
        for stat in STATS:
            f = js.per_example_stat(model.loss, js_stat(stat))
            plain, fl0, m0 = _compiled(f, params, batch)
            weighted, fl1, m1 = _compiled(lambda p, b, f=f, w=w: f(p, b, example_weights=w),
                                          params, batch)
            sg, s0, s1 = _time([grad_c, plain, weighted], (params, batch), reps)
            t_grad, t0, t1 = (statistics.median(s) for s in (sg, s0, s1))
            ratio = _paired_ratio(s1, s0)
            rows.append({
                "regime": name, "B": B, "stat": stat,
                "time_weighted_over_plain": ratio,
                "time_plain_over_grad": _paired_ratio(s0, sg),
                "flops_weighted_over_plain": fl1 / fl0, "temp_weighted_over_plain": m1 / m0
                if m0 else float("nan"), "t_grad_s": t_grad, "t_plain_s": t0,
                "t_weighted_s": t1, "grad_flops": grad_flops, "grad_temp_bytes": grad_mem,
            })
            print(f"{name:6s} {stat:14s} weighted/plain time {ratio:5.2f}  "
                  f"flops {fl1 / fl0:5.2f}  temp {rows[-1]['temp_weighted_over_plain']:5.2f}",
                  flush=True)
    return rows


def main(argv=None):
    ap = output.parser(__doc__)
    a = ap.parse_args(argv)
    rows = run(a.quick, a.reps)
    if a.out:
        meta = {"jax": jax.__version__, "backend": jax.default_backend(),
                "machine": platform.machine(), "cpus": jax.local_device_count(),
                "note": "time ratios: medians over rounds of the ratio within a round "
                        "(calls interleaved, one process)"}
        with open(a.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()

"""Time to the first step: tracing + lowering and XLA compile time of each statistic
against ``jax.grad`` of the same loss, on transformers of growing depth (unrolled by a
Python loop, and stacked under ``lax.scan`` + ``jax.checkpoint``), in one process.

Nothing runs: each method is lowered and compiled afresh (a new ``jax.jit``, jax's
caches cleared) ``--reps`` times. Both wall time and the process's CPU time are
recorded; the CPU time moves far less when other work shares the machine, so the
ratios use it. Time ratios are medians over rounds of the ratio within a round (a
round lowers and compiles ``grad`` and every statistic back to back). The package
also reports the program XLA compiles: lines of optimised HLO, as a stable proxy.

    python -m benchmarks.compile_time [--quick] [--reps N] \
        [--out benchmarks/results/cpu_compile.json]

Issue 49's target (`../shared/bench/compile_check.py`, GPT-2 small): lower and compile
time of every statistic <= 1.5x grad's.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time

import jax

import jaxpr_surgery as js
from benchmarks import models
from benchmarks.methods import js_stat

STATS = ["second_moment", "variance", "sign_mean", "sq_norms", "clipped_mean", "kurtosis"]


def _regimes(quick):
    if quick:
        return {"unrolled L1": lambda: models.transformer(T=8, d=32, V=64, layers=1, heads=2),
                "scan L2": lambda: models.scan_remat(T=8, d=32, V=64, layers=2, heads=2)}
    out = {}
    for L in (2, 4, 8):
        out[f"unrolled L{L}"] = lambda L=L: models.transformer(
            T=128, d=256, V=8192, layers=L, heads=4)
    for L in (4, 8):
        out[f"scan L{L}"] = lambda L=L: models.scan_remat(T=128, d=256, V=8192, layers=L,
                                                          heads=4)
    return out


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _measure(fn, args):
    """Seconds ``(lower wall, lower cpu, compile wall, compile cpu)`` and the lines of
    the optimised HLO, from a fresh jit with jax's caches cleared."""
    jax.clear_caches()
    f = jax.jit(fn)
    w0, c0 = time.perf_counter(), _cpu()
    low = f.lower(*args)
    w1, c1 = time.perf_counter(), _cpu()
    comp = low.compile()
    w2, c2 = time.perf_counter(), _cpu()
    return (w1 - w0, c1 - c0, w2 - w1, c2 - c1), comp.as_text().count("\n")


def _paired(num, den):
    return statistics.median(a / b for a, b in zip(num, den))


def run(quick=False, reps=None, stats=None):
    reps = reps or (1 if quick else 3)
    stats = stats or (STATS[:2] if quick else STATS)
    jax.jit(lambda x: x * 2).lower(1.0).compile()  # the backend's start-up is no one's
    rows = []
    for name, build in _regimes(quick).items():
        model = build()
        B = 8
        params, batch = model.params, model.make_batch(B)
        fns = {"grad": jax.grad(model.loss)}
        fns.update({s: js.per_example_stat(model.loss, js_stat(s)) for s in stats})
        samples = {m: [] for m in fns}
        lines = {}
        for _ in range(reps):
            for m, fn in fns.items():
                t, lines[m] = _measure(fn, (params, batch))
                samples[m].append(t)
        g = samples["grad"]
        for m in fns:
            s = samples[m]
            med = [statistics.median(x[k] for x in s) for k in range(4)]
            row = {
                "regime": name, "layers": model.info["layers"], "B": B, "method": m,
                "lower_s": med[0], "lower_cpu_s": med[1],
                "compile_s": med[2], "compile_cpu_s": med[3],
                "hlo_lines": lines[m],
            }
            if m != "grad":
                row.update({
                    "lower_cpu_x_grad": _paired([x[1] for x in s], [x[1] for x in g]),
                    "compile_cpu_x_grad": _paired([x[3] for x in s], [x[3] for x in g]),
                    "lower_wall_x_grad": _paired([x[0] for x in s], [x[0] for x in g]),
                    "compile_wall_x_grad": _paired([x[2] for x in s], [x[2] for x in g]),
                    "hlo_lines_x_grad": lines[m] / lines["grad"],
                })
                print(f"{name:12s} {m:14s} lower {row['lower_cpu_x_grad']:5.2f}x  compile "
                      f"{row['compile_cpu_x_grad']:5.2f}x grad (cpu time)  hlo "
                      f"{row['hlo_lines_x_grad']:4.2f}x", flush=True)
            else:
                print(f"{name:12s} grad           lower {med[1]:.2f} s  compile {med[3]:.2f} s "
                      f"(cpu time)", flush=True)
            rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = run(a.quick, a.reps)
    if a.out:
        meta = {"jax": jax.__version__, "backend": jax.default_backend(),
                "machine": platform.machine(),
                "note": "ratios: medians over rounds of the ratio within a round, of the "
                        "process's CPU time (and wall time); lowering = tracing, the "
                        "package's analysis and lowering to StableHLO; nothing runs"}
        with open(a.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()

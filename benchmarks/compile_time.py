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

``--phases``: where each statistic's lowering goes, split by the package's steps (the
trace of one example, the batch-of-one proof, the analysis, the plan, the chunk sizing,
the engine's one VJP, and within it the sites' statistics in the backward pass and the
leaves' values from what the sites kept) and the rest (jax lowering the program),
against grad's.

    python -m benchmarks.compile_time --phases [--quick] \
        [--out benchmarks/results/cpu_compile_phases.json]

``--rerun``: a script's first and second run with jax's persistent compilation cache
(``jax_compilation_cache_dir``, a fresh folder), each in a process of its own: the second
process traces and lowers again and loads what XLA compiled in the first. Wall time, one
round; ``first_step_x_cold_grad`` is the second run's lower + compile over the first run's
of ``grad``.

    python -m benchmarks.compile_time --rerun [--quick] \
        [--out benchmarks/results/cpu_compile_rerun.json]

Issue 49's target (`../shared/bench/compile_check.py`, GPT-2 small): lower and compile
time of every statistic <= 1.5x grad's.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import jax

import jaxpr_surgery as js
from benchmarks import models, output
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
    """Seconds ``(lower wall, lower cpu, compile wall, compile cpu, lower cpu of this
    thread)``, and the lines of the optimised HLO and of the lowered StableHLO (the
    program the lowering produced: a deterministic proxy of its work, where a lowering of
    a fraction of a second moves by a third between processes on a shared machine) and
    the fusions of the optimised HLO (XLA:CPU compiles each into a kernel of its own, at
    about a millisecond each however small: on models of many small layers, the proxy
    its compile time follows), from
    a fresh jit with jax's caches cleared. (Lowering is this thread's Python; the
    process's CPU time also counts what other threads do meanwhile.)"""
    jax.clear_caches()
    f = jax.jit(fn)
    w0, c0, t0 = time.perf_counter(), _cpu(), time.thread_time()
    low = f.lower(*args)
    w1, c1, t1 = time.perf_counter(), _cpu(), time.thread_time()
    comp = low.compile()
    w2, c2 = time.perf_counter(), _cpu()
    hlo = comp.as_text()
    return ((w1 - w0, c1 - c0, w2 - w1, c2 - c1, t1 - t0),
            (hlo.count("\n"), low.as_text().count("\n"), len(_FUSION.findall(hlo))))


_FUSION = re.compile(r"=\s*\S.*?\sfusion\(")  # (a fusion instruction of the optimised HLO)


def _paired(num, den):
    return statistics.median(a / b for a, b in zip(num, den))


def run(quick=False, reps=None, stats=None, quiet=False):
    reps = reps or (1 if quick else 3)
    stats = stats or (STATS[:2] if quick else STATS)
    jax.jit(lambda x: x * 2).lower(1.0).compile()  # the backend's start-up is no one's
    say = (lambda *a, **k: None) if quiet else print
    rows = []
    for name, build in _regimes(quick).items():
        model = build()
        B = 8
        params, batch = model.params, model.make_batch(B)
        fns = {"grad": jax.grad(model.loss)}
        fns.update({s: js.per_example_stat(model.loss, js_stat(s)) for s in stats})
        samples = {m: [] for m in fns}
        sizes = {}  # (HLO lines, StableHLO lines, fusions)
        for _ in range(reps):
            for m, fn in fns.items():
                t, sizes[m] = _measure(fn, (params, batch))
                samples[m].append(t)
        g = samples["grad"]
        for m in fns:
            s = samples[m]
            med = [statistics.median(x[k] for x in s) for k in range(4)]
            row = {
                "regime": name, "layers": model.info["layers"], "B": B, "method": m,
                "lower_s": med[0], "lower_cpu_s": med[1],
                "compile_s": med[2], "compile_cpu_s": med[3],
                "hlo_lines": sizes[m][0], "stablehlo_lines": sizes[m][1],
                "fusions": sizes[m][2],
            }
            if m != "grad":
                row.update({
                    "lower_cpu_x_grad": _paired([x[1] for x in s], [x[1] for x in g]),
                    "compile_cpu_x_grad": _paired([x[3] for x in s], [x[3] for x in g]),
                    "lower_wall_x_grad": _paired([x[0] for x in s], [x[0] for x in g]),
                    "compile_wall_x_grad": _paired([x[2] for x in s], [x[2] for x in g]),
                    "hlo_lines_x_grad": sizes[m][0] / sizes["grad"][0],
                    "stablehlo_lines_x_grad": sizes[m][1] / sizes["grad"][1],
                    "fusions_x_grad": sizes[m][2] / sizes["grad"][2],
                })
                say(f"{name:12s} {m:14s} lower {row['lower_cpu_x_grad']:5.2f}x  compile "
                    f"{row['compile_cpu_x_grad']:5.2f}x grad (cpu time)  hlo "
                    f"{row['hlo_lines_x_grad']:4.2f}x  stablehlo "
                    f"{row['stablehlo_lines_x_grad']:4.2f}x  fusions "
                    f"{row['fusions_x_grad']:4.2f}x", flush=True)
            else:
                say(f"{name:12s} grad           lower {med[1]:.2f} s  compile {med[3]:.2f} s "
                    f"(cpu time)", flush=True)
            rows.append(row)
    return rows


# The package's steps of a call's lowering (``--phases``): a module and the attribute the
# call reaches it by, each timed without the steps inside it (the chunk sizing lowers the
# engine once: that engine time is the engine's).
PHASES = {
    "trace one example": ("arguments", "Prepared.trace"),
    "batch-of-one proof": ("independence", "check"),
    "analysis": ("analysis", "analyse_jaxpr"),
    "plan": ("plans", "make_plan"),
    "chunk sizing": ("chunking", "activation_bytes_of"),
    "engine (the one VJP)": ("engine", "run"),
    "site statistics": ("sites.base", "direct_norms"),
    "leaf values": ("engine", "_leaf_values"),
}


class _Timers:
    """Exclusive wall seconds per phase: a phase called inside another is not counted
    twice."""

    def __init__(self):
        self.total, self.stack = {}, []

    def wrap(self, name, fn):
        def timed(*a, **k):
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                inner = self.stack.pop()
                self.total[name] = self.total.get(name, 0.0) + dt - inner
                if self.stack:
                    self.stack[-1] += dt

        return timed


def _patched(timers):
    """The `PHASES` wrapped by ``timers``; returns the undo."""
    import importlib

    undo = []
    for name, (mod, attr) in PHASES.items():
        owner = importlib.import_module(f"jaxpr_surgery._src.{mod}")
        *path, last = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        orig = getattr(owner, last)
        setattr(owner, last, timers.wrap(name, orig))
        undo.append((owner, last, orig))

    def restore():
        for owner, name, fn in undo:
            setattr(owner, name, fn)

    return restore


def phases(quick=False, reps=None, stats=None):
    """Rows: per regime and statistic, the median wall seconds of each of the package's
    steps of lowering (`PHASES`), the rest (jax tracing the jit around them and lowering
    to StableHLO), the whole lowering, and grad's lowering, from fresh jits."""
    reps = reps or (1 if quick else 3)
    stats = stats or (STATS[:2] if quick else STATS)
    jax.jit(lambda x: x * 2).lower(1.0).compile()
    rows = []
    for name, build in _regimes(quick).items():
        model = build()
        params, batch = model.params, model.make_batch(8)
        grad = []
        for _ in range(reps):
            jax.clear_caches()
            t0 = time.perf_counter()
            jax.jit(jax.grad(model.loss)).lower(params, batch)
            grad.append(time.perf_counter() - t0)
        for s in stats:
            seen = []
            for _ in range(reps):
                jax.clear_caches()
                timers = _Timers()
                undo = _patched(timers)
                try:
                    f = jax.jit(js.per_example_stat(model.loss, js_stat(s)))
                    t0 = time.perf_counter()
                    f.lower(params, batch)
                    whole = time.perf_counter() - t0
                finally:
                    undo()
                seen.append((whole, dict(timers.total)))
            med = {p: statistics.median(t.get(p, 0.0) for _, t in seen) for p in PHASES}
            whole = statistics.median(w for w, _ in seen)
            row = {"regime": name, "method": s, "lower_s": whole,
                   "grad_lower_s": statistics.median(grad), "phases_s": med,
                   "rest_s": whole - sum(med.values())}
            row["lower_x_grad"] = whole / row["grad_lower_s"]
            print(f"{name:12s} {s:14s} lower {whole:.2f} s ({row['lower_x_grad']:.2f}x grad): "
                  + ", ".join(f"{p} {v:.2f}" for p, v in med.items())
                  + f", jax and the rest {row['rest_s']:.2f}", flush=True)
            rows.append(row)
    return rows


_CHILD = "--cache-child"  # (internal: one run of `rerun`, with the cache in this folder)


def _child(cache, quick, stats):
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    rows = run(quick, reps=1, stats=stats, quiet=True)
    print(_CHILD + json.dumps(rows))


def rerun(quick=False, stats=None):
    """Rows of a first and a second run (separate processes) sharing a fresh persistent
    compilation cache: per regime and method the wall seconds of lowering and compiling
    in each, and the second's lower + compile over the first's of ``grad``."""
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(2):
            cmd = [sys.executable, "-m", "benchmarks.compile_time", _CHILD, cache]
            cmd += ["--quick"] * quick + (["--stats", ",".join(stats)] if stats else [])
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.environ.get("PYTHONPATH")])))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in proc.stdout.splitlines() if x.startswith(_CHILD)]
            if proc.returncode or not line:
                raise RuntimeError(f"a run failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
            runs.append({(r["regime"], r["method"]): r for r in json.loads(line[0][len(_CHILD):])})
    first, second = runs
    rows = []
    for (regime, method), a in first.items():
        b = second[(regime, method)]
        cold_grad = first[(regime, "grad")]
        row = {"regime": regime, "layers": a["layers"], "B": a["B"], "method": method,
               "first_lower_s": a["lower_s"], "first_compile_s": a["compile_s"],
               "second_lower_s": b["lower_s"], "second_compile_s": b["compile_s"],
               "first_step_x_cold_grad": (b["lower_s"] + b["compile_s"])
               / (cold_grad["lower_s"] + cold_grad["compile_s"])}
        print(f"{regime:12s} {method:14s} first {a['lower_s']:.2f} + {a['compile_s']:.2f} s"
              f"  second {b['lower_s']:.2f} + {b['compile_s']:.2f} s  "
              f"({row['first_step_x_cold_grad']:.2f}x a cold grad)", flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    ap = output.parser(__doc__)
    ap.add_argument("--rerun", action="store_true",
                    help="a first and a second run sharing jax's persistent compilation cache")
    ap.add_argument("--stats", default=None, help="comma-separated statistics (default: all)")
    ap.add_argument("--phases", action="store_true",
                    help="where each statistic's lowering goes, by the package's steps")
    ap.add_argument(_CHILD, default=None, help="(internal)")
    a = ap.parse_args(argv)
    stats = a.stats.split(",") if a.stats else None
    if a.cache_child:
        return _child(a.cache_child, a.quick, stats)
    if a.phases:
        rows = phases(a.quick, a.reps, stats)
    else:
        rows = rerun(a.quick, stats) if a.rerun else run(a.quick, a.reps, stats)
    if a.out:
        meta = {"jax": jax.__version__, "backend": jax.default_backend(),
                "machine": platform.machine(),
                "note": "ratios: medians over rounds of the ratio within a round, of the "
                        "process's CPU time (and wall time); lowering = tracing, the "
                        "package's analysis and lowering to StableHLO; nothing runs"}
        if a.rerun:
            meta["note"] = ("a first and a second run, each a process of its own, sharing a "
                            "fresh jax persistent compilation cache; wall seconds, one round; "
                            "first_step_x_cold_grad: the second run's lower + compile over "
                            "the first run's of grad")
        if a.phases:
            meta["note"] = ("wall seconds of lowering (medians over fresh jits), split by the "
                            "package's steps (PHASES, each without the steps it calls); "
                            "rest_s: jax tracing the jit around them and lowering to "
                            "StableHLO; grad_lower_s: jax.grad's whole lowering")
        with open(a.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()

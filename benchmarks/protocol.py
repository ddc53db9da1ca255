"""The measurement protocol: every method of one (regime, batch size) is compiled in this
process, then the compiled executables are timed interleaved (A B C A B C ...).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks.methods import make_method, microbatch_size_for
from benchmarks.output import RESULT_FIELDS
from jaxpr_surgery._src.chunking import _minor_faults as minor_faults  # all threads' faults

MAX_CALLS_PER_SAMPLE = 50  # a timing sample of a fast method averages up to this many calls
# quick mode checks the harness, not the numbers: compile without LLVM optimisation
QUICK_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                          "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass
class Settings:
    """The protocol's knobs: repeats and time caps, the sweeps' budgets and sizes."""

    quick: bool
    min_reps: int
    max_reps: int
    time_cap_s: float          # stop adding repeats once a method has spent this long
    slow_s: float              # a warmup slower than this counts as a sample
    budget_bytes: int          # memory budget for the largest-batch search
    maxbatch_methods: list[tuple[str, str]]
    maxbatch_cap: int
    maxbatch_rtol: float
    chunk_regime: str
    chunk_batch: int
    chunk_sizes: list[int | None]
    chunk_time: bool
    compiler_options: dict | None = None
    sample_s: float = 0.02     # a sample of a fast method averages calls adding up to this


def settings(quick: bool, args) -> Settings:
    """The protocol's settings of a quick or full run, with the command line's overrides."""
    mb_methods = [("grad", "grad"), ("js", "second_moment"), ("js", "sq_norms"),
                  ("vmap", "second_moment"), ("micro_grad_mb", "second_moment")]
    # (micro_grad_mb's temp memory hardly grows with B: it usually reaches the cap)
    if quick:
        s = Settings(True, 1, 2, 0.2, 1e9, 16 * 2**20,
                     [("grad", "grad"), ("js", "second_moment"), ("vmap", "second_moment")],
                     4096, 0.25, "short", 8, [2, None], False, QUICK_COMPILER_OPTIONS,
                     sample_s=0.0)
    else:
        s = Settings(False, 2, 15, 2.5, 3.0, 2 * 2**30, mb_methods, 1 << 17, 0.1,
                     "short", 32, [1, 4, 16, None], True)
    if args.compiler_options:
        s.compiler_options = json.loads(args.compiler_options)
    if args.reps is not None:
        s.max_reps = args.reps
        s.min_reps = min(s.min_reps, args.reps)
    if args.budget_mib is not None:
        s.budget_bytes = int(args.budget_mib * 2**20)
    return s


# --------------------------------------------------------------------------- #
# Measurement helpers
# --------------------------------------------------------------------------- #
_COMPILER_OPTIONS: dict | None = None


def set_compiler_options(options: dict | None):
    """The XLA compile options of every later compile (``None``: XLA's defaults)."""
    global _COMPILER_OPTIONS
    _COMPILER_OPTIONS = options


def _compile(lowered):
    if _COMPILER_OPTIONS:
        return lowered.compile(compiler_options=_COMPILER_OPTIONS)
    return lowered.compile()


def _cost(compiled):
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    f = ca.get("flops")
    ba = ca.get("bytes accessed")
    return (float(f) if f is not None else None), (float(ba) if ba is not None else None)


def _mem(compiled):
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    out = {}
    for k, name in [("temp_bytes", "temp_size_in_bytes"), ("output_bytes", "output_size_in_bytes"),
                    ("argument_bytes", "argument_size_in_bytes"),
                    ("peak_bytes", "peak_memory_in_bytes")]:
        v = getattr(ma, name, None)
        out[k] = int(v) if v is not None else None
    return out


def _has_loop(compiled):
    try:
        txt = compiled.as_text()
    except Exception:  # noqa: BLE001
        return None
    return (" while(" in txt) or ("= while(" in txt) or (" while " in txt and "body=" in txt)


def _err(e: BaseException) -> str:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    msg = f"{type(e).__name__}: {e}"
    tail = "".join(tb[-3:])
    return (msg[:1500] + "\n--- traceback tail ---\n" + tail[-1500:])


def _spec(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def temp_at(model, method, stat, B, **kw):
    """Temporary memory of the compiled method at batch size B (abstract shapes, no execution)."""
    fn = make_method(model, method, stat, B, **kw)
    compiled = _compile(jax.jit(fn).lower(_spec(model.params), model.batch_spec(B)))
    t = _mem(compiled).get("temp_bytes")
    del compiled
    return t


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# One (regime, batch size): compile every method, then time interleaved
# --------------------------------------------------------------------------- #
def _finish_rows(rows, samples_by_label):
    base = next((r for r in rows if r["method"] == "grad" and r["ok"]), None)
    for r in rows:
        s = samples_by_label.get(r["label"], [])
        if r["ok"] and s:
            r["time_median_s"] = statistics.median(s)
            r["time_min_s"], r["time_max_s"] = min(s), max(s)
            r["n_reps"] = len(s)
            r["time_all_s"] = s
        if base is None:
            continue
        for k, kr in [("time_median_s", "time_ratio"), ("flops", "flops_ratio"),
                      ("temp_bytes", "temp_ratio")]:
            if r.get(k) is not None and base.get(k):
                r[kr] = r[k] / base[k]


def run_config(model, regime, B, entries, st):
    """Compile + interleaved timing for one (regime, B). Returns result rows."""
    params = model.params
    batch = model.make_batch(B)
    jax.block_until_ready(batch)
    rows, runnable, faults = [], [], {}
    for method, stat in entries:
        row = _new_row(regime, B, method, stat)
        samples: list[float] = []
        compiled = _compile_and_warm_up(model, row, params, batch, st, samples)
        if compiled is not None:
            runnable.append((row, compiled, samples))
        rows.append((row, samples))
        faults[row["label"]] = [0, 0]  # minor page faults, calls (timed samples only)
        log(f"  compiled {regime.name:10s} B={B:<5d} {row['label']:30s} "
            f"lower {row['trace_lower_s'] or 0:6.2f}s compile {row['compile_s'] or 0:6.2f}s "
            f"warm {row['warmup_s'] or 0:7.3f}s temp {(row['temp_bytes'] or 0) / 2**20:8.1f}MiB")

    _time_interleaved(runnable, params, batch, st, faults)
    del runnable
    gc.collect()

    out = [r for r, _ in rows]
    for r in out:
        n_faults, n_calls = faults.get(r["label"], (0, 0))
        r["minor_faults_per_call"] = n_faults / n_calls if n_calls else None
    _finish_rows(out, {r["label"]: s for r, s in rows})
    g = next((r for r in out if r["method"] == "grad"), None)
    if g and g["ok"]:
        log(f"  timed {regime.name} B={B}: grad {g['time_median_s'] * 1e3:.1f} ms; " + ", ".join(
            f"{r['label']} {r['time_ratio']:.2f}x" for r in out
            if r["ok"] and r["method"] == "js" and r["time_ratio"] is not None))
    return out


def _new_row(regime, B, method, stat):
    """A result row of every `RESULT_FIELDS`, not yet measured."""
    row = {k: None for k in RESULT_FIELDS}
    row.update(regime=regime.name, batch=B, method=method, statistic=stat,
               label=method if method == "grad" else f"{method}:{stat}", ok=False)
    if method in ("micro_grad_mb", "js_chunk", "grad_chunk"):
        row["microbatch_size"] = microbatch_size_for(B)
    return row


def _compile_and_warm_up(model, row, params, batch, st, samples):
    """Compiles ``row``'s method and calls it once, filling the row's compile-time
    fields; a slow warmup is the first of ``samples``, a fast one sets how many calls a
    sample averages. Returns the compiled executable, or ``None`` where it failed (the
    error recorded in the row)."""
    try:
        fn = make_method(model, row["method"], row["statistic"], row["batch"])
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(params, batch)
        t1 = time.perf_counter()
        compiled = _compile(lowered)
        t2 = time.perf_counter()
        row["trace_lower_s"], row["compile_s"] = t1 - t0, t2 - t1
        row["flops"], row["bytes_accessed"] = _cost(compiled)
        row.update(_mem(compiled))
        row["has_loop"] = _has_loop(compiled)
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, batch))
        row["warmup_s"] = time.perf_counter() - t0
        row["ok"] = True
        if row["warmup_s"] > st.slow_s:
            samples.append(row["warmup_s"])
        else:  # a fast call: each sample averages several (less timer and jitter noise)
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, batch))
            row["calls_per_sample"] = max(1, min(MAX_CALLS_PER_SAMPLE, int(
                st.sample_s / max(time.perf_counter() - t0, 1e-6))))
        return compiled
    except Exception as e:  # noqa: BLE001 - record and go on
        row["error"] = _err(e)
        log(f"  ! {row['regime']} B={row['batch']} {row['label']}: {type(e).__name__}: "
            f"{str(e)[:300]}")
        return None


def _time_interleaved(runnable, params, batch, st, faults):
    """Rounds over the runnable methods (A B C A B C ...), each adding one sample, until
    every method has its repeats; counts page faults per call into ``faults``."""
    for _ in range(st.max_reps + 1):
        active = [(r, c, s) for r, c, s in runnable
                  if r["ok"] and len(s) < st.max_reps
                  and (len(s) < st.min_reps or sum(s) < st.time_cap_s)]
        if not active:
            break
        for row, compiled, samples in active:
            try:
                k = row.get("calls_per_sample") or 1
                t = 0.0
                f0 = minor_faults("RUSAGE_SELF")
                for _ in range(k):
                    t0 = time.perf_counter()
                    jax.block_until_ready(compiled(params, batch))
                    t += time.perf_counter() - t0
                f1 = minor_faults("RUSAGE_SELF")
                samples.append(t / k)
                if f0 is not None and f1 is not None:
                    faults[row["label"]][0] += f1 - f0
                    faults[row["label"]][1] += k
            except Exception as e:  # noqa: BLE001
                row["ok"], row["error"] = False, _err(e)

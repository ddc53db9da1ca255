"""The measurements beside the main table: the largest batch within a memory budget
(compile only), the memory of ``chunk_size`` and the tracing cost of a deep model."""

from __future__ import annotations

import gc
import math
import statistics
import time

import jax

from benchmarks import models
from benchmarks.methods import make_method, microbatch_size_for
from benchmarks.protocol import Settings, _compile, _cost, _err, _has_loop, _mem, log, temp_at


# --------------------------------------------------------------------------- #
# Largest batch within a memory budget (compile only)
# --------------------------------------------------------------------------- #
def max_batch_search(temp_fn, budget, known: dict[int, int], granule: int, cap: int,
                     rtol: float, max_evals: int = 10):
    """Largest B (a multiple of ``granule``, at most ``cap``) with ``temp_fn(B) <= budget``.

    Compile-only search. Temporary memory is close to affine in B, so the search
    extrapolates/interpolates (secant) from the points it has -- ``known``
    ({B: temp} already measured by the benchmark) plus its own evaluations --
    aiming just past the predicted crossing to close a bracket [lo fits, hi
    does not], then just short of it, with bisection as the safeguard. Stops
    when ``hi - lo <= max(granule, rtol * lo)``. Returns
    ``(largest fitting B or 0, capped, evaluations)``; ``capped`` means even
    ``cap`` fits."""
    pts = {int(b): int(t) for b, t in known.items()
           if t is not None and b % granule == 0 and b <= cap}
    evals: list[list[int]] = []

    def rd(x):
        return int(min(max(granule, int(x) // granule * granule), cap // granule * granule))

    def ev(b):
        t = int(temp_fn(b))
        pts[b] = t
        evals.append([b, t])
        return t

    if not pts:
        ev(rd(granule))
    for _ in range(max_evals):
        fits = sorted(b for b, t in pts.items() if t <= budget)
        over = sorted(b for b, t in pts.items() if t > budget)
        lo = fits[-1] if fits else 0
        hi = over[0] if over else None
        if hi is None and lo >= rd(cap):
            return lo, True, evals
        if hi is not None and (hi - lo <= granule or (lo and hi - lo <= rtol * lo)):
            return lo, False, evals
        if hi is None:  # extrapolate upward, aim just past the predicted crossing
            xs = sorted(pts)[-2:]
            slope = ((pts[xs[1]] - pts[xs[0]]) / (xs[1] - xs[0])) if len(xs) == 2 else 0.0
            pred = xs[-1] + (budget - pts[xs[-1]]) / slope if slope > 0 else math.inf
            cand = min(pred * (1 + rtol / 2), 64.0 * max(lo, granule))
            cand = max(cand, lo + granule)
        elif lo == 0:  # even the smallest tried B is over budget: go down
            if hi <= granule:
                return 0, False, evals
            slope = pts[hi] / hi
            cand = min(budget / slope if slope > 0 else hi / 2, hi / 2)
        else:  # interpolate inside the bracket, aim just short of the crossing
            slope = (pts[hi] - pts[lo]) / (hi - lo)
            pred = lo + (budget - pts[lo]) / slope if slope > 0 else (lo + hi) / 2
            cand = pred * (1 - rtol / 4)
            if not (lo < rd(cand) < hi):
                cand = (lo + hi) / 2
        c = rd(cand)
        if c in pts:
            c = rd((lo + hi) / 2) if hi is not None else rd(2 * max(lo, granule))
            if c in pts:
                return lo, False, evals
        ev(c)
    fits = sorted(b for b, t in pts.items() if t <= budget)
    return (fits[-1] if fits else 0), False, evals


def run_maxbatch(model, regime, rows, st: Settings):
    out = []
    Bref = max(regime.batches)
    for method, stat in st.maxbatch_methods:
        rec = {"regime": regime.name, "method": method, "statistic": stat,
               "label": method if method == "grad" else f"{method}:{stat}",
               "budget_bytes": st.budget_bytes, "max_batch": None, "capped": False,
               "n_compiles": 0, "evaluations": [], "error": None, "microbatch_size": None,
               "search_s": None}
        t0 = time.perf_counter()
        try:
            kw = {}
            granule = 1
            known = {r["batch"]: r["temp_bytes"] for r in rows
                     if r["method"] == method and r["statistic"] == stat and r["ok"]}
            if method == "micro_grad_mb":
                granule = microbatch_size_for(Bref)
                kw["microbatch_size"] = granule
                rec["microbatch_size"] = granule
                known = {b: t for b, t in known.items() if microbatch_size_for(b) == granule}
            best, capped, evals = max_batch_search(
                lambda b, m=method, s=stat, kw=kw: temp_at(model, m, s, b, **kw),
                st.budget_bytes, known,
                granule, st.maxbatch_cap, st.maxbatch_rtol)
            rec.update(max_batch=best, capped=capped, evaluations=evals, n_compiles=len(evals))
        except Exception as e:  # noqa: BLE001
            rec["error"] = _err(e)
        rec["search_s"] = time.perf_counter() - t0
        gc.collect()
        log(f"  max batch {regime.name} {rec['label']:30s} -> {rec['max_batch']}"
            f"{' (cap)' if rec['capped'] else ''} [{rec['n_compiles']} compiles, "
            f"{rec['search_s']:.1f}s]" + (f" ERROR {rec['error'][:200]}" if rec["error"] else ""))
        out.append(rec)
    return out


# --------------------------------------------------------------------------- #
# chunk_size memory curve
# --------------------------------------------------------------------------- #
def run_chunk_curve(model, regime, st: Settings):
    B = st.chunk_batch
    params, batch = model.params, model.make_batch(B)
    pts, runnable = [], []
    for cs in st.chunk_sizes:
        p = {"chunk_size": cs, "temp_bytes": None, "flops": None, "compile_s": None,
             "time_median_s": None, "error": None, "has_loop": None}
        try:
            fn = make_method(model, "js", "second_moment", B, chunk_size=cs)
            t0 = time.perf_counter()
            compiled = _compile(jax.jit(fn).lower(params, batch))
            p["compile_s"] = time.perf_counter() - t0
            p["temp_bytes"] = _mem(compiled).get("temp_bytes")
            p["flops"] = _cost(compiled)[0]
            p["has_loop"] = _has_loop(compiled)
            if st.chunk_time:
                runnable.append((p, compiled, []))
        except Exception as e:  # noqa: BLE001
            p["error"] = _err(e)
        pts.append(p)
        log(f"  chunk {regime.name} B={B} chunk_size={cs}: temp "
            f"{(p['temp_bytes'] or 0) / 2**20:.1f}MiB" + (" ERROR" if p["error"] else ""))
    if runnable:
        for _ in range(2 + 1):  # warmup + 2 interleaved repeats
            for p, c, s in runnable:
                try:
                    t0 = time.perf_counter()
                    jax.block_until_ready(c(params, batch))
                    s.append(time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001
                    p["error"] = _err(e)
        for p, _, s in runnable:
            if len(s) > 1:
                p["time_median_s"] = statistics.median(s[1:])
    del runnable
    gc.collect()
    return {"regime": regime.name, "batch": B, "statistic": "second_moment", "method": "js",
            "points": pts}


# --------------------------------------------------------------------------- #
# Tracing cost of a deep unrolled model
# --------------------------------------------------------------------------- #
TRACE_STATS = ("mean", "second_moment", "variance", "clipped_mean")


def run_tracing(st: Settings):
    """trace+lower of ``jax.jit(f).lower(params, batch)`` for grad and js on a transformer
    with many identical layers (a Python loop, no scan): each repetition builds every
    function afresh (no jit cache hit across repetitions), methods interleaved; min.
    ``deeper``: the same at four times the depth (does the cost grow like grad's?)."""
    layers, reps = (3, 1) if st.quick else (12, 7)
    out = _trace_points(st, layers, reps, TRACE_STATS)
    out["deeper"] = _trace_points(st, 4 * layers, 1 if st.quick else 3,
                                  ("second_moment", "clipped_mean"))
    return out


def _trace_points(st: Settings, layers, reps, stats):
    model = models.transformer(T=16 if not st.quick else 8, d=64 if not st.quick else 16,
                               V=512 if not st.quick else 64, layers=layers)
    B = 8
    params, batch = model.params, model.make_batch(B)
    methods = [("grad", "grad")] + [("js", s) for s in stats]
    samples = {m: [] for m in methods}
    for _ in range(reps):
        for m in methods:
            fn = make_method(model, m[0], m[1], B)
            gc.collect()  # no collection of an earlier method's garbage inside this sample
            t0 = time.perf_counter()
            jax.jit(fn).lower(params, batch)
            samples[m].append(time.perf_counter() - t0)
    g = min(samples[("grad", "grad")])
    pts = [{"method": m, "statistic": s, "trace_lower_s": min(samples[(m, s)]),
            "ratio": min(samples[(m, s)]) / g, "samples_s": samples[(m, s)]}
           for m, s in methods]
    for p in pts:
        log(f"  tracing {layers} layers {p['method']:4s} {p['statistic']:14s} "
            f"{p['trace_lower_s']:.3f}s ({p['ratio']:.2f}x grad)")
    return {"model": "transformer", "layers": layers, "batch": B,
            "n_leaves": len(jax.tree.leaves(params)), "reps": reps, "points": pts}

"""Benchmark suite: per-example gradient statistics vs ``jax.grad``, ``vmap(grad)``
and ``optax.microbatching.micro_grad``.

Usage::

    python -m benchmarks.run                      # -> benchmarks/results/<platform>.json/.csv
    python -m benchmarks.run --quick --out /tmp/q.json
    python -m benchmarks.run --regimes mlp short  # a subset of regimes
    python -m benchmarks.plot                     # PNGs in docs/img/, table in docs/benchmarks.md

Protocol (the project's benchmarking protocol, docs/benchmarks.md): every method is compiled with
``jax.jit(...).lower(...).compile()`` in this one process and the compiled
executable is what is timed; methods of one (regime, batch size) are run
*interleaved* (A B C A B C ...) and we report medians and ratios to plain
``jax.grad`` of the same batch loss. Besides wall time we record XLA's compiled
FLOPs (``compiled.cost_analysis()``) and temporary memory
(``compiled.memory_analysis().temp_size_in_bytes``), which are stable on a
noisy machine. Caveat: ``cost_analysis`` counts the body of a ``while`` loop
(``lax.fori_loop`` in ``micro_grad`` with microbatching, ``lax.scan`` over
layers or chunks) once, so FLOPs of looped programs are under-counted; each
row records ``has_loop`` so such numbers can be discounted.

Methods (``method`` x ``statistic``):

* ``grad`` -- ``jax.grad(loss)(params, batch)``, the baseline (statistic ``grad``).
* ``js`` -- ``jaxpr_surgery.per_example_stat(loss, stat)``.
* ``vmap`` -- ``jax.vmap(jax.grad(per_example_loss))`` then the same reduction.
* ``micro_grad`` -- ``optax.microbatching.micro_grad(loss, transform_fn=...,
  metrics_fn=..., accumulator=MEAN)`` without microbatching (one vmap).
* ``micro_grad_mb`` -- the same with ``microbatch_size=B // 4`` (a
  ``fori_loop`` over 4 microbatches): memory traded for time.

Statistics: ``mean, second_moment, variance, sign_mean, sq_norms,
clipped_mean`` and ``mean+second_moment`` (a tuple, one pass).

Also recorded: the largest batch whose temporary memory fits a budget (found by
compiling at abstract shapes only -- a bracketing secant/bisection search on
``memory_analysis``, no execution), and for the ``short`` transformer the
temporary memory (and time) of ``second_moment`` against ``chunk_size``, and
the trace+lower time of a 12-layer unrolled transformer and of a 48-layer one
(``--no-tracing`` skips them).

Each row also records ``minor_faults_per_call``: the process's minor page faults
per timed call. With glibc's default malloc, a freed buffer above its mmap
threshold (at most 32 MiB) goes back to the OS, so a program whose XLA temporary
buffer is larger page-faults all of it on every call; on the 2-core machine of
docs/benchmarks.md a fault costs about 1 microsecond, so 100 MiB of temporary
memory adds about 25 ms a call. ``--allocator steady`` runs the suite with malloc
keeping freed memory (`STEADY_ALLOCATOR_ENV`) and writes
``<platform>_steady_alloc.json``; docs/benchmarks.md sets the two side by side.

A method that fails records its error in the JSON; the run goes on.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpr_surgery as js
from benchmarks import models
from jaxpr_surgery._src import fused
from jaxpr_surgery._src.chunking import _minor_faults as minor_faults  # all threads' faults

SCHEMA_VERSION = 1
CLIP_NORM = 1.0
ALL_STATS = ["mean", "second_moment", "variance", "sign_mean", "sq_norms", "clipped_mean",
             "mean+second_moment"]
# js_chunk: per_example_stat with chunk_size = B // 4, the memory of micro_grad_mb
BASELINES = ["js_chunk", "vmap", "micro_grad", "micro_grad_mb", "js_fused"]
N_MICROBATCHES = 4
MAX_CALLS_PER_SAMPLE = 50  # a timing sample of a fast method averages up to this many calls

RESULT_FIELDS = [
    "regime", "batch", "method", "statistic", "label", "ok", "error",
    "time_median_s", "time_ratio", "n_reps", "time_min_s", "time_max_s", "warmup_s",
    "flops", "flops_ratio", "bytes_accessed", "temp_bytes", "temp_ratio", "peak_bytes",
    "output_bytes", "argument_bytes", "trace_lower_s", "compile_s", "has_loop",
    "microbatch_size", "calls_per_sample", "minor_faults_per_call",
]

# glibc malloc returns a freed buffer above its mmap threshold (at most 32 MiB) to the
# OS, so an XLA:CPU program whose temporary buffer is larger page-faults all of it on
# every call; "steady" keeps freed memory in the process (one arena, no mmap, no trim),
# so that after the first call no method pays for page faults (docs/benchmarks.md).
STEADY_ALLOCATOR_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class Regime:
    name: str
    build: Callable[[], models.Model]
    batches: list[int]
    description: str
    # statistics per method: {method: (at the smallest batch, at the larger batches)};
    # ``grad`` always runs.
    plan: dict[str, tuple[list[str], list[str]]] = None  # type: ignore[assignment]
    maxbatch: bool = True

    def entries(self, i_batch: int):
        out = [("grad", "grad")]
        for m in ["js"] + BASELINES:
            if m == "js_fused" and jax.default_backend() != "gpu":
                continue  # the kernel is Triton's: GPUs only
            small, large = self.plan.get(m, ([], []))
            out += [(m, s) for s in (small if i_batch == 0 else large)]
        if any(m in ("js_chunk", "micro_grad_mb") for m, _ in out):
            out.append(("grad_chunk", "grad"))  # the floor of any equal-memory method
        return out


CORE4 = ["second_moment", "sq_norms", "clipped_mean", "mean+second_moment"]
FULL_PLAN = {
    "js": (ALL_STATS, ALL_STATS),
    "js_chunk": (["second_moment", "sign_mean"], ["second_moment", "sign_mean"]),
    "vmap": (ALL_STATS, ["second_moment", "sq_norms"]),
    "micro_grad": (["second_moment", "sq_norms"], ["second_moment"]),
    "micro_grad_mb": (["second_moment", "sq_norms", "sign_mean"], ["second_moment", "sign_mean"]),
    # js with JAXPR_SURGERY_TILE_KERNEL=pallas (GPU runs only; fused.py)
    "js_fused": (["second_moment", "sign_mean", "variance"], ["second_moment", "sign_mean"]),
}
EVERYTHING_PLAN = {m: (ALL_STATS, ALL_STATS) for m in ["js"] + BASELINES}
QUICK_PLAN_FULL = {"js": (ALL_STATS, ALL_STATS),
                   **{m: (["second_moment"], ["second_moment"]) for m in BASELINES}}
QUICK_PLAN = {"js": (["second_moment", "sq_norms", "mean+second_moment"],) * 2,
              "js_chunk": (["second_moment"], ["second_moment"]),
              "vmap": (["second_moment"], ["second_moment"]),
              "micro_grad_mb": (["second_moment"], ["second_moment"])}
QUICK_PLAN_SCAN = {"js": (["second_moment"], ["second_moment"]),
                   "vmap": (["second_moment"], ["second_moment"])}
# quick mode checks the harness, not the numbers: compile without LLVM optimisation
QUICK_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                          "xla_llvm_disable_expensive_passes": True}
QUICK_DEFAULT_REGIMES = ["mlp", "short", "scan_remat", "matrix"]
# per-example Kronecker moments (matrix_check.py): js against micro_grad forming each
# example's moments from its materialised gradient
MATRIX_PLAN = {"js": (["kron_moments"], ["kron_moments"]),
               "micro_grad_mb": (["kron_moments"], ["kron_moments"])}
KRON_MAX_DIM = 1024


def _regimes(quick: bool) -> dict[str, Regime]:
    if quick:
        return {
            "mlp": Regime("mlp", lambda: models.mlp(din=32, hidden=64, nclass=10), [16],
                          "token-free MLP 32-64-10 (quick)", QUICK_PLAN_FULL),
            "cnn": Regime("cnn", lambda: models.cnn(size=8, c1=4, c2=4), [8],
                          "CNN 8x8x1 conv(4)-conv(4,s2)-dense (quick)", QUICK_PLAN, maxbatch=False),
            "short": Regime("short", lambda: models.transformer(T=8, d=32, V=64, layers=1, heads=2,
                                                                name="short"), [8],
                            "transformer T=8 d=32 V=64 (quick)", QUICK_PLAN, maxbatch=False),
            "long": Regime("long", lambda: models.transformer(T=32, d=16, V=32, layers=1, heads=2,
                                                              name="long"), [4],
                           "transformer T=32 d=16 V=32 (quick)", QUICK_PLAN, maxbatch=False),
            "vocab": Regime("vocab", lambda: models.transformer(T=4, d=8, V=512, layers=1, heads=2,
                                                                name="vocab"), [8],
                            "transformer T=4 d=8 V=512 tied (quick)", QUICK_PLAN, maxbatch=False),
            "scan_remat": Regime("scan_remat", lambda: models.scan_remat(T=8, d=16, V=32, layers=2,
                                                                         heads=2), [8],
                                 "scan over 2 remat layers T=8 d=16 (quick)", QUICK_PLAN_SCAN,
                                 maxbatch=False),
            "matrix": Regime("matrix", lambda: models.transformer(T=8, d=32, V=64, layers=1,
                                                                  heads=2, name="matrix"), [8],
                             "kron_moments, transformer T=8 d=32 V=64 (quick)", MATRIX_PLAN,
                             maxbatch=False),
        }
    return {
        "mlp": Regime("mlp", lambda: models.mlp(), [32, 256],
                      "token-free MLP 784-1024-10, ReLU, softmax CE", FULL_PLAN),
        "cnn": Regime("cnn", lambda: models.cnn(), [32, 128],
                      "CNN 28x28x1: conv3x3(16,SAME)-conv3x3(32,s2)-dense(10)", FULL_PLAN,
                      maxbatch=False),
        "short": Regime("short", lambda: models.transformer(T=32, d=256, V=8192, layers=2, heads=4,
                                                            name="short"), [8, 32],
                        "transformer LM T=32 d=256 V=8192 L=2 H=4, tied, learned pos, LN",
                        FULL_PLAN),
        "long": Regime("long", lambda: models.transformer(T=128, d=64, V=1024, layers=2, heads=4,
                                                          name="long"), [8, 32],
                       "transformer LM T=128 d=64 V=1024 L=2 H=4 (T >= d)", FULL_PLAN),
        "vocab": Regime("vocab", lambda: models.transformer(T=16, d=64, V=32768, layers=1,
                                                            heads=4, name="vocab"), [8, 32],
                        "transformer LM T=16 d=64 V=32768 L=1, tied (large vocab)", FULL_PLAN,
                        maxbatch=False),
        "scan_remat": Regime("scan_remat", lambda: models.scan_remat(T=32, d=128, V=2048,
                                                                     layers=4, heads=4), [8, 32],
                             "transformer T=32 d=128 V=2048, lax.scan over 4 "
                             "jax.checkpoint layers, stacked params", FULL_PLAN),
        "matrix": Regime("matrix", lambda: models.transformer(T=32, d=256, V=8192, layers=2,
                                                              heads=4, name="matrix"), [32],
                         "kron_moments (max_dim 1024) on the short transformer: per-example "
                         "Kronecker moments", MATRIX_PLAN, maxbatch=False),
    }


@dataclasses.dataclass
class Settings:
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


def _settings(quick: bool, args) -> Settings:
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
# Methods
# --------------------------------------------------------------------------- #
def js_stat(name):
    return {
        "mean": js.stats.mean,
        "second_moment": js.stats.second_moment,
        "variance": js.stats.variance,
        "sign_mean": js.stats.sign_mean,
        "sq_norms": js.stats.sq_norms,
        "clipped_mean": lambda: js.stats.clipped_mean(CLIP_NORM),
        "mean+second_moment": lambda: (js.stats.mean(), js.stats.second_moment()),
        "kron_moments": lambda: js.stats.kron_moments(KRON_MAX_DIM),
    }[name]()


def kron_of(g):
    """One example's Kronecker moments from its materialised gradient (the contract)."""
    def leaf(x):
        out = []
        for j, n in enumerate(x.shape):
            u = jnp.moveaxis(x, j, 0).reshape(n, -1)
            out.append(u @ u.T if n <= KRON_MAX_DIM else jnp.sum(u * u, axis=1))
        return tuple(out)
    return jax.tree.map(leaf, g)


def _global_sq_norm(tree):
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


def reduce_stacked(name, G, B):
    """The statistic from stacked per-example gradients G (leaves [B, ...])."""
    tm = jax.tree.map
    if name == "mean":
        return tm(lambda g: jnp.mean(g, 0), G)
    if name == "second_moment":
        return tm(lambda g: jnp.mean(jnp.square(g), 0), G)
    if name == "variance":
        return tm(lambda g: jnp.var(g, 0, ddof=1), G)
    if name == "sign_mean":
        return tm(lambda g: jnp.mean(jnp.sign(g), 0), G)
    sq = sum(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), 1) for g in jax.tree.leaves(G))
    if name == "sq_norms":
        return sq
    if name == "clipped_mean":
        f = jnp.minimum(1.0, CLIP_NORM / jnp.sqrt(jnp.maximum(sq, 1e-30)))
        return tm(lambda g: jnp.mean(g * f.reshape((-1,) + (1,) * (g.ndim - 1)), 0), G)
    if name == "mean+second_moment":
        return (tm(lambda g: jnp.mean(g, 0), G), tm(lambda g: jnp.mean(jnp.square(g), 0), G))
    if name == "kron_moments":
        return tm(lambda x: jnp.mean(x, 0), jax.vmap(kron_of)(G))
    raise ValueError(name)


def _micro_transform(name):
    """(transform_fn, metrics_fn, finalize(result, metrics, B)) for micro_grad."""
    tm = jax.tree.map
    ident = lambda r, m, B: r  # noqa: E731
    if name == "mean":
        return (lambda g: g), (lambda g: None), ident
    if name == "second_moment":
        return (lambda g: tm(jnp.square, g)), (lambda g: None), ident
    if name == "variance":
        def fin(r, m, B):
            mu, m2 = r
            return tm(lambda a, b: (b - jnp.square(a)) * (B / (B - 1)), mu, m2)
        return (lambda g: (g, tm(jnp.square, g))), (lambda g: None), fin
    if name == "sign_mean":
        return (lambda g: tm(jnp.sign, g)), (lambda g: None), ident
    if name == "sq_norms":
        return (lambda g: jnp.zeros((), jnp.float32)), _global_sq_norm, (lambda r, m, B: m)
    if name == "clipped_mean":
        def clip(g):
            n = jnp.sqrt(jnp.maximum(_global_sq_norm(g), 1e-30))
            f = jnp.minimum(1.0, CLIP_NORM / n)
            return tm(lambda x: x * f, g)
        return clip, (lambda g: None), ident
    if name == "mean+second_moment":
        return (lambda g: (g, tm(jnp.square, g))), (lambda g: None), ident
    if name == "kron_moments":
        return kron_of, (lambda g: None), ident
    raise ValueError(name)


def microbatch_size_for(B):
    return max(1, B // N_MICROBATCHES)


def _chunked_grad(loss, B, mb):
    """``jax.grad`` of the mean loss computed over chunks of ``mb`` examples in a
    ``lax.scan`` (the memory of ``micro_grad_mb`` and ``js_chunk``, no statistics):
    what running the model a chunk at a time costs by itself."""
    if B % mb:
        raise ValueError(f"grad_chunk: batch {B} is not a multiple of the chunk {mb}")
    n = B // mb

    def f(p, b):
        chunks = jax.tree.map(lambda x: x.reshape((n, mb) + x.shape[1:]), b)

        def body(acc, chunk):
            g = jax.grad(loss)(p, chunk)
            return jax.tree.map(jnp.add, acc, g), None

        total = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), chunks)[0]
        return jax.tree.map(lambda t: t / n, total)
    return f


def make_method(model: models.Model, method: str, stat: str, B: int,
                microbatch_size: int | None = None, chunk_size: int | str | None = "auto"):
    loss = model.loss
    # the chunk of the equal-memory methods (grad_chunk, js_chunk, micro_grad_mb)
    mb = microbatch_size if microbatch_size is not None else microbatch_size_for(B)
    if method == "grad":
        return jax.grad(loss)
    if method == "js":
        return js.per_example_stat(loss, js_stat(stat), chunk_size=chunk_size)
    if method == "grad_chunk":  # the plain gradient, one chunk of B/4 at a time
        return _chunked_grad(loss, B, mb)
    if method == "js_chunk":  # equal memory to micro_grad_mb: the same chunk
        return js.per_example_stat(loss, js_stat(stat), chunk_size=mb)
    if method == "js_fused":  # js with the fused Pallas tile kernel (GPU only)
        inner = js.per_example_stat(loss, js_stat(stat), chunk_size=chunk_size)

        def fused_call(p, b):
            with fused.selected("pallas"):  # read while the call is traced
                return inner(p, b)
        return fused_call
    if method == "vmap":
        def per_example_loss(p, ex):
            return loss(p, jax.tree.map(lambda x: x[None], ex))

        def f(p, b):
            G = jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0))(p, b)
            return reduce_stacked(stat, G, B)
        return f
    if method in ("micro_grad", "micro_grad_mb"):
        transform, metrics, fin = _micro_transform(stat)
        mg = optax.microbatching.micro_grad(
            loss, argnums=0, batch_argnums=1, keep_batch_dim=True,
            microbatch_size=mb if method == "micro_grad_mb" else None,
            accumulator=optax.microbatching.AccumulationType.MEAN,
            transform_fn=transform, metrics_fn=metrics)

        def f(p, b):
            r, aux = mg(p, b)
            return fin(r, aux.metrics, B)
        return f
    raise ValueError(method)


# --------------------------------------------------------------------------- #
# Measurement helpers
# --------------------------------------------------------------------------- #
_COMPILER_OPTIONS: dict | None = None


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
        row = {k: None for k in RESULT_FIELDS}
        row.update(regime=regime.name, batch=B, method=method, statistic=stat,
                   label=method if method == "grad" else f"{method}:{stat}", ok=False)
        if method in ("micro_grad_mb", "js_chunk", "grad_chunk"):
            row["microbatch_size"] = microbatch_size_for(B)
        samples: list[float] = []
        try:
            fn = make_method(model, method, stat, B)
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
            runnable.append((row, compiled, samples))
        except Exception as e:  # noqa: BLE001 - record and go on
            row["error"] = _err(e)
            log(f"  ! {regime.name} B={B} {row['label']}: {type(e).__name__}: {str(e)[:300]}")
        rows.append((row, samples))
        faults[row["label"]] = [0, 0]  # minor page faults, calls (timed samples only)
        log(f"  compiled {regime.name:10s} B={B:<5d} {row['label']:30s} "
            f"lower {row['trace_lower_s'] or 0:6.2f}s compile {row['compile_s'] or 0:6.2f}s "
            f"warm {row['warmup_s'] or 0:7.3f}s temp {(row['temp_bytes'] or 0) / 2**20:8.1f}MiB")

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


# --------------------------------------------------------------------------- #
# Targets from the issue
# --------------------------------------------------------------------------- #
def _row(rows, regime, B, method, stat):
    for r in rows:
        if (r["regime"], r["batch"], r["method"], r["statistic"]) == (regime, B, method, stat):
            return r
    return None


def evaluate_targets(rows, tracing=None):
    """Every target of the issue, per batch size: value, threshold, met (None = not measured)."""
    out = []

    def add(tid, desc, regime, B, label, value, thr, extra=None):
        met = None if value is None else bool(value <= thr)
        d = {"target": tid, "description": desc, "regime": regime, "batch": B, "what": label,
             "value": value, "threshold": thr, "met": met}
        if extra:
            d.update(extra)
        out.append(d)

    batches = lambda reg: sorted({r["batch"] for r in rows if r["regime"] == reg})  # noqa: E731
    for B in batches("mlp"):
        for s in ["second_moment", "sign_mean", "sq_norms", "clipped_mean"]:
            r = _row(rows, "mlp", B, "js", s)
            ok = r is not None and r["ok"]
            add("mlp_time", "MLP: js time <= 1.2x grad", "mlp", B, s,
                r["time_ratio"] if ok else None, 1.2)
            add("mlp_mem", "MLP: js temp memory <= 2x grad", "mlp", B, s,
                r["temp_ratio"] if ok else None, 2.0)
    for B in batches("short"):
        for s in ["sq_norms", "clipped_mean"]:
            r = _row(rows, "short", B, "js", s)
            ok = r is not None and r["ok"]
            add("transformer_time", "transformer (short): js time <= 1.1x grad", "short", B, s,
                r["time_ratio"] if ok else None, 1.1)
    regimes = sorted({r["regime"] for r in rows})
    for reg in regimes:
        for B in batches(reg):
            a = _row(rows, reg, B, "js", "second_moment")
            v = _row(rows, reg, B, "vmap", "second_moment")
            if a is None:  # a regime of other statistics (matrix)
                continue
            val = None
            if a and v and a["ok"] and v["ok"] and a["time_median_s"] and v["time_median_s"]:
                val = a["time_median_s"] / v["time_median_s"]
            add("sm_vs_vmap", "js second_moment time <= vmap(grad) second_moment time", reg, B,
                "second_moment / vmap", val, 1.0)
            both = _row(rows, reg, B, "js", "mean+second_moment")
            val = extra = None
            if a and both and a["ok"] and both["ok"] and a["time_median_s"]:
                val = both["time_median_s"] / a["time_median_s"]
                # the mean alone (the gradient) may itself cost more than second_moment
                m = _row(rows, reg, B, "js", "mean")
                if m and m["ok"] and m["time_median_s"]:
                    slower = max(m["time_median_s"], a["time_median_s"])
                    extra = {"mean_vs_second_moment": m["time_median_s"] / a["time_median_s"],
                             "vs_slower_alone": both["time_median_s"] / slower}
            add("fused_vs_single", "js mean+second_moment time <= 1.1x second_moment alone",
                reg, B, "mean+second_moment / second_moment", val, 1.1, extra)
    # token-axis statistics on transformers (the tokens issue)
    for reg, tmax in (("short", 1.6), ("long", 1.1)):
        for B in batches(reg):
            for s in ["second_moment", "sign_mean"]:
                r = _row(rows, reg, B, "js", s)
                ok = r is not None and r["ok"]
                add("tokens_time", "tokens: js E[g^2]/E[sign] default time <= 1.6x grad (short), "
                    "1.1x (long)", reg, B, s, r["time_ratio"] if ok else None, tmax)
                add("tokens_mem", "tokens: js E[g^2]/E[sign] default temp memory <= 1.3x grad",
                    reg, B, s, r["temp_ratio"] if ok else None, 1.3)
    for reg in regimes:
        for B in batches(reg):
            for s in ["second_moment", "sign_mean"]:
                c = _row(rows, reg, B, "js_chunk", s)
                m = _row(rows, reg, B, "micro_grad_mb", s)
                tv = mv = None
                if c and m and c["ok"] and m["ok"] and m["time_median_s"]:
                    tv = c["time_median_s"] / m["time_median_s"]
                    mv = c["temp_bytes"] / max(m["temp_bytes"], 1)
                if c is None and m is None:
                    continue
                # the floor: the plain gradient in the same chunks, which any method
                # at this memory also computes
                gc_ = _row(rows, reg, B, "grad_chunk", "grad")
                extra = None
                if tv is not None and gc_ and gc_["ok"] and gc_["time_median_s"]:
                    extra = {"grad_chunk_vs_micro_grad":
                             gc_["time_median_s"] / m["time_median_s"],
                             "js_chunk_vs_grad_chunk":
                             c["time_median_s"] / gc_["time_median_s"]}
                add("equal_mem_time", "equal memory (chunk B/4): js time <= 0.8x micro_grad "
                    "(microbatch B/4)", reg, B, s, tv, 0.8, extra)
                add("equal_mem_mem", "equal memory (chunk B/4): js temp memory <= micro_grad's",
                    reg, B, s, mv, 1.0)
            a = _row(rows, reg, B, "js", "second_moment")
            v = _row(rows, reg, B, "js", "variance")
            val = None
            if a and v and a["ok"] and v["ok"] and a["time_median_s"]:
                val = v["time_median_s"] / a["time_median_s"]
                add("var_vs_sm", "js variance time <= 1.2x second_moment alone", reg, B,
                    "variance / second_moment", val, 1.2)
    for B in batches("matrix"):
        r = _row(rows, "matrix", B, "js", "kron_moments")
        m = _row(rows, "matrix", B, "micro_grad_mb", "kron_moments")
        ok = r is not None and r["ok"]
        add("matrix_time", "matrix: js kron_moments time <= 2.0x grad", "matrix", B,
            "kron_moments", r["time_ratio"] if ok else None, 2.0)
        mem = None
        if ok and r.get("temp_ratio") is not None and r.get("output_bytes"):
            grad_temp = r["temp_bytes"] / max(r["temp_ratio"], 1e-30)
            mem = r["temp_bytes"] / (1.5 * grad_temp + r["output_bytes"])
        add("matrix_mem", "matrix: js temp memory <= 1.5x grad's + the result's size (value: "
            "the ratio to that bound)", "matrix", B, "kron_moments", mem, 1.0)
        val = None
        if ok and m is not None and m["ok"] and m["time_median_s"]:
            val = r["time_median_s"] / m["time_median_s"]
        add("matrix_vs_micro_grad", "matrix: js kron_moments time <= 0.5x micro_grad "
            "(microbatch B/4) forming the same moments", "matrix", B, "kron_moments / micro_grad",
            val, 0.5)
    for B in batches("scan_remat"):
        for s in ALL_STATS:
            r = _row(rows, "scan_remat", B, "js", s)
            ok = r is not None and r["ok"]
            add("remat_mem", "scan+remat: js temp memory <= 1.3x grad-with-remat", "scan_remat",
                B, s, r["temp_ratio"] if ok else None, 1.3)
    if tracing and tracing.get("points"):
        for p in tracing["points"]:
            if p["method"] == "js":
                add("trace_lower", f"tracing: js trace+lower of a {tracing['layers']}-layer "
                    "transformer <= 1.5x grad's", "deep", tracing["batch"], p["statistic"],
                    p["ratio"], 1.5)
    return out


# --------------------------------------------------------------------------- #
# Machine info and output
# --------------------------------------------------------------------------- #
def machine_info():
    import jaxlib

    try:
        dev = jax.devices()[0]
        kind, plat, ndev = dev.device_kind, dev.platform, jax.device_count()
    except Exception:  # noqa: BLE001
        kind = plat = None
        ndev = 0
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "jaxpr_surgery": getattr(js, "__version__", None),
        "backend": plat,
        "device_kind": kind,
        "device_count": ndev,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "allocator": allocator_info(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["loadavg_start"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def write_outputs(doc, out_path):
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)
    os.replace(tmp, out_path)
    csv_path = os.path.splitext(out_path)[0] + ".csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in doc["results"]:
            rr = dict(r)
            if rr.get("error"):
                rr["error"] = rr["error"].splitlines()[0][:300]
            w.writerow(rr)
    return csv_path


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def allocator_info():
    """The allocator mode of this process: ``steady`` where `STEADY_ALLOCATOR_ENV` is
    in effect, else ``default``; with the malloc settings found in the environment."""
    env = {k: os.environ[k] for k in sorted(os.environ)
           if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    if "LD_PRELOAD" in env:  # library names only: no path of this machine in the results
        env["LD_PRELOAD"] = " ".join(
            os.path.basename(x) for x in env["LD_PRELOAD"].replace(":", " ").split()
        )
    steady = all(os.environ.get(k) == v for k, v in STEADY_ALLOCATOR_ENV.items())
    return {"mode": "steady" if steady else "default", "libc": list(platform.libc_ver()),
            "env": env}


def default_out(allocator="default"):
    try:
        plat = jax.devices()[0].platform
    except Exception:  # noqa: BLE001
        plat = "cpu"
    suffix = "" if allocator == "default" else f"_{allocator}_alloc"
    return os.path.join(os.path.dirname(__file__), "results", f"{plat}{suffix}.json")


def _reexec_steady(argv):
    """Runs this command again in a process with `STEADY_ALLOCATOR_ENV` (malloc reads
    it at start-up) and returns its exit code."""
    import subprocess

    env = dict(os.environ, **STEADY_ALLOCATOR_ENV)
    return subprocess.call([sys.executable, "-m", "benchmarks.run", *argv], env=env)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="tiny models, one batch size, 1-2 repeats")
    ap.add_argument("--out", default=None, help="JSON path (CSV written next to it)")
    ap.add_argument("--regimes", nargs="+", default=None,
                    help="subset of: mlp cnn short long vocab scan_remat matrix")
    ap.add_argument("--reps", type=int, default=None, help="max repeats per method")
    ap.add_argument("--budget-mib", type=float, default=None, help="memory budget, MiB")
    ap.add_argument("--compiler-options", default=None,
                    help="JSON dict of XLA compile options, e.g. "
                         '\'{"xla_backend_optimization_level": 0}\'')
    ap.add_argument("--no-maxbatch", action="store_true")
    ap.add_argument("--no-chunk", action="store_true")
    ap.add_argument("--no-tracing", action="store_true",
                    help="skip the trace+lower timing of a deep unrolled transformer")
    ap.add_argument("--all-baseline-stats", action="store_true",
                    help="run every statistic for vmap/micro_grad at every batch size")
    ap.add_argument("--allocator", choices=["default", "steady"], default="default",
                    help="steady: run with glibc malloc keeping freed memory (one arena, no "
                         "mmap, no trim), so that no call page-faults its temporary buffers; "
                         "results go to <platform>_steady_alloc.json unless --out is given")
    args = ap.parse_args(argv)
    if args.allocator == "steady" and allocator_info()["mode"] != "steady":
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            ap.error("--allocator steady sets glibc malloc's environment variables; this "
                     f"process runs on {platform.system()} {platform.libc_ver()[0] or ''}.")
        raise SystemExit(_reexec_steady(list(sys.argv[1:] if argv is None else argv)))

    st = _settings(args.quick, args)
    global _COMPILER_OPTIONS
    _COMPILER_OPTIONS = st.compiler_options
    regimes = _regimes(args.quick)
    names = args.regimes or (QUICK_DEFAULT_REGIMES if args.quick else list(regimes))
    bad = [n for n in names if n not in regimes]
    if bad:
        ap.error(f"unknown regime(s) {bad}; choose from {list(regimes)}")
    out_path = args.out or default_out(args.allocator)

    t_start = time.perf_counter()
    doc = {
        "schema_version": SCHEMA_VERSION,
        "quick": args.quick,
        "machine": machine_info(),
        "settings": {k: v for k, v in dataclasses.asdict(st).items()},
        "statistics": ALL_STATS,
        "methods": ["grad", "js"] + BASELINES + ["grad_chunk"],
        "clip_norm": CLIP_NORM,
        "n_microbatches": N_MICROBATCHES,
        "notes": [
            "time_ratio / flops_ratio / temp_ratio are relative to method 'grad' "
            "(jax.grad of the batch loss) at the same regime and batch size.",
            "XLA cost_analysis counts while-loop bodies (lax.fori_loop in micro_grad_mb, "
            "lax.scan over layers or chunks) once: FLOPs of rows with has_loop=true are "
            "under-counted.",
            "micro_grad_mb uses microbatch_size = B // 4 (4 microbatches); in the max-batch "
            "search its microbatch size is fixed to (largest benchmarked B) // 4.",
            "Wall times on a shared CPU are noisy; temp memory and FLOPs are deterministic.",
            "grad_chunk is jax.grad run over chunks of B // 4 examples in a lax.scan (the "
            "chunk of js_chunk and micro_grad_mb): the time any method at that memory spends "
            "running the model, before any statistic; equal_mem_time targets carry it as "
            "grad_chunk_vs_micro_grad and js_chunk_vs_grad_chunk.",
            "Statistics per method (time budget): js every statistic at every batch size; "
            "vmap every statistic at the smallest batch size of a regime and second_moment, "
            "sq_norms at larger ones; micro_grad and micro_grad_mb second_moment and "
            "sq_norms at the smallest batch size and second_moment at larger ones "
            "(--all-baseline-stats: everything everywhere). Quick mode runs a reduced set.",
            "A warmup call slower than settings.slow_s counts as a timing sample (slow "
            "methods get fewer repeats); repeats stop after settings.time_cap_s per method "
            "once settings.min_reps are taken. A sample of a faster method is the mean of "
            "calls_per_sample calls (about 20 ms of them, each waited for), so sub-millisecond "
            "programs are not timed one call at a time.",
        ],
        "regimes": {},
        "results": [],
        "max_batch": [],
        "chunk_curve": None,
        "tracing": None,
        "targets": [],
    }
    for name in names:
        reg = regimes[name]
        t_reg = time.perf_counter()
        log(f"== regime {name}: {reg.description}, batches {reg.batches}")
        try:
            model = reg.build()
        except Exception as e:  # noqa: BLE001
            doc["regimes"][name] = {"description": reg.description, "error": _err(e)}
            continue
        doc["regimes"][name] = {"description": reg.description, "batches": reg.batches,
                                "info": model.info}
        reg_rows = []
        if args.all_baseline_stats:
            reg.plan = EVERYTHING_PLAN
        for i, B in enumerate(reg.batches):
            reg_rows += run_config(model, reg, B, reg.entries(i), st)
        doc["results"] += reg_rows
        if not args.no_maxbatch and reg.maxbatch:
            doc["max_batch"] += run_maxbatch(model, reg, reg_rows, st)
        if not args.no_chunk and name == st.chunk_regime:
            try:
                doc["chunk_curve"] = run_chunk_curve(model, reg, st)
            except Exception as e:  # noqa: BLE001
                doc["chunk_curve"] = {"error": _err(e)}
        doc["regimes"][name]["wall_s"] = time.perf_counter() - t_reg
        log(f"== regime {name} done in {doc['regimes'][name]['wall_s']:.1f}s")
        doc["targets"] = evaluate_targets(doc["results"], doc["tracing"])
        doc["total_wall_s"] = time.perf_counter() - t_start
        write_outputs(doc, out_path)
        jax.clear_caches()
        gc.collect()

    if not args.no_tracing and not args.regimes:
        log("== tracing cost")
        try:
            doc["tracing"] = run_tracing(st)
        except Exception as e:  # noqa: BLE001
            doc["tracing"] = {"error": _err(e)}

    try:
        doc["machine"]["loadavg_end"] = list(os.getloadavg())
    except OSError:
        pass
    doc["targets"] = evaluate_targets(doc["results"], doc["tracing"])
    doc["total_wall_s"] = time.perf_counter() - t_start
    csv_path = write_outputs(doc, out_path)
    n_err = sum(1 for r in doc["results"] if not r["ok"])
    met = [t for t in doc["targets"] if t["met"] is True]
    missed = [t for t in doc["targets"] if t["met"] is False]
    log(f"wrote {out_path} and {csv_path}: {len(doc['results'])} rows ({n_err} errors), "
        f"targets met {len(met)}, missed {len(missed)}, total {doc['total_wall_s']:.1f}s")
    return doc


if __name__ == "__main__":
    main()

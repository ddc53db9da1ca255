"""``chunk_size="auto"`` (the default): on CPU, where the allocator page-faults large
temporaries afresh on every call (glibc's default malloc), the batch runs in chunks whose
activations, estimated from the per-example jaxpr, fit `chunking.CPU_CHUNK_BYTES`;
elsewhere, where the allocator keeps freed memory, or where the whole batch fits, in one
go. Checks the estimate, the choice of chunk, the allocator probe (in processes with
either allocator), that the chunked default is checked against the vmap(grad) oracle
(float32 and float64, with a remainder chunk), and the argument's validation."""

from __future__ import annotations

import collections
import os
import platform
import subprocess
import sys

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery as js
from jaxpr_surgery._src import chunking, tiling


@pytest.fixture(autouse=True)
def _allocator_faults(monkeypatch):
    """The choices below are those of a process whose allocator gives large buffers
    back (glibc's default): whatever this one's, measured by the probe."""
    monkeypatch.setattr(chunking, "temporaries_refault", lambda: True)


# --------------------------------------------------------------------------- #
# The choice of chunk
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "B,per_ex,budget,want",
    [
        (8, 1, 64, None),  # the batch fits
        (1, 10**9, 64, None),  # one example: nothing to chunk
        (8, 16, 64, 4),  # 4 fit exactly: a divisor
        (32, 9, 64, 4),  # 7 fit; balanced 7 (5 chunks) -> divisor 4 (>= 7/2)
        (13, 16, 64, 4),  # prime B: no useful divisor, balanced chunks of 4 (+1 remainder)
        (12, 20, 64, 3),  # 3 fit: a divisor
        (10, 10**9, 64, 1),  # one example is over the budget: one at a time
        (256, 1, 64, 64),  # a divisor equal to what fits
    ],
)
def test_auto_chunk(B, per_ex, budget, want):
    got = chunking.auto_chunk(B, per_ex, budget)
    assert got == want
    if got is not None:
        assert got * per_ex <= budget or got == 1  # never over the budget
        assert got < B


@pytest.mark.parametrize(
    "B,budget,acc,want",
    [
        (32, 64, 0, 4),  # the cache alone: 4 of 16 bytes fit 64
        (32, 64, 16, 4),  # merges stream 16 bytes per chunk: 3 x 16 = 48 <= 4 x 16
        (32, 64, 32, 8),  # 3 x 32 = 96 bytes of activations at least: 6, the divisor 8
        (8, 64, 32, None),  # ... which is the whole batch of 8
        (32, 64, 200, None),  # 3 x 200 / 16 = 38 examples > B
        (32, 112, 32, 8),  # 7 fit, at least 6: no divisor in [6, 7], 8 just above
        (29, 112, 32, 6),  # prime: balanced chunks of 6 (5 chunks), a remainder of 5
    ],
)
def test_auto_chunk_keeps_merges_small(B, budget, acc, want):
    assert chunking.auto_chunk(B, 16, budget, accumulator_bytes=acc) == want


def test_accumulator_bytes():
    from jaxpr_surgery._src.arguments import flatten_stats

    avals = [jax.ShapeDtypeStruct((10, 3), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.bfloat16)]
    reds = lambda s: flatten_stats(s)[3]  # noqa: E731
    # float32 accumulators (bf16 leaves accumulate in float32): 34 numbers per statistic
    assert chunking.accumulator_bytes(reds(js.stats.second_moment()), avals) == 34 * 4
    assert chunking.accumulator_bytes(reds(js.stats.variance()), avals) == 2 * 34 * 4
    assert chunking.accumulator_bytes(reds(js.stats.sq_norms()), avals) == 0  # per example
    both = {"m": js.stats.mean(), "v": js.stats.variance(), "n": js.stats.sq_norms()}
    assert chunking.accumulator_bytes(reds(both), avals) == 3 * 34 * 4


def test_chunks_under_a_device_split_count_the_parameters():
    """Under a batch split by XLA's partitioner (devices.py) every chunk may gather the
    parameters again (FSDP; the trace cannot see which are sharded), so the automatic
    chunk counts their bytes as streamed per chunk, as it does the accumulators. Before,
    a per-example statistic counted nothing there: chunks of a scan stack's norms on a 2-D
    mesh moved 1.36x grad's collective bytes, the whole batch 1.19x (shard_bench)."""
    from jaxpr_surgery._src import cuts
    from jaxpr_surgery._src.arguments import flatten_stats

    avals = [jax.ShapeDtypeStruct((10, 3), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.bfloat16)]
    reds = lambda s: flatten_stats(s)[3]  # noqa: E731
    params = 30 * 4 + 4 * 2
    with cuts.split_over(4, "parts"):
        assert chunking.accumulator_bytes(reds(js.stats.sq_norms()), avals) == params
        assert chunking.accumulator_bytes(reds(js.stats.variance()), avals) == (
            params + 2 * 34 * 4)
    assert chunking.accumulator_bytes(reds(js.stats.sq_norms()), avals) == 0
    # a batch whose activations exceed the budget runs whole once the parameters dominate
    assert chunking.auto_chunk(16, 8 << 20, accumulator_bytes=params) == 8
    assert chunking.auto_chunk(16, 8 << 20, accumulator_bytes=50 << 20) is None


def test_auto_chunk_default_budget_is_read_at_call_time(monkeypatch):
    monkeypatch.setattr(chunking, "CPU_CHUNK_BYTES", 100)
    assert chunking.auto_chunk(8, 50) == 2
    monkeypatch.setattr(chunking, "CPU_CHUNK_BYTES", 10**6)
    assert chunking.auto_chunk(8, 50) is None


def _per_example_jaxpr(loss, params, batch):
    ex = jax.tree.map(lambda a: a[0], batch)
    closed = jax.make_jaxpr(lambda p, e: loss(p, jax.tree.map(lambda a: a[None], e)))(
        params, ex)
    n_p, n_e = len(jax.tree.leaves(params)), len(jax.tree.leaves(ex))
    return closed.jaxpr, [False] * n_p + [True] * n_e


def test_activation_bytes_counts_data_dependent_values_only():
    W = jnp.ones((64, 32), jnp.float32)
    x = jnp.ones((1, 64), jnp.float32)

    def f(w, b):
        wt = (w * 2.0).T  # parameters only: counted once per batch, not per example
        return jnp.sum(jnp.tanh(b @ w) @ wt)

    jaxpr, flags = _per_example_jaxpr(f, W, x)
    got = chunking.activation_bytes(jaxpr, flags)
    # the data-dependent values: [1,64]-example reshapes aside, b@w [1,32], tanh [1,32],
    # @wt [1,64], the scalar sum: a few hundred bytes, far below W's 8 KiB
    assert 0 < got < W.size * 4 // 4
    # the same function with a parameter-sized data-dependent value counts it
    jaxpr2, flags2 = _per_example_jaxpr(lambda w, b: jnp.sum(w * jnp.sum(b)), W, x)
    assert chunking.activation_bytes(jaxpr2, flags2) >= W.size * 4


def test_activation_bytes_looks_into_jit_but_not_into_loops():
    W = jnp.ones((16, 16), jnp.float32)
    x = jnp.ones((1, 16), jnp.float32)
    big = lambda h: jnp.sum(jnp.exp(h[..., None] * jnp.ones(4096)))  # 256 KiB inside  # noqa: E731

    flat = chunking.activation_bytes(*_per_example_jaxpr(lambda w, b: big(b @ w), W, x))
    jitted = chunking.activation_bytes(
        *_per_example_jaxpr(lambda w, b: jax.jit(big)(b @ w), W, x))
    assert jitted == flat > 16 * 4096 * 4

    def scanned(w, b):
        h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w) + big(c) * 0, None), b, None, length=3)
        return jnp.sum(h)

    assert chunking.activation_bytes(*_per_example_jaxpr(scanned, W, x)) < 16 * 4096 * 4


# --------------------------------------------------------------------------- #
# The default call, chunked, against the oracle
# --------------------------------------------------------------------------- #
def _chunk_loops(loss, stat, params, batch, chunk_size="auto"):
    """Lengths of the loops over chunks of the call (top-level scans in the chunk
    loops' name scope; the tile loops of the sites are not)."""
    from jaxpr_surgery._src import api

    closed = jax.make_jaxpr(js.per_example_stat(loss, stat, chunk_size=chunk_size))(
        params, batch)
    return dict(collections.Counter(
        e.params["length"] for e in closed.jaxpr.eqns
        if e.primitive is jax.lax.scan_p and api.CHUNK_LOOP in str(e.source_info.name_stack)
    ))


# B=8: four chunks of 2 in one loop; B=7: two chunks of 3 in one loop, and a
# remainder of 1 (no chunk is peeled before the loop: one compiled chunk body). Each
# model, dtype and shape once (a pairwise cover of the 2 x 2 x 2 grid: each case
# compiles every statistic).
@pytest.mark.slow  # every statistic compiled in chunks on the transformer
@pytest.mark.parametrize(
    "name,dtype,B,chunk,loops",
    [
        ("transformer", jnp.float64, 8, 2, 4),
        ("transformer", jnp.float32, 7, 3, 2),
        ("tied", jnp.float32, 8, 2, 4),
        ("tied", jnp.float64, 7, 3, 2),
    ],
)
def test_default_is_chunked_when_activations_exceed_the_budget(monkeypatch, name, dtype, B,
                                                               chunk, loops):
    if not tiling.prefer_per_example():
        pytest.skip("auto chunking applies on CPU only")
    with M.x64() if dtype == jnp.float64 else _null():
        maker = {"transformer": M.make_transformer, "tied": M.make_tied}[name]
        loss, params, batch = maker(dtype=dtype, batch_size=B)
        jaxpr, flags = _per_example_jaxpr(loss, params, batch)
        per_ex = chunking.activation_bytes(jaxpr, flags)
        # a budget of 3 examples: balanced chunks of 2 (B = 8), or 3, 3 and 1 (B = 7)
        monkeypatch.setattr(chunking, "CPU_CHUNK_BYTES", 3 * per_ex)
        monkeypatch.setattr(chunking, "MERGE_FACTOR", 0)  # the tiny models' merges are free
        assert chunking.auto_chunk(B, per_ex) == chunk
        stats = M.all_stats()
        f = js.per_example_stat(loss, stats)
        assert _chunk_loops(loss, stats, params, batch) == {loops: 1}
        out = jax.jit(f)(params, batch)
        ora = M.oracle(loss, params, batch)
        tol = dict(rtol=1e-9, atol=1e-11) if dtype == jnp.float64 else {}
        for k in M.STAT_NAMES:  # (the whole batch against the oracle: test_oracle.py)
            M.assert_stat_close(k, out[k], ora[k], **tol)


def test_default_is_one_chunk_where_the_batch_fits():
    loss, params, batch = M.get("mlp")
    assert _chunk_loops(loss, js.stats.second_moment(), params, batch) == {}


def test_default_is_one_chunk_off_cpu(monkeypatch):
    loss, params, batch = M.get("transformer")
    monkeypatch.setattr(chunking, "CPU_CHUNK_BYTES", 1)
    monkeypatch.setattr(chunking, "MERGE_FACTOR", 0)
    stat = js.stats.second_moment()
    assert _chunk_loops(loss, stat, params, batch) == {M.B: 1}  # one example each
    monkeypatch.setattr(tiling, "prefer_per_example", lambda: False)
    assert _chunk_loops(loss, stat, params, batch) == {}


def test_default_runs_whole_where_the_allocator_keeps_memory(monkeypatch):
    """Without page faults on every call, the whole batch was the fastest on CPU
    (docs/benchmarks.md): "auto" then chunks nothing, however large the batch."""
    loss, params, batch = M.get("transformer")
    monkeypatch.setattr(chunking, "CPU_CHUNK_BYTES", 1)
    monkeypatch.setattr(chunking, "MERGE_FACTOR", 0)
    stat = js.stats.second_moment()
    assert _chunk_loops(loss, stat, params, batch) == {M.B: 1}  # refaults: chunks of 1
    monkeypatch.setattr(chunking, "temporaries_refault", lambda: False)
    assert _chunk_loops(loss, stat, params, batch) == {}
    assert chunking.resolve("auto", 64, 10**9) is None
    assert chunking.resolve(4, 64, 10**9) == 4  # an explicit chunk is kept
    report = js.explain(loss, stat)(params, batch)
    assert report.chunk_size is None
    assert any("allocator keeps freed memory" in n for n in report.notes)
    assert "allocator" in str(report)


# the probe runs while the user's function is traced (here under jit, as it would be)
_PROBE = """
import jax
from jaxpr_surgery._src import chunking
out = []
jax.jit(lambda x: (out.append(chunking.temporaries_refault()), x)[1]).lower(1.0)
print(out[0])
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the probe's two answers are set up with glibc malloc's environment",
)
def test_allocator_probe_tells_the_two_allocators_apart():
    """The probe, in fresh processes and inside a trace: glibc's default malloc maps
    a buffer above 32 MiB afresh each time (True: keep the chunks); with malloc
    keeping freed memory, the second allocation reuses the first's pages (False);
    with only mmap disabled, a thread's arena cannot hold it (True, as `grad`
    measured there)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    base.pop("GLIBC_TUNABLES", None)
    base["PYTHONPATH"] = root + os.pathsep + base.get("PYTHONPATH", "")
    base["JAX_PLATFORMS"] = "cpu"
    got = {}
    from benchmarks.run import STEADY_ALLOCATOR_ENV as steady  # the benchmark's setting

    partial = {k: v for k, v in steady.items() if k != "MALLOC_ARENA_MAX"}
    for name, extra in (("default", {}), ("steady", steady), ("partial", partial)):
        out = subprocess.run([sys.executable, "-c", _PROBE], env={**base, **extra},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got[name] = out.stdout.strip().splitlines()[-1]
    assert got == {"default": "True", "steady": "False", "partial": "True"}


@pytest.mark.parametrize("bad", ["Auto", "whole", 0, -2, 2.5, True])
def test_bad_chunk_size_is_named(bad):
    loss, params, batch = M.get("mlp")
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, None .* \"auto\""):
        js.per_example_stat(loss, js.stats.mean(), chunk_size=bad)(params, batch)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_explicit_none_runs_the_whole_batch_even_when_large(monkeypatch):
    loss, params, batch = M.get("transformer")
    monkeypatch.setattr(chunking, "CPU_CHUNK_BYTES", 1)
    monkeypatch.setattr(chunking, "MERGE_FACTOR", 0)
    g = js.per_example_stat(loss, js.stats.mean(), chunk_size=None)
    assert _chunk_loops(loss, js.stats.mean(), params, batch)  # the default: chunked
    assert _chunk_loops(loss, js.stats.mean(), params, batch, chunk_size=None) == {}
    np.testing.assert_allclose(
        jax.tree.leaves(jax.jit(g)(params, batch))[0],
        jax.tree.leaves(jax.grad(loss)(params, batch))[0], rtol=1e-5, atol=1e-6)


def test_explain_reports_the_chunk(monkeypatch):
    loss, params, batch = M.get("transformer")
    rep = js.explain(loss)(params, batch)
    assert rep.chunk_size is None and rep.activation_bytes_per_example > 0
    assert "batch run whole" in str(rep)
    if tiling.prefer_per_example():
        monkeypatch.setattr(chunking, "CPU_CHUNK_BYTES", 2 * rep.activation_bytes_per_example)
        monkeypatch.setattr(chunking, "MERGE_FACTOR", 0)
        rep2 = js.explain(loss)(params, batch)
        assert rep2.chunk_size == 2 and "chunks of 2 examples" in str(rep2)
        assert rep2.as_dict()["chunk_size"] == 2
    assert js.explain(loss, chunk_size=4)(params, batch).chunk_size == 4
    assert js.explain(loss, chunk_size=None)(params, batch).chunk_size is None
    with pytest.raises(ValueError, match="explain: chunk_size must be"):
        js.explain(loss, chunk_size="big")

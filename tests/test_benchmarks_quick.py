"""The benchmark harness: ``python -m benchmarks.run --quick`` and ``python -m benchmarks.plot``.

Runs the quick suite (tiny models, one batch size, 1-2 repeats) in a subprocess
into a temporary directory and checks the JSON/CSV schema, then renders the
markdown report from it. The quick suite is meant to take well under a minute
on an idle 2-core machine; the subprocess timeout is generous because shared CI
machines are noisy.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RESULT_KEYS = {
    "regime", "batch", "method", "statistic", "label", "ok", "error", "time_median_s",
    "time_ratio", "n_reps", "flops", "flops_ratio", "temp_bytes", "temp_ratio",
    "trace_lower_s", "compile_s", "has_loop", "microbatch_size", "minor_faults_per_call",
}
MACHINE_KEYS = {"platform", "cpu_count", "jax", "jaxlib", "optax", "device_kind", "date"}


def test_max_batch_search_affine():
    from benchmarks.sweeps import max_batch_search

    for a, b in [(1000, 3), (0, 100), (5e5, 7.3)]:
        f = lambda B, a=a, b=b: a + b * B  # noqa: E731
        budget = 2**20
        for granule in (1, 8):
            for known in ({}, {8: f(8), 32: f(32)}):
                best, capped, evals = max_batch_search(f, budget, known, granule, 1 << 20, 0.05)
                true = int((budget - a) // b) // granule * granule
                assert not capped
                assert best % granule == 0
                assert f(best) <= budget
                assert best >= 0.95 * true - granule, (a, b, granule, best, true)
                assert len(evals) <= 8
    # nothing fits / everything fits up to the cap
    assert max_batch_search(lambda B: 10**9 * B, 100, {}, 1, 1000, 0.05)[0] == 0
    best, capped, _ = max_batch_search(lambda B: 10, 100, {}, 4, 1000, 0.05)
    assert capped and best == 1000


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench")
    out = str(out_dir / "quick.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", out],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        doc = json.load(f)
    return doc, out, wall, out_dir


def test_quick_json_schema(quick_run):
    doc, out, wall, _ = quick_run
    print(f"quick benchmark suite wall time: {wall:.1f} s "
          f"(inside the process: {doc['total_wall_s']:.1f} s)")
    assert doc["schema_version"] == 1
    assert doc["quick"] is True
    assert MACHINE_KEYS <= set(doc["machine"])
    assert doc["machine"]["cpu_count"] >= 1

    rows = doc["results"]
    assert rows
    for r in rows:
        assert RESULT_KEYS <= set(r), sorted(RESULT_KEYS - set(r))
        assert r["ok"], (r["label"], r["error"])
        assert isinstance(r["temp_bytes"], int) and r["temp_bytes"] >= 0
        assert r["flops"] is None or r["flops"] >= 0
        assert r["time_median_s"] > 0 and r["n_reps"] >= 1
        assert r["compile_s"] >= 0 and r["trace_lower_s"] >= 0
        assert math.isfinite(r["time_ratio"])
        # minor page faults per timed call (counted by the OS on Linux and macOS)
        f = r["minor_faults_per_call"]
        assert f is None or (math.isfinite(f) and f >= 0)
    if sys.platform.startswith("linux"):
        assert all(r["minor_faults_per_call"] is not None for r in rows)
    assert doc["machine"]["allocator"]["mode"] in ("default", "steady")

    methods = {r["method"] for r in rows}
    assert {"grad", "js", "vmap", "micro_grad", "micro_grad_mb"} <= methods
    stats = {r["statistic"] for r in rows if r["method"] == "js"}
    assert set(doc["statistics"]) <= stats  # every statistic ran at least once
    regimes = {r["regime"] for r in rows}
    assert {"mlp", "short", "scan_remat", "matrix"} <= regimes
    for reg in regimes:
        assert reg in doc["regimes"] and doc["regimes"][reg]["info"]["n_params"] > 0
        grads = [r for r in rows if r["regime"] == reg and r["method"] == "grad"]
        assert grads
        for g in grads:
            assert g["time_ratio"] == pytest.approx(1.0)
            assert g["temp_ratio"] in (None, pytest.approx(1.0))
    mb = [r for r in rows if r["method"] == "micro_grad_mb"]
    assert all(r["microbatch_size"] >= 1 for r in mb)
    assert all(r["has_loop"] for r in mb)  # fori_loop over microbatches

    # largest batch within the budget
    assert doc["max_batch"]
    for r in doc["max_batch"]:
        assert r["error"] is None, r["error"]
        assert r["max_batch"] >= 1
        assert r["budget_bytes"] > 0
        for b, t in r["evaluations"]:
            assert t <= r["budget_bytes"] or b > r["max_batch"]

    # trace+lower of a deep unrolled model, and its target rows
    tr = doc["tracing"]
    assert tr and "error" not in tr, tr
    assert {(p["method"], p["statistic"]) for p in tr["points"]} >= {("grad", "grad"),
                                                                    ("js", "second_moment")}
    for p in tr["points"]:
        assert p["trace_lower_s"] > 0 and math.isfinite(p["ratio"])
    assert any(t["target"] == "trace_lower" and t["met"] is not None for t in doc["targets"])

    # chunk_size memory curve
    cc = doc["chunk_curve"]
    assert cc["statistic"] == "second_moment" and len(cc["points"]) >= 2
    for p in cc["points"]:
        assert p["error"] is None and p["temp_bytes"] >= 0

    # targets
    assert doc["targets"]
    kinds = {t["target"] for t in doc["targets"]}
    assert {"mlp_time", "mlp_mem", "transformer_time", "sm_vs_vmap", "fused_vs_single",
            "remat_mem"} <= kinds
    for t in doc["targets"]:
        assert t["met"] in (True, False, None)
        if t["met"] is not None:
            assert t["met"] == (t["value"] <= t["threshold"])
    fused = [t for t in doc["targets"] if t.get("vs_slower_alone") is not None]
    assert fused and all(t["target"] == "fused_vs_single" for t in fused)
    for t in fused:
        assert t["vs_slower_alone"] <= t["value"] + 1e-12  # the slower one is at least sm
    # the equal-memory floor: grad in the same chunks, beside every equal-memory row
    assert any(r["method"] == "grad_chunk" for r in rows)
    eq = [t for t in doc["targets"] if t["target"] == "equal_mem_time" and t["met"] is not None]
    assert eq
    for t in eq:
        assert t["grad_chunk_vs_micro_grad"] > 0 and t["js_chunk_vs_grad_chunk"] > 0
        assert t["value"] == pytest.approx(
            t["grad_chunk_vs_micro_grad"] * t["js_chunk_vs_grad_chunk"])


def test_chunked_grad_reference_is_the_gradient():
    """The floor's reference computes what it claims (the gradient), with chunks."""
    from benchmarks import methods, models

    m = models.transformer(T=4, d=8, V=16, layers=1, heads=2)
    b = m.make_batch(8)
    want = jax.grad(m.loss)(m.params, b)
    got = jax.jit(methods.make_method(m, "grad_chunk", "grad", 8))(m.params, b)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        methods.make_method(m, "grad_chunk", "grad", 8, microbatch_size=3)


def test_steady_allocator_settings(monkeypatch):
    """``--allocator steady`` re-runs the suite with malloc keeping freed memory: the
    mode is read back from the environment, and results go to their own file."""
    from benchmarks import run

    for k in run.STEADY_ALLOCATOR_ENV:
        monkeypatch.delenv(k, raising=False)
    assert run.allocator_info()["mode"] == "default"
    for k, v in run.STEADY_ALLOCATOR_ENV.items():
        monkeypatch.setenv(k, v)
    info = run.allocator_info()
    assert info["mode"] == "steady" and info["env"]["MALLOC_MMAP_MAX_"] == "0"
    assert run.default_out("steady").endswith("_steady_alloc.json")
    assert not run.default_out().endswith("_alloc.json")


def test_quick_csv(quick_run):
    doc, out, _, _ = quick_run
    csv_path = os.path.splitext(out)[0] + ".csv"
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(doc["results"])
    assert {"regime", "batch", "method", "statistic", "time_ratio", "temp_ratio",
            "flops_ratio"} <= set(rows[0])


def test_plot_markdown(quick_run):
    doc, out, _, out_dir = quick_run
    md = str(out_dir / "bench.md")
    from benchmarks import plot

    # the run against itself as "another jax" and as the steady-allocator run: every
    # row has the same status
    plot.main([out, "--md", md, "--img-dir", str(out_dir / "img"), "--compare", out,
               "--steady", out])
    text = open(md).read()
    assert "## Page faults: the same suite with a steady allocator" in text
    assert "| short |" in text.split("## Page faults")[1]
    assert "## Targets from the issue" in text
    assert "## Tracing cost" in text
    assert "## The same targets on jax" in text and "Rows whose status differs" not in text
    assert "| mlp |" in text
    assert "Equal memory: the floor" in text
    assert "mean+second_moment against each alone" in text
    pngs = os.listdir(out_dir / "img")
    assert any(p.startswith("bench_mlp") for p in pngs)


def test_a_regime_that_fails_to_build_is_recorded(monkeypatch, tmp_path):
    """The run goes on past a model that cannot be built: its error is in the JSON."""
    from benchmarks import regimes, run

    def broken():
        raise RuntimeError("no such model")

    monkeypatch.setattr(run, "regimes", lambda quick: {
        "broken": regimes.Regime("broken", broken, [4], "a model that fails", {})})
    out = tmp_path / "broken.json"
    doc = run.main(["--quick", "--regimes", "broken", "--out", str(out)])
    assert "RuntimeError: no such model" in doc["regimes"]["broken"]["error"]
    assert doc["results"] == [] and doc["tracing"] is None
    assert json.loads(out.read_text())["regimes"]["broken"]["description"] == "a model that fails"


def test_compile_time_quick(tmp_path):
    """The time-to-first-step benchmark (`benchmarks.compile_time`): every method of every
    regime lowered and compiled, with its ratios to grad's, in the JSON."""
    from benchmarks import compile_time

    out = tmp_path / "compile.json"
    rows = compile_time.main(["--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["rows"] == rows and doc["meta"]["jax"] == jax.__version__
    regimes = {r["regime"] for r in rows}
    assert any(r.startswith("scan") for r in regimes) and len(regimes) == 2
    for r in rows:
        assert r["compile_cpu_s"] > 0 and r["lower_cpu_s"] > 0 and r["hlo_lines"] > 0
        assert r["stablehlo_lines"] > 0 and r["fusions"] > 0
        if r["method"] != "grad":
            assert 0 < r["compile_cpu_x_grad"] < 100 and 0 < r["hlo_lines_x_grad"] < 100
            assert 0 < r["stablehlo_lines_x_grad"] < 100 and 0 < r["fusions_x_grad"] < 100


def test_compile_time_phases_quick():
    """`benchmarks.compile_time --phases`: every step it names is a function the lowering
    calls (a renamed one would time nothing), each at most the whole lowering."""
    from benchmarks import compile_time

    rows = compile_time.phases(quick=True, stats=["second_moment"])
    assert len(rows) == 2
    for r in rows:
        ph = r["phases_s"]
        assert set(ph) == set(compile_time.PHASES), r
        assert all(0 < v < r["lower_s"] for k, v in ph.items() if k != "chunk sizing"), r
        assert r["rest_s"] > 0


def test_compile_time_rerun_quick(tmp_path):
    """`benchmarks.compile_time --rerun`: a first and a second process sharing jax's
    persistent compilation cache; the second loads what the first compiled (its compile
    a fraction of the first's), in the JSON."""
    from benchmarks import compile_time

    out = tmp_path / "rerun.json"
    rows = compile_time.main(["--rerun", "--quick", "--stats", "second_moment", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["rows"] == rows and "persistent compilation cache" in doc["meta"]["note"]
    assert {r["method"] for r in rows} == {"grad", "second_moment"} and len(rows) == 4
    for r in rows:
        assert r["first_compile_s"] > 0 and r["second_lower_s"] > 0
        assert r["second_compile_s"] < 0.5 * r["first_compile_s"], r  # (loaded, not compiled)
        assert 0 < r["first_step_x_cold_grad"] < 100


def test_one_trace_prototype_is_exact():
    """The one-trace floor's prototype (`benchmarks.one_trace`): E[g^2] of every dense
    leaf it serves (each layer's attention and MLP matrices, inside jnp's jitted einsums)
    equals vmap(grad)'s, and its gradient grad's, so the floor it measures is that of a
    correct program."""
    from benchmarks import models, one_trace

    model = models.transformer(T=8, d=32, V=64, layers=2, heads=2)
    one_trace._BLOCKS.clear()
    served, err = one_trace.check(model)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(model.params)]
    # (re-evaluated; intercepted in grad's trace, calls inlined or jitted once per body;
    # intercepted under vmap of the batch-of-one loss; the batch loss evaluated in layers)
    for method in ("prototype", "intercept", "intercept-cached", "vmap-intercept-cached",
                   "+ proof online", "batch-evaluate"):
        got = sorted(names[i].split("'")[-2] for i in served[method])
        assert got == sorted(["w1", "w2", "wk", "wo", "wq", "wv"] * 2), method
    assert err < 1e-5
    # (design E's layers: the second one binds the first one's jit, the last layer's
    # outputs made those of the others)
    assert len(one_trace._BLOCKS) == 1


def test_one_trace_sites_from_online_tags_find_a_moved_batch():
    """The prototype whose sites read the batch's layout from the independence proof's
    tags, computed as the intercepted equations are recorded ("+ proof online"), serves
    layers that meet the batch folded into the rows, time-major, and inside a jitted
    layer, exactly; the prototypes that assume a leading batch axis serve none of them."""
    from benchmarks import one_trace

    model = one_trace.folded()
    served, err = one_trace.check(model)
    names = sorted(model.params)
    assert [names[i] for i in served["+ proof online"]] == ["head", "w1", "w3"]
    assert all(not served[m] for m in ("prototype", "intercept", "intercept-cached"))
    assert err < 1e-5
    proofs = one_trace.check_proofs(model)
    assert proofs == {"loss": ["independent"] * 3, "loss ** 2": ["cross-example"] * 3}


def test_batch_engine_prototype_is_exact():
    """Design E' measured with the package's rules (`benchmarks.batch_engine`): its
    engine, evaluating the batch loss's jaxpr where the package re-evaluates the
    per-example one under vmap, gives the package's statistics on an unrolled and a
    scanned transformer (so the lowering time it measures is that of a correct
    program), and it ran (not the package's own engine)."""
    from benchmarks import batch_engine, models

    for model in (models.transformer(T=8, d=32, V=64, layers=2, heads=2),
                  models.scan_remat(T=8, d=32, V=64, layers=2, heads=2)):
        before = batch_engine.COUNTS["batch"]
        assert batch_engine.check(model, ("second_moment", "clipped_mean")) < 2e-5
        assert batch_engine.COUNTS["batch"] >= before + 2


def test_tp_recompute_prototype_is_exact():
    """The tensor-parallel clipped mean's prototype (`benchmarks.tp_recompute`): keeping
    every site's input and cotangent, and recomputing the blocks' inner ones from the
    residual stream's, both give vmap(grad)'s clipped mean (so the memory it measures is
    that of a correct program)."""
    from benchmarks import tp_recompute

    errors = tp_recompute.check()
    assert set(errors) == {"keep", "recompute"}
    assert max(errors.values()) < 2e-5, errors


def test_one_trace_quick(tmp_path):
    """`benchmarks.one_trace --quick`: every method of both regimes lowered and compiled,
    the prototype checked, all in the JSON."""
    from benchmarks import one_trace

    out = tmp_path / "one_trace.json"
    rows, checks = one_trace.main(["--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["rows"] == rows and doc["checks"] == checks
    assert {r["method"] for r in rows} == {"grad", "trace", "re-evaluate", "prototype",
                                           "intercept", "intercept-cached", "+ proof traced",
                                           "+ proof from stream", "+ proof online", "vmap",
                                           "vmap-intercept-cached", "batch-evaluate",
                                           "batch-evaluate + proof", "package"}
    assert all(c["max_rel_error"] < 1e-5 for c in checks.values())
    # (the proof from the intercepted equations decides as the proof from a trace: a
    # model's loss independent, its square not a mean of per-example terms)
    for c in checks.values():
        assert c["proofs"] == {"loss": ["independent"] * 3,
                               "loss ** 2": ["cross-example"] * 3}, c["proofs"]
    # (the scan stack's layers: served by the prototypes that enter its scan)
    scan = checks["scan L2"]["served"]
    assert (scan["prototype"] == scan["intercept-cached"] == scan["vmap-intercept-cached"]
            == scan["+ proof online"] == scan["batch-evaluate"] != [] == scan["intercept"])
    for r in rows:
        if r["method"] != "grad":
            assert 0 < r["lower_cpu_x_grad"] < 100 and 0 < r["lower_thread_x_grad"] < 100
            assert 0 < r["trace_thread_x_grad"] < 100

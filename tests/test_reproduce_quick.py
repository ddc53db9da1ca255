"""Smoke test of the reproduction script: ``python -m examples.reproduce --quick``.

Runs the quick mode (tiny model, two seeds, two learning rates, a few steps;
about half a minute on an idle 2-core machine, most of it XLA compilation) in a
subprocess writing into ``tmp_path``, then checks the JSON structure, the
design (paired seeds, rate grids, the sqrt rule's hyperparameters, equal
examples seen), the intervals and that every figure exists.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zoo

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

SIGN = {"per_example_sign_sgd", "sign_sgd", "ema_of_sign", "sign_ema"}
ADAM = ["micro_adam_msq", "adam", "micro_adam", "micro_adam_var"]
FIGURES = {"study_sign.png", "study_adam.png", "study_sign_fidelity.png", "study_sqrt_b.png"}
RUN_KEYS = {"label", "lr", "seed", "batch_size", "steps", "diverged", "final_eval_loss", "eval",
            "fidelity", "hp", "seconds"}


def _run_module(*args):
    """``python -m ARGS`` from the checkout, with XLA_FLAGS left to the module."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce_quick")
    t0 = time.perf_counter()
    proc = _run_module("examples.reproduce", "--quick", "--out", str(out))
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"quick mode took {seconds:.1f} s")
    return out, json.loads((out / "study.json").read_text())


def _check_runs(runs, labels, cfg, lrs):
    assert {r["label"] for r in runs} == set(labels)
    assert len(runs) == len(labels) * len(lrs) * len(cfg["seeds"])
    for r in runs:
        assert RUN_KEYS <= set(r), RUN_KEYS - set(r)
        assert r["lr"] in lrs
        if not r["diverged"]:
            assert r["eval"][-1]["step"] == r["steps"]
            assert math.isfinite(r["final_eval_loss"])
            assert r["final_eval_loss"] == r["eval"][-1]["loss"]
            assert all(e["examples"] == e["step"] * r["batch_size"] for e in r["eval"])


def _check_best(best, labels, lrs):
    assert set(best) == set(labels)
    for b in best.values():
        assert b["lr"] in lrs and isinstance(b["interior"], bool)
        assert math.isclose(b["loss"], min(b["by_lr"].values()))


def _check_diff(d, n_seeds):
    lo, hi = d["ci95"]
    assert lo <= d["mean"] <= hi and len(d["per_seed"]) == n_seeds
    assert d["decided"] == (hi < 0 or lo > 0)


def test_quick_study(quick_run):
    out, doc = quick_run
    cfg = doc["config"]
    assert set(doc["experiments"]) == {"sign", "adam", "sqrt_b"}
    assert {p.name for p in out.glob("*.png")} >= FIGURES
    sign = doc["experiments"]["sign"]
    labels = sorted(SIGN) + [f"sign_ema b1={b:g}" for b in cfg["sign_ema_betas"]]
    _check_runs(sign["runs"], labels, cfg, cfg["sign_lrs"])
    _check_best(sign["best"], labels, cfg["sign_lrs"])
    for d in sign["differences"].values():
        _check_diff(d, len(cfg["seeds"]))
    for f in sign["fidelity"].values():  # agreements are fractions
        assert all(0 <= v <= 1 for v in f.values())
    assert sign["verdict"].split(":")[0] in ("reproduced", "contradicted", "undecided")
    adam = doc["experiments"]["adam"]
    _check_runs(adam["runs"], ADAM, cfg, cfg["adam_lrs"])
    _check_best(adam["best"], ADAM, cfg["adam_lrs"])
    assert set(adam["dose_response"]) == {f"{b} - {a}" for a, b in zip(ADAM, ADAM[1:])}
    sq = doc["experiments"]["sqrt_b"]
    B0, lr0 = sq["base_batch_size"], sq["base_lr"]
    assert lr0 == adam["best"]["adam"]["lr"]
    examples = {r["steps"] * r["batch_size"] for r in sq["runs"]}
    assert len(examples) == 1  # every batch size sees the same number of examples
    for r in sq["runs"]:
        kappa = r["batch_size"] / B0
        want = lr0 * math.sqrt(kappa) if r["rule"] == "sqrt" else lr0
        assert math.isclose(r["lr"], want, rel_tol=1e-9)
        if r["rule"] == "sqrt":  # the full rule: EMA horizons and eps too
            assert math.isclose(1 - r["hp"]["b2"], kappa * (1 - cfg["b2"]), rel_tol=1e-9)
            assert math.isclose(r["hp"]["eps"], 1e-8 / math.sqrt(kappa), rel_tol=1e-9)
    _check_diff(sq["sqrt_minus_constant_spread"], len(cfg["seeds"]))


def test_resume_keeps_finished_experiments(quick_run, tmp_path):
    out, doc = quick_run
    (tmp_path / "study.json").write_text(json.dumps(doc))
    proc = _run_module("examples.reproduce", "--quick", "--resume", "--experiments",
                       "sign", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((tmp_path / "study.json").read_text())
    assert again["experiments"]["sign"]["runs"] == doc["experiments"]["sign"]["runs"]


def test_resume_after_widening_a_grid_reuses_runs(quick_run, tmp_path):
    """A study whose grid was narrower: --resume redoes the summaries, reuses every finished
    run and trains only the new rate."""
    out, doc = quick_run
    cfg = doc["config"]
    lo, hi = cfg["sign_lrs"]
    old = json.loads(json.dumps(doc))
    old["config"]["sign_lrs"] = [lo]
    sign = old["experiments"]["sign"]
    sign["runs"] = [r for r in sign["runs"] if r["lr"] == lo]
    (tmp_path / "study.json").write_text(json.dumps(old))
    proc = _run_module("examples.reproduce", "--quick", "--resume", "--experiments",
                       "sign", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    n_old = len(sign["runs"])
    assert f"reused {n_old} runs" in proc.stdout, proc.stdout[-2000:]
    again = json.loads((tmp_path / "study.json").read_text())
    assert again["config"]["sign_lrs"] == [lo, hi]
    runs = again["experiments"]["sign"]["runs"]
    assert [r for r in runs if r["lr"] == lo] == sign["runs"]  # reused as they were
    assert len([r for r in runs if r["lr"] == hi]) == n_old  # the new rate, every label/seed
    assert set(again["experiments"]["sign"]["best"]) == set(sign["best"])


def test_reusable_runs_need_the_same_model_and_data(quick_run):
    sys.path.insert(0, str(ROOT))
    try:
        from examples.reproduce import study
    finally:
        sys.path.remove(str(ROOT))
    _, doc = quick_run
    n = sum(len(e["runs"]) for e in doc["experiments"].values())
    cfg, data = dict(doc["config"]), doc["data"]
    assert len(study.reusable_runs(doc, dict(cfg, seeds=[0, 1, 2], adam_lrs=[1.0]), data)) == n
    assert study.reusable_runs(doc, dict(cfg, d=cfg["d"] * 2), data) == []
    assert study.reusable_runs(doc, dict(cfg, steps=cfg["steps"] + 1), data) == []
    assert study.reusable_runs(doc, cfg, dict(data, train_bytes=1)) == []


def test_files_on_command_line(tmp_path):
    """Text files given on the command line replace the standard library (data only)."""
    sys.path.insert(0, str(ROOT))
    try:
        from examples.reproduce.data import load_corpus
    finally:
        sys.path.remove(str(ROOT))
    files = []
    for i in range(12):
        p = tmp_path / f"f{i:02d}.txt"
        p.write_bytes(bytes([65 + i]) * 500)
        files.append(p)
    corpus = load_corpus(files, max_bytes=10**6, heldout_every=10)
    assert corpus.n_heldout_files == 1 and corpus.n_train_files == 11
    assert set(corpus.heldout.tolist()) == {65 + 9}  # the 10th file, by file
    ids = corpus.heldout_windows(4, 16)["ids"]
    assert ids.shape == (4, 17)


def test_shampoo_study_quick(tmp_path):
    """``python -m examples.reproduce.shampoo --quick``: paired runs, best rates, intervals."""
    proc = _run_module("examples.reproduce.shampoo", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "shampoo.json").read_text())
    cfg = doc["config"]
    names = {"shampoo_per_example", "shampoo_classic", "adam", "micro_adam"}
    assert {r["optimizer"] for r in doc["runs"]} == names
    n_lrs = len(cfg["shampoo_lrs"])
    assert len(doc["runs"]) == len(cfg["seeds"]) * 4 * n_lrs
    best = doc["summary"]["best"]
    assert set(best) == names
    for name, b in best.items():
        assert b["lr"] in (cfg["shampoo_lrs"] if name.startswith("shampoo") else cfg["adam_lrs"])
        assert isinstance(b["interior"], bool)
    pairs = doc["summary"]["paired_differences"]
    assert set(pairs) == {"shampoo_per_example - shampoo_classic", "micro_adam - adam"}
    for p in pairs.values():
        lo, hi = p["ci95"]
        assert lo <= p["mean"] <= hi and len(p["per_seed"]) == len(cfg["seeds"])


def test_research_stats_quick(tmp_path):
    """``python -m examples.research_stats --quick``: the figure and a sane record."""
    proc = _run_module("examples.research_stats", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "research_stats.png").stat().st_size > 10_000
    doc = json.loads((tmp_path / "research_stats.json").read_text())
    cfg = doc["config"]
    assert [r["step"] for r in doc["records"]] == list(
        range(0, cfg["steps"] + 1, cfg["measure_every"]))
    for r in doc["records"]:
        assert len(r["cosines"]) == cfg["batch_size"]
        assert all(-1 - 1e-6 <= c <= 1 + 1e-6 for c in r["cosines"])
        for q in [r["global_norm_quantiles"], *r["norm_quantiles"].values()]:
            assert 0 <= q[0] <= q[1] <= q[2]
        assert r["diversity"] >= 1 / cfg["batch_size"] - 1e-6
        assert r["trace_cov"] > 0


def test_research_stats_match_vmap_grad():
    """The example's one-pass measurement against per-example gradients from vmap(grad)."""
    sys.path.insert(0, str(ROOT))
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np

        from examples import research_stats as rs
        from examples.reproduce import model
    finally:
        sys.path.remove(str(ROOT))
    cfg = rs.QUICK
    params = model.init_params(jax.random.PRNGKey(1), **cfg.model_cfg())
    r = np.random.default_rng(0)
    batch = {"ids": jnp.asarray(r.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1)),
                                jnp.int32)}
    ref = jax.tree.map(lambda x: jnp.asarray(r.standard_normal(x.shape), x.dtype), params)
    got = rs.measure_fn(cfg)(params, batch, ref)
    np.testing.assert_allclose(got["loss"], model.loss_fn(params, batch), rtol=1e-5)
    g = zoo.vmap_grads(model.loss_fn, params, batch)
    o = functools.partial(zoo.oracle_from_grads, g)  # the suite's oracle (tests/zoo.py)
    np.testing.assert_allclose(got["cosines"], o("per_example_cosines", reference=ref),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["global_norms"], o("norm_quantiles", q=rs.Q, per_leaf=False),
                               rtol=1e-4)
    np.testing.assert_allclose(got["norms"]["blocks"][0]["w1"],
                               o("norm_quantiles", q=rs.Q)["blocks"][0]["w1"], rtol=1e-4)
    np.testing.assert_allclose(got["diversity"], o("gradient_diversity"), rtol=1e-4)
    B = cfg.batch_size
    tr = sum(np.sum(v) for v in jax.tree.leaves(o("variance")))
    np.testing.assert_allclose(got["noise"].trace_cov, tr, rtol=1e-4)
    g2 = sum(np.sum(m**2) for m in jax.tree.leaves(o("mean"))) - tr / B
    np.testing.assert_allclose(got["noise"].grad_sq_norm, g2, rtol=1e-3)
    np.testing.assert_allclose(got["kurtosis"]["blocks"][0]["w1"],
                               np.nanmedian(o("kurtosis")["blocks"][0]["w1"]), rtol=1e-3)

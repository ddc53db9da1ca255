"""Smoke test of the reproduction script: ``python -m examples.reproduce --quick``.

Runs the quick mode (tiny model, one seed, two learning rates, a few steps;
well under a minute on an idle 2-core machine, most of it XLA compilation) in a
subprocess writing into ``tmp_path``, then checks the JSON structure and that
every figure exists.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

SIGN = {"per_example_sign_sgd", "sign_sgd", "ema_of_sign", "sign_ema"}
ADAM = {"adam", "micro_adam", "micro_adam_var", "micro_adam_msq"}
FIGURES = {
    "sign": {"sign_loss_curves.png", "sign_lr_sensitivity.png", "sign_snr.png"},
    "adam": {"adam_loss_curves.png", "adam_lr_sensitivity.png", "adam_snr.png"},
    "batch": {"batch_size.png"},
}
RUN_KEYS = {"optimizer", "clip", "label", "lr", "seed", "batch_size", "steps", "diverged", "spikes",
            "final_eval_loss", "train_loss", "eval", "snr", "seconds"}
SNR_KEYS = {"step", "noise_scale", "snr_aggregate_per_example",
            "snr_median_per_example", "snr_median_batch_mean", "snr_median_ema",
            "sign_fidelity_per_example", "sign_fidelity_batch_mean", "sign_fidelity_ema"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce_quick")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "examples.reproduce", "--quick", "--no-progress", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"quick mode took {seconds:.1f} s")
    return out


def _check_runs(runs, optimizers, n_lrs):
    assert runs
    assert {r["optimizer"] for r in runs} == optimizers
    for r in runs:
        assert RUN_KEYS <= set(r), set(r) ^ RUN_KEYS
        assert r["steps"] >= 1 and r["batch_size"] >= 2
        if not r["diverged"]:
            assert len(r["train_loss"]) == r["steps"]
            assert r["eval"] and r["eval"][-1]["step"] == r["steps"]
            assert math.isfinite(r["final_eval_loss"])
            assert math.isclose(r["final_eval_loss"], r["eval"][-1]["loss"], abs_tol=1e-4)
            assert r["snr"] and SNR_KEYS <= set(r["snr"][-1])
        else:
            assert r["final_eval_loss"] is None  # NaN is written as null
    lrs_per_label = {}
    for r in runs:
        lrs_per_label.setdefault(r["label"], set()).add(r["lr"])
    assert all(len(v) == n_lrs for v in lrs_per_label.values())


def _check_summary(summary, labels):
    assert set(summary["best"]) == labels
    assert set(summary["by_lr"]) == labels
    assert sorted(summary["ranking"]) == sorted(labels)
    for label, best in summary["best"].items():
        assert best["loss"] <= math.log(256) + 1e-6
        assert min(row["mean"] for row in summary["by_lr"][label].values()) == best["loss"]


def test_quick_outputs(quick_run):
    out = quick_run
    meta = json.loads((out / "results.json").read_text())
    assert meta["quick"] is True
    assert set(meta["experiments"]) == {"sign", "adam", "batch"}
    assert meta["model"]["n_params"] > 0
    assert meta["data"]["train_bytes"] > 0 and meta["data"]["heldout_bytes"] > 0
    assert meta["data"]["heldout_files"] >= 1
    cfg = meta["config"]
    for name, figs in FIGURES.items():
        entry = meta["experiments"][name]
        assert set(entry["figures"]) == figs
        for fig in figs:
            path = out / fig
            assert path.exists() and path.stat().st_size > 1000, fig
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / entry["json"]).exists()

    sign = json.loads((out / "sign.json").read_text())
    _check_runs(sign["runs"], SIGN, len(cfg["sign_lrs"]))
    _check_summary(sign["summary"], SIGN)
    assert set(sign["snr_vs_outcome"]) == SIGN
    for label, d in sign["snr_vs_outcome"].items():
        assert d["placement"] == sign["placement"][label]
    assert isinstance(sign["latest_placement_wins"], bool)

    adam = json.loads((out / "adam.json").read_text())
    _check_runs(adam["runs"], ADAM, len(cfg["adam_lrs"]))
    labels = ADAM | {a + " +clip" for a in ADAM}
    _check_summary(adam["summary"], labels)
    assert adam["clip"]["where"].startswith("update")

    batch = json.loads((out / "batch.json").read_text())
    assert batch["batch_sizes"] == cfg["batch_sizes"]
    assert batch["lr_rules"] == cfg["batch_lr_rules"] == ["sqrt", "constant"]
    assert set(batch["settings"]) == set(cfg["batch_optimizers"])
    assert set(batch["summary"]) == set(batch["lr_rules"])
    for by_name in batch["summary"].values():
        assert set(by_name) == set(cfg["batch_optimizers"])
        for by_b in by_name.values():
            assert set(by_b) == {str(b) for b in cfg["batch_sizes"]}
    # sqrt rule: lr(B) = base_lr * sqrt(B / B0); control: lr(B) = base_lr; steps * B constant
    B0 = batch["base_batch_size"]
    for r in batch["runs"]:
        base = batch["settings"][r["optimizer"]]["base_lr"]
        factor = math.sqrt(r["batch_size"] / B0) if r["lr_rule"] == "sqrt" else 1.0
        assert math.isclose(r["lr"], base * factor, rel_tol=1e-6)
        assert r["steps"] * r["batch_size"] == batch["examples_budget"]
    n = len(cfg["batch_optimizers"]) * len(cfg["batch_sizes"]) * len(batch["lr_rules"])
    assert len(batch["runs"]) == n * len(cfg["seeds"])


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
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "examples.reproduce.shampoo", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
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

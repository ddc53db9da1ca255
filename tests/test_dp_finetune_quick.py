"""Smoke test of the private fine-tune: ``python -m examples.dp_finetune --quick``.

Runs the quick mode (a tiny LM pre-trained for a few steps, LoRA adapters fine-tuned
under DP and without; about 15 s on an idle 2-core machine, most of it XLA compilation)
in a subprocess writing into ``tmp_path``, then checks the record: the epsilon spent
along the run is dp_accounting's for the calibrated noise, rises to at most the target,
and every evaluation is sane; the figure exists. A second test checks the example's
private step against ``vmap(grad)``: its clipped sum of the LoRA adapters' per-example
gradients (global and per-layer bounds) is the one computed by hand.
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

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")
pytest.importorskip("dp_accounting")


def _import_example():
    sys.path.insert(0, str(ROOT))
    try:
        from examples import dp_finetune
    finally:
        sys.path.remove(str(ROOT))
    return dp_finetune


def test_dp_finetune_quick(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "examples.dp_finetune", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    print(f"quick mode took {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "dp_finetune.png").stat().st_size > 10_000
    doc = json.loads((tmp_path / "dp_finetune.json").read_text())
    cfg = doc["config"]

    import jaxpr_surgery as js

    z, q = doc["noise_multiplier"], doc["sampling_probability"]
    assert z > 0 and q == cfg["expected_batch"] / doc["private_examples"]
    steps = [r["step"] for r in doc["dp"]]
    assert steps[0] == 0 and steps[-1] == cfg["finetune_steps"]
    assert steps == [r["step"] for r in doc["non_private"]]
    eps = [r["epsilon"] for r in doc["dp"]]
    assert eps[0] == 0 and all(a < b for a, b in zip(eps, eps[1:]))
    assert eps[-1] <= cfg["target_epsilon"]
    assert eps[-1] == pytest.approx(js.privacy.epsilon(
        noise_multiplier=z, sampling_probability=q, steps=cfg["finetune_steps"],
        delta=cfg["delta"]), rel=1e-9)
    # calibrated: 1% less noise would overspend
    assert js.privacy.epsilon(noise_multiplier=z / 1.01, sampling_probability=q,
                              steps=cfg["finetune_steps"],
                              delta=cfg["delta"]) > cfg["target_epsilon"]
    for r in doc["dp"] + doc["non_private"]:
        assert 1 < r["perplexity"] < 300
        assert math.isclose(r["perplexity"], math.exp(r["loss"]), rel_tol=1e-6)
        assert 0 <= r["accuracy"] <= 1
    # the adapters start as the base model (B = 0): step 0 is the pre-trained model
    for key in ("dp", "non_private"):
        assert doc[key][0]["loss"] == pytest.approx(doc["final"]["pretrained"]["loss"])
    assert doc["sensitivity"] > 0


@pytest.mark.parametrize("clipping", ["global", "per-layer"])
def test_dp_finetune_private_step_matches_vmap_grad(clipping):
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxpr_surgery as js

    ex = _import_example()
    cfg = dataclasses.replace(ex.QUICK, clipping=clipping)
    base = ex.model.init_params(jax.random.PRNGKey(1), **cfg.model_cfg())
    adapters = ex.init_adapters(jax.random.PRNGKey(2), base, cfg.rank)
    # B != 0, so that every adapter has a gradient
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(3),
                                                                   x.shape), adapters)
    r = np.random.default_rng(0)
    batch = {"ids": jnp.asarray(r.integers(0, 256, (6, cfg.seq_len + 1)), jnp.int32)}
    bounds = ex.clip_bounds(cfg, adapters, base, batch)
    got = js.per_example_stat(ex.lora_loss, js.stats.clipped_sum(bounds))(
        adapters, batch, base)

    one = lambda a, x: ex.lora_loss(a, {"ids": x[None]}, base)  # noqa: E731
    g = jax.vmap(jax.grad(one), (None, 0))(adapters, batch["ids"])

    def clip(sub, C):
        n = jnp.sqrt(sum(jnp.sum(x.reshape(6, -1) ** 2, 1) for x in jax.tree.leaves(sub)))
        f = jnp.minimum(1.0, C / n)
        return jax.tree.map(lambda x: jnp.tensordot(f, x, 1), sub)

    if clipping == "global":
        assert isinstance(bounds, float)
        want = clip(g, bounds)
    else:
        want = {"blocks": [{n: clip(gb[n], cb[n]) for n in ex.ADAPTED}
                           for gb, cb in zip(g["blocks"], bounds["blocks"])]}
        assert js.optim.dp_sensitivity(bounds) == pytest.approx(
            float(js.per_example_stat(ex.lora_loss, js.stats.norm_quantiles(
                0.5, per_leaf=False))(adapters, batch, base)), rel=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)

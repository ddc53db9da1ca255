"""The README's first command: ``python examples/demo.py`` runs every step (``--quick``:
tiny sizes, one timing call) and prints the ratios it measured."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpr_surgery as js  # noqa: E402
from examples import demo  # noqa: E402


def test_demo_quick_runs_every_step(capsys):
    demo.main(["--quick", "--batch-size", "4", "--seq", "8"])
    out = capsys.readouterr().out
    assert "== explain" in out and "== check against jax.vmap" in out
    table = out.split("== check")[0]
    assert max(map(len, table.splitlines())) <= 100, table  # explain fits a terminal
    for name in demo.six_statistics():  # checked against vmap(grad), and named in explain
        assert re.search(rf"^{name}\s", out, re.M), name
    assert out.count("jax.grad (the mean only)") == 2  # both regimes timed
    for method in ("jaxpr_surgery, 6 statistics", "vmap(grad) + reductions, same 6",
                   "optax micro_grad, same 6"):
        assert out.count(method) == 2, method
    # ratios are measured: a number, never a placeholder
    assert len(re.findall(r"takes [0-9.e+-]+x the time of (vmap\(grad\)|micro_grad)", out)) >= 2
    # the noise scale is a number with its pieces, or undefined with the reason (these
    # tiny sizes leave it undefined): never a bare inf
    para = re.search(r"^  noise scale (\S+) .*?(?=\n\n)", out, re.M | re.S)
    assert para, out
    text = " ".join(para[0].split())
    if para[1] == "inf":
        assert "(undefined)" in text and "is not positive" in text, text
    else:
        assert math.isfinite(float(para[1])) and "tr(Sigma) / |G|^2 = " in text, text
    assert not re.search(r"^\S+\s+(inf|nan)\b", out, re.M), out


def test_demo_noise_scale_is_defined_on_its_own_model():
    """At the demo's default sizes the first figure it prints is a number: its token ids
    follow a Zipf law, a signal the model at initialisation has not learnt (uniformly
    random ids carry none; the noise scale was inf)."""
    c = jax.jit(js.per_example_stat(demo.loss_fn, js.stats.noise_scale_components()))(
        *demo.transformer_problem())
    assert float(c.batch_size) == 16
    # the signal is not marginal: |G|^2 well above the noise tr(Sigma)/B of the batch mean
    assert float(c.grad_sq_norm) > 0.5 * float(c.trace_cov) / 16, c
    assert 0 < float(c.noise_scale) < math.inf
    assert str(c).startswith(f"noise scale {float(c.noise_scale):.4g} = "), str(c)

"""The README's first command: ``python examples/demo.py`` runs every step (``--quick``:
tiny sizes, one timing call) and prints the ratios it measured."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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

"""Random models (`_random_models`) with their parameters and batch sharded by XLA's
partitioner on 8 CPU devices: a mesh of 8 x 1, 4 x 2, 2 x 4 or 1 x 8 (Auto or Explicit
axes), each parameter split on up to two of its axes (where the mesh's axis divides it)
or replicated, the batch split over one axis or replicated; against the oracle on one
device.

Run as a script (tests/test_random_models.py does, in a subprocess: the device count is
set before jax starts): one JSON line per case given, a seed (a model of the first
family of blocks), ``more<seed>`` (of both families, ``_random_models.MORE_KINDS``) or
``layers<seed>`` (stacks of transformer layers under ``lax.scan``, whose clipped sums
recompute their layers' inner values: ``_random_models.LAYER_KINDS``).
"""

from __future__ import annotations

import json
import os
import random
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import _random_models as R  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpr_surgery as js  # noqa: E402

WIDTHS = (4, 8, 8, 16)  # (divisible by the mesh's axes)


def placement(seed, params, B, mesh):
    """``(parameter shardings, batch sharding)`` drawn for ``seed``."""
    r = random.Random(seed * 101 + 3)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))

    def one(x):
        spec = [None] * x.ndim
        if x.ndim and r.random() < 0.8:
            for _ in range(2):
                ax, name = r.randrange(x.ndim), r.choice(list(sizes))
                if x.shape[ax] % sizes[name] == 0 and spec[ax] is None and name not in spec:
                    spec[ax] = name
        return NamedSharding(mesh, P(*spec))

    ps = jax.tree.map(one, params)
    name = r.choice([None, "data", "model"])
    batch = NamedSharding(mesh, P(name) if name and B % sizes[name] == 0 else P())
    return ps, batch


def run(case):
    more, layers = case.startswith("more"), case.startswith("layers")
    seed = int(case[4:] if more else case[6:] if layers else case)
    r = random.Random(seed + 9)
    shape = random.Random(seed).choice([(2, 4), (4, 2), (8, 1), (1, 8)])
    kind = random.Random(seed * 17 + 1).choice(["Auto", "Auto", "Explicit"])
    mesh = jax.make_mesh(shape, ("data", "model"),
                         axis_types=(getattr(jax.sharding.AxisType, kind),) * 2)
    kinds = R.KINDS + R.MORE_KINDS if more else R.LAYER_KINDS if layers else R.KINDS
    loss, p, batch_of, desc = R.make_model(seed, jnp.float64, widths=WIDTHS, kinds=kinds)
    _, chunk, budget, weights, req, kws = R.draw_call(seed)
    B = r.choice([2, 4, 6, 8] if layers else [2, 3, 4, 6, 8])
    weights = R.resized(weights, B)
    if layers and not any(k[0].startswith("clipped") for k in kws.values()):
        # (what the layers' recompute serves: a clipped sum, the batch split by device)
        clip = 0.05 * r.choice([0.1, 1.0, 10.0])
        req["clipped_sum"] = js.stats.clipped_sum(clip)
        kws["clipped_sum"] = ("clipped_sum", {"clip_norm": clip})
    if not req:
        return {"case": case, "bad": [], "desc": desc}
    batch = batch_of(B)
    ps, bs = placement(seed, p, B, mesh)
    # (on an Auto mesh with the batch split, the activations may be constrained to the
    # batch's axis, as MaxText constrains them: the oracle is the unconstrained twin's)
    over = tuple(bs.spec)[0] if tuple(bs.spec) else None
    constrained = kind == "Auto" and over is not None and random.Random(seed * 7 + 5).random() < 0.5
    if constrained:
        def c(h):
            spec = P(over, *[None] * (h.ndim - 1))
            return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, spec))
        closs = R.make_model(seed, jnp.float64, widths=WIDTHS, kinds=kinds, constrain=c)[0]
    else:
        closs = loss
    kw = {} if weights is None else {"example_weights": jnp.asarray(weights)}
    fn = js.per_example_stat(closs, req, chunk_size=chunk, memory_budget_bytes=budget)
    got = jax.jit(fn)(jax.device_put(p, ps), jax.device_put(batch, bs), **kw)
    bad = R.mismatches(got, R.per_example_grads(loss, p, batch), kws, weights,
                       not R.lower_precision(desc))
    where = [f"mesh {shape} {kind}", f"B {B}", f"chunk_size {chunk}", f"budget {budget}",
             "weights" if weights is not None else "no weights",
             "activations constrained" if constrained else "unconstrained",
             "specs " + " ".join(str(s.spec) for s in jax.tree.leaves(ps))]
    return {"case": case, "bad": bad, "desc": desc + where}


if __name__ == "__main__":
    for s in sys.argv[1:]:
        try:
            out = run(s)
        except Exception as e:  # noqa: BLE001
            out = {"case": s, "crash": f"{type(e).__name__}: {str(e)[:600]}"}
        print(json.dumps(out), flush=True)

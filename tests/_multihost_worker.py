"""One of two processes of four CPU devices each (jax.distributed, gloo collectives):
FSDP under XLA's partitioner over the 8 devices of both. Run by tests/test_gspmd.py;
prints one JSON line: each statistic's largest error against the same statistic
computed by this process alone, unsharded (float64)."""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402


def main(pid, port):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=pid)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpr_surgery as js

    r = np.random.default_rng(0)
    params = {"w1": r.normal(size=(16, 32)) / 4, "b1": r.normal(size=32) / 4,
              "w2": r.normal(size=(32, 8)) / 6}
    batch = {"x": r.normal(size=(16, 16)), "y": r.normal(size=(16, 8))}

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2)

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs = {"w1": P(None, "fsdp"), "b1": P(), "w2": P("fsdp", None)}

    def place(x, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

    p = {k: place(v, specs[k]) for k, v in params.items()}
    b = {k: place(v, P(("data", "fsdp"))) for k, v in batch.items()}
    stats = {"mean": js.stats.mean(), "variance": js.stats.variance(),
             "sq_norms": js.stats.sq_norms(), "clipped_mean": js.stats.clipped_mean(0.3),
             "kurtosis": js.stats.kurtosis()}
    errs = {}
    for name, st in stats.items():
        got = jax.jit(js.per_example_stat(loss, st, chunk_size=3))(p, b)
        got = multihost_utils.process_allgather(got, tiled=True)
        want = js.per_example_stat(loss, st)(jax.tree.map(jnp.asarray, params),
                                             jax.tree.map(jnp.asarray, batch))
        errs[name] = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w)))
                               / max(float(np.max(np.abs(np.asarray(w)))), 1e-30))
                         for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print("RESULT " + json.dumps({"process": pid, "devices": jax.device_count(),
                                  "errors": errs}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])

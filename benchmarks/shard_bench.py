"""Sharded models: each statistic's collective bytes and per-device temporary memory
against ``jax.grad``'s, on 8 simulated CPU devices. Compile only (nothing runs).

Setups (XLA's partitioner: ``jax.jit`` with ``NamedSharding``, out_shardings like the
parameters): ``fsdp`` (a (2, 4) mesh ('data', 'fsdp'), every matrix sharded over 'fsdp'
on its largest axis 4 divides, the batch over both axes), ``tp`` (Megatron tensor
parallelism over 'model', the batch over 'data'), ``2d`` (FSDP over 'fsdp' and TP over
'model' on a (4, 2) mesh). And FSDP written for the mesh, each weight sharded as in
``fsdp`` and gathered whole before the loss runs: ``fsdp-shard_map`` (by hand inside
``shard_map``, ``jax.lax.all_gather(w, 'fsdp', tiled=True)``, ``axis_name`` the batch's
axes; grad is ``jax.grad`` under the same ``shard_map``) and ``fsdp-explicit`` (sharding
in types: an Explicit mesh, ``jax.sharding.reshard(w, P())``, the embedding lookup's
``out_sharding`` said). And ``fsdp-constrained`` / ``tp-constrained`` /
``2d-constrained``: ``fsdp`` / ``tp`` / ``2d`` with the model's residual stream
constrained to the batch's axes after the lookup and every block
(``with_sharding_constraint(h, P(batch_axes, None, None))``, as MaxText's logical axis
rules constrain activations). Models: the transformer of ``benchmarks.models`` (tied
embedding, layers by a Python loop) and its scan-over-layers twin (``scan_remat``).
Chunks: the whole batch (``chunk_size=None``) and the default (``"auto"``).

Collective bytes are the result sizes of all-gather / all-reduce / reduce-scatter /
all-to-all / collective-permute ops in the compiled module, *executed*: each
computation's ops times the number of times it runs (a while loop's body times its
known trip count), so a chunk or tile loop pays per iteration; a loop whose trip count is
not known when compiled counts once (the flagged examples' recompute, norms.py, which
usually runs no trip). Temporary memory is
``compiled.memory_analysis().temp_size_in_bytes`` (per device). "remat" counts XLA's
"Involuntary full rematerialization" warnings while the program compiles.

    python -m benchmarks.shard_bench [--quick | --size issue] [--setups fsdp,tp,...]
        [--models scan,...] [--out benchmarks/results/cpu_shard.json]

``--size issue`` measures issue 59's own model (T 256, d 1024, 16 heads, 4 layers, B 16;
V 32768) instead of the default (T 128, d 512, 8 heads, 4 layers, B 16, V 16384).

Issue 59's targets (for XLA's partitioner; the written setups are measured against the
same): collective bytes <= 1.25x grad's for single-reduction statistics
(1.6x variance, 2.8x kurtosis), temp memory <= 1.25x, no involuntary rematerialization
where grad has none (``../shared/bench/shard_check.py`` checks them on scale_check's
model).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

LIMITS = {"mean": 1.25, "second_moment": 1.25, "sign_mean": 1.25, "sq_norms": 1.25,
          "clipped_mean": 1.25, "variance": 1.6, "kurtosis": 2.8}
TEMP_LIMIT = 1.25

_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_COLL = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(all-gather|all-reduce|"
                   r"reduce-scatter|all-to-all|collective-permute)(-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_CALLS = ("calls", "branch_computations", "called_computations", "true_computation",
          "false_computation")


def _nbytes(text):
    total = 0
    for dt, dims in _ARRAY.findall(text):
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        total += _BYTES[dt] * n
    return total


def collective_bytes(hlo: str) -> tuple[int, int]:
    """``(static, executed)`` result bytes of the collectives in a compiled module's text
    (``compiled.as_text()``): executed counts a while loop's body times its known trip
    count, and every computation called from another as often as its caller runs."""
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        h = _HEADER.match(line)
        if h and not line.startswith(" "):
            cur = h.group(2)
            comps[cur] = [0, []]
            entry = cur if h.group(1) else entry
            continue
        if cur is None:
            continue
        m = _COLL.match(line)
        if m:
            comps[cur][0] += _nbytes(m.group(1))
        if " while(" in line:
            n = re.search(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', line)
            body = re.search(r"body=%?([\w.\-]+)", line)
            if body:
                comps[cur][1].append((body.group(1), int(n.group(1)) if n else 1))
        keys = _CALLS + (("to_apply",) if " call(" in line else ())
        for key in keys:
            for grp in re.findall(r"\b" + key + r"=(\{[^}]*\}|%?[\w.\-]+)", line):
                comps[cur][1] += [(c.strip().lstrip("%"), 1)
                                  for c in grp.strip("{}").split(",") if c.strip()]

    @functools.cache
    def executed(c, depth=0):
        if c not in comps or depth > 64:
            return 0
        return comps[c][0] + sum(n * executed(k, depth + 1) for k, n in comps[c][1])

    return sum(v[0] for v in comps.values()), (executed(entry) if entry else 0)


@contextlib.contextmanager
def _stderr_to(path):
    """The process's file descriptor 2 (where XLA's C++ logs go) into ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def specs(setup, params):
    """Each leaf's PartitionSpec and the batch's, for ``setup``."""
    def fsdp(x, axis="fsdp", n=4):
        if x.ndim < 2:
            return (None,) * x.ndim
        order = sorted(range(x.ndim), key=lambda a: -x.shape[a])
        a = next((a for a in order if x.shape[a] % n == 0), None)
        return tuple(axis if i == a else None for i in range(x.ndim))

    def tp(path, x):
        name = str(path[-1].key) if hasattr(path[-1], "key") else ""
        lead = (None,) * (x.ndim - 2)  # scan stacks keep their [L] axis whole
        if name in ("wq", "wk", "wv"):  # [(L,) d, heads, k]: by heads
            return (None,) * (x.ndim - 2) + ("model", None)
        if name == "wo":  # [(L,) heads, k, d]
            return (None,) * (x.ndim - 3) + ("model", None, None)
        if name == "w1":
            return (*lead, None, "model")
        if name in ("w2", "embed"):
            return (*lead, "model", None)
        return (None,) * x.ndim

    if setup == "fsdp":
        return jax.tree.map(lambda x: P(*fsdp(x)), params), P(("data", "fsdp"))
    if setup == "tp":
        return jax.tree_util.tree_map_with_path(lambda p, x: P(*tp(p, x)), params), P("data")
    if setup == "2d":
        def both(path, x):
            t = tp(path, x)
            f = fsdp(x, "fsdp", 4)
            return P(*[a if a is not None else (b if b is not None and b not in t else None)
                       for a, b in zip(t, f)])
        return jax.tree_util.tree_map_with_path(both, params), P("fsdp")
    raise ValueError(setup)


# model sizes (transformer keyword arguments) and batch: the default, a smoke run's, and
# issue 59's own model (its vocabulary unsaid there: GPT-2's rounded to a power of two)
SIZES = {"default": (dict(T=128, d=512, V=16384, layers=4, heads=8), 16),
         "quick": (dict(T=16, d=64, V=512, layers=2, heads=2), 16),
         "issue": (dict(T=256, d=1024, V=32768, layers=4, heads=16), 16)}

MESHES = {"fsdp": ((2, 4), ("data", "fsdp")), "tp": ((2, 4), ("data", "model")),
          "2d": ((4, 2), ("fsdp", "model")), "fsdp-shard_map": ((2, 4), ("data", "fsdp")),
          "fsdp-explicit": ((2, 4), ("data", "fsdp")),
          "fsdp-constrained": ((2, 4), ("data", "fsdp")),
          "tp-constrained": ((2, 4), ("data", "model")),
          "2d-constrained": ((4, 2), ("fsdp", "model"))}
# the setups whose loss is written for the mesh rather than partitioned by XLA: each
# weight gathered before use, by hand inside shard_map (axis_name: the batch's axes) or
# by `jax.sharding.reshard` under Explicit axes (sharding in types)
WRITTEN = {"fsdp-shard_map": "fsdp", "fsdp-explicit": "fsdp"}
# the setups whose model constrains its activations (the residual stream, ``[B, T, d]``) to
# the batch's axes, as MaxText's logical axis rules do: partitioned by XLA as the base setup
CONSTRAINED = {"fsdp-constrained": ("fsdp", P(("data", "fsdp"), None, None)),
               "tp-constrained": ("tp", P("data", None, None)),
               "2d-constrained": ("2d", P("fsdp", None, None))}


def _gathered(loss, pspec, gather):
    """``loss`` on whole weights: each leaf sharded by ``pspec`` gathered by
    ``gather(w, axis)`` (its one sharded axis) before the loss runs."""
    def written(params, batch):
        def whole(w, s):
            axes = [a for a, n in enumerate(s) if n is not None]
            return gather(w, axes[0]) if axes else w
        return loss(jax.tree.map(whole, params, pspec,
                                 is_leaf=lambda s: isinstance(s, P)), batch)
    return written


def measure(loss, params, batch_spec, setup, stats, chunk, log):
    """``{method: {collective_mib, static_mib, temp_mib, remat}}`` (grad first)."""
    import jaxpr_surgery as js

    shape, names = MESHES[setup]
    explicit = setup == "fsdp-explicit"
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))
    base = CONSTRAINED[setup][0] if setup in CONSTRAINED else WRITTEN.get(setup, setup)
    pspec, bspec = specs(base, params)
    ns = lambda s: NamedSharding(mesh, s)  # noqa: E731
    ps = jax.tree.map(ns, pspec, is_leaf=lambda s: isinstance(s, P))
    ap = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      params, ps)
    ab = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=ns(bspec)),
                      batch_spec)
    wrap, opts = (lambda f, outs: f), {}
    if setup == "fsdp-shard_map":  # the hand-written FSDP of JAX's shard_map tutorial
        loss = _gathered(loss, pspec, lambda w, a: jax.lax.all_gather(w, "fsdp", axis=a,
                                                                      tiled=True))
        opts = {"axis_name": tuple(bspec[0])}

        def wrap(f, outs):
            spec = jax.tree.map(lambda s: s.spec, outs)
            return jax.shard_map(f, mesh=mesh, in_specs=(pspec, bspec), out_specs=spec)
    elif explicit:  # FSDP written for sharding in types: each weight resharded whole
        loss = _gathered(loss, pspec, lambda w, a: jax.sharding.reshard(w, P()))

    def cost(fn, outs):
        ctx = explicit or setup in CONSTRAINED  # (a bare PartitionSpec names its mesh)
        with _stderr_to(log), (jax.set_mesh(mesh) if ctx else contextlib.nullcontext()):
            c = jax.jit(wrap(fn, outs), out_shardings=outs).lower(ap, ab).compile()
        with open(log, errors="replace") as f:
            remat = f.read().count("Involuntary full rematerialization")
        static, executed = collective_bytes(c.as_text())
        return {"collective_mib": executed / 2**20, "static_mib": static / 2**20,
                "temp_mib": c.memory_analysis().temp_size_in_bytes / 2**20, "remat": remat}

    out = {"grad": cost(jax.grad(loss), ps)}
    for name, st in stats.items():
        outs = ns(P(bspec[0])) if name == "sq_norms" else ps
        out[name] = cost(js.per_example_stat(loss, st, chunk_size=chunk, **opts), outs)
    return out


def main(argv=None):
    import jaxpr_surgery as js
    from benchmarks import models, output

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model: a smoke run")
    ap.add_argument("--size", default="default", choices=sorted(SIZES),
                    help="the model's size (ignored with --quick)")
    ap.add_argument("--out", default=None, help="results JSON (default: print only)")
    ap.add_argument("--setups", default=",".join(MESHES))
    ap.add_argument("--models", default="transformer,scan")
    ap.add_argument("--stats", default=None,
                    help="comma-separated statistics to measure (default: every one)")
    a = ap.parse_args(argv)
    if jax.device_count() < 8:
        raise SystemExit("shard_bench: needs 8 devices; run it as python -m "
                         "benchmarks.shard_bench (it sets XLA_FLAGS itself).")
    S = js.stats
    stats = {"mean": S.mean(), "second_moment": S.second_moment(), "sign_mean": S.sign_mean(),
             "sq_norms": S.sq_norms(), "clipped_mean": S.clipped_mean(1.0),
             "variance": S.variance(), "kurtosis": S.kurtosis()}
    if a.stats:
        unknown = set(a.stats.split(",")) - set(stats)
        if unknown:
            raise SystemExit(f"shard_bench: --stats: unknown {sorted(unknown)}; "
                             f"choose among {sorted(stats)}")
        stats = {k: v for k, v in stats.items() if k in a.stats.split(",")}
    size, B = SIZES["quick" if a.quick else a.size]
    builders = {"transformer": models.transformer, "scan": models.scan_remat}
    rows, bad = [], []
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "xla.log")
        # (sharding in types: the embedding lookup says where its rows go, as the batch)
        typed = {"lookup_sharding": P(specs("fsdp", {})[1][0], None, None)}
        for model_name in a.models.split(","):
            for setup in a.setups.split(","):
                extra = typed if setup == "fsdp-explicit" else {}
                if setup in CONSTRAINED:
                    extra = {"activation_sharding": CONSTRAINED[setup][1]}
                m = builders[model_name](**size, **extra)
                for chunk in (None, "auto"):
                    res = measure(m.loss, m.params, m.batch_spec(B), setup, stats, chunk, log)
                    g = res["grad"]
                    label = f"{model_name} {setup} chunk={chunk or 'whole'}"
                    print(f"{label}: grad {g['collective_mib']:.0f} MiB collectives, "
                          f"temp {g['temp_mib']:.0f} MiB, remat {g['remat']}", flush=True)
                    for k, v in res.items():
                        rc = v["collective_mib"] / max(g["collective_mib"], 1e-9)
                        rt = v["temp_mib"] / max(g["temp_mib"], 1e-9)
                        v.update(collective_ratio=rc, temp_ratio=rt)
                        rows.append({"model": model_name, "setup": setup,
                                     "chunk": chunk or "whole", "method": k, **v})
                        if k == "grad":
                            continue
                        miss = (rc > LIMITS[k] or rt > TEMP_LIMIT
                                or v["remat"] > g["remat"])
                        if miss:
                            bad.append(f"{label} {k}")
                        print(f"  {k:14s} collectives {rc:5.2f}x  temp {rt:5.2f}x  "
                              f"remat {v['remat']}" + ("  MISS" if miss else ""), flush=True)
    result = {"machine": output.machine_info(), "quick": a.quick, "batch": B, "size": size,
              "stats": sorted(stats),
              "limits": {"collectives": LIMITS, "temp": TEMP_LIMIT}, "rows": rows,
              "missed": bad}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print("shard_bench: " + ("every target met" if not bad else f"{len(bad)} missed"))
    return result


if __name__ == "__main__":
    main()

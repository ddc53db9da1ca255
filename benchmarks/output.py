"""The suite's output: the machine it ran on, the allocator mode, the JSON and CSV files."""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import os
import platform

import jax
import numpy as np
import optax

import jaxpr_surgery as js

SCHEMA_VERSION = 1


def write_small(path, note, rows, **parts):
    """A small benchmark's results JSON at ``path``: ``{"meta": {jax, backend, machine,
    note}, **parts, "rows": rows}`` (``parts``: e.g. the ``--quick`` checks)."""
    meta = {"jax": jax.__version__, "backend": jax.default_backend(),
            "machine": platform.machine(), "note": note}
    with open(path, "w") as fh:
        json.dump({"meta": meta, **parts, "rows": rows}, fh, indent=1)


def parser(doc):
    """The command line every small benchmark script takes (``--quick``, ``--reps N``,
    ``--out FILE``), described by the first paragraph of its module docstring ``doc``;
    a script adds its own options to it."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, one round: a smoke run")
    ap.add_argument("--reps", type=int, default=None, help="rounds (default: the script's)")
    ap.add_argument("--out", default=None, help="results JSON (default: print only)")
    return ap

RESULT_FIELDS = [
    "regime", "batch", "method", "statistic", "label", "ok", "error",
    "time_median_s", "time_ratio", "n_reps", "time_min_s", "time_max_s", "warmup_s",
    "flops", "flops_ratio", "bytes_accessed", "temp_bytes", "temp_ratio", "peak_bytes",
    "output_bytes", "argument_bytes", "trace_lower_s", "compile_s", "has_loop",
    "microbatch_size", "calls_per_sample", "minor_faults_per_call",
]

# glibc malloc returns a freed buffer above its mmap threshold (at most 32 MiB) to the
# OS, so an XLA:CPU program whose temporary buffer is larger page-faults all of it on
# every call; "steady" keeps freed memory in the process (one arena, no mmap, no trim),
# so that after the first call no method pays for page faults (docs/benchmarks.md).
STEADY_ALLOCATOR_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}


def machine_info():
    import jaxlib

    try:
        dev = jax.devices()[0]
        kind, plat, ndev = dev.device_kind, dev.platform, jax.device_count()
    except Exception:  # noqa: BLE001
        kind = plat = None
        ndev = 0
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "jaxpr_surgery": getattr(js, "__version__", None),
        "backend": plat,
        "device_kind": kind,
        "device_count": ndev,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "allocator": allocator_info(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["loadavg_start"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def write_outputs(doc, out_path):
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)
    os.replace(tmp, out_path)
    csv_path = os.path.splitext(out_path)[0] + ".csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in doc["results"]:
            rr = dict(r)
            if rr.get("error"):
                rr["error"] = rr["error"].splitlines()[0][:300]
            w.writerow(rr)
    return csv_path


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def allocator_info():
    """The allocator mode of this process: ``steady`` where `STEADY_ALLOCATOR_ENV` is
    in effect, else ``default``; with the malloc settings found in the environment."""
    env = {k: os.environ[k] for k in sorted(os.environ)
           if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    if "LD_PRELOAD" in env:  # library names only: no path of this machine in the results
        env["LD_PRELOAD"] = " ".join(
            os.path.basename(x) for x in env["LD_PRELOAD"].replace(":", " ").split()
        )
    steady = all(os.environ.get(k) == v for k, v in STEADY_ALLOCATOR_ENV.items())
    return {"mode": "steady" if steady else "default", "libc": list(platform.libc_ver()),
            "env": env}


def default_out(allocator="default"):
    try:
        plat = jax.devices()[0].platform
    except Exception:  # noqa: BLE001
        plat = "cpu"
    suffix = "" if allocator == "default" else f"_{allocator}_alloc"
    return os.path.join(os.path.dirname(__file__), "results", f"{plat}{suffix}.json")

"""The targets of the issue, evaluated from the result rows.

Each target row: ``target`` (its id), ``description``, ``regime``, ``batch``, ``what``
(the statistic or ratio), ``value``, ``threshold`` and ``met`` (``value <= threshold``;
``None`` where not measured), with extra fields for some.
"""

from __future__ import annotations

from benchmarks.methods import ALL_STATS


def evaluate_targets(rows, tracing=None):
    """Every target of the issue, per batch size: value, threshold, met (None = not measured)."""
    t = _Targets(rows)
    _mlp(t)
    _short_transformer(t)
    for reg in t.regimes:
        for B in t.batches(reg):
            _against_single(t, reg, B)
    _tokens(t)
    _long_context(t)
    for reg in t.regimes:
        for B in t.batches(reg):
            _equal_memory(t, reg, B)
            _variance(t, reg, B)
    _matrix(t)
    _remat(t)
    _tracing(t, tracing)
    return t.out


class _Targets:
    """The result rows, looked up by (regime, batch, method, statistic), and the target
    rows evaluated so far."""

    def __init__(self, rows):
        self.rows = rows
        self.regimes = sorted({r["regime"] for r in rows})
        self.out = []

    def batches(self, reg):
        return sorted({r["batch"] for r in self.rows if r["regime"] == reg})

    def row(self, regime, B, method, stat):
        for r in self.rows:
            if (r["regime"], r["batch"], r["method"], r["statistic"]) == (regime, B, method, stat):
                return r
        return None

    def ok_value(self, regime, B, method, stat, key):
        """``key`` of the row where it ran without error, else ``None``."""
        r = self.row(regime, B, method, stat)
        return r[key] if r is not None and r["ok"] else None

    def add(self, tid, desc, regime, B, label, value, thr, extra=None):
        met = None if value is None else bool(value <= thr)
        d = {"target": tid, "description": desc, "regime": regime, "batch": B, "what": label,
             "value": value, "threshold": thr, "met": met}
        if extra:
            d.update(extra)
        self.out.append(d)


def _mlp(t):
    for B in t.batches("mlp"):
        for s in ["second_moment", "sign_mean", "sq_norms", "clipped_mean"]:
            t.add("mlp_time", "MLP: js time <= 1.2x grad", "mlp", B, s,
                  t.ok_value("mlp", B, "js", s, "time_ratio"), 1.2)
            t.add("mlp_mem", "MLP: js temp memory <= 2x grad", "mlp", B, s,
                  t.ok_value("mlp", B, "js", s, "temp_ratio"), 2.0)


def _short_transformer(t):
    for B in t.batches("short"):
        for s in ["sq_norms", "clipped_mean"]:
            t.add("transformer_time", "transformer (short): js time <= 1.1x grad", "short", B, s,
                  t.ok_value("short", B, "js", s, "time_ratio"), 1.1)


def _against_single(t, reg, B):
    """js second_moment against vmap's; mean+second_moment against second_moment alone."""
    a = t.row(reg, B, "js", "second_moment")
    v = t.row(reg, B, "vmap", "second_moment")
    if a is None:  # a regime of other statistics (matrix)
        return
    val = None
    if a and v and a["ok"] and v["ok"] and a["time_median_s"] and v["time_median_s"]:
        val = a["time_median_s"] / v["time_median_s"]
    t.add("sm_vs_vmap", "js second_moment time <= vmap(grad) second_moment time", reg, B,
          "second_moment / vmap", val, 1.0)
    both = t.row(reg, B, "js", "mean+second_moment")
    val = extra = None
    if a and both and a["ok"] and both["ok"] and a["time_median_s"]:
        val = both["time_median_s"] / a["time_median_s"]
        # the mean alone (the gradient) may itself cost more than second_moment
        m = t.row(reg, B, "js", "mean")
        if m and m["ok"] and m["time_median_s"]:
            slower = max(m["time_median_s"], a["time_median_s"])
            extra = {"mean_vs_second_moment": m["time_median_s"] / a["time_median_s"],
                     "vs_slower_alone": both["time_median_s"] / slower}
    t.add("fused_vs_single", "js mean+second_moment time <= 1.1x second_moment alone",
          reg, B, "mean+second_moment / second_moment", val, 1.1, extra)


def _tokens(t):
    """Token-axis statistics on transformers (the tokens issue)."""
    for reg, tmax in (("short", 1.6), ("long", 1.1)):
        for B in t.batches(reg):
            for s in ["second_moment", "sign_mean"]:
                t.add("tokens_time", "tokens: js E[g^2]/E[sign] default time <= 1.6x grad "
                      "(short), 1.1x (long)", reg, B, s,
                      t.ok_value(reg, B, "js", s, "time_ratio"), tmax)
                t.add("tokens_mem", "tokens: js E[g^2]/E[sign] default temp memory <= 1.3x grad",
                      reg, B, s, t.ok_value(reg, B, "js", s, "temp_ratio"), 1.3)


# long sequences (T >= 4d, issue 40): time against grad per statistic
LONG_CONTEXT = {"second_moment": 1.05, "sign_mean": 1.05, "variance": 1.2, "sq_norms": 1.1,
                "clipped_mean": 1.35}


def _long_context(t):
    """Long sequences: each statistic's time against grad, and its temp memory at most
    1.3x grad's (plus the result, which XLA counts among the outputs)."""
    reg = "long_context"
    for B in t.batches(reg):
        for s, tmax in LONG_CONTEXT.items():
            t.add("long_context_time", f"long context: js {s} time <= {tmax}x grad", reg, B, s,
                  t.ok_value(reg, B, "js", s, "time_ratio"), tmax)
            t.add("long_context_mem", "long context: js temp memory <= 1.3x grad", reg, B, s,
                  t.ok_value(reg, B, "js", s, "temp_ratio"), 1.3)


def _equal_memory(t, reg, B):
    """js in chunks of B/4 against micro_grad in microbatches of B/4 (the same memory)."""
    for s in ["second_moment", "sign_mean"]:
        c = t.row(reg, B, "js_chunk", s)
        m = t.row(reg, B, "micro_grad_mb", s)
        tv = mv = None
        if c and m and c["ok"] and m["ok"] and m["time_median_s"]:
            tv = c["time_median_s"] / m["time_median_s"]
            mv = c["temp_bytes"] / max(m["temp_bytes"], 1)
        if c is None and m is None:
            continue
        # the floor: the plain gradient in the same chunks, which any method
        # at this memory also computes
        gc_ = t.row(reg, B, "grad_chunk", "grad")
        extra = None
        if tv is not None and gc_ and gc_["ok"] and gc_["time_median_s"]:
            extra = {"grad_chunk_vs_micro_grad": gc_["time_median_s"] / m["time_median_s"],
                     "js_chunk_vs_grad_chunk": c["time_median_s"] / gc_["time_median_s"]}
        t.add("equal_mem_time", "equal memory (chunk B/4): js time <= 0.8x micro_grad "
              "(microbatch B/4)", reg, B, s, tv, 0.8, extra)
        t.add("equal_mem_mem", "equal memory (chunk B/4): js temp memory <= micro_grad's",
              reg, B, s, mv, 1.0)


def _variance(t, reg, B):
    """js variance against second_moment alone (only where both ran)."""
    a = t.row(reg, B, "js", "second_moment")
    v = t.row(reg, B, "js", "variance")
    if a and v and a["ok"] and v["ok"] and a["time_median_s"]:
        t.add("var_vs_sm", "js variance time <= 1.2x second_moment alone", reg, B,
              "variance / second_moment", v["time_median_s"] / a["time_median_s"], 1.2)


def _matrix(t):
    """Per-example Kronecker moments: time and memory against grad and micro_grad."""
    for B in t.batches("matrix"):
        r = t.row("matrix", B, "js", "kron_moments")
        m = t.row("matrix", B, "micro_grad_mb", "kron_moments")
        ok = r is not None and r["ok"]
        t.add("matrix_time", "matrix: js kron_moments time <= 2.0x grad", "matrix", B,
              "kron_moments", r["time_ratio"] if ok else None, 2.0)
        mem = None
        if ok and r.get("temp_ratio") is not None and r.get("output_bytes"):
            grad_temp = r["temp_bytes"] / max(r["temp_ratio"], 1e-30)
            mem = r["temp_bytes"] / (1.5 * grad_temp + r["output_bytes"])
        t.add("matrix_mem", "matrix: js temp memory <= 1.5x grad's + the result's size (value: "
              "the ratio to that bound)", "matrix", B, "kron_moments", mem, 1.0)
        val = None
        if ok and m is not None and m["ok"] and m["time_median_s"]:
            val = r["time_median_s"] / m["time_median_s"]
        t.add("matrix_vs_micro_grad", "matrix: js kron_moments time <= 0.5x micro_grad "
              "(microbatch B/4) forming the same moments", "matrix", B,
              "kron_moments / micro_grad", val, 0.5)


def _remat(t):
    for B in t.batches("scan_remat"):
        for s in ALL_STATS:
            t.add("remat_mem", "scan+remat: js temp memory <= 1.3x grad-with-remat", "scan_remat",
                  B, s, t.ok_value("scan_remat", B, "js", s, "temp_ratio"), 1.3)


def _tracing(t, tracing):
    if not (tracing and tracing.get("points")):
        return
    for p in tracing["points"]:
        if p["method"] == "js":
            t.add("trace_lower", f"tracing: js trace+lower of a {tracing['layers']}-layer "
                  "transformer <= 1.5x grad's", "deep", tracing["batch"], p["statistic"],
                  p["ratio"], 1.5)

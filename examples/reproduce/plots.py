"""Figures of the study (PNG next to ``study.json``); needs matplotlib."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .study import capped  # noqa: E402

__all__ = ["plot_all"]


def _lr_curves(ax, exp, title):
    by = {}
    for r in exp["runs"]:
        by.setdefault(r["label"], {}).setdefault(r["lr"], []).append(capped(r["final_eval_loss"]))
    for label, d in by.items():
        lrs = sorted(d)
        m = [np.mean(d[lr]) for lr in lrs]
        lo = [np.min(d[lr]) for lr in lrs]
        hi = [np.max(d[lr]) for lr in lrs]
        line, = ax.plot(lrs, m, "o-", label=label)
        ax.fill_between(lrs, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final held-out loss (nats/byte; mean, min-max over seeds)")
    ax.set_title(title)
    ax.legend(fontsize=7)


def plot_all(doc, out: Path):
    out = Path(out)
    names = []
    ex = doc["experiments"]
    for key, title in (("sign", "Claim 1: where the sign goes"),
                       ("adam", "Claim 2: v = mu^2 + lambda sigma^2")):
        if key in ex:
            fig, ax = plt.subplots(figsize=(6, 4))
            _lr_curves(ax, ex[key], title)
            fig.tight_layout()
            fig.savefig(out / f"study_{key}.png", dpi=120)
            plt.close(fig)
            names.append(f"study_{key}.png")
    if "sign" in ex and ex["sign"].get("fidelity"):
        fid = ex["sign"]["fidelity"]
        labels = list(fid)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = np.arange(len(labels))
        a = [fid[k]["update_vs_probe_a"] for k in labels]
        b = [fid[k]["update_vs_probe_b"] for k in labels]
        ref = np.mean([fid[k]["probe_a_vs_b"] for k in labels])
        ax.bar(x - 0.2, a, 0.4, label="update vs probe A")
        ax.bar(x + 0.2, b, 0.4, label="update vs probe B")
        ax.axhline(ref, color="k", ls="--", label="probe A vs probe B")
        ax.axhline(0.5, color="gray", ls=":")
        ax.set_xticks(x, labels, rotation=20, fontsize=7)
        ax.set_ylabel("sign agreement (second half of training)")
        ax.set_title("Sign fidelity at each placement's best rate")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "study_sign_fidelity.png", dpi=120)
        plt.close(fig)
        names.append("study_sign_fidelity.png")
    if "sqrt_b" in ex:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        B0 = ex["sqrt_b"]["base_batch_size"]
        for ax, rule in zip(axes, ("sqrt", "constant")):
            for B in sorted({r["batch_size"] for r in ex["sqrt_b"]["runs"]}):
                rs = [r for r in ex["sqrt_b"]["runs"] if r["batch_size"] == B and
                      (r["rule"] == rule or B == B0) and not r["diverged"]]
                if not rs:
                    continue
                xs = [e["examples"] for e in rs[0]["eval"]]
                n = min(len(r["eval"]) for r in rs)
                ys = np.mean([[e["loss"] for e in r["eval"][:n]] for r in rs], axis=0)
                ax.plot(xs[:n], ys, "o-", label=f"B={B}")
            ax.set_xlabel("examples seen")
            ax.set_title(f"Adam, {rule} rule")
            ax.legend()
        axes[0].set_ylabel("held-out loss (mean over seeds)")
        fig.tight_layout()
        fig.savefig(out / "study_sqrt_b.png", dpi=120)
        plt.close(fig)
        names.append("study_sqrt_b.png")
    return names

"""Matplotlib figures of the results (PNG, written next to the JSON)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .experiments import UNIFORM_LOSS, capped  # noqa: E402

__all__ = ["plot_sign", "plot_adam", "plot_batch"]

COLORS = {
    "per_example_sign_sgd": "tab:red",
    "sign_sgd": "tab:orange",
    "ema_of_sign": "tab:green",
    "sign_ema": "tab:blue",
    "adam": "tab:blue",
    "micro_adam": "tab:green",
    "micro_adam_var": "tab:red",
    "micro_adam_msq": "tab:purple",
}
PLACEMENT_LABEL = {"per_example": "per-example g_b", "batch_mean": "batch mean",
                   "ema": "EMA of batch means"}


def _color(label):
    return COLORS.get(label.split(" ")[0], "k")


def _style(label):
    return "--" if label.endswith("+clip") else "-"


def _runs_at(runs, label, lr, batch_size=None):
    return [r for r in runs if r["label"] == label and r["lr"] == lr
            and (batch_size is None or r["batch_size"] == batch_size)]


def _eval_curve(runs):
    """Mean held-out loss over seeds at the steps every run reached (diverged runs stop)."""
    curves = [{e["step"]: e["loss"] for e in r["eval"]} for r in runs]
    steps = sorted(set.intersection(*[set(c) for c in curves])) if curves else []
    ys = np.array([[c[s] for s in steps] for c in curves]) if steps else np.zeros((0, 0))
    return np.array(steps), ys


def _smooth(x, k=10):
    x = np.asarray([np.nan if v is None else v for v in x], float)
    if x.size < k:
        return x
    c = np.convolve(np.nan_to_num(x, nan=UNIFORM_LOSS), np.ones(k) / k, mode="valid")
    return np.concatenate([np.full(k - 1, np.nan), c])


def _loss_curves(ax_eval, ax_train, runs, best, labels):
    lows = []
    for label in labels:
        lr = best[label]["lr"]
        rs = [r for r in _runs_at(runs, label, lr) if not r["diverged"]]
        if not rs:  # every seed diverged at the best lr (it is ln 256 then)
            ax_eval.plot([], [], _style(label), color=_color(label),
                         label=f"{label}: diverged at every lr")
            continue
        steps, ys = _eval_curve(rs)
        if len(steps):
            m = ys.mean(0)
            ax_eval.plot(steps, m, _style(label), color=_color(label), marker=".",
                         label=f"{label} (lr={lr:g})")
            if ys.shape[0] > 1:
                ax_eval.fill_between(steps, ys.min(0), ys.max(0), color=_color(label), alpha=0.15)
        if ax_train is not None:
            n = min(len(r["train_loss"]) for r in rs)
            tl = np.mean([_smooth(r["train_loss"][:n]) for r in rs], axis=0)
            ax_train.plot(np.arange(1, n + 1), tl, _style(label), color=_color(label), lw=1,
                          label=label)
            lows.append(np.nanmin(tl))
    ax_eval.set_xlabel("step")
    ax_eval.set_ylabel("held-out loss (nats/byte)")
    ax_eval.set_title("held-out loss at each optimizer's best lr\n(mean over seeds, band: min-max)")
    ax_eval.legend(fontsize=7)
    if ax_train is not None:
        ax_train.set_xlabel("step")
        ax_train.set_ylabel("training loss (10-step moving average)")
        ax_train.set_title("training loss at the best lr")
        if lows:
            ax_train.set_ylim(min(lows) - 0.1, UNIFORM_LOSS + 0.2)
        ax_train.legend(fontsize=7)


def _lr_sensitivity(ax, summary, runs, labels, title):
    """Final held-out loss vs lr; the y-axis is cut at best + 1.2 nats (cut points: triangles)."""
    rows_by = {label: sorted(summary["by_lr"][label].values(), key=lambda r: r["lr"])
               for label in labels}
    means_all = [r["mean"] for rows in rows_by.values() for r in rows]
    lo = min(means_all) - 0.05
    hi = min(UNIFORM_LOSS + 0.1, lo + 1.25)
    top = hi - 0.03
    for label in labels:
        rows = rows_by[label]
        lrs = np.array([r["lr"] for r in rows])
        means = np.array([r["mean"] for r in rows])
        stds = np.array([r["std"] for r in rows])
        shown = np.minimum(means, top)
        ax.errorbar(lrs, shown, yerr=np.where(means > top, 0, stds), fmt=_style(label) + "o",
                    color=_color(label), capsize=3, ms=4, label=label)
        cut = means > top
        if cut.any():
            ax.plot(lrs[cut], shown[cut], "^", color=_color(label), ms=9)
        div = [r for r in rows if r["n_diverged"]]
        if div:
            ax.plot([r["lr"] for r in div], [min(r["mean"], top) for r in div], "x",
                    color=_color(label), ms=11, mew=2)
        for r in runs:  # every seed, faintly
            if r["label"] == label:
                ax.plot(r["lr"], min(capped(r["final_eval_loss"]), top), ".",
                        color=_color(label), alpha=0.35, ms=3)
    ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final held-out loss (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.text(0.01, 0.01, "^: above the axis; x: a seed diverged (counted as ln 256 = 5.55)",
            transform=ax.transAxes, fontsize=6.5, va="bottom", color="gray")


def plot_sign(result: dict, out: Path) -> list[str]:
    """sign_loss_curves.png, sign_lr_sensitivity.png, sign_snr.png."""
    runs, summary = result["runs"], result["summary"]
    labels = list(summary["best"])
    files = []

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    _loss_curves(a, b, runs, summary["best"], labels)
    fig.suptitle("Sign placements: loss curves")
    fig.tight_layout()
    files.append(_save(fig, out / "sign_loss_curves.png"))

    fig, ax = plt.subplots(figsize=(6, 4.2))
    _lr_sensitivity(ax, summary, runs, labels,
                    "Sign placements: learning-rate sensitivity\n(mean ± std over seeds, "
                    "dots: single seeds)")
    fig.tight_layout()
    files.append(_save(fig, out / "sign_lr_sensitivity.png"))

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.3))
    # (a), (b): SNR and sign fidelity at the three points of the chain, over training,
    # from every optimizer's best-lr runs (mean over optimizers and seeds)
    series = [r["snr"] for label in labels
              for r in _runs_at(runs, label, summary["best"][label]["lr"]) if r["snr"]]
    if series:
        n = min(len(s) for s in series)
        steps = [s["step"] for s in series[0][:n]]
        for place, ls in (("per_example", "-"), ("batch_mean", "--"), ("ema", ":")):
            snr = np.mean([[s[f"snr_median_{place}"] for s in ser[:n]] for ser in series], 0)
            fid = np.mean([[s[f"sign_fidelity_{place}"] for s in ser[:n]] for ser in series], 0)
            a.plot(steps, snr, ls, color="k", marker=".", label=PLACEMENT_LABEL[place])
            b.plot(steps, fid, ls, color="k", marker=".", label=PLACEMENT_LABEL[place])
        agg = np.mean([[s["snr_aggregate_per_example"] for s in ser[:n]] for ser in series], 0)
        a.plot(steps, agg, "-", color="gray", lw=0.8, label="per-example, |mu|^2/tr(Sigma)")
    a.set_yscale("log")
    a.set_xlabel("step")
    a.set_ylabel("median per-coordinate SNR  mu^2/sigma^2")
    a.set_title("measured SNR at each point of the chain\n(per-example x B x (1+b1)/(1-b1))")
    a.legend(fontsize=7)
    b.set_xlabel("step")
    b.set_ylabel("mean over coordinates of erf(sqrt(SNR/2))")
    b.set_title("predicted sign fidelity E[sign(x) sign(mu)]")
    b.set_ylim(0, 1.02)
    b.legend(fontsize=7)
    offsets = {"per_example_sign_sgd": (8, -4), "sign_sgd": (8, -22), "ema_of_sign": (-30, 10),
               "sign_ema": (8, 4)}
    for label, d in result["snr_vs_outcome"].items():
        c.errorbar(d["snr_median_at_placement"], d["final_eval_loss"],
                   yerr=summary["best"][label]["std"], fmt="o", color=_color(label), ms=7,
                   capsize=3, zorder=3)
        c.annotate(f"{label}\n(sign at {PLACEMENT_LABEL[d['placement']]})",
                   (d["snr_median_at_placement"], d["final_eval_loss"]), fontsize=7,
                   xytext=offsets.get(label, (8, 4)), textcoords="offset points")
    c.set_xscale("log")
    c.set_xlabel("median SNR where the sign is applied (best-lr runs, over training)")
    c.set_ylabel("best final held-out loss")
    c.set_title("SNR at the sign vs outcome")
    c.margins(x=0.4, y=0.25)
    fig.tight_layout()
    files.append(_save(fig, out / "sign_snr.png"))
    return files


def plot_adam(result: dict, out: Path) -> list[str]:
    """adam_loss_curves.png, adam_lr_sensitivity.png, adam_snr.png."""
    runs, summary = result["runs"], result["summary"]
    labels = list(summary["best"])
    plain = [k for k in labels if not k.endswith("+clip")]
    clipped = [k for k in labels if k.endswith("+clip")]
    files = []

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    _loss_curves(a, b, runs, summary["best"], labels)
    fig.suptitle("Adam preconditioner variants: loss curves (dashed: update clipped)")
    fig.tight_layout()
    files.append(_save(fig, out / "adam_loss_curves.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    _lr_sensitivity(axes[0], summary, runs, plain, "no clipping")
    _lr_sensitivity(axes[1], summary, runs, clipped,
                    f"update clipped to global norm {result['clip']['max_norm']:.0f}\n"
                    f"(RMS <= {result['clip']['clip_rms']:g}) before the learning rate")
    fig.suptitle("Adam preconditioner variants: learning-rate sensitivity (mean ± std over seeds)")
    fig.tight_layout()
    files.append(_save(fig, out / "adam_lr_sensitivity.png"))

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for label in labels:
        for r in _runs_at(runs, label, summary["best"][label]["lr"])[:1]:
            if r["snr"]:
                ax.plot([s["step"] for s in r["snr"]],
                        [s["snr_median_per_example"] for s in r["snr"]], _style(label),
                        color=_color(label), marker=".", label=label)
    B = runs[0]["batch_size"] if runs else 1
    ax.axhline(1.0, color="gray", ls=":", lw=0.8)
    ax.axhline(1.0 / B, color="gray", ls="--", lw=0.8)
    ax.text(ax.get_xlim()[0], 1.0, " mu^2 = sigma^2", fontsize=7, va="bottom", color="gray")
    ax.text(ax.get_xlim()[0], 1.0 / B, f" mu^2 = sigma^2/B (B={B})", fontsize=7, va="bottom",
            color="gray")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("median per-coordinate mu^2/sigma^2")
    ax.set_title("per-example SNR during training (best lr, seed 0):\n"
                 "below 1, E[g_b^2] (micro_adam) is dominated by sigma^2")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(_save(fig, out / "adam_snr.png"))
    return files


def plot_batch(result: dict, out: Path) -> list[str]:
    """batch_size.png: per variant, held-out loss vs examples seen (top) and vs steps (bottom);
    right: final held-out loss vs B at the same number of examples."""
    runs, settings = result["runs"], result["settings"]
    names = list(settings)
    sizes = result["batch_sizes"]
    cmap = plt.get_cmap("viridis")
    ncol = len(names) + 1
    fig, axes = plt.subplots(2, ncol, figsize=(3.6 * ncol, 7.0), sharey=True, squeeze=False)
    for col, name in enumerate(names):
        st = settings[name]
        for rule in result.get("lr_rules", ["sqrt"]):
            for i, B in enumerate(sizes):
                if rule != "sqrt" and B == st["base_batch_size"]:
                    continue  # the same runs as the sqrt rule
                rs = [r for r in runs if r["optimizer"] == name and r["batch_size"] == B
                      and r.get("lr_rule", "sqrt") == rule]
                steps, ys = _eval_curve(rs)
                if len(steps):
                    kw = dict(color=cmap(i / max(1, len(sizes) - 1)),
                              marker="." if rule == "sqrt" else None,
                              ls="-" if rule == "sqrt" else "--", lw=1.5 if rule == "sqrt" else 1,
                              label=f"B={B}, lr={rs[0]['lr']:.2g}"
                                    + ("" if rule == "sqrt" else f" ({rule})"))
                    axes[0, col].plot(steps * B, ys.mean(0), **kw)
                    axes[1, col].plot(steps, ys.mean(0), **kw)
        axes[0, col].set_title(f"{st['label']}\nlr = {st['base_lr']:g} * "
                               f"sqrt(B/{st['base_batch_size']})", fontsize=9)
        axes[0, col].set_xlabel("training examples seen")
        axes[1, col].set_xlabel("step")
        axes[0, col].legend(fontsize=7)
    axes[0, 0].set_ylabel("held-out loss (nats/byte)")
    axes[1, 0].set_ylabel("held-out loss (nats/byte)")
    rules = result.get("lr_rules", ["sqrt"])
    for ax, rule in zip(axes[:, -1], rules + [None] * (2 - len(rules)), strict=False):
        if rule is None:
            ax.axis("off")
            continue
        summ = result["summary"].get(rule, {})
        for name in names:
            s = summ.get(name, {})
            bs = [B for B in sizes if str(B) in s]
            ax.errorbar(bs, [s[str(B)]["mean"] for B in bs],
                        yerr=[s[str(B)]["std"] for B in bs], fmt="o-" if rule == "sqrt" else "o--",
                        color=_color(name), capsize=3, label=settings[name]["label"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        what = "lr ~ sqrt(B)" if rule == "sqrt" else f"control: {rule} lr"
        ax.set_title(f"final held-out loss vs B, {what}\n"
                     f"({result['examples_budget']} examples each)", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Square-root learning-rate rule across batch sizes (solid; dashed: the same "
                 "lr at every B). Top: vs examples seen; bottom: vs steps")
    fig.tight_layout()
    return [_save(fig, out / "batch_size.png")]


def _save(fig, path: Path) -> str:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name

"""The regimes of the suite: a model, its batch sizes and the statistics each method runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from benchmarks import models
from benchmarks.methods import ALL_STATS, BASELINES


@dataclasses.dataclass
class Regime:
    name: str
    build: Callable[[], models.Model]
    batches: list[int]
    description: str
    # statistics per method: {method: (at the smallest batch, at the larger batches)};
    # ``grad`` always runs.
    plan: dict[str, tuple[list[str], list[str]]] = None  # type: ignore[assignment]
    maxbatch: bool = True

    def entries(self, i_batch: int):
        out = [("grad", "grad")]
        for m in ["js"] + BASELINES:
            if m == "js_fused" and jax.default_backend() != "gpu":
                continue  # the kernel is Triton's: GPUs only
            small, large = self.plan.get(m, ([], []))
            out += [(m, s) for s in (small if i_batch == 0 else large)]
        if any(m in ("js_chunk", "micro_grad_mb") for m, _ in out):
            out.append(("grad_chunk", "grad"))  # the floor of any equal-memory method
        return out


FULL_PLAN = {
    "js": (ALL_STATS, ALL_STATS),
    "js_chunk": (["second_moment", "sign_mean"], ["second_moment", "sign_mean"]),
    "vmap": (ALL_STATS, ["second_moment", "sq_norms"]),
    "micro_grad": (["second_moment", "sq_norms"], ["second_moment"]),
    "micro_grad_mb": (["second_moment", "sq_norms", "sign_mean"], ["second_moment", "sign_mean"]),
    # js with JAXPR_SURGERY_TILE_KERNEL=pallas (GPU runs only; fused.py)
    "js_fused": (["second_moment", "sign_mean", "variance"], ["second_moment", "sign_mean"]),
}
EVERYTHING_PLAN = {m: (ALL_STATS, ALL_STATS) for m in ["js"] + BASELINES}
QUICK_PLAN_FULL = {"js": (ALL_STATS, ALL_STATS),
                   **{m: (["second_moment"], ["second_moment"]) for m in BASELINES}}
QUICK_PLAN = {"js": (["second_moment", "sq_norms", "mean+second_moment"],) * 2,
              "js_chunk": (["second_moment"], ["second_moment"]),
              "vmap": (["second_moment"], ["second_moment"]),
              "micro_grad_mb": (["second_moment"], ["second_moment"])}
QUICK_PLAN_SCAN = {"js": (["second_moment"], ["second_moment"]),
                   "vmap": (["second_moment"], ["second_moment"])}
QUICK_DEFAULT_REGIMES = ["mlp", "short", "scan_remat", "matrix"]
# long sequences (T >= 4d, issue 40): every statistic against grad, E[g^2] by vmap(grad)
LONG_CONTEXT_STATS = ["second_moment", "sign_mean", "variance", "sq_norms", "clipped_mean"]
LONG_CONTEXT_PLAN = {"js": (LONG_CONTEXT_STATS, LONG_CONTEXT_STATS),
                     "vmap": (["second_moment"], ["second_moment"])}
# per-example Kronecker moments (matrix_check.py): js against micro_grad forming each
# example's moments from its materialised gradient
MATRIX_PLAN = {"js": (["kron_moments"], ["kron_moments"]),
               "micro_grad_mb": (["kron_moments"], ["kron_moments"])}
# LoRA adapters only (issue 36): merged ``W + A @ B`` against the unmerged form
LORA_PLAN = {"js": (ALL_STATS, ALL_STATS),
             "vmap": (["second_moment", "sq_norms"], ["second_moment", "sq_norms"])}


def regimes(quick: bool) -> dict[str, Regime]:
    """The regimes by name: small models in quick mode, the full suite otherwise."""
    if quick:
        return {
            "mlp": Regime("mlp", lambda: models.mlp(din=32, hidden=64, nclass=10), [16],
                          "token-free MLP 32-64-10 (quick)", QUICK_PLAN_FULL),
            "cnn": Regime("cnn", lambda: models.cnn(size=8, c1=4, c2=4), [8],
                          "CNN 8x8x1 conv(4)-conv(4,s2)-dense (quick)", QUICK_PLAN, maxbatch=False),
            "short": Regime("short", lambda: models.transformer(T=8, d=32, V=64, layers=1, heads=2,
                                                                name="short"), [8],
                            "transformer T=8 d=32 V=64 (quick)", QUICK_PLAN, maxbatch=False),
            "long": Regime("long", lambda: models.transformer(T=32, d=16, V=32, layers=1, heads=2,
                                                              name="long"), [4],
                           "transformer T=32 d=16 V=32 (quick)", QUICK_PLAN, maxbatch=False),
            "vocab": Regime("vocab", lambda: models.transformer(T=4, d=8, V=512, layers=1, heads=2,
                                                                name="vocab"), [8],
                            "transformer T=4 d=8 V=512 tied (quick)", QUICK_PLAN, maxbatch=False),
            "long_context": Regime("long_context",
                                   lambda: models.transformer(T=64, d=16, V=64, layers=1, heads=2,
                                                              name="long_context"), [2],
                                   "transformer T=64 d=16 V=64 (T = 4d, quick)",
                                   LONG_CONTEXT_PLAN, maxbatch=False),
            "scan_remat": Regime("scan_remat", lambda: models.scan_remat(T=8, d=16, V=32, layers=2,
                                                                         heads=2), [8],
                                 "scan over 2 remat layers T=8 d=16 (quick)", QUICK_PLAN_SCAN,
                                 maxbatch=False),
            "matrix": Regime("matrix", lambda: models.transformer(T=8, d=32, V=64, layers=1,
                                                                  heads=2, name="matrix"), [8],
                             "kron_moments, transformer T=8 d=32 V=64 (quick)", MATRIX_PLAN,
                             maxbatch=False),
            "merged_lora": Regime("merged_lora", lambda: models.lora(T=4, D=16, F=32, r=2), [4],
                                  "merged LoRA x @ (W + A @ B), adapters only (quick)",
                                  LORA_PLAN, maxbatch=False),
            "lora": Regime("lora", lambda: models.lora(T=4, D=16, F=32, r=2, merged=False), [4],
                           "unmerged LoRA x @ W + (x @ A) @ B, adapters only (quick)",
                           LORA_PLAN, maxbatch=False),
        }
    return {
        "mlp": Regime("mlp", lambda: models.mlp(), [32, 256],
                      "token-free MLP 784-1024-10, ReLU, softmax CE", FULL_PLAN),
        "cnn": Regime("cnn", lambda: models.cnn(), [32, 128],
                      "CNN 28x28x1: conv3x3(16,SAME)-conv3x3(32,s2)-dense(10)", FULL_PLAN,
                      maxbatch=False),
        "short": Regime("short", lambda: models.transformer(T=32, d=256, V=8192, layers=2, heads=4,
                                                            name="short"), [8, 32],
                        "transformer LM T=32 d=256 V=8192 L=2 H=4, tied, learned pos, LN",
                        FULL_PLAN),
        "long": Regime("long", lambda: models.transformer(T=128, d=64, V=1024, layers=2, heads=4,
                                                          name="long"), [8, 32],
                       "transformer LM T=128 d=64 V=1024 L=2 H=4 (T >= d)", FULL_PLAN),
        "long_context": Regime("long_context",
                               lambda: models.transformer(T=1024, d=256, V=8192, layers=2,
                                                          heads=4, name="long_context"), [4],
                               "transformer LM T=1024 d=256 V=8192 L=2 H=4, tied (T = 4d)",
                               LONG_CONTEXT_PLAN, maxbatch=False),
        "vocab": Regime("vocab", lambda: models.transformer(T=16, d=64, V=32768, layers=1,
                                                            heads=4, name="vocab"), [8, 32],
                        "transformer LM T=16 d=64 V=32768 L=1, tied (large vocab)", FULL_PLAN,
                        maxbatch=False),
        "scan_remat": Regime("scan_remat", lambda: models.scan_remat(T=32, d=128, V=2048,
                                                                     layers=4, heads=4), [8, 32],
                             "transformer T=32 d=128 V=2048, lax.scan over 4 "
                             "jax.checkpoint layers, stacked params", FULL_PLAN),
        "matrix": Regime("matrix", lambda: models.transformer(T=32, d=256, V=8192, layers=2,
                                                              heads=4, name="matrix"), [32],
                         "kron_moments (max_dim 1024) on the short transformer: per-example "
                         "Kronecker moments", MATRIX_PLAN, maxbatch=False),
        "merged_lora": Regime("merged_lora", lambda: models.lora(), [32],
                              "merged LoRA x @ (W + (alpha/r) A @ B), T=32 D=256 F=1024 r=8, "
                              "adapters only (W frozen)", LORA_PLAN, maxbatch=False),
        "lora": Regime("lora", lambda: models.lora(merged=False), [32],
                       "unmerged LoRA x @ W + (alpha/r) (x @ A) @ B, T=32 D=256 F=1024 r=8, "
                       "adapters only (W frozen)", LORA_PLAN, maxbatch=False),
    }


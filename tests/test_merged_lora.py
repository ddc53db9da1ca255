"""Merged LoRA weights ``x @ (W + c * A @ B)``: each adapter (and a trained base weight)
is a site of its own (`sites/lora.py`), checked against the ``vmap(grad)`` oracle.

The zoo case ``merged_lora`` (every statistic, both dtypes) is in test_oracle.py; here:
variants (one example, rank one without tokens, subtraction and transposed views, an
adapter used elsewhere too, the merged weight at two sites, layers under ``lax.scan``),
chunks, ``vmap``/``jit``, clipping with remat (the reweighted pass), a frozen weight
passed as an argument, ``explain``, and the uses that fall back, with their reasons.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from conftest import (
    PROFILES,
    STAT_IDS,
    STATS,
    Reference,
    assert_tree_close_bound,
    check_against_reference,
    dtype_ctx,
    run_stat,
)

import jaxpr_surgery as js

LORA = "merged-lora"


# --------------------------------------------------------------------------- #
# Variants, checked with the oracle suite's error model (conftest.Reference)
# --------------------------------------------------------------------------- #
class _VariantReference(Reference):
    """`conftest.Reference` of a case built by ``make(dtype)`` rather than from the zoo."""

    def __init__(self, name, make):
        self.name = name
        with zoo.x64():
            self.case = make(jnp.float64)
        self.g = jax.tree.map(lambda a: np.asarray(a, np.float64), zoo.per_example_grads(self.case))
        self.leaves, self.treedef = jax.tree.flatten(self.g)
        self.B = self.leaves[0].shape[0]
        self.norms = np.sqrt(zoo.oracle_from_grads(self.g, "sq_norms"))
        self._clip = {"median": float(np.median(self.norms)),
                      "all": 0.5 * float(np.min(self.norms))}
        self._cache = {}


def _mlp(dtype, *, B=5, T=3, D=6, H=7, R=2, scale=0.5, seed=0):
    """A two-layer merged LoRA MLP: frozen ``W1`` (a constant), ``(W2 + s * A2 @ B2)`` with
    ``W2`` trained; tokens when ``T``, else one vector per example."""
    r = zoo._Rand(seed, dtype)
    w1 = r.dense(D, H)
    params = {
        "A1": r.normal((D, R), 0.4), "B1": r.normal((R, H), 0.4),
        "W2": r.dense(H, H), "A2": r.normal((H, R), 0.4), "B2": r.normal((R, H), 0.4),
        "head": r.dense(H, 3),
    }
    shape = (B, T, D) if T else (B, D)
    batch = {"x": r.normal(shape), "y": r.ints(shape[:-1], 3)}

    def loss_fn(p, batch):
        h = jnp.tanh(batch["x"] @ (w1 + (p["A1"] @ p["B1"]) * (4.0 / R)))
        h = jnp.tanh(h @ (p["W2"] + scale * (p["A2"] @ p["B2"])))
        return jnp.mean(zoo._xent(h @ p["head"], batch["y"]))

    return zoo.ZooCase("mlp", loss_fn, params, batch)


def _views(dtype):
    """Adapters stored transposed and used through ``.T`` views, subtracted from the base
    weight, the base weight on the right of the product's scale; a trained scalar factor is
    not a constant, so it is not folded: see `test_unsupported_uses_fall_back`."""
    r = zoo._Rand(3, dtype)
    B, T, D, H, R = 4, 5, 7, 3, 3
    params = {"At": r.normal((R, D), 0.4), "Bt": r.normal((H, R), 0.4), "W": r.dense(D, H)}
    batch = {"x": r.normal((B, T, D)), "y": r.normal((B, T, H))}

    def loss_fn(p, batch):
        m = p["W"] - (p["At"].T @ p["Bt"].T) / 3.0
        return jnp.mean(jnp.square(jnp.tanh(jnp.einsum("btd,dh->bth", batch["x"], m)) - batch["y"]))

    return zoo.ZooCase("views", loss_fn, params, batch)


def _shared(dtype):
    """The adapter ``A`` also used unmerged, and the merged weight at two sites."""
    r = zoo._Rand(4, dtype)
    B, T, D, R = 6, 2, 5, 2
    w = r.dense(D, D)
    params = {"A": r.normal((D, R), 0.4), "B": r.normal((R, D), 0.4), "P": r.dense(R, D)}
    batch = {"x": r.normal((B, T, D)), "y": r.normal((B, T, D))}

    def loss_fn(p, batch):
        m = w + p["A"] @ p["B"]
        h = jnp.tanh(batch["x"] @ m) + (batch["x"] @ p["A"]) @ p["P"]
        h = jnp.tanh(h @ m)
        return jnp.mean(jnp.square(h - batch["y"]))

    return zoo.ZooCase("shared", loss_fn, params, batch)


def _scanned(dtype):
    """Merged layers stacked on a leading axis, ``lax.scan`` over them (the sites and
    their taps inside the scan body)."""
    r = zoo._Rand(5, dtype)
    L, B, T, D, R = 3, 4, 2, 5, 2
    w = r.normal((L, D, D), 1 / math.sqrt(D))
    params = {"A": r.normal((L, D, R), 0.4), "B": r.normal((L, R, D), 0.4), "W": r.dense(D, D)}
    batch = {"x": r.normal((B, T, D)), "y": r.normal((B, T, D))}

    def loss_fn(p, batch):
        def layer(h, lw):
            w0, a, b = lw
            return jnp.tanh(h @ (w0 + a @ b)), None

        h, _ = jax.lax.scan(layer, batch["x"], (w, p["A"], p["B"]))
        return jnp.mean(jnp.square(h @ p["W"] - batch["y"]))

    return zoo.ZooCase("scanned", loss_fn, params, batch)


def _unrolled(dtype):
    """Four identical merged layers in a Python loop: the interpreter evaluates each
    layer as one cached block (its site and taps inside)."""
    r = zoo._Rand(6, dtype)
    L, B, T, D, R = 4, 4, 3, 5, 2
    params = [{"A": r.normal((D, R), 0.4), "B": r.normal((R, D), 0.4), "W": r.dense(D, D)}
              for _ in range(L)]
    batch = {"x": r.normal((B, T, D)), "y": r.normal((B, T, D))}

    def loss_fn(p, batch):
        h = batch["x"]
        for lp in p:
            h = jnp.tanh(h @ (lp["W"] + 0.5 * lp["A"] @ lp["B"]))
        return jnp.mean(jnp.square(h - batch["y"]))

    return zoo.ZooCase("unrolled", loss_fn, params, batch)


VARIANTS = {
    "one_example": lambda dt: _mlp(dt, B=1),
    "rank_one_no_tokens": lambda dt: _mlp(dt, B=6, T=0, D=5, H=9, R=1),
    "views": _views,
    "shared": _shared,
    "scanned": _scanned,
    "unrolled": _unrolled,
}
# statistics undefined for one example (variance with ddof=1 and what builds on it)
_NOT_AT_B1 = {"variance", "snr", "gradient_noise_scale", "kurtosis"}
_REFS = {}


def _ref(name):
    if name not in _REFS:
        _REFS[name] = _VariantReference(name, VARIANTS[name])
    return _REFS[name]


def _stat_ids(name):
    return [s for s in STAT_IDS if not (name == "one_example" and s in _NOT_AT_B1)]


def _check_variant(name, dtype, **options):
    ref = _ref(name)
    ids = _stat_ids(name)
    with dtype_ctx(dtype):
        case = VARIANTS[name](jnp.dtype(dtype))
    out = run_stat(case, {s: ref.stat(s) for s in ids}, **options)
    prof = PROFILES[dtype]
    for s in ids:
        assert_tree_close_bound(
            out[s], ref.oracle(s), ref.bound(s, prof), what=f"{name}/{s}/{dtype}")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_match_oracle(name, dtype):
    _check_variant(name, dtype)


def _kinds(loss, params, batch, **kw):
    rep = js.explain(loss, **kw)(params, batch)
    return {leaf.path: (leaf.kinds, leaf.rule) for leaf in rep.leaves}, rep


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_take_the_merged_rule(name):
    case = VARIANTS[name](jnp.float32)
    rows, rep = _kinds(case.loss_fn, case.params, case.batch)
    assert rep.fallback_leaves == [], str(rep)
    adapters = {"one_example": ["A1", "B1", "A2", "B2", "W2"],
                "rank_one_no_tokens": ["A1", "B1", "A2", "B2", "W2"],
                "views": ["At", "Bt", "W"], "shared": [], "scanned": ["A", "B"],
                "unrolled": [f"[{i}]['{k}']" for i in range(4) for k in "ABW"]}[name]
    for k in adapters:
        k = k if k.startswith("[") else f"['{k}']"
        assert rows[k] == ([LORA], "streamed"), str(rep)
    if name == "shared":  # the merged weight at two sites, A at a third (dense)
        assert rows["['B']"] == ([LORA, LORA], "streamed"), str(rep)
        assert sorted(rows["['A']"][0]) == ["dense", LORA, LORA], str(rep)


# --------------------------------------------------------------------------- #
# The zoo case: explain, chunks, compositions, clipping with remat
# --------------------------------------------------------------------------- #
def test_zoo_case_explain_names_every_leaf_merged():
    case = zoo.get_case("merged_lora", "float32")
    rows, rep = _kinds(case.loss_fn, case.params, case.batch,
                       stat=[js.stats.variance(), js.stats.norms(), js.stats.clipped_mean(1.0)])
    for k in ("A1", "B1", "W2", "A2", "B2"):
        assert rows[f"['{k}']"] == ([LORA], "streamed"), str(rep)
    assert rows["['head']"] == (["dense"], "streamed")
    assert rep.fallback_leaves == []
    text = rep.jaxpr()
    line = next(ln for ln in text.splitlines() if "['W2'] merged-lora" in ln)
    assert "['A2'] merged-lora" in line and "['B2'] merged-lora" in line  # one equation
    assert "rank-r projection" in str(rep)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_zoo_case_in_chunks_of_two(dtype):
    case = zoo.get_case("merged_lora", dtype)
    from conftest import reference

    ref = reference("merged_lora")
    ids = ["mean", "variance", "sq_norms_per_leaf", "norms", "clipped_mean", "sign_mean",
           "elementwise_cos", "gradient_noise_scale"]
    out = run_stat(case, {s: ref.stat(s) for s in ids}, chunk_size=2)  # 5 examples: 2+2+1
    for s in ids:
        check_against_reference(out[s], "merged_lora", s, dtype)


def test_zoo_case_under_vmap_and_jit():
    """``vmap`` over stacked batches of ``jit(per_example_stat)``: each batch's own."""
    case = zoo.get_case("merged_lora", "float32")
    stat = {"v": js.stats.variance(), "n": js.stats.norms(), "c": js.stats.clipped_sum(0.5)}
    f = jax.jit(js.per_example_stat(case.loss_fn, stat))
    other = jax.tree.map(lambda x: x[::-1] * (1.5 if x.dtype == jnp.float32 else 1), case.batch)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), case.batch, other)
    both = jax.jit(jax.vmap(f, in_axes=(None, 0)))(case.params, stacked)
    for k, batch in enumerate((case.batch, other)):
        alone = f(case.params, batch)
        jax.tree.map(
            lambda a, b, k=k: np.testing.assert_allclose(a[k], b, rtol=2e-5, atol=1e-7), both, alone
        )


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_clipping_with_remat_taps_the_reweighted_pass(dtype):
    """With ``jax.checkpoint`` in the loss, clipped sums take a second, reweighted pass:
    the taps weight their sites' gradients there too."""
    case = zoo.get_case("merged_lora", dtype)
    remat = jax.checkpoint(case.loss_fn)
    from conftest import reference

    ref = reference("merged_lora")
    for s in ("clipped_mean", "clipped_sum", "clipped_mean_all"):
        out = run_stat(zoo.ZooCase("r", remat, case.params, case.batch), ref.stat(s))
        check_against_reference(out, "merged_lora", s, dtype)


def test_frozen_weight_as_an_argument():
    """``W`` passed as an argument that is not differentiated (``argnums=0``)."""
    case = _mlp(jnp.float32)
    r = np.random.default_rng(7)
    w = jnp.asarray(r.normal(size=(6, 7)) / 3, jnp.float32)
    p = {k: case.params[k] for k in ("A1", "B1", "head")}

    def loss(p, batch, w):
        h = jnp.tanh(batch["x"] @ (w + 0.5 * p["A1"] @ p["B1"]))
        return jnp.mean(zoo._xent(h @ p["head"], batch["y"]))

    rep = js.explain(loss, argnums=0, batch_argnums=1)(p, case.batch, w)
    rows = {leaf.path: (leaf.kinds, leaf.rule) for leaf in rep.leaves}
    assert rows["['A1']"] == ([LORA], "streamed") and rows["['B1']"] == ([LORA], "streamed")
    with zoo.x64():
        p64 = jax.tree.map(lambda a: a.astype(jnp.float64), p)
        b64 = {"x": case.batch["x"].astype(jnp.float64), "y": case.batch["y"]}
        w64 = w.astype(jnp.float64)
        g = zoo.vmap_grads(lambda p, b: loss(p, b, w64), p64, b64)
        for stat, name in [(js.stats.variance(), "variance"), (js.stats.sq_norms(), "sq_norms"),
                           (js.stats.sign_mean(), "sign_mean")]:
            got = jax.jit(js.per_example_stat(loss, stat))(p64, b64, w64)
            want = zoo.oracle_from_grads(jax.tree.map(np.asarray, g), name)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13),
                         got, want)


# --------------------------------------------------------------------------- #
# What falls back, and why
# --------------------------------------------------------------------------- #
def _small():
    r = zoo._Rand(11, jnp.float32)
    p = {"A": r.normal((4, 2), 0.4), "B": r.normal((2, 3), 0.4), "W": r.dense(4, 3)}
    batch = {"x": r.normal((5, 2, 4))}
    return p, batch


def _fallback_reasons(loss):
    p, batch = _small()
    rep = js.explain(loss)(p, batch)
    return {leaf.path: " ".join(leaf.reasons) for leaf in rep.leaves if leaf.fallback}, rep


def test_unsupported_uses_fall_back():
    # the merged weight transformed elementwise before it meets the data
    reasons, rep = _fallback_reasons(
        lambda p, b: jnp.mean(b["x"] @ jnp.tanh(p["W"] + p["A"] @ p["B"])))
    assert set(reasons) == {"['A']", "['B']", "['W']"}, str(rep)
    assert "merged weight (W + A @ B) used in tanh" in reasons["['A']"]
    # a scale by another parameter is no constant factor
    reasons, _ = _fallback_reasons(
        lambda p, b: jnp.mean(b["x"] @ (p["W"] * (p["A"] @ p["B"]))))
    assert set(reasons) == {"['A']", "['B']", "['W']"}
    assert "combined with another parameter in mul" in reasons["['W']"]


def test_a_residual_factor_takes_the_others_along():
    """An adapter residual elsewhere (inside a custom_vjp) is a per-example copy: the
    other adapter and the base weight read it, so they fall back too, saying why."""

    @jax.custom_vjp
    def ident(a):
        return a

    ident.defvjp(lambda a: (a, None), lambda _, g: (g,))

    def loss(p, b):
        y = b["x"] @ (p["W"] + p["A"] @ p["B"])
        return jnp.mean(y) + jnp.mean(b["x"] @ ident(p["A"]))

    reasons, rep = _fallback_reasons(loss)
    assert set(reasons) == {"['A']", "['B']", "['W']"}, str(rep)
    assert "with a factor that takes exact per-example gradients" in reasons["['B']"]
    p, batch = _small()
    g = zoo.vmap_grads(loss, p, batch)
    got = jax.jit(js.per_example_stat(loss, js.stats.second_moment()))(p, batch)
    jax.tree.map(lambda a, gb: np.testing.assert_allclose(a, np.mean(gb ** 2, 0), rtol=1e-5),
                 got, g)


def test_a_residual_base_weight_keeps_the_adapters_streamed():
    """Weight decay on ``W`` makes it residual (its per-example copy is read by the
    adapters' sites, batched); the adapters keep their rule and stay exact."""
    case = zoo.get_case("weight_decay_lora", "float32")
    rows, rep = _kinds(case.loss_fn, case.params, case.batch)
    assert rows["['A']"] == ([LORA], "streamed") and rows["['B']"] == ([LORA], "streamed"), str(rep)
    from conftest import reference

    ref = reference("weight_decay_lora")
    for s in ("variance", "norms_per_leaf", "clipped_mean"):
        check_against_reference(run_stat(case, ref.stat(s)), "weight_decay_lora", s, "float32")


def test_stat_ids_cover_the_oracle_list():
    assert set(_stat_ids("views")) == set(STATS)

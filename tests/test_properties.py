"""Property tests of the statistics (hypothesis + pytest) on a few zoo models.

* permutation invariance of the batch (sq_norms permute along),
* a batch of one example,
* a duplicated batch (mean unchanged, variance scaled by a known factor),
* clipped_mean / clipped_sum with clip = inf are mean / sum,
* internal consistency: sum over leaves of per-leaf sq_norms, norms**2,
* zero-gradient examples: no NaN in norms / clipped statistics,
* variance accuracy when the examples nearly agree (and when they agree exactly).

The jitted statistic function is built once per (model, request) and reused
across hypothesis examples with the same shapes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from conftest import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpr_surgery as js

pytestmark = pytest.mark.slow

SETTINGS = settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

PROP_CASES = ["mlp", "transformer"]
CLIP = 0.3


def _request(clip=CLIP):
    s = js.stats
    return {
        "mean": s.mean(),
        "sum": s.sum(),
        "m2": s.second_moment(),
        "var": s.variance(),
        "var0": s.variance(ddof=0),
        "sign": s.sign_mean(),
        "abs": s.abs_mean(),
        "sq": s.sq_norms(),
        "sq_leaf": s.sq_norms(per_leaf=True),
        "norms": s.norms(),
        "norms_leaf": s.norms(per_leaf=True),
        "clip": s.clipped_mean(clip),
        "clipsum": s.clipped_sum(clip),
    }


@functools.cache
def _stat_fn(case_name: str, kind: str = "all"):
    case = zoo.get_case(case_name, "float32")
    if kind == "all":
        req = _request()
    elif kind == "one":  # a batch of one: variance(ddof=1) is undefined (raises)
        req = {k: v for k, v in _request().items() if k != "var"}
    elif kind == "inf":
        req = {
            "mean": js.stats.mean(),
            "sum": js.stats.sum(),
            "clip": js.stats.clipped_mean(math.inf),
            "clipsum": js.stats.clipped_sum(math.inf),
        }
    elif kind == "var":
        req = {"var": js.stats.variance(), "m2": js.stats.second_moment(), "mean": js.stats.mean()}
    else:
        raise ValueError(kind)
    return jax.jit(js.per_example_stat(case.loss_fn, req))


def _run(case_name, batch, kind="all", params=None):
    case = zoo.get_case(case_name, "float32")
    out = _stat_fn(case_name, kind)(case.params if params is None else params, batch)
    return jax.tree.map(np.asarray, out)


def _take(batch, idx):
    idx = np.asarray(idx)
    return jax.tree.map(lambda x: x[idx], batch)


def _close(a, b, rtol=2e-5, atol_frac=1e-5, what=""):
    """Tree allclose with an absolute floor relative to each leaf's magnitude."""
    fa, ta = jax.tree_util.tree_flatten_with_path(a)
    fb, tb = jax.tree.flatten(b)
    assert ta == tb, f"{what}: structure {ta} != {tb}"
    for (path, x), y in zip(fa, fb, strict=True):
        x = np.asarray(x, np.float64)
        y = np.asarray(y, np.float64)
        scale = float(np.max(np.abs(y))) if y.size else 0.0
        np.testing.assert_allclose(
            x,
            y,
            rtol=rtol,
            atol=atol_frac * scale + 1e-30,
            err_msg=f"{what} {jax.tree_util.keystr(path)}",
        )


def _B(case_name):
    return jax.tree.leaves(zoo.get_case(case_name, "float32").batch)[0].shape[0]


# --------------------------------------------------------------------------- #
# Permutation invariance
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("case_name", PROP_CASES)
@SETTINGS
@given(data=st.data())
def test_permutation_invariance(case_name, data):
    B = _B(case_name)
    perm = np.asarray(data.draw(st.permutations(list(range(B))), label="perm"))
    batch = zoo.get_case(case_name, "float32").batch
    base = _run(case_name, batch)
    out = _run(case_name, _take(batch, perm))
    for k in ("mean", "sum", "m2", "var", "var0", "abs", "clip", "clipsum"):
        _close(out[k], base[k], what=f"{case_name} {k} permuted {perm}")
    # sign means are multiples of 1/B: compare exactly up to rounding of k/B
    _close(out["sign"], base["sign"], rtol=0, atol_frac=1e-6, what="sign permuted")
    for k in ("sq", "norms"):
        _close(out[k], base[k][perm], what=f"{k} permuted")
    for k in ("sq_leaf", "norms_leaf"):
        _close(out[k], jax.tree.map(lambda v: v[perm], base[k]), what=f"{k} permuted")


# --------------------------------------------------------------------------- #
# A batch of one example
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("case_name", PROP_CASES)
@SETTINGS
@given(data=st.data())
def test_batch_of_one(case_name, data):
    B = _B(case_name)
    i = data.draw(st.integers(0, B - 1), label="example")
    batch = _take(zoo.get_case(case_name, "float32").batch, [i])
    out = _run(case_name, batch, kind="one")
    mean = out["mean"]
    # the one per-example gradient is the mean; check it against the oracle's g_i
    g_i = jax.tree.map(lambda g: np.asarray(g[i], np.float64), reference(case_name).g)
    _close(mean, g_i, rtol=1e-4, atol_frac=1e-4, what="mean of one example == g_i")
    _close(out["sum"], mean, rtol=1e-6, atol_frac=1e-7, what="sum == mean")
    # variance with ddof=0 of one example is 0
    for (path, v), m2 in zip(
        jax.tree_util.tree_flatten_with_path(out["var0"])[0],
        jax.tree.leaves(out["m2"]),
        strict=True,
    ):
        assert np.all(np.abs(v) <= 1e-7 * np.max(m2) + 1e-30), (
            f"variance(ddof=0) of one example not 0 at {jax.tree_util.keystr(path)}: "
            f"max {np.max(np.abs(v))} (max m2 {np.max(m2)})"
        )
    _close(
        jax.tree.map(np.abs, mean),
        jax.tree.map(np.sqrt, out["m2"]),
        rtol=1e-5,
        atol_frac=1e-5,
        what="|mean| == sqrt(second_moment)",
    )
    _close(
        out["abs"], jax.tree.map(np.abs, mean), rtol=1e-5, atol_frac=1e-6, what="abs_mean == |mean|"
    )
    for (path, s), m in zip(
        jax.tree_util.tree_flatten_with_path(out["sign"])[0], jax.tree.leaves(mean), strict=True
    ):
        clear = np.abs(m) > 1e-5 * np.max(np.abs(m))
        np.testing.assert_array_equal(
            s[clear],
            np.sign(m)[clear],
            err_msg=f"sign_mean == sign(mean) {jax.tree_util.keystr(path)}",
        )
    norm2 = sum(np.sum(np.square(np.asarray(m, np.float64))) for m in jax.tree.leaves(mean))
    assert out["sq"].shape == (1,)
    np.testing.assert_allclose(out["sq"][0], norm2, rtol=1e-5)
    np.testing.assert_allclose(out["norms"][0], math.sqrt(norm2), rtol=1e-5)
    _close(
        out["sq_leaf"],
        jax.tree.map(lambda m: np.sum(np.square(m))[None], mean),
        rtol=1e-5,
        what="per-leaf sq_norms of one example",
    )
    factor = min(1.0, CLIP / math.sqrt(norm2))
    _close(
        out["clip"],
        jax.tree.map(lambda m: m * factor, mean),
        rtol=1e-5,
        what="clipped_mean of one example",
    )


# --------------------------------------------------------------------------- #
# Duplicated batch
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("case_name", PROP_CASES)
def test_duplicated_batch(case_name):
    batch = zoo.get_case(case_name, "float32").batch
    B = _B(case_name)
    base = _run(case_name, batch)
    dup = _run(case_name, jax.tree.map(lambda x: jnp.concatenate([x, x]), batch))
    for k in ("mean", "m2", "var0", "sign", "abs", "clip"):
        _close(dup[k], base[k], what=f"{k} of a duplicated batch")
    _close(dup["sum"], jax.tree.map(lambda s: 2 * s, base["sum"]), what="sum doubles")
    _close(dup["clipsum"], jax.tree.map(lambda s: 2 * s, base["clipsum"]), what="clipsum doubles")
    # ddof=1: M2 doubles, divisor B-1 -> 2B-1
    f = 2 * (B - 1) / (2 * B - 1)
    _close(dup["var"], jax.tree.map(lambda v: f * v, base["var"]), what="variance(ddof=1) scaled")
    _close(dup["sq"], np.concatenate([base["sq"], base["sq"]]), what="sq_norms tiled")
    _close(
        dup["norms_leaf"],
        jax.tree.map(lambda v: np.concatenate([v, v]), base["norms_leaf"]),
        what="per-leaf norms tiled",
    )


# --------------------------------------------------------------------------- #
# clip = inf, internal consistency
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("case_name", PROP_CASES)
def test_clip_inf_is_mean(case_name):
    out = _run(case_name, zoo.get_case(case_name, "float32").batch, kind="inf")
    # the two routes sum the same float32 per-example gradients in different orders: a
    # few ulps of the leaf's largest value apart where the examples cancel (the
    # transformer's embedding: 1.4 float32 eps of its scale apart on jax 0.10.2 and 0.12)
    tol = dict(rtol=1e-6, atol_frac=8 * float(np.finfo(np.float32).eps))
    _close(out["clip"], out["mean"], **tol, what="clipped_mean(inf) == mean")
    _close(out["clipsum"], out["sum"], **tol, what="clipped_sum(inf) == sum")


@pytest.mark.parametrize("case_name", ["mlp", "cnn", "transformer", "rnn", "weight_decay_lora"])
def test_norm_consistency(case_name):
    case = zoo.get_case(case_name, "float32")
    s = js.stats
    req = {
        "sq": s.sq_norms(),
        "sq_leaf": s.sq_norms(per_leaf=True),
        "n": s.norms(),
        "n_leaf": s.norms(per_leaf=True),
    }
    out = jax.tree.map(
        np.asarray, jax.jit(js.per_example_stat(case.loss_fn, req))(case.params, case.batch)
    )
    B = jax.tree.leaves(case.batch)[0].shape[0]
    assert out["sq"].shape == (B,) and out["n"].shape == (B,)
    assert jax.tree.structure(out["sq_leaf"]) == jax.tree.structure(case.params)
    leaf_sum = sum(np.asarray(v, np.float64) for v in jax.tree.leaves(out["sq_leaf"]))
    np.testing.assert_allclose(leaf_sum, out["sq"], rtol=1e-5, err_msg="sum of per-leaf sq_norms")
    np.testing.assert_allclose(
        np.square(out["n"].astype(np.float64)), out["sq"], rtol=1e-5, err_msg="norms**2 == sq_norms"
    )
    _close(
        jax.tree.map(np.square, out["n_leaf"]),
        out["sq_leaf"],
        rtol=1e-5,
        what="per-leaf norms**2 == per-leaf sq_norms",
    )
    assert np.all(out["sq"] >= 0)


# --------------------------------------------------------------------------- #
# Zero-gradient examples
# --------------------------------------------------------------------------- #
def _weighted_mlp():
    """An MLP whose batch carries per-example weights; weight 0 gives g_b == 0 exactly."""
    case = zoo.get_case("mlp", "float32")
    base_loss = case.loss_fn

    def loss_fn(params, batch):
        per_ex = jax.vmap(lambda x, y: base_loss(params, {"x": x[None], "y": y[None]}))(
            batch["x"], batch["y"]
        )
        return jnp.mean(batch["w"] * per_ex)

    return case, loss_fn


@pytest.mark.parametrize("zero", [[0], [1, 3], "all"])
def test_zero_gradient_example_no_nan(zero):
    case, loss_fn = _weighted_mlp()
    B = jax.tree.leaves(case.batch)[0].shape[0]
    w = np.ones(B, np.float32)
    zero_idx = list(range(B)) if zero == "all" else zero
    w[zero_idx] = 0.0
    batch = dict(case.batch, w=jnp.asarray(w))
    s = js.stats
    req = {
        "n": s.norms(),
        "n_leaf": s.norms(per_leaf=True),
        "sq": s.sq_norms(),
        "clip": s.clipped_mean(CLIP),
        "clipsum": s.clipped_sum(CLIP),
        "mean": s.mean(),
        "var": s.variance(),
        "sign": s.sign_mean(),
        "snr": s.snr(),
    }
    out = jax.tree.map(np.asarray, jax.jit(js.per_example_stat(loss_fn, req))(case.params, batch))
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        assert not np.any(np.isnan(leaf)), f"NaN in {jax.tree_util.keystr(path)}"
    np.testing.assert_array_equal(out["n"][zero_idx], 0.0)
    np.testing.assert_array_equal(out["sq"][zero_idx], 0.0)
    for v in jax.tree.leaves(out["n_leaf"]):
        np.testing.assert_array_equal(v[zero_idx], 0.0)
    # against the oracle of the same weighted model
    wcase = zoo.ZooCase("weighted_mlp", loss_fn, case.params, batch)
    g = zoo.per_example_grads(wcase)
    for k, name, kw in [
        ("clip", "clipped_mean", {"clip_norm": CLIP}),
        ("clipsum", "clipped_sum", {"clip_norm": CLIP}),
        ("mean", "mean", {}),
        ("n", "norms", {}),
    ]:
        _close(
            out[k],
            zoo.oracle_from_grads(g, name, **kw),
            rtol=1e-5,
            atol_frac=1e-5,
            what=f"zero-grad example(s) {zero}: {k}",
        )
    if zero == "all":
        for v in jax.tree.leaves(out["clip"]) + jax.tree.leaves(out["snr"]):
            np.testing.assert_array_equal(v, 0.0)


def test_grad_of_clipped_mean_with_zero_gradient_example():
    """api.md says the statistic function is grad-able: no NaN through a zero norm."""
    case, loss_fn = _weighted_mlp()
    B = jax.tree.leaves(case.batch)[0].shape[0]
    w = np.ones(B, np.float32)
    w[0] = 0.0
    batch = dict(case.batch, w=jnp.asarray(w))
    f = js.per_example_stat(loss_fn, js.stats.clipped_mean(CLIP))

    def outer(params):
        return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(f(params, batch)))

    gr = jax.jit(jax.grad(outer))(case.params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(gr)[0]:
        assert np.all(np.isfinite(np.asarray(leaf))), (
            f"non-finite grad at {jax.tree_util.keystr(path)}"
        )


# --------------------------------------------------------------------------- #
# Variance accuracy when examples (nearly) agree
# --------------------------------------------------------------------------- #
NEAR_CASES = ["mlp", "cnn", "rnn"]


def _near_batch(case_name, dtype, spread):
    """Every example is example 0 with its continuous input perturbed by ``spread`` (relative)."""
    case = zoo.get_case(case_name, dtype)
    B = jax.tree.leaves(case.batch)[0].shape[0]
    rng = np.random.default_rng(123)
    x0 = np.asarray(case.batch["x"][0], np.float32)
    noise = rng.standard_normal((B,) + x0.shape).astype(np.float32)
    x = (x0[None] * (1 + spread * noise)).astype(np.float32)
    batch = {k: jnp.asarray(np.repeat(np.asarray(v[:1]), B, axis=0)) for k, v in case.batch.items()}
    with zoo._maybe_x64(case.params):
        batch["x"] = jnp.asarray(x, dtype=case.batch["x"].dtype)
    return zoo.ZooCase(case.name + "_near", case.loss_fn, case.params, batch)


@pytest.mark.parametrize("case_name", NEAR_CASES)
def test_variance_accurate_when_examples_nearly_agree(case_name):
    """Per-example grads differing by ~1e-3 relative: float32 variance within 1e-3 of float64.

    ``E[g^2] - mean^2`` in float32 is off by tens of percent here.
    """
    near32 = _near_batch(case_name, "float32", 1e-3)
    with zoo.x64():
        near64 = _near_batch(case_name, "float64", 1e-3)
    g64 = zoo.per_example_grads(near64)
    var64 = zoo.oracle_from_grads(g64, "variance")
    mean64 = zoo.oracle_from_grads(g64, "mean")
    # construction check: the examples really nearly agree
    rel = [
        np.sqrt(np.sum(v)) / np.sqrt(np.sum(np.square(m)))
        for v, m in zip(jax.tree.leaves(var64), jax.tree.leaves(mean64), strict=True)
    ]
    assert 1e-5 < np.median(rel) < 1e-2, rel
    out = jax.tree.map(
        np.asarray,
        jax.jit(
            js.per_example_stat(
                near32.loss_fn, {"var": js.stats.variance(), "var0": js.stats.variance(ddof=0)}
            )
        )(near32.params, near32.batch),
    )
    naive32 = zoo.oracle_from_grads(zoo.per_example_grads(near32), "variance")
    B = jax.tree.leaves(near32.batch)[0].shape[0]
    for (path, v32), v0, vn, v64 in zip(
        jax.tree_util.tree_flatten_with_path(out["var"])[0],
        jax.tree.leaves(out["var0"]),
        jax.tree.leaves(naive32),
        jax.tree.leaves(var64),
        strict=True,
    ):
        nrm = np.linalg.norm(v64)
        err = np.linalg.norm(v32.astype(np.float64) - v64) / nrm
        err_naive = np.linalg.norm(vn - v64) / nrm
        where = jax.tree_util.keystr(path)
        assert np.all(v32 >= 0), f"negative variance at {where}"
        assert err <= max(1e-3, 3 * err_naive), (
            f"{case_name} {where}: float32 variance rel. error {err:.2e} vs float64 oracle "
            f"(float32 vmap(grad) achieves {err_naive:.2e})"
        )
        np.testing.assert_allclose(
            v0 * B,
            v32 * (B - 1),
            rtol=1e-5,
            atol=1e-6 * np.max(v32),
            err_msg=f"ddof=0 vs ddof=1 {where}",
        )


@pytest.mark.parametrize("case_name", ["mlp", "transformer"])
def test_variance_of_identical_examples_is_tiny(case_name):
    """All examples equal: variance ~0 (centred computation), never negative."""
    case = zoo.get_case(case_name, "float32")
    B = jax.tree.leaves(case.batch)[0].shape[0]
    batch = jax.tree.map(lambda x: jnp.repeat(x[:1], B, axis=0), case.batch)
    out = _run(case_name, batch, kind="var")
    for (path, v), m2 in zip(
        jax.tree_util.tree_flatten_with_path(out["var"])[0], jax.tree.leaves(out["m2"]), strict=True
    ):
        where = jax.tree_util.keystr(path)
        assert np.all(v >= 0), f"negative variance at {where}: min {v.min()}"
        assert np.all(v <= 1e-10 * np.max(m2) + 1e-35), (
            f"variance of identical examples at {where}: max {v.max():.3e} "
            f"vs max second moment {np.max(m2):.3e}"
        )


# --------------------------------------------------------------------------- #
# Leaves with no per-example dependence
# --------------------------------------------------------------------------- #
def test_unused_and_example_independent_params():
    """An unused leaf gets zeros; a leaf used only by a regulariser (no example data)
    has the same gradient for every example: variance 0, snr inf (mean != 0)."""
    case = zoo.get_case("mlp", "float32")
    rng = np.random.default_rng(0)
    params = dict(
        case.params,
        unused=jnp.asarray(rng.standard_normal((3, 2)), jnp.float32),
        reg=jnp.asarray(rng.standard_normal((4,)), jnp.float32),
    )

    def loss_fn(params, batch):
        core = {k: params[k] for k in ("l1", "l2", "l3")}
        return case.loss_fn(core, batch) + 1e-2 * jnp.sum(jnp.square(params["reg"]))

    s = js.stats
    req = {
        "mean": s.mean(),
        "var": s.variance(),
        "m2": s.second_moment(),
        "sign": s.sign_mean(),
        "sq_leaf": s.sq_norms(per_leaf=True),
        "sq": s.sq_norms(),
        "clip": s.clipped_mean(CLIP),
        "snr": s.snr(),
    }
    out = jax.tree.map(np.asarray, jax.jit(js.per_example_stat(loss_fn, req))(params, case.batch))
    B = jax.tree.leaves(case.batch)[0].shape[0]
    for k in ("mean", "var", "m2", "sign", "clip", "snr"):
        np.testing.assert_array_equal(out[k]["unused"], 0.0, err_msg=f"unused leaf: {k}")
    np.testing.assert_array_equal(out["sq_leaf"]["unused"], np.zeros(B))
    reg = np.asarray(params["reg"], np.float64)
    np.testing.assert_allclose(out["mean"]["reg"], 2e-2 * reg, rtol=1e-6)
    np.testing.assert_allclose(out["m2"]["reg"], np.square(2e-2 * reg), rtol=1e-5)
    np.testing.assert_array_equal(out["sign"]["reg"], np.sign(reg))
    assert np.all(np.abs(out["var"]["reg"]) <= 1e-12 * np.max(out["m2"]["reg"]))
    np.testing.assert_allclose(
        out["sq_leaf"]["reg"], np.full(B, np.sum(np.square(2e-2 * reg))), rtol=1e-5
    )
    assert np.all(np.isinf(out["snr"]["reg"]) | (out["snr"]["reg"] > 1e10))
    # against the oracle of the same model
    wcase = zoo.ZooCase("mlp_extra", loss_fn, params, case.batch)
    g = zoo.per_example_grads(wcase)
    for k, name, kw in [
        ("clip", "clipped_mean", {"clip_norm": CLIP}),
        ("sq", "sq_norms", {}),
        ("mean", "mean", {}),
    ]:
        _close(
            out[k],
            zoo.oracle_from_grads(g, name, **kw),
            rtol=1e-5,
            atol_frac=1e-5,
            what=f"extra leaves: {k}",
        )

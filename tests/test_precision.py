"""Precision: float64 models with float32 constants (a Flax BatchNorm's running
statistics), clipping in float64 models, float32 squared norms past the float32 range, and
ghost norms that cancel in float32 (their values, derivatives and grad of vmap).

Float64 results are compared with the jitted ``vmap(grad)`` oracle (zoo.py) at about
1e-12: a float32 step inside the transformation shows as 1e-7.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js

STATS = {
    "mean": (js.stats.mean(), {}),
    "sum": (js.stats.sum(), {}),
    "second_moment": (js.stats.second_moment(), {}),
    "variance": (js.stats.variance(), {}),
    "abs_mean": (js.stats.abs_mean(), {}),
    "sq_norms": (js.stats.sq_norms(), {}),
    "norms": (js.stats.norms(), {}),
}


def _all_stats(clip):
    stats = {k: s for k, (s, _) in STATS.items()}
    stats["clipped_mean"] = js.stats.clipped_mean(clip)
    stats["clipped_sum"] = js.stats.clipped_sum(0.5 * clip)
    return stats


def _median_norm(case):
    return float(np.median(np.sqrt(zoo.oracle(case, "sq_norms"))))


def _check_all(case, got, clip, rtol=1e-12):
    """Every entry of ``got`` (from `_all_stats`) against the oracle, relative to the
    oracle's scale of each leaf."""
    kws = {"clipped_mean": {"clip_norm": clip}, "clipped_sum": {"clip_norm": 0.5 * clip}}
    for name, value in got.items():
        kw = kws.get(name, {})
        want = zoo.oracle(case, name, **kw)
        scale = zoo.oracle_scale(case, name, **kw)
        scales = [scale] if isinstance(scale, float) else jax.tree.leaves(scale)
        assert len(scales) == len(jax.tree.leaves(want)) == len(jax.tree.leaves(value))
        leaves = zip(jax.tree.leaves(value), jax.tree.leaves(want), scales)
        for k, (a, w, s) in enumerate(leaves):
            err = float(np.max(np.abs(np.asarray(a, np.float64) - w)))
            assert err <= rtol * s, f"{name} leaf {k}: error {err:.3g} = {err / s:.3g} x scale"


# --------------------------------------------------------------------------- #
# Float32 constants in a float64 model
# --------------------------------------------------------------------------- #
def _bn_resnet_case(B=5):
    """A small Flax ResNet (conv, BatchNorm in inference mode, two identical residual
    blocks, dense head) in float64 whose running statistics stay float32, as Flax's
    default ``param_dtype`` makes them."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Conv(4, (3, 3), use_bias=False)(x)
            y = nn.relu(nn.BatchNorm(use_running_average=True)(y))
            y = nn.Conv(4, (3, 3), use_bias=False)(y)
            return nn.relu(x + nn.BatchNorm(use_running_average=True)(y))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
            x = Block()(Block()(x))
            return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))

    model = Net()
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((B, 6, 6, 2)), jnp.float64)
    y = jnp.asarray(r.integers(0, 3, B))
    variables = model.init(jax.random.key(1), x[:1].astype(jnp.float32))
    # running statistics away from their initial 0 and 1, in float32
    stats = jax.tree.map(
        lambda a: jnp.asarray(a + 0.3 + r.uniform(0, 0.5, a.shape), jnp.float32),
        variables["batch_stats"],
    )
    params = jax.tree.map(lambda a: a.astype(jnp.float64), variables["params"])

    def loss(p, b):
        logits = model.apply({"params": p, "batch_stats": stats}, b["x"])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, b["y"][:, None], 1))

    return zoo.ZooCase("bn_resnet", loss, params, {"x": x, "y": y})


def test_float32_running_statistics_in_a_float64_resnet():
    """Every statistic, clipping included, to 1e-12 of vmap(grad); ``mean`` equals
    ``jax.jit(jax.grad)``. The running statistics' ``rsqrt(var + eps)`` runs in float32:
    inside the transformation's nested jits XLA folded it to other float32 values than
    in the user's program (one ulp: 1e-7 relative on every leaf)."""
    with zoo.x64():
        case = _bn_resnet_case()
        clip = _median_norm(case)
        got = jax.jit(js.per_example_stat(case.loss_fn, _all_stats(clip)))(case.params, case.batch)
        _check_all(case, got, clip)
        g = jax.jit(jax.grad(case.loss_fn))(case.params, case.batch)
        for a, w in zip(jax.tree.leaves(got["mean"]), jax.tree.leaves(g)):
            np.testing.assert_allclose(a, w, rtol=1e-12, atol=1e-14 * float(np.max(np.abs(w))))


def _constants_case(remat=False, B=4):
    """A float64 MLP of three identical layers (repeated layers are traced once) mixing
    float32 constants through transcendental functions (rsqrt, exp, tanh) into the
    activations, and a float32 literal into a gain."""
    r = np.random.default_rng(1)
    d = 6
    n = lambda *s: jnp.asarray(r.standard_normal(s) * 0.6, jnp.float64)  # noqa: E731
    params = [{"w": n(d, d), "b": n(d), "g": 1.0 + n(d)} for _ in range(3)]
    consts = [jnp.asarray(r.uniform(0.3, 2.0, d), jnp.float32) for _ in range(3)]

    def layer(h, p, c):
        h = h @ p["w"] + p["b"]
        h = (h - jnp.tanh(c)) * jax.lax.rsqrt(c + np.float32(1e-5))
        h = h * (p["g"] * jnp.exp(-c))
        return jnp.tanh(h)

    if remat:
        layer = jax.checkpoint(layer)

    def loss(ps, b):
        h = b["x"]
        for p, c in zip(ps, consts):
            h = layer(h, p, c)
        return jnp.mean(jnp.sum((h - b["y"]) ** 2, -1))

    batch = {"x": n(B, d), "y": n(B, d)}
    return zoo.ZooCase("constants", loss, params, batch)


@pytest.mark.parametrize("remat", [False, True])
def test_float32_constants_in_a_float64_model(remat):
    with zoo.x64():
        case = _constants_case(remat)
        clip = _median_norm(case)
        got = jax.jit(js.per_example_stat(case.loss_fn, _all_stats(clip)))(case.params, case.batch)
        _check_all(case, got, clip)


# --------------------------------------------------------------------------- #
# Float32 squared norms past the float32 range
# --------------------------------------------------------------------------- #
HUGE = 3e19  # one example's loss weight: its gradient norm ~1e20, its squared norm ~1e40


def _exploding_case(remat=False, B=4, T=3, V=7, D=5):
    """A float32 LM-like loss whose per-example terms carry a weight ``s_b`` (a batch
    input), ``HUGE`` for example 1: that example's gradient is ``HUGE`` times an ordinary
    one on every leaf, representable in float32 while its squared norm is not.

    Leaf kinds: a table used by an embedding and by the tied output layer (two sites),
    a token-axis dense layer, a layernorm gain (scale-shift), a bias, and a pair of
    factors ``u @ v`` (residual: exact per-example gradients)."""
    r = np.random.default_rng(2)
    n = lambda *s: jnp.asarray(r.standard_normal(s) * 0.5, jnp.float32)  # noqa: E731
    params = {"embed": n(V, D), "w": n(D, D), "b": n(D), "g": 1.0 + n(D), "u": n(D, 2),
              "v": n(2, D)}

    def block(h, p):
        h = jnp.tanh(h @ p["w"] + p["b"])
        mu = jnp.mean(h, -1, keepdims=True)
        h = (h - mu) * jax.lax.rsqrt(jnp.mean(jnp.square(h - mu), -1, keepdims=True) + 1e-5)
        return h * p["g"] + h @ (p["u"] @ p["v"])

    if remat:
        block = jax.checkpoint(block)

    def loss(p, b):
        h = block(p["embed"][b["ids"]], p)
        logits = h @ p["embed"].T
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, b["targets"][..., None], -1)[..., 0]
        return jnp.mean(b["s"] * jnp.mean(nll, -1))

    s = np.ones(B, np.float32)
    s[1] = HUGE
    batch = {"ids": jnp.asarray(r.integers(0, V, (B, T))),
             "targets": jnp.asarray(r.integers(0, V, (B, T))), "s": jnp.asarray(s)}
    return zoo.ZooCase("exploding", loss, params, batch)


def _sq_norms64(case):
    return zoo.oracle(case, "sq_norms")  # float64 from the float32 per-example gradients


def test_the_exploding_case_overflows_float32():
    case = _exploding_case()
    sq = _sq_norms64(case)
    assert np.all(np.isfinite(sq)) and sq[1] > 1e39 > float(np.finfo(np.float32).max)
    g = zoo.per_example_grads(case)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(g))


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("chunk", [None, 3])
def test_norms_and_clipping_past_float32_squares(remat, chunk):
    """``norms`` stays finite (the norm is representable), the example's clipped gradient
    counts C g / |g| instead of nothing, cosines and norm quantiles see the true norm;
    ``sq_norms`` is the honest float32 value of the square: inf."""
    case = _exploding_case(remat)
    sq = _sq_norms64(case)
    C = float(np.sqrt(np.median(sq)))
    g = zoo.per_example_grads(case)
    ref = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64).mean(0) / HUGE,
                                             jnp.float32), g)
    stats = {
        "norms": js.stats.norms(),
        "norms_leaf": js.stats.norms(per_leaf=True),
        "sq_norms": js.stats.sq_norms(),
        "clipped_sum": js.stats.clipped_sum(C),
        "clipped_mean": js.stats.clipped_mean(C),
        "cos": js.stats.per_example_cosines(ref),
        "q": js.stats.norm_quantiles((0.0, 1.0), per_leaf=False),
    }
    got = jax.jit(js.per_example_stat(case.loss_fn, stats, chunk_size=chunk))(
        case.params, case.batch)
    np.testing.assert_allclose(got["norms"], np.sqrt(sq), rtol=2e-5)
    want_leaf = zoo.oracle(case, "norms", per_leaf=True)
    for a, w in zip(jax.tree.leaves(got["norms_leaf"]), jax.tree.leaves(want_leaf)):
        np.testing.assert_allclose(a, w, rtol=2e-5)
    assert np.isinf(got["sq_norms"][1])
    np.testing.assert_allclose(np.delete(got["sq_norms"], 1), np.delete(sq, 1), rtol=2e-5)
    for name in ("clipped_sum", "clipped_mean"):
        want = zoo.oracle(case, name, clip_norm=C)
        atol = 5e-5 * C / (4 if name == "clipped_mean" else 1)  # |terms| <= C
        for a, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, w, rtol=0, atol=atol)
    # cosines against the float64 oracle
    g64 = [np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in jax.tree.leaves(g)]
    r64 = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(ref)]
    dots = sum(x @ y for x, y in zip(g64, r64))
    cos = dots / (np.sqrt(sq) * np.sqrt(sum(y @ y for y in r64)))
    assert abs(cos[1]) > 0.1
    np.testing.assert_allclose(got["cos"], cos, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["q"], [np.sqrt(sq).min(), np.sqrt(sq).max()], rtol=2e-5)


def test_tied_table_past_float32_squares_in_feature_blocks(monkeypatch):
    """The tied table's overflowing example is recomputed from its summed gradient in
    feature blocks (`tiling.recompute_tile`) where that exceeds its share of the budget:
    norms and clipped sums as exact as whole. Its 7 rows in blocks of 4 leave a
    remainder: the embedding keeps the ids of a block's rows, the output layer slices
    them, and both must read the same rows (the last block was a shifted slice, off by
    1.7% on the overflowing example's norm)."""
    from jaxpr_surgery._src import tiling

    monkeypatch.setattr(tiling, "MIN_FEATURE_TILE_BYTES", 16)
    cut = []
    inner = tiling.recompute_tile
    monkeypatch.setattr(tiling, "recompute_tile",
                        lambda shape, *a: cut.append((shape, inner(shape, *a))) or cut[-1][1])
    case = _exploding_case()
    sq = _sq_norms64(case)
    C = float(np.sqrt(np.median(sq)))
    stats = {"norms": js.stats.norms(per_leaf=True), "clipped_sum": js.stats.clipped_sum(C)}
    # the table's G (7 x 5 float32) fits a tile of two examples, not a block of 1/8
    got = jax.jit(js.per_example_stat(case.loss_fn, stats, memory_budget_bytes=560,
                                      chunk_size=None))(case.params, case.batch)
    assert any(shape == (7, 5) and c is not None and c[1] < c[2] for shape, c in cut), cut
    for a, w in zip(jax.tree.leaves(got["norms"]),
                    jax.tree.leaves(zoo.oracle(case, "norms", per_leaf=True))):
        np.testing.assert_allclose(a, w, rtol=2e-5)
    want = zoo.oracle(case, "clipped_sum", clip_norm=C)
    for a, w in zip(jax.tree.leaves(got["clipped_sum"]), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, w, rtol=0, atol=5e-5 * C)


def _weighted_zoo_case(name, B_huge=1):
    """Zoo case ``name`` (float32) whose per-example loss carries a weight, ``HUGE`` for
    example ``B_huge``: each example's loss is ``loss_fn(params, example) * s``."""
    case = zoo.get_case(name, "float32")
    B = jax.tree.leaves(case.batch)[0].shape[0]
    s = np.ones(B, np.float32)
    s[B_huge] = HUGE

    def loss(p, b):  # one example (batch of one) per call: l_b = loss_fn(p, ex_b) s_b
        return case.loss_fn(p, b["inner"]) * b["s"][0]

    return zoo.ZooCase(name + "_weighted", loss, case.params,
                       {"inner": case.batch, "s": jnp.asarray(s)})


@pytest.mark.parametrize(
    "name", ["cnn", "transformer_scan_remat", "rnn", "onehot_embedding", "mlp_bf16"])
def test_norms_past_float32_squares_across_layer_kinds(name):
    """Convolutions, layers in lax.scan (remat), a recurrence, one-hot embeddings and
    bfloat16 parameters: norms finite, clipping keeps the example, squares honest."""
    case = _weighted_zoo_case(name)
    sq = _sq_norms64(case)
    assert sq[1] > float(np.finfo(np.float32).max)
    C = float(np.sqrt(np.median(sq)))
    stats = {"norms": js.stats.norms(), "sq_norms": js.stats.sq_norms(),
             "clipped_sum": js.stats.clipped_sum(C)}
    # (the loss is written for one example, its weight s[0]: on the whole batch it
    # would weigh every example by the first's, which the check refuses)
    got = jax.jit(js.per_example_stat(case.loss_fn, stats, check=False))(case.params, case.batch)
    rtol = 2e-2 if name in zoo.LOW_PRECISION else 1e-4
    np.testing.assert_allclose(got["norms"], np.sqrt(sq), rtol=rtol)
    assert np.isinf(got["sq_norms"][1])
    np.testing.assert_allclose(np.delete(got["sq_norms"], 1), np.delete(sq, 1), rtol=2 * rtol)
    want = zoo.oracle(case, "clipped_sum", clip_norm=C)
    for a, w in zip(jax.tree.leaves(got["clipped_sum"]), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float64), w, rtol=0, atol=rtol * C)


# --------------------------------------------------------------------------- #
# Clipping by a second backward pass (remat) in a float64 model with float32 steps
# --------------------------------------------------------------------------- #
def _float32_step_case(B=5, d=6):
    """A float64 MLP under ``jax.checkpoint`` whose hidden activations pass through
    float32 (as recurrentgemma's RG-LRU scan accumulates in float32 whatever the model's
    dtype): their cotangents are rounded to float32 in the backward pass, and a clipped
    sum that seeds that pass with ``c_b`` instead of 1 rounds ``c_b`` times them."""
    r = np.random.default_rng(3)
    n = lambda *s: jnp.asarray(r.standard_normal(s) * 0.6, jnp.float64)  # noqa: E731
    params = [{"w": n(d, d), "b": n(d)} for _ in range(2)]

    @jax.checkpoint
    def layer(h, p):
        h = jnp.tanh(h @ p["w"] + p["b"])
        return jnp.exp(0.5 * h.astype(jnp.float32)).astype(jnp.float64)

    def loss(ps, b):
        h = b["x"]
        for p in ps:
            h = layer(h, p)
        return jnp.mean(jnp.sum((h - b["y"]) ** 2, -1))

    return zoo.ZooCase("float32_step", loss, params, {"x": n(B, d), "y": n(B, d)})


def test_clipping_by_recompute_with_float32_steps():
    """Every statistic to 1e-12 of vmap(grad), clipped sums included: the second pass
    is seeded like the first and applies the clip factors where the parameters meet
    the data (in float64), not at the loss (where float32 steps would round them)."""
    with zoo.x64():
        case = _float32_step_case()
        clip = _median_norm(case)
        got = jax.jit(js.per_example_stat(case.loss_fn, _all_stats(clip)))(case.params, case.batch)
        _check_all(case, got, clip)


# --------------------------------------------------------------------------- #
# Ghost norms that cancel: float32 against float64, derivatives, grad of vmap
# --------------------------------------------------------------------------- #
def _cancel_case(dtype, which="all"):
    r = np.random.default_rng(4)
    B, T, d, F = 8, 32, 64, 64
    x = r.standard_normal((B, T // 2, d))
    c = r.standard_normal((B, T // 2, F))
    # the second half of the tokens undoes the first: on every example, or on the
    # odd ones alone (the recomputation must pick exactly those)
    sign = np.ones(B) if which == "all" else np.where(np.arange(B) % 2, 1.0, -1.0)
    sign = sign[:, None, None]
    x = np.concatenate([x, x + 1e-4 * r.standard_normal(x.shape)], 1)
    c = np.concatenate([c, -sign * c], 1)
    W = jnp.asarray(r.standard_normal((d, F)) / 8, dtype)

    def loss(W, b):
        return jnp.mean(jnp.sum((b["x"] @ W) * b["c"], axis=(-1, -2)))

    return loss, W, {"x": jnp.asarray(x, dtype), "c": jnp.asarray(c, dtype)}


@pytest.mark.parametrize("which", ["all", "odd"])
def test_ghost_norms_cancellation_float32_vs_float64(which):
    loss, W, b = _cancel_case(jnp.float32, which)
    sq, cm = js.per_example_stat(loss, (js.stats.sq_norms(), js.stats.clipped_mean(1e-2)))(W, b)

    def ref():
        l64, W64, b64 = _cancel_case(jnp.float64, which)
        g = zoo.vmap_grads(l64, W64, b64)
        o = zoo.oracle_from_grads
        return o(g, "sq_norms"), o(g, "clipped_mean", clip_norm=1e-2)

    n2, cm_ref = zoo.in_x64(ref)
    assert np.all(np.asarray(sq) >= 0)
    np.testing.assert_allclose(sq, n2, rtol=2e-2)
    # G_b itself cancels in float32 (as it does for vmap(grad)): compare at its scale
    np.testing.assert_allclose(cm, cm_ref, rtol=2e-2, atol=1e-2 * np.abs(cm_ref).max())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ghost_norms_recomputed_in_feature_blocks(monkeypatch, dtype):
    """An example whose ghost norm cancelled is formed alone in feature blocks where its
    ``G`` exceeds `tiling.RECOMPUTE_BUDGET_SHARE` of the memory budget (the loop's
    buffers are allocated whether or not it runs: under tensor parallelism a whole
    vocabulary-sized ``G`` per device part took 1.9x grad's memory): the same values,
    and their derivative, as the oracle's."""
    from jaxpr_surgery._src import tiling

    monkeypatch.setattr(tiling, "MIN_FEATURE_TILE_BYTES", 1024)
    cut = []
    inner = tiling.recompute_tile
    monkeypatch.setattr(tiling, "recompute_tile", lambda *a: cut.append(inner(*a)) or cut[-1])
    dt = jnp.dtype(dtype)
    budget = 8 * 64 * 64 * dt.itemsize // 3  # G_b: 64 x 64; blocks of 1/3 of it
    fn = js.per_example_stat(_tanh_loss, js.stats.sq_norms(), memory_budget_bytes=budget,
                             chunk_size=None)

    def run():
        W, b = _cancel_case(dt, "odd")[1:]
        sq = jax.jit(fn)(W, b)
        jac = jax.jit(jax.jacrev(lambda W: fn(W, b)))(W)
        return np.asarray(sq, np.float64), np.asarray(jac, np.float64)

    def ref():
        W, b = _cancel_case(jnp.float64, "odd")[1:]
        n2 = lambda W: jnp.sum(jnp.square(zoo.vmap_grads(_tanh_loss, W, b)), (1, 2))  # noqa: E731
        return np.asarray(n2(W)), np.asarray(jax.jacrev(n2)(W))

    got = zoo.in_x64(run) if dtype == "float64" else run()
    want_sq, want_jac = zoo.in_x64(ref)
    assert cut and all(c is not None and c[1] < c[2] for c in cut), cut  # (4 blocks of 16)
    # (G_b cancels to ~1e-4 of its terms, in vmap(grad) too: float64 agrees to ~1e-8)
    rtol = 1e-7 if dtype == "float64" else 2e-2
    np.testing.assert_allclose(got[0], want_sq, rtol=rtol)
    np.testing.assert_allclose(got[1], want_jac, rtol=rtol, atol=rtol * np.abs(want_jac).max())


def _tanh_loss(W, b):  # not linear in W: the norms have a derivative to check
    return jnp.mean(jnp.sum(jnp.tanh(b["x"] @ W) * b["c"], axis=(-1, -2)))


@pytest.mark.parametrize("jac", ["jacrev", "jacfwd"])
def test_ghost_norms_derivative_where_they_cancel(jac):
    """The flagged examples' norms come from a loop with a traced trip count, which
    has no reverse-mode derivative: derivatives (both modes) must still work and
    come from the exact recomputation, not the cancelling ghost sum (that one is
    off by 10x on the odd examples here in float32)."""
    d = getattr(jax, jac)

    def jacobian(dtype):
        W, b = _cancel_case(dtype, "odd")[1:]
        fn = js.per_example_stat(_tanh_loss, js.stats.sq_norms())
        return np.asarray(jax.jit(d(lambda W: fn(W, b)))(W), np.float64)

    def oracle():
        W, b = _cancel_case(jnp.float64, "odd")[1:]
        n2 = lambda W: jnp.sum(jnp.square(zoo.vmap_grads(_tanh_loss, W, b)), (1, 2))  # noqa: E731
        return np.asarray(jax.jit(d(n2))(W)), jacobian(jnp.float64)

    ref, ours64 = zoo.in_x64(oracle)
    np.testing.assert_allclose(ours64, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    ours32 = jacobian(jnp.float32)
    scale = np.abs(ref).reshape(len(ref), -1).max(1)
    err = np.abs(ours32 - ref).reshape(len(ref), -1).max(1) / scale
    assert np.all(err < 2e-2), err


def test_ghost_norms_grad_of_vmap_where_they_cancel():
    """grad of a vmap over models (the recomputation's flags batched) runs and matches
    the oracle, on the examples that cancel too."""

    def grads(dtype, ours):
        W, b = _cancel_case(dtype, "odd")[1:]
        Ws = jnp.stack([W, -0.5 * W])
        fn = js.per_example_stat(_tanh_loss, js.stats.sq_norms())
        if not ours:
            fn = lambda W, b: jnp.sum(jnp.square(zoo.vmap_grads(_tanh_loss, W, b)), (1, 2))  # noqa: E731
        wt = jnp.arange(1.0, 9.0, dtype=dtype)  # a different weight per example
        f = lambda Ws: jnp.sum(jax.vmap(fn, in_axes=(0, None))(Ws, b) * wt)  # noqa: E731
        return np.asarray(jax.jit(jax.grad(f))(Ws), np.float64)

    ref = zoo.in_x64(lambda: grads(jnp.float64, False))
    np.testing.assert_allclose(zoo.in_x64(lambda: grads(jnp.float64, True)), ref, rtol=1e-9,
                               atol=1e-12 * np.abs(ref).max())
    np.testing.assert_allclose(grads(jnp.float32, True), ref, rtol=2e-2,
                               atol=2e-2 * np.abs(ref).max())


def test_token_products_norms_need_no_recomputation(monkeypatch):
    """A token-axis dense layer whose norms come from tiles of its products (the cost
    model's choice at T much larger than its width) computes them on examples scaled
    by powers of two: exact, finite past float32's squares (``sq_norms`` the honest
    inf), and with no loop that recomputes examples one at a time (one per layer of
    the program: the time to the first step)."""
    from jaxpr_surgery._src import norms
    from jaxpr_surgery._src.sites import dense

    r = np.random.default_rng(5)
    B, T, D = 4, 16, 4
    params = {"w": jnp.asarray(r.standard_normal((D, D)) * 0.5, jnp.float32)}
    s = np.ones(B, np.float32)
    s[2] = 4 * HUGE

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w"])
        return jnp.mean(b["s"] * jnp.mean(jnp.sum(h**2, -1), -1))

    batch = {"x": jnp.asarray(r.standard_normal((B, T, D)), jnp.float32), "s": jnp.asarray(s)}
    case = zoo.ZooCase("products", loss, params, batch)
    recomputed, scaled = [], []
    monkeypatch.setattr(norms, "recompute_flagged", lambda *a: recomputed.append(1) or a[2])
    inner = dense.DenseKernel.scaled_sq_norms
    monkeypatch.setattr(dense.DenseKernel, "scaled_sq_norms",
                        lambda self, ing: scaled.append(self.c.N) or inner(self, ing))
    sq = _sq_norms64(case)
    assert sq[2] > 1e39 > float(np.finfo(np.float32).max)
    got = jax.jit(js.per_example_stat(loss, {"n": js.stats.norms(), "sq": js.stats.sq_norms()}))(
        params, batch)
    assert scaled == [T] and not recomputed
    np.testing.assert_allclose(got["n"], np.sqrt(sq), rtol=2e-5)
    assert np.isinf(got["sq"][2])
    np.testing.assert_allclose(np.delete(got["sq"], 2), np.delete(sq, 2), rtol=2e-5)


def test_kept_products_give_the_norms_past_float32_squares(monkeypatch):
    """A clipped sum at a token layer that keeps its products for the weighted sum
    (`keeps_products_for_clip`) takes an overflowing example's norm from its kept
    product (one more pass over it), not from recomputing the example in a loop of its
    own: exact, and no such loop in the program."""
    from jaxpr_surgery._src import norms

    r = np.random.default_rng(6)
    B, T, D = 4, 16, 4
    params = {"w": jnp.asarray(r.standard_normal((D, D)) * 0.5, jnp.float32)}
    s = np.ones(B, np.float32)
    s[1] = 4 * HUGE

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w"])
        return jnp.mean(b["s"] * jnp.mean(jnp.sum(h**2, -1), -1))

    batch = {"x": jnp.asarray(r.standard_normal((B, T, D)), jnp.float32), "s": jnp.asarray(s)}
    case = zoo.ZooCase("kept", loss, params, batch)
    rep = js.explain(loss, js.stats.clipped_mean(1.0))(params, batch)
    assert "kept for the weighted sum" in rep.leaves[0].hows["clipped_mean"], str(rep)
    recomputed = []
    monkeypatch.setattr(norms, "recompute_flagged", lambda *a: recomputed.append(1) or a[2])
    sq = _sq_norms64(case)
    assert sq[1] > 1e39 > float(np.finfo(np.float32).max)
    C = float(np.sqrt(np.median(sq)))
    got = jax.jit(js.per_example_stat(loss, js.stats.clipped_sum(C)))(params, batch)
    assert not recomputed
    want = zoo.oracle(case, "clipped_sum", clip_norm=C)
    np.testing.assert_allclose(got["w"], want["w"], rtol=0, atol=5e-5 * C)

"""Regression tests of the adversarial audit: inputs that once gave silently wrong
numbers, each checked against the vmap(grad) oracle (float64 where it matters)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js
from jaxpr_surgery._src.sites.embedding import canonical_ids, pack_ids, unpack_ids


def _per_example_grads(loss, params, batch):
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    return jax.vmap(jax.grad(one), in_axes=(None, 0))(params, batch)


_o = zoo.oracle_from_grads  # the oracle (tests/zoo.py), numpy float64


def _x64(fn):
    with jax.enable_x64(True):
        return fn()


# --------------------------------------------------------------------------- #
# 1. narrow integer ids into a table with more rows than the dtype's range
# --------------------------------------------------------------------------- #
V_NARROW = 300


def _lookup(kind):
    def loss(table, b):
        ids = b["ids"]
        if kind == "index":
            e = table[ids]
        elif kind == "onehot":
            e = jax.nn.one_hot(ids, V_NARROW, dtype=table.dtype) @ table
        else:
            e = jnp.take(table, ids, axis=0, mode=kind)
        return jnp.mean(jnp.sum(jnp.tanh(e) * b["y"], axis=(-1, -2)))

    return loss


@pytest.mark.parametrize("kind", ["index", "fill", "clip", "onehot"])
@pytest.mark.parametrize("id_dtype", [jnp.uint8, jnp.int8, jnp.int16])
def test_narrow_ids(kind, id_dtype):
    r = np.random.default_rng(0)
    info = np.iinfo(id_dtype)
    B, T, d = 6, 7, 3
    ids = r.integers(max(info.min, -3), info.max + 1, (B, T))
    ids[0, :3] = [info.max, 0, 1]
    table = jnp.asarray(r.standard_normal((V_NARROW, d)), jnp.float32)
    b = {"ids": jnp.asarray(ids, id_dtype), "y": jnp.asarray(r.standard_normal((B, T, d)),
                                                           jnp.float32)}
    loss = _lookup(kind)
    if kind == "index" and info.min < 0:
        pytest.skip("negative ids wrap around in table[ids]; covered by take(mode=...)")
    m, m2, sq = js.per_example_stat(
        loss, (js.stats.mean(), js.stats.second_moment(), js.stats.sq_norms()))(table, b)
    g = _per_example_grads(loss, table, b)
    np.testing.assert_allclose(m, jax.grad(loss)(table, b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, _o(g, "mean"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m2, _o(g, "second_moment"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sq, _o(g, "sq_norms"), rtol=1e-5, atol=1e-6)


def test_canonical_ids_keep_meaning():
    ids = jnp.asarray([0, 5, 255, 200], jnp.uint8)
    np.testing.assert_array_equal(canonical_ids(ids, 300), [0, 5, 255, 200])
    np.testing.assert_array_equal(canonical_ids(ids, 100), [0, 5, 100, 100])
    ids = jnp.asarray([-128, -1, 0, 127], jnp.int8)
    np.testing.assert_array_equal(canonical_ids(ids, 300), [-1, -1, 0, 127])


# --------------------------------------------------------------------------- #
# 2. large vocabularies: ids stay integral end to end
# --------------------------------------------------------------------------- #
def test_ids_pack_exactly():
    ids = jnp.asarray([-1, 0, 1, 4095, 4096, 2**24 + 1, 2**24 + 3, 2**31 - 1], jnp.int32)
    for dt in (jnp.float32, jnp.float64) if jax.config.jax_enable_x64 else (jnp.float32,):
        np.testing.assert_array_equal(unpack_ids(pack_ids(ids, dt)), ids)


def test_tied_leaf_large_ids_exact():
    """Ids above 2**24 into a tied (embedding x unembedding) leaf whose statistics go
    through ingredients, on a narrow table seen through a huge-id offset."""
    r = np.random.default_rng(1)
    V, d, B, T = 2**24 + 6, 1, 3, 4
    table = jnp.asarray(r.standard_normal((V, d)) * 0.1, jnp.float32)
    ids = jnp.asarray(r.integers(2**24 - 2, V, (B, T)), jnp.int32)

    def loss(t, b):
        h = t[b["ids"]]  # [B, T, 1]
        z = h[:, :, :, None] * t[2**24 - 2:, 0]  # tied use: last rows as a dense weight
        return jnp.mean(jnp.sum(jnp.tanh(z), axis=(-1, -2, -3)))

    rep = js.explain(loss)(table, {"ids": ids})
    assert not rep.fallback_leaves, str(rep)
    m, sq = js.per_example_stat(loss, (js.stats.mean(), js.stats.sq_norms()))(
        table, {"ids": ids})
    g = _per_example_grads(loss, table, {"ids": ids})
    rows = np.arange(2**24 - 2, V)
    np.testing.assert_allclose(np.asarray(m)[rows], _o(g, "mean")[rows], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(sq, _o(g, "sq_norms"), rtol=1e-4)


# --------------------------------------------------------------------------- #
# 3. variance cancellation on a token-free dense layer
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_variance_when_products_agree(dtype):
    def run():
        r = np.random.default_rng(2)
        x = jnp.asarray(r.uniform(1, 3, (16, 1)), dtype)
        W = jnp.asarray(r.uniform(0.5, 2, (1, 8)), dtype)
        loss = lambda W, b: jnp.mean(jnp.sum(jnp.log(b["x"] @ W), -1))  # noqa: E731
        var = js.per_example_stat(loss, js.stats.variance())(W, {"x": x})
        # every per-example gradient is 1/W exactly: the variance is 0
        scale = float(jnp.max(1 / W) ** 2)
        eps = float(jnp.finfo(dtype).eps)
        assert float(jnp.max(jnp.abs(var))) <= 64 * eps * scale, var
        return var

    (_x64 if dtype == jnp.float64 else lambda f: f())(run)


# --------------------------------------------------------------------------- #
# 4. a user's statistic never aliases a built-in of the same name
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", ["square", "sign", "abs", "identity"])
def test_user_names_do_not_alias_builtins(name):
    loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)  # noqa: E731
    r = np.random.default_rng(3)
    w = jnp.asarray(r.standard_normal(3), jnp.float32)
    b = {"x": jnp.asarray(r.standard_normal((5, 3)), jnp.float32),
         "y": jnp.asarray(r.standard_normal(5), jnp.float32)}
    cube = js.stats.elementwise(lambda g: g**3, multiplicative=True, name=name)
    builtin = {"square": js.stats.second_moment(), "sign": js.stats.sign_mean(),
               "abs": js.stats.abs_mean(), "identity": js.stats.mean()}[name]
    got_cube, got_b = js.per_example_stat(loss, (cube, builtin))(w, b)
    g = _per_example_grads(loss, w, b)
    np.testing.assert_allclose(got_cube, _o(g, "elementwise", phi=lambda x: x**3), rtol=1e-5)
    ref = {"square": "second_moment", "sign": "sign_mean", "abs": "abs_mean",
           "identity": "mean"}[name]
    np.testing.assert_allclose(got_b, _o(g, ref), rtol=1e-5)


# --------------------------------------------------------------------------- #
# 5. ghost norms when token contributions cancel
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
        g = _per_example_grads(l64, W64, b64)
        return _o(g, "sq_norms"), _o(g, "clipped_mean", clip_norm=1e-2)

    n2, cm_ref = _x64(ref)
    assert np.all(np.asarray(sq) >= 0)
    np.testing.assert_allclose(sq, n2, rtol=2e-2)
    # G_b itself cancels in float32 (as it does for vmap(grad)): compare at its scale
    np.testing.assert_allclose(cm, cm_ref, rtol=2e-2, atol=1e-2 * np.abs(cm_ref).max())


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
        n2 = lambda W: jnp.sum(jnp.square(_per_example_grads(_tanh_loss, W, b)), (1, 2))  # noqa: E731
        return np.asarray(jax.jit(d(n2))(W)), jacobian(jnp.float64)

    ref, ours64 = _x64(oracle)
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
            fn = lambda W, b: jnp.sum(jnp.square(_per_example_grads(_tanh_loss, W, b)), (1, 2))  # noqa: E731
        wt = jnp.arange(1.0, 9.0, dtype=dtype)  # a different weight per example
        f = lambda Ws: jnp.sum(jax.vmap(fn, in_axes=(0, None))(Ws, b) * wt)  # noqa: E731
        return np.asarray(jax.jit(jax.grad(f))(Ws), np.float64)

    ref = _x64(lambda: grads(jnp.float64, False))
    np.testing.assert_allclose(_x64(lambda: grads(jnp.float64, True)), ref, rtol=1e-9,
                               atol=1e-12 * np.abs(ref).max())
    np.testing.assert_allclose(grads(jnp.float32, True), ref, rtol=2e-2,
                               atol=2e-2 * np.abs(ref).max())


# --------------------------------------------------------------------------- #
# 6. clipping bounds
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), np.float32(0), np.float64("nan"),
                                 np.float32(-2), jnp.asarray(-1.0), jnp.asarray(0.0)])
def test_bad_concrete_clip_bounds_raise(bad):
    with pytest.raises(ValueError, match="clip_norm"):
        js.stats.clipped_mean(bad)
    with pytest.raises(ValueError, match="clip_norm"):
        js.stats.clipped_sum(bad)


def test_concrete_numpy_bound_works():
    loss = lambda w, b: jnp.mean((b["x"] @ w) ** 2)  # noqa: E731
    w, b = jnp.ones(3), {"x": jnp.arange(12.0).reshape(4, 3)}
    a = js.per_example_stat(loss, js.stats.clipped_mean(np.float32(2.0)))(w, b)
    c = js.per_example_stat(loss, js.stats.clipped_mean(2.0))(w, b)
    np.testing.assert_allclose(a, c)


@pytest.mark.parametrize("bound", [float("nan"), 0.0, -1.0])
def test_traced_bad_bound_poisons(bound):
    loss = lambda w, b: jnp.mean((b["x"] @ w) ** 2)  # noqa: E731
    w, b = jnp.ones(3), {"x": jnp.arange(12.0).reshape(4, 3)}
    f = jax.jit(lambda w, b, C: js.per_example_stat(loss, js.stats.clipped_mean(C))(w, b))
    out = f(w, b, jnp.float32(bound))
    assert np.all(np.isnan(out)), out
    ok = f(w, b, jnp.float32(np.inf))
    np.testing.assert_allclose(ok, jax.grad(loss)(w, b), rtol=1e-5)


# --------------------------------------------------------------------------- #
# Precision, keywords, undefined estimates
# --------------------------------------------------------------------------- #
def test_low_precision_result_dtypes():
    loss = lambda w, b: jnp.mean((b["x"] @ w) ** 2)  # noqa: E731
    w = jnp.ones(3, jnp.bfloat16)
    b = {"x": jnp.arange(12.0).reshape(4, 3).astype(jnp.bfloat16)}
    m, m2, n, s = js.per_example_stat(loss, (js.stats.mean(), js.stats.second_moment(),
                                             js.stats.norms(), js.stats.sign_mean()))(w, b)
    assert m.dtype == jnp.bfloat16  # gradient-like: the parameters' dtype, like jax.grad
    assert m2.dtype == jnp.float32 and n.dtype == jnp.float32 and s.dtype == jnp.float32


def test_keyword_arguments_pass_through():
    def loss(w, b, scale=1.0):
        return scale * jnp.mean((b["x"] @ w) ** 2)

    w, b = jnp.ones(3), {"x": jnp.arange(12.0).reshape(4, 3)}
    m = js.per_example_stat(loss, js.stats.mean())(w, b, scale=2.0)
    np.testing.assert_allclose(m, jax.grad(loss)(w, b, scale=2.0), rtol=1e-6)
    (l, ), _ = (js.value_and_per_example_stat(loss, js.stats.mean())(w, b, scale=3.0)[0],), None
    np.testing.assert_allclose(l, loss(w, b, scale=3.0), rtol=1e-6)


@pytest.mark.parametrize("stat,B", [(lambda: js.stats.variance(), 1),
                                    (lambda: js.stats.variance(ddof=3), 3),
                                    (lambda: js.stats.snr(), 1),
                                    (lambda: js.stats.gradient_noise_scale(), 1)])
def test_undefined_estimates_raise(stat, B):
    loss = lambda w, b: jnp.mean((b["x"] @ w) ** 2)  # noqa: E731
    w, b = jnp.ones(3), {"x": jnp.arange(3.0 * B).reshape(B, 3)}
    with pytest.raises(ValueError, match=f"B={B}"):
        js.per_example_stat(loss, stat())(w, b)


# --------------------------------------------------------------------------- #
# 7. check_per_example compares gradients, accepts sum losses, says what is wrong
# --------------------------------------------------------------------------- #
def _lin_case():
    r = np.random.default_rng(5)
    w = jnp.asarray(r.standard_normal(3), jnp.float32)
    b = {"x": jnp.asarray(r.standard_normal((6, 3)), jnp.float32),
         "y": jnp.asarray(r.standard_normal(6), jnp.float32)}
    return w, b


def test_check_per_example_catches_gradient_only_interaction():
    w, b = _lin_case()

    def loss(w, b):  # value: the mean loss; gradient scaled by a batch statistic
        per = (b["x"] @ w - b["y"]) ** 2
        s = jnp.std(b["x"] @ w)
        return jnp.mean(per) + jnp.mean(per) * (s - jax.lax.stop_gradient(s))

    # the loss value equals the mean of per-example losses ...
    np.testing.assert_allclose(loss(w, b), jnp.mean((b["x"] @ w - b["y"]) ** 2), rtol=1e-6)
    with pytest.raises(ValueError, match="gradients do not"):
        js.check_per_example(loss)(w, b)


def test_check_per_example_accepts_sum_losses_and_rejects_jit():
    w, b = _lin_case()
    sum_loss = lambda w, b: jnp.sum((b["x"] @ w - b["y"]) ** 2)  # noqa: E731
    assert js.check_per_example(sum_loss)(w, b) is None
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda w, b: js.check_per_example(sum_loss)(w, b))(w, b)
    with pytest.raises(ValueError, match="empty"):
        js.check_per_example(sum_loss)(w, {"x": b["x"][:0], "y": b["y"][:0]})


def test_string_in_aux_is_a_clear_error():
    w, b = _lin_case()

    def loss(w, b):
        return jnp.mean((b["x"] @ w - b["y"]) ** 2), {"note": "hello"}

    with pytest.raises(TypeError, match="not an array in its aux output"):
        js.per_example_stat(loss, js.stats.mean(), has_aux=True)(w, b)


def test_eager_calls_trace_once_per_signature():
    w, b = _lin_case()
    count = {"n": 0}

    def loss(w, b):
        count["n"] += 1
        return jnp.mean((b["x"] @ w - b["y"]) ** 2)

    f = js.per_example_stat(loss, js.stats.second_moment())
    first = f(w, b)
    n = count["n"]
    second = f(w + 1.0, b)  # same signature: no new trace
    assert count["n"] == n
    assert not np.allclose(first, second)
    f(w, {"x": b["x"][:4], "y": b["y"][:4]})  # new shape: traced again
    assert count["n"] > n


def test_debug_print_of_parameters_is_no_fallback(capsys):
    w, b = _lin_case()

    def loss(w, b):
        jax.debug.print("w[0]={x}", x=w[0])
        jax.debug.print("w={w}", w=w)
        return jnp.mean((b["x"] @ w - b["y"]) ** 2)

    rep = js.explain(loss)(w, b)
    assert rep.fallback_leaves == [], str(rep)
    m2 = js.per_example_stat(loss, js.stats.second_moment())(w, b)
    g = _per_example_grads(loss, w, b)
    np.testing.assert_allclose(m2, _o(g, "second_moment"), rtol=1e-5)


# --------------------------------------------------------------------------- #
# Convolutions as dense sites over patches (strides, dilation, padding, layouts, groups)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("cfg", [
    dict(dn=("NHWC", "HWIO", "NHWC"), strides=(1, 1), pad="SAME", rdil=(1, 1), groups=1),
    dict(dn=("NCHW", "OIHW", "NCHW"), strides=(2, 1), pad=((1, 0), (2, 1)), rdil=(1, 2),
         groups=1),
    dict(dn=("NHWC", "HWIO", "NHWC"), strides=(3, 2), pad="SAME", rdil=(1, 1), groups=1,
         cout=48),
    dict(dn=("NHWC", "HWIO", "NHWC"), strides=(1, 1), pad="VALID", rdil=(1, 1), groups=2),
])
def test_conv_statistics_match_oracle(cfg):
    def run():
        r = np.random.default_rng(6)
        nhwc = cfg["dn"][0] == "NHWC"
        x = r.standard_normal((5, 7, 6, 4) if nhwc else (5, 4, 7, 6))
        co = cfg.get("cout", 6)
        w = r.standard_normal((3, 2, 4 // cfg["groups"], co) if nhwc else (co, 4, 3, 2)) * 0.3

        def loss(w, b):
            y = jax.lax.conv_general_dilated(
                b["x"], w, cfg["strides"], cfg["pad"], rhs_dilation=cfg["rdil"],
                dimension_numbers=cfg["dn"], feature_group_count=cfg["groups"])
            return jnp.mean(jnp.sum(jnp.tanh(y) ** 2, axis=(1, 2, 3)))

        w64, b64 = jnp.asarray(w), {"x": jnp.asarray(x)}
        stats = (js.stats.mean(), js.stats.second_moment(), js.stats.variance(),
                 js.stats.sq_norms(), js.stats.clipped_mean(0.5))
        out = jax.jit(js.per_example_stat(loss, stats))(w64, b64)
        g = _per_example_grads(loss, w64, b64)
        ref = (_o(g, "mean"), _o(g, "second_moment"), _o(g, "variance"), _o(g, "sq_norms"),
               _o(g, "clipped_mean", clip_norm=0.5))
        for a, e in zip(out, ref, strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-12)
        rep = js.explain(loss)(w64, b64)
        assert rep.leaves[0].kinds == ["conv"]
        # patches per tile (streamed) for every ungrouped conv; grouped convs keep the
        # exact per-example VJP
        patches = cfg["groups"] == 1
        assert rep.leaves[0].rule == ("streamed" if patches else "materialised"), str(rep)

    _x64(run)


# --------------------------------------------------------------------------- #
# Parameter-only calls: position tables looked up by constant positions inside a jit
# (``jnp.take``, Flax ``nn.Embed`` on ``arange`` as in Hugging Face GPT-2 and BERT)
# --------------------------------------------------------------------------- #
def _positions_model(kind):
    @jax.jit
    def scaled(t):  # a parameter-only jit whose input is already transformed
        return 2.0 * t

    def loss(p, b):
        T = b["x"].shape[1]
        if kind == "take":
            pos = jnp.take(p["pos"], jnp.arange(T), axis=0)
        elif kind == "nested":
            pos = jax.jit(lambda t: jnp.take(t, jnp.arange(T) % 3, axis=0) * 0.5)(p["pos"])
        else:  # "pre": sliced outside, then through a jit
            pos = scaled(p["pos"][:T] + 1.0)
        h = jnp.tanh(b["x"] @ p["w"] + pos)
        return jnp.mean(jnp.sum(h * b["y"], axis=(-1, -2)))

    return loss


@pytest.mark.parametrize("kind", ["take", "nested", "pre"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_parameter_only_calls_are_sites_not_fallbacks(kind, dtype):
    def run():
        r = np.random.default_rng(5)
        B, T, d = 5, 4, 3
        p = {"pos": jnp.asarray(r.standard_normal((6, d)), dtype),
             "w": jnp.asarray(r.standard_normal((d, d)), dtype)}
        b = {"x": jnp.asarray(r.standard_normal((B, T, d)), dtype),
             "y": jnp.asarray(r.standard_normal((B, T, d)), dtype)}
        loss = _positions_model(kind)
        rep = js.explain(loss, js.stats.second_moment())(p, b)
        assert not rep.fallback_leaves, str(rep)
        got = js.per_example_stat(
            loss, (js.stats.mean(), js.stats.variance(), js.stats.sq_norms()))(p, b)
        g = _per_example_grads(loss, p, b)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-11)
        mean, var = _o(g, "mean"), _o(g, "variance")
        for k in p:
            np.testing.assert_allclose(got[0][k], mean[k], **tol)
            np.testing.assert_allclose(got[1][k], var[k], **tol)
        np.testing.assert_allclose(got[2], _o(g, "sq_norms"), **tol)

    if dtype == jnp.float64:
        _x64(run)
    else:
        run()

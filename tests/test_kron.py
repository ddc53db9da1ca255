"""kron_moments (per-example Kronecker moments) against vmap(grad), and per-example Shampoo.

The oracle forms each example's moments from its materialised gradient,
entry j = (1/B) sum_b U_j(g_b) U_j(g_b)^T (or its diagonal beyond max_dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js

pytestmark = pytest.mark.slow


def kron_np(g, max_dim):
    """Oracle: per-leaf tuple of (1/B) sum_b U_j U_j^T from numpy ``g [B, *shape]``
    (the zoo's, tests/zoo.py)."""
    return zoo.kron_np(g, max_dim)


def oracle(grads, max_dim):
    return jax.tree.map(lambda g: kron_np(g, max_dim), grads)


def assert_kron_close(got, want, rtol, what=""):
    """Relative to each entry's largest value, with a floor of ``rtol`` x the largest
    value of the whole tree (moments of leaves whose true gradient is zero, such as an
    attention key bias, are rounding noise: see conftest.py)."""
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(gl) == len(wl), f"{what}: {len(gl)} arrays vs {len(wl)}"
    top = max(float(np.max(np.abs(b))) for b in wl)
    for i, (a, b) in enumerate(zip(gl, wl)):
        a = np.asarray(a, np.float64)
        assert a.shape == b.shape, f"{what} entry {i}: shape {a.shape} vs {b.shape}"
        scale = max(np.max(np.abs(b)), 1e-3 * top, 1e-300)
        err = np.max(np.abs(a - b)) / scale
        assert err <= rtol, f"{what} entry {i} {b.shape}: relative error {err:.2e} > {rtol:.0e}"


def _case_kron(case, max_dim, **kw):
    return js.per_example_stat(case.loss_fn, js.stats.kron_moments(max_dim), **kw)(
        case.params, case.batch
    )


# Every zoo case (core and frameworks) against the oracle, float64 and float32, with every
# axis a full matrix (max_dim=1024) and most axes diagonal (max_dim=4): the oracle matrix
# (test_oracle.py, test_frameworks.py; "kron_moments*" in conftest.STATS).


def test_low_precision_params_give_float32():
    case = zoo.get_case("mlp_bf16", jnp.float32)
    got = _case_kron(case, 1024)
    want = oracle(zoo.per_example_grads(case), 1024)
    for a in jax.tree.leaves(got):
        assert a.dtype == jnp.float32
    assert_kron_close(got, want, 5e-2, "mlp_bf16")


# --------------------------------------------------------------------------- #
# Site kinds, one at a time, on random inputs in float64
# --------------------------------------------------------------------------- #
def _r(seed=0):
    return np.random.default_rng(seed)


def _check_model(loss, params, batch, max_dim, rtol=1e-11, **kw):
    got = js.per_example_stat(loss, js.stats.kron_moments(max_dim), **kw)(params, batch)
    B = jax.tree.leaves(batch)[0].shape[0]
    g = zoo.vmap_grads(loss, params, batch)
    assert B == jax.tree.leaves(g)[0].shape[0]
    assert_kron_close(got, oracle(g, max_dim), rtol)
    return got


def _tied(p, b):
    x = p["emb"][b["tok"]]
    q = jnp.einsum("btd,dhk->bthk", x, p["wq"])
    o = jnp.einsum("bthk,hkd->btd", jnp.tanh(q), p["wo"])
    z = o @ p["emb"].T
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), b["tgt"][..., None], -1))


def _tied_case(B=5, T=6, V=13, d=8):
    r = _r(1)
    p = {
        k: jnp.asarray(r.normal(size=s))
        for k, s in {"emb": (V, d), "wq": (d, 2, 3), "wo": (2, 3, d)}.items()
    }
    b = {"tok": jnp.asarray(r.integers(0, V, (B, T))), "tgt": jnp.asarray(r.integers(0, V, (B, T)))}
    return p, b


@pytest.mark.parametrize("max_dim", [1024, 8, 5])
def test_tied_embedding_and_einsum_heads(max_dim):
    with zoo.x64():
        p, b = _tied_case()
        _check_model(_tied, p, b, max_dim)


def test_tied_leaf_is_streamed_not_materialised():
    p, b = _tied_case()
    rep = js.explain(_tied, js.stats.kron_moments(8))(p, b)
    by_path = {leaf.path: leaf for leaf in rep.leaves}
    for path in ("['emb']", "['wq']", "['wo']"):
        assert by_path[path].rules["kron_moments"] == "streamed", by_path[path]


def test_block_axes_of_per_head_weights():
    """dot_general batch dims shared with the weight (a head axis): cross-block grams."""
    with zoo.x64():
        r = _r(2)
        p = {"wh": jnp.asarray(r.normal(size=(3, 4, 5)))}
        b = {"x": jnp.asarray(r.normal(size=(4, 3, 6, 4)))}
        loss = lambda p, b: jnp.mean(jnp.sin(jnp.einsum("bhnc,hcf->bhnf", b["x"], p["wh"])))  # noqa: E731
        for max_dim in (1024, 3):
            _check_model(loss, p, b, max_dim)


def test_scan_layers_and_reshaped_views_fall_back_exactly():
    with zoo.x64():
        r = _r(3)

        def scan_loss(p, b):
            def body(h, w):
                return jnp.tanh(h @ w), None

            h, _ = jax.lax.scan(body, b["x"], p["ws"])
            return jnp.mean(h**2)

        p = {"ws": jnp.asarray(r.normal(size=(3, 4, 4)))}
        _check_model(scan_loss, p, {"x": jnp.asarray(r.normal(size=(5, 6, 4)))}, 1024)
        rep = js.explain(scan_loss, js.stats.kron_moments())(p, {"x": jnp.ones((5, 6, 4))})
        assert rep.leaves[0].rules["kron_moments"] == "materialised", rep.leaves[0].detail

        def reshaped(p, b):
            w = p["w"].reshape(4, 2, 3)
            return jnp.mean(jnp.sin(jnp.einsum("bnc,chk->bnhk", b["x"], w)))

        p = {"w": jnp.asarray(r.normal(size=(4, 6)))}
        _check_model(reshaped, p, {"x": jnp.asarray(r.normal(size=(5, 3, 4)))}, 1024)

        def transposed(p, b):  # a permuted view is still streamed
            return jnp.mean(jnp.sin(b["x"] @ p["w"].T))

        _check_model(
            transposed,
            {"w": jnp.asarray(r.normal(size=(3, 4)))},
            {"x": jnp.asarray(r.normal(size=(5, 7, 4)))},
            2,
        )


@pytest.mark.parametrize("layout", ["deep", "early"])
def test_conv(layout):
    """Deep layers run as dense-over-patches (tokens = positions); early ones exactly."""
    with zoo.x64():
        r = _r(4)
        cout = 16 if layout == "deep" else 2
        p = {"k": jnp.asarray(r.normal(size=(3, 3, 2, cout)))}
        b = {"x": jnp.asarray(r.normal(size=(4, 5, 5, 2)))}

        def loss(p, b):
            y = jax.lax.conv_general_dilated(
                b["x"], p["k"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            return jnp.mean(jnp.sin(y))

        for max_dim in (1024, 2):
            _check_model(loss, p, b, max_dim)


def test_narrow_ids_and_a_vocabulary_beyond_max_dim():
    """uint8 ids into 300 rows (the ids' dtype cannot hold V), out-of-range ids dropped."""
    with zoo.x64():
        r = _r(5)
        V, d = 300, 6
        p = {"emb": jnp.asarray(r.normal(size=(V, d)))}
        ids = jnp.asarray(r.integers(0, 256, (6, 9)), jnp.uint8)
        b = {"ids": ids, "y": jnp.asarray(r.normal(size=(6, 9, d)))}

        def loss(p, b):
            e = jnp.take(p["emb"], b["ids"], axis=0, mode="fill", fill_value=0)
            return jnp.mean((jnp.tanh(e) - b["y"]) ** 2)

        for max_dim in (1024, 100):
            _check_model(loss, p, b, max_dim)


def test_zero_d_and_vector_leaves():
    with zoo.x64():
        r = _r(6)
        p = {"s": jnp.asarray(1.5), "v": jnp.asarray(r.normal(size=3))}
        b = {"x": jnp.asarray(r.normal(size=(4, 3)))}
        loss = lambda p, b: jnp.mean((b["x"] * p["s"] + p["v"]) ** 2)  # noqa: E731
        got = _check_model(loss, p, b, 1024)
        assert got["s"] == ()


def _empty_models():
    """Models with an empty axis: no tokens (T = 0), a zero-width weight, a zero-width
    weight reached only through the exact fallback (inside lax.scan), beside an ordinary
    leaf whose moments must stay right."""
    r = _r(8)
    B, T, C, F = 5, 3, 4, 6

    def dense(p, b):
        h = jnp.tanh(b["x"] @ p["w"])
        return jnp.mean(jnp.sum(h @ p["v"], axis=(1, 2))) + jnp.mean(b["z"] @ p["u"])

    def emb(p, b):
        return jnp.mean(jnp.sum(jnp.tanh(p["emb"][b["ids"]]), axis=(1, 2))) + jnp.mean(
            jnp.tanh(b["z"] @ p["u"]))

    def scanned(p, b):
        def body(c, w):
            return c, jnp.sum(jnp.tanh(b["z"] @ w))
        return jnp.mean(jax.lax.scan(body, 0.0, p["ws"])[1]) + jnp.mean(jnp.tanh(b["z"] @ p["u"]))

    def arr(*s):
        return jnp.asarray(r.normal(size=s))

    z = arr(B, C)
    yield "T=0", dense, {"w": arr(C, F), "v": arr(F, 2), "u": arr(C)}, {"x": arr(B, 0, C), "z": z}
    yield "zero width", dense, {"w": arr(C, 0), "v": arr(0, 2), "u": arr(C)}, {
        "x": arr(B, T, C), "z": z}
    yield "zero in", dense, {"w": arr(0, F), "v": arr(F, 2), "u": arr(C)}, {
        "x": arr(B, T, 0), "z": z}
    yield "embedding T=0", emb, {"emb": arr(7, 3), "u": arr(C, 2)}, {
        "ids": jnp.zeros((B, 0), jnp.int32), "z": z}
    yield "embedding zero width", emb, {"emb": arr(7, 0), "u": arr(C, 2)}, {
        "ids": jnp.asarray(r.integers(0, 7, (B, T))), "z": z}
    yield "fallback zero width", scanned, {"ws": arr(2, C, 0), "u": arr(C, 2)}, {"z": z}


@pytest.mark.parametrize("max_dim", [1024, 2])
def test_empty_axes_give_zeros_of_the_right_shapes(max_dim):
    """Regression: a zero-size axis (T = 0, a zero-width weight) raised ZeroDivisionError
    (a reshape with -1 over zero entries); every axis's moment is zeros there."""
    with zoo.x64():
        for what, loss, p, b in _empty_models():
            want = oracle(zoo.vmap_grads(loss, p, b), max_dim)
            for kw in ({}, {"chunk_size": 2}):
                got = js.per_example_stat(loss, js.stats.kron_moments(max_dim), **kw)(p, b)
                gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
                assert len(gl) == len(wl), what
                for x, e in zip(gl, wl):
                    assert x.shape == e.shape, (what, x.shape, e.shape)
                    np.testing.assert_allclose(x, e, rtol=1e-10, atol=1e-12, err_msg=what)
                assert np.any(np.asarray(got["u"][0]) != 0), what


def test_tiles_with_remainders_chunks_and_tiny_budgets():
    with zoo.x64():
        p, b = _tied_case(B=7)
        for kw in ({"chunk_size": 3}, {"memory_budget_bytes": 1}, {"memory_budget_bytes": 3000}):
            _check_model(_tied, p, b, 5, **kw)
        r = _r(7)
        mp = {"w1": jnp.asarray(r.normal(size=(5, 7))), "w2": jnp.asarray(r.normal(size=(7, 3)))}
        mb = {"x": jnp.asarray(r.normal(size=(11, 5)))}
        mlp = lambda p, b: jnp.mean(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])  # noqa: E731
        _check_model(mlp, mp, mb, 4, memory_budget_bytes=700)


def test_one_pass_with_other_statistics_under_jit():
    p, b = _tied_case()
    stats = (js.stats.mean(), js.stats.kron_moments(5), js.stats.second_moment())
    together = jax.jit(js.per_example_stat(_tied, stats))(p, b)
    alone = [js.per_example_stat(_tied, s)(p, b) for s in stats]
    for t, a in zip(together, alone):
        for x, y in zip(jax.tree.leaves(t), jax.tree.leaves(a)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_clipping_in_the_same_pass():
    """With a clipped mean in the request every leaf runs in ingredients mode."""
    with zoo.x64():
        p, b = _tied_case()
        both = js.per_example_stat(_tied, (js.stats.clipped_mean(0.1), js.stats.kron_moments(5)))
        got = both(p, b)[1]
        g = jax.vmap(
            jax.grad(lambda p, ex: _tied(p, jax.tree.map(lambda a: a[None], ex))), (None, 0)
        )(p, b)
        assert_kron_close(got, oracle(g, 5), 1e-11)


def test_grad_and_vmap_compose():
    with zoo.x64():
        r = _r(8)
        p = {"w": jnp.asarray(r.normal(size=(4, 3)))}
        b = {"x": jnp.asarray(r.normal(size=(5, 6, 4)))}
        loss = lambda p, b: jnp.mean(jnp.sin(b["x"] @ p["w"]))  # noqa: E731

        def js_total(p):
            m = js.per_example_stat(loss, js.stats.kron_moments())(p, b)
            return sum(jnp.sum(x * x) for x in jax.tree.leaves(m))

        def ref_total(p):
            g = jax.vmap(
                jax.grad(lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))), (None, 0)
            )(p, b)["w"]
            m0 = jnp.einsum("bij,bkj->ik", g, g) / 5
            m1 = jnp.einsum("bji,bjk->ik", g, g) / 5
            return jnp.sum(m0 * m0) + jnp.sum(m1 * m1)

        np.testing.assert_allclose(
            jax.grad(js_total)(p)["w"], jax.grad(ref_total)(p)["w"], rtol=1e-9
        )
        ps = {"w": jnp.stack([p["w"], 2 * p["w"]])}
        vm = jax.vmap(lambda p: js.per_example_stat(loss, js.stats.kron_moments())(p, b))(ps)
        one = js.per_example_stat(loss, js.stats.kron_moments())({"w": 2 * p["w"]}, b)
        np.testing.assert_allclose(vm["w"][0][1], one["w"][0], rtol=1e-10)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices: tests/conftest.py")
def test_shard_map_axis_name_gives_the_union_of_devices():
    p, b = _tied_case(B=8)
    fn = js.per_example_stat(_tied, js.stats.kron_moments(5), axis_name="d")
    mesh = jax.make_mesh((4,), ("d",))
    sm = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))
    rep = jax.sharding.NamedSharding(mesh, P())
    split = jax.sharding.NamedSharding(mesh, P("d"))
    got = sm(jax.device_put(p, rep), jax.device_put(b, split))
    want = js.per_example_stat(_tied, js.stats.kron_moments(5))(p, b)
    assert any(float(jnp.max(jnp.abs(x))) > 0 for x in jax.tree.leaves(got))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-7)


def test_no_per_example_gradient_in_memory():
    """XLA's temp memory at a token dense site stays far below B |W|."""
    B, T, d, f = 32, 16, 256, 512
    r = _r(9)
    p = {"w": jnp.asarray(r.normal(size=(d, f)) * 0.05, jnp.float32)}
    b = {"x": jnp.asarray(r.normal(size=(B, T, d)), jnp.float32)}
    loss = lambda p, b: jnp.mean(jnp.tanh(b["x"] @ p["w"]) ** 2)  # noqa: E731
    fn = js.per_example_stat(loss, js.stats.kron_moments(), memory_budget_bytes=1 << 20)
    temp = jax.jit(fn).lower(p, b).compile().memory_analysis().temp_size_in_bytes
    per_example_all = B * d * f * 4
    assert temp < per_example_all / 4, (temp, per_example_all)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None, "8"])
def test_max_dim_is_validated(bad):
    with pytest.raises(ValueError, match="max_dim"):
        js.stats.kron_moments(bad)
    with pytest.raises(ValueError, match="max_dim"):
        js.optim.scale_by_shampoo(max_dim=bad)


# --------------------------------------------------------------------------- #
# Shampoo
# --------------------------------------------------------------------------- #
def _inv_root_np(a, p, eps):
    if a.ndim == 1:
        return (a + eps) ** (-1.0 / p)
    w, v = np.linalg.eigh(a + eps * np.eye(a.shape[0]))
    return (v * np.maximum(w, eps) ** (-1.0 / p)) @ v.T


def _shampoo_np(grads_seq, stats_seq, b2, eps, max_dim, every=1):
    """NumPy reference of the contract: per step, the update of one leaf."""
    L = None
    roots = None
    out = []
    for t, (g, S) in enumerate(zip(grads_seq, stats_seq), start=1):
        k = g.ndim
        if L is None:
            L = [np.zeros_like(s) for s in S]
        L = [b2 * a + (1 - b2) * s for a, s in zip(L, S)]
        if (t - 1) % every == 0:
            roots = [_inv_root_np(a / (1 - b2**t), 2 * k, eps) for a in L]
        u = g.copy()
        for j, r in enumerate(roots):
            if r.ndim == 1:
                shape = [1] * k
                shape[j] = -1
                u = u * r.reshape(shape)
            else:
                u = np.moveaxis(np.tensordot(r, u, axes=((1,), (j,))), 0, j)
        out.append(u)
    return out


def _batches(steps, B, seed=10):
    r = _r(seed)
    return [
        {"x": jnp.asarray(r.normal(size=(B, 5, 4))), "y": jnp.asarray(r.normal(size=(B, 5, 3)))}
        for _ in range(steps)
    ]


def _lin(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"]) + p["c"] - b["y"]) ** 2) + 0.1 * p["s"] ** 2


def _params():
    r = _r(11)
    return {
        "w": jnp.asarray(r.normal(size=(4, 3))),
        "c": jnp.asarray(r.normal(size=3)),
        "s": jnp.asarray(0.7),
    }


@pytest.mark.parametrize("per_example", [True, False])
@pytest.mark.parametrize("max_dim,every", [(1024, 1), (3, 2)])
def test_shampoo_matches_numpy_reference(per_example, max_dim, every):
    with zoo.x64():
        p0 = _params()
        b2, eps = 0.9, 1e-6
        tx = js.optim.scale_by_shampoo(
            b2=b2, eps=eps, per_example=per_example, max_dim=max_dim, precondition_every=every
        )
        req = js.optim.stat_request(tx)
        assert set(req) == ({"mean", "kron_moments"} if per_example else {"mean"})
        state = tx.init(p0)
        seq_g, seq_s, got = [], [], []
        for b in _batches(4, 6):
            st = js.per_example_stat(_lin, req)(p0, b)
            u, state = tx.update(st["mean"], state, p0, **js.optim.update_kwargs(st))
            g = np.asarray(st["mean"]["w"])
            seq_g.append(g)
            if per_example:
                seq_s.append([np.asarray(x) for x in st["kron_moments"]["w"]])
            else:
                seq_s.append(
                    [
                        g @ g.T if 4 <= max_dim else np.sum(g * g, 1),
                        g.T @ g if 3 <= max_dim else np.sum(g * g, 0),
                    ]
                )
            got.append(np.asarray(u["w"]))
            np.testing.assert_array_equal(np.asarray(u["s"]), np.asarray(st["mean"]["s"]))
        want = _shampoo_np(seq_g, seq_s, b2, eps, max_dim, every)
        for t, (a, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(a, w, rtol=1e-8, atol=1e-10, err_msg=f"step {t + 1}")


def test_shampoo_step_one_is_the_fourth_root_sandwich():
    with zoo.x64():
        p0 = _params()
        b = _batches(1, 6)[0]
        tx = js.optim.scale_by_shampoo(eps=1e-4)
        st = js.per_example_stat(_lin, js.optim.stat_request(tx))(p0, b)
        u, _ = tx.update(st["mean"], tx.init(p0), **js.optim.update_kwargs(st))
        m0, m1 = (np.asarray(x) for x in st["kron_moments"]["w"])
        g = np.asarray(st["mean"]["w"])
        want = _inv_root_np(m0, 4, 1e-4) @ g @ _inv_root_np(m1, 4, 1e-4)
        np.testing.assert_allclose(np.asarray(u["w"]), want, rtol=1e-9)


def test_shampoo_per_example_and_classic_coincide_at_batch_one():
    with zoo.x64():
        p0 = _params()
        outs = []
        for per_example in (True, False):
            tx = js.optim.shampoo(0.1, per_example=per_example)
            state = tx.init(p0)
            p = p0
            for b in _batches(3, 1, seed=12):
                st = js.per_example_stat(_lin, js.optim.stat_request(tx))(p, b)
                u, state = tx.update(st["mean"], state, p, **js.optim.update_kwargs(st))
                p = optax.apply_updates(p, u)
            outs.append(p)
        for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9)


def test_shampoo_trains_under_jit_and_explains_missing_stats():
    p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _params())
    tx = js.optim.shampoo(0.05)
    req = js.optim.stat_request(tx)
    assert sorted(req) == ["kron_moments", "mean"]

    @jax.jit
    def step(p, state, b):
        loss, st = js.value_and_per_example_stat(_lin, req)(p, b)
        u, state = tx.update(st["mean"], state, p, **js.optim.update_kwargs(st))
        return optax.apply_updates(p, u), state, loss

    state = tx.init(p)
    b = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _batches(1, 8)[0])
    losses = []
    for _ in range(15):
        p, state, loss = step(p, state, b)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    with pytest.raises(ValueError, match="kron_moments"):
        tx.update(p, tx.init(p), p)
    wrong = js.per_example_stat(_lin, js.stats.kron_moments(2))(p, b)
    with pytest.raises(ValueError, match="max_dim=1024"):
        tx.update(p, tx.init(p), p, kron_moments=wrong)

"""Non-float leaves of the differentiated argument (integer and bool buffers, PRNG keys,
float0) are skipped as ``eqx.filter_grad`` skips them: every statistic holds ``None``
there, the float leaves' statistics equal ``vmap(grad)`` of the loss with the non-float
leaves closed over, and ``explain`` lists them as skipped. Complex leaves raise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo

import jaxpr_surgery as js

B = 5
SKIPPED = ("count", "idx", "key", "mask", "old_key", "step", "zero")


def _params(dtype):
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.standard_normal(s).astype(np.float32), dtype)  # noqa: E731
    return {
        "w": f(4, 3),
        "b": f(3),
        "g": f(3),
        "step": jnp.int32(3),  # a step counter read as a float
        "idx": jnp.array([2, 0, 3, 1], jnp.int32),  # an index buffer gathered
        "mask": jnp.array([True, False, True]),
        "count": jnp.array([1, 2], jnp.uint8),
        "key": jax.random.key(7),  # typed key (NNX Rngs keep these)
        "old_key": jax.random.PRNGKey(1),  # raw uint32 key
        "zero": np.zeros((2,), jax.dtypes.float0),
    }


def _batch(dtype, n=B):
    r = np.random.default_rng(1)
    return {
        "x": jnp.asarray(r.standard_normal((n, 4)).astype(np.float32), dtype),
        "y": jnp.asarray(r.standard_normal((n, 3)).astype(np.float32), dtype),
    }


def loss(p, b):
    x = b["x"][:, p["idx"]]
    h = jnp.tanh(x @ p["w"] + p["b"]) * (1.0 + 0.1 * p["step"].astype(x.dtype))
    noise = 0.1 * jax.random.normal(p["key"], h.shape[1:], h.dtype)
    noise = noise + 0.1 * jax.random.uniform(p["old_key"], h.shape[1:], h.dtype)
    h = jnp.where(p["mask"], h * p["g"] + noise, h)
    h = h + 0.01 * jnp.sum(p["count"]).astype(h.dtype)
    return jnp.mean((h - b["y"]) ** 2)


def _split(p):
    floats = {k: v for k, v in p.items() if k not in SKIPPED}
    rest = {k: v for k, v in p.items() if k in SKIPPED}
    return floats, rest


def _closed(p):
    """The loss of the float leaves, the non-float ones closed over."""
    floats, rest = _split(p)
    return floats, lambda fl, b: loss({**fl, **rest}, b)


def _per_example_grads(p, b):
    floats, closed = _closed(p)
    pe = lambda fl, ex: closed(fl, jax.tree.map(lambda x: x[None], ex))  # noqa: E731
    return jax.jit(jax.vmap(jax.grad(pe), in_axes=(None, 0)))(floats, b)


def _assert_skipped(tree):
    for k in SKIPPED:
        assert tree[k] is None, k


ORACLE_STATS = {
    "mean": ((), {}),
    "sum": ((), {}),
    "second_moment": ((), {}),
    "variance": ((), {}),
    "sign_mean": ((), {}),
    "abs_mean": ((), {}),
    "sq_norms": ((), {}),
    "norms": ((), {}),
    "clipped_mean": ((0.3,), {"clip_norm": 0.3}),
    "clipped_sum": ((0.3,), {"clip_norm": 0.3}),
    "snr": ((), {}),
    "gradient_noise_scale": ((), {}),
}


def _all_stats(ref):
    out = {n: getattr(js.stats, n)(*a) for n, (a, _) in ORACLE_STATS.items()}
    out.update(
        sq_norms_leaf=js.stats.sq_norms(per_leaf=True),
        cube=js.stats.elementwise(lambda g: g**3, name="cube"),
        kron=js.stats.kron_moments(),
        quantiles=js.stats.norm_quantiles((0.0, 0.5, 1.0)),
        quantiles_global=js.stats.norm_quantiles((0.0, 0.5, 1.0), per_leaf=False),
        dots=js.stats.per_example_dots(ref),
        dots_leaf=js.stats.per_example_dots(ref, per_leaf=True),
        cosines=js.stats.per_example_cosines(ref),
        fourth=js.stats.fourth_moment(),
        kurtosis=js.stats.kurtosis(),
        diversity=js.stats.gradient_diversity(),
        pieces=js.stats.noise_scale_components(),
    )
    return out


# the statistics whose value is a pytree like the parameters
PARAM_SHAPED = ("mean", "sum", "second_moment", "variance", "sign_mean", "abs_mean",
                "clipped_mean", "clipped_sum", "snr", "sq_norms_leaf", "cube", "kron",
                "quantiles", "dots_leaf", "fourth", "kurtosis")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_every_statistic_skips_nonfloat_leaves_and_matches_oracle(dtype):
    with zoo.x64() if dtype == "float64" else _null():
        p, b = _params(dtype), _batch(dtype)
        floats, closed = _closed(p)
        # the reference as eqx.filter_grad gives it: None at the skipped leaves
        ref = {**jax.tree.map(lambda x: jnp.cos(x), floats), **dict.fromkeys(SKIPPED)}
        stats = _all_stats(ref)
        out = jax.jit(js.per_example_stat(loss, stats))(p, b)
        if dtype == "float64":  # every statistic of the float leaves alone, the rest closed over
            want = js.per_example_stat(closed, _all_stats(jax.tree.map(jnp.cos, floats)))(
                floats, b)
        g = _per_example_grads(p, b)
    for name in PARAM_SHAPED:
        _assert_skipped(out[name])
    if dtype == "float64":
        for name, val in out.items():
            got = ({k: v for k, v in val.items() if k not in SKIPPED} if name in PARAM_SHAPED
                   else val)
            jax.tree.map(lambda a, e: np.testing.assert_allclose(
                np.asarray(a), np.asarray(e), rtol=1e-10, atol=1e-12), got, want[name])
    for name, (_, kw) in ORACLE_STATS.items():
        o = zoo.oracle_from_grads(g, name, **kw)
        got = out[name]
        if name in PARAM_SHAPED:
            got = {k: v for k, v in got.items() if k not in SKIPPED}
        jax.tree.map(lambda a, e: np.testing.assert_allclose(
            np.asarray(a, np.float64), e, rtol=1e-9 if dtype == "float64" else 2e-4,
            atol=1e-12 if dtype == "float64" else 1e-5), got, o)
    # global norms over the float leaves only
    sq = sum(np.sum(np.square(np.asarray(x, np.float64)).reshape(B, -1), 1)
             for x in jax.tree.leaves(g))
    np.testing.assert_allclose(np.asarray(out["sq_norms"], np.float64), sq,
                               rtol=1e-9 if dtype == "float64" else 1e-5)
    # gradient-like statistics come back in the parameters' dtype
    assert out["mean"]["w"].dtype == jnp.dtype(dtype)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize(
    "chunk_size,n", [(None, 1), (2, 7)], ids=["B1", "chunks-remainder"]
)
def test_value_and_stat_has_aux_chunks(chunk_size, n):
    p, b = _params(jnp.float32), _batch(jnp.float32, n)

    def loss_aux(p, b):
        return loss(p, b), {"step": p["step"], "y0": b["y"][:, 0]}

    fn = js.value_and_per_example_stat(
        loss_aux, (js.stats.mean(), js.stats.variance(ddof=0), js.stats.norms()),
        has_aux=True, chunk_size=chunk_size,
    )
    (value, aux), (mean, var, norms) = jax.jit(fn)(p, b)
    floats, closed = _closed(p)
    np.testing.assert_allclose(value, closed(floats, b), rtol=1e-6)
    np.testing.assert_array_equal(aux["step"], np.full((n,), 3))
    _assert_skipped(mean)
    _assert_skipped(var)
    g = _per_example_grads(p, b)
    for k in floats:
        np.testing.assert_allclose(mean[k], np.mean(g[k], 0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var[k], np.var(g[k], 0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        norms, np.sqrt(zoo.oracle_from_grads(g, "sq_norms")), rtol=1e-5)


def test_argnums_tuple_with_nonfloat_leaves():
    p, b = _params(jnp.float32), _batch(jnp.float32)
    floats, rest = _split(p)
    fn = lambda fl, b, r: loss({**fl, **r}, b)  # noqa: E731
    out = js.per_example_stat(fn, js.stats.second_moment(), argnums=(0, 2),
                              batch_argnums=1)(floats, b, rest)
    assert isinstance(out, tuple) and len(out) == 2
    assert all(v is None for v in out[1].values())
    g = _per_example_grads(p, b)
    for k in floats:
        np.testing.assert_allclose(out[0][k], np.mean(np.square(g[k]), 0), rtol=1e-5, atol=1e-7)


def test_skipped_leaves_are_traced_not_baked_in():
    """A new value of an integer leaf under one jit reaches the loss."""
    p, b = _params(jnp.float32), _batch(jnp.float32)
    f = jax.jit(js.value_and_per_example_stat(loss, js.stats.mean()))
    v3, _ = f(p, b)
    v5, m5 = f({**p, "step": jnp.int32(5), "key": jax.random.key(8)}, b)
    floats, closed5 = _closed({**p, "step": jnp.int32(5), "key": jax.random.key(8)})
    np.testing.assert_allclose(v5, closed5(floats, b), rtol=1e-6)
    assert not np.allclose(v3, v5)
    np.testing.assert_allclose(m5["w"], jax.grad(closed5)(floats, b)["w"], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_shard_map_axis_name_with_nonfloat_leaves():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    p, b = _params(jnp.float32), _batch(jnp.float32, 8)
    del p["zero"]  # float0 cannot be placed on devices
    stats = (js.stats.variance(), js.stats.norms())
    mesh = jax.make_mesh((4,), ("d",))
    fn = js.per_example_stat(loss, stats, axis_name="d")
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P("d")))
    var, norms = jax.jit(sm)(jax.device_put(p, NamedSharding(mesh, P())),
                             jax.device_put(b, NamedSharding(mesh, P("d"))))
    var1, norms1 = js.per_example_stat(loss, stats)(p, b)
    assert var["step"] is None and var["key"] is None
    np.testing.assert_allclose(var["w"], var1["w"], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(norms, norms1, rtol=1e-5)


def test_vmap_and_grad_with_nonfloat_leaves():
    p, b = _params(jnp.float32), _batch(jnp.float32)
    mean = lambda w: js.per_example_stat(loss, js.stats.mean())({**p, "w": w}, b)["w"]  # noqa: E731
    ws = jnp.stack([p["w"], 2 * p["w"]])
    np.testing.assert_allclose(jax.vmap(mean)(ws)[1], mean(ws[1]), rtol=1e-5, atol=1e-7)
    floats, closed = _closed(p)
    oracle = lambda w: jax.grad(closed)({**floats, "w": w}, b)["w"]  # noqa: E731
    np.testing.assert_allclose(jax.grad(lambda w: jnp.sum(jnp.sin(mean(w))))(p["w"]),
                               jax.grad(lambda w: jnp.sum(jnp.sin(oracle(w))))(p["w"]),
                               rtol=1e-4, atol=1e-6)


def test_tree_map_over_results_with_none():
    """None is an empty subtree: a map over the statistic alone skips it; a map over the
    parameters first sees None there; the statistic first needs ``is_leaf``."""
    p, b = _params(jnp.float32), _batch(jnp.float32)
    mean = js.per_example_stat(loss, js.stats.mean())(p, b)
    doubled = jax.tree.map(lambda x: 2 * x, mean)
    assert set(doubled) == set(p) and doubled["step"] is None
    assert len(jax.tree.leaves(mean)) == 3
    stepped = jax.tree.map(lambda x, g: x if g is None else x - 0.1 * g, p, mean)
    assert stepped["step"] is p["step"]
    np.testing.assert_allclose(stepped["w"], p["w"] - 0.1 * mean["w"])
    with pytest.raises(ValueError):
        jax.tree.map(lambda g, x: x, mean, p)
    stepped2 = jax.tree.map(lambda g, x: x if g is None else x - 0.1 * g, mean, p,
                            is_leaf=lambda x: x is None)
    assert stepped2["step"] is p["step"]


def test_explain_lists_skipped_leaves():
    p, b = _params(jnp.float32), _batch(jnp.float32)
    rep = js.explain(loss)(p, b)
    paths = [leaf.path for leaf in rep.leaves]
    assert paths == [jax.tree_util.keystr(k) for k, _ in
                     jax.tree_util.tree_flatten_with_path(p)[0]]  # every leaf, in tree order
    by = {leaf.path: leaf for leaf in rep.leaves}
    assert by["['step']"].rule == "skipped"
    assert by["['step']"].detail.startswith("skipped: non-float leaf (int32)")
    assert by["['key']"].detail.startswith("skipped: non-float leaf (key<fry>)")
    assert by["['mask']"].rules == dict.fromkeys(rep.statistics, "skipped")
    assert by["['w']"].rule == "streamed" and by["['w']"].kinds == ["dense"]
    assert sorted(rep.skipped_leaves) == sorted(f"['{k}']" for k in SKIPPED)
    assert rep.fallback_leaves == []
    text = str(rep)
    assert "skipped: non-float leaf (int32); its statistics are None" in text
    assert "skipped: non-float leaf (uint8)" in text
    assert "skipped: non-float leaf (float0)" in text
    assert "fallback leaves: 0; skipped leaves: 7" in rep.format(None)
    assert rep.as_dict()["leaves"][1]["rule"] == "skipped"  # ['count']


def test_complex_leaf_raises():
    p, b = _params(jnp.float32), _batch(jnp.float32)
    p = {**p, "z": jnp.ones(3, jnp.complex64)}
    with pytest.raises(NotImplementedError, match=r"parameter leaf \['z'\] has the complex"):
        js.per_example_stat(loss, js.stats.mean())(p, b)


def test_only_nonfloat_leaves_raises():
    _, b = _params(jnp.float32), _batch(jnp.float32)
    with pytest.raises(ValueError, match=r"hold no floating-point arrays.*\['n'\]"):
        js.per_example_stat(lambda p, b: jnp.mean(b["x"]) * p["n"], js.stats.mean())(
            {"n": jnp.int32(2)}, b)


def test_check_per_example_with_nonfloat_leaves():
    p, b = _params(jnp.float32), _batch(jnp.float32)
    js.check_per_example(loss)(p, b)


# --------------------------------------------------------------------------- #
# Frameworks: an Equinox buffer, Flax NNX Rngs
# --------------------------------------------------------------------------- #
def test_equinox_module_with_integer_buffer():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        lin: eqx.nn.Linear
        perm: jax.Array  # an integer buffer
        steps: jax.Array
        scale: float = 0.5

        def __call__(self, x):
            x = x[self.perm]
            return self.lin(x) * (self.scale + 0.01 * self.steps.astype(x.dtype))

    model = Model(eqx.nn.Linear(4, 3, key=jax.random.key(0)), jnp.array([3, 1, 0, 2]),
                  jnp.int32(4))
    b = _batch(jnp.float32)

    def mloss(m, b):
        return jnp.mean((jax.vmap(m)(b["x"]) - b["y"]) ** 2)

    stats = {"mean": js.stats.mean(), "m2": js.stats.second_moment()}
    out = eqx.filter_jit(js.per_example_stat(mloss, stats))(model, b)
    want = eqx.filter_grad(mloss)(model, b)
    # None where eqx.filter_grad has None: the same tree
    assert jax.tree.structure(out["mean"]) == jax.tree.structure(want)
    assert out["mean"].perm is None and out["m2"].steps is None and out["m2"].scale is None
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7),
                 out["mean"], want)
    pe = jax.vmap(eqx.filter_grad(lambda m, ex: mloss(m, jax.tree.map(lambda x: x[None], ex))),
                  in_axes=(None, 0))(model, b)
    np.testing.assert_allclose(out["m2"].lin.weight, np.mean(np.square(pe.lin.weight), 0),
                               rtol=1e-5, atol=1e-8)
    # eqx.apply_updates skips the None updates
    new = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, out["mean"]))
    assert new.perm is model.perm and new.steps is model.steps
    rep = js.explain(mloss)(model, b)
    assert sorted(rep.skipped_leaves) == [".perm", ".steps"]


def test_flax_nnx_rngs_in_the_state():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, deterministic=True, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    model = Model(nnx.Rngs(0))
    graphdef, state = nnx.split(model)  # everything: Params and the RNG key and count
    kinds = {str(jnp.result_type(x)) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
             else "key" for x in jax.tree.leaves(state)}
    assert "key" in kinds and "uint32" in kinds  # Rngs are in the differentiated state
    b = _batch(jnp.float32)

    def mloss(state, b):
        return jnp.mean((nnx.merge(graphdef, state)(b["x"]) - b["y"]) ** 2)

    out = jax.jit(js.per_example_stat(mloss, js.stats.mean()))(state, b)
    want = nnx.grad(lambda m: jnp.mean((m(b["x"]) - b["y"]) ** 2))(model)
    got_flat = {k: v for k, v in jax.tree_util.tree_flatten_with_path(
        out, is_leaf=lambda x: x is None)[0]}
    n_none = sum(v is None for v in got_flat.values())
    assert n_none == len(jax.tree.leaves(state)) - 2  # all but the kernel and bias
    for name in ("kernel", "bias"):
        (got,), (exp,) = jax.tree.leaves(out["lin"][name]), jax.tree.leaves(want["lin"][name])
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- #
# Optimizers
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("make", [
    lambda: js.optim.micro_adam_var(1e-2),
    lambda: js.optim.dp_adam(1e-2, clip_norm=0.5, noise_multiplier=1.0),
    lambda: js.optim.chain(js.optim.track_gradient_statistics(), optax.adamw(1e-2)),
], ids=["micro_adam_var", "dp_adam", "track+optax.adamw"])
def test_optimizer_step_with_nonfloat_leaves(make):
    """The optimizers keep no state for a skipped leaf and give it a None update, as
    optax gives for a None gradient: the step of the float leaves is the step of the
    loss with the others closed over."""
    opt = make()
    p, b = _params(jnp.float32), _batch(jnp.float32)
    floats, closed = _closed(p)

    def step(opt, fn, params, state):
        stats = jax.jit(js.per_example_stat(fn, js.optim.stat_request(opt, state)))(params, b)
        return opt.update(stats["mean"], state, params,
                          **js.optim.update_kwargs(stats, key=jax.random.key(3)))

    state = opt.init(p)
    state_f = opt.init(floats)
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(state_f))  # none for the ints
    for _ in range(2):
        updates, state = step(opt, loss, p, state)
        updates_f, state_f = step(opt, closed, floats, state_f)
        _assert_skipped(updates)
        for k in floats:
            np.testing.assert_allclose(updates[k], updates_f[k], rtol=1e-5, atol=1e-8)
    # optax.apply_updates cannot add None to an array: apply to the float leaves
    # (or eqx.apply_updates, which skips None)
    with pytest.raises(TypeError):
        optax.apply_updates(p, updates)
    new = jax.tree.map(lambda x, u: x if u is None else x + u, p, updates)
    assert new["step"] is p["step"]
    np.testing.assert_allclose(new["w"], p["w"] + updates["w"])


def test_float_leaves_matches_filtered_params():
    """The same step when the caller filters the parameters (eqx.filter(p,
    eqx.is_inexact_array) or None at the skipped leaves), the optax way."""
    p, b = _params(jnp.float32), _batch(jnp.float32)
    opt = js.optim.micro_adam(1e-2)
    pf = {k: (None if k in SKIPPED else v) for k, v in p.items()}
    stats = js.per_example_stat(loss, js.optim.stat_request(opt))(p, b)
    u1, s1 = opt.update(stats["mean"], opt.init(p), p, **js.optim.update_kwargs(stats))
    u2, s2 = opt.update(stats["mean"], opt.init(pf), pf, **js.optim.update_kwargs(stats))
    assert jax.tree.structure(u1) == jax.tree.structure(u2)
    assert jax.tree.structure(s1) == jax.tree.structure(s2)
    jax.tree.map(np.testing.assert_array_equal, u1, u2)

"""Per-layer clipping: ``clipped_sum`` / ``clipped_mean`` with a pytree of bounds that is a
prefix of the parameters, each bound clipping the part of every example's gradient under
it by that part's own norm: ``sum_b min(1, C_k / ||g_b,k||) g_b,k`` per group ``k``.

Checked against ``jax.vmap(jax.grad(per-example loss))`` clipped per group by hand (numpy
float64), in float64 (tight) and float32, on zoo models; with chunks, remat (the second,
reweighted pass), shard_map, traced bounds, bad bounds, and the DP optimizers' noise.
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
import jaxpr_surgery.optim as jso
from jaxpr_surgery._src import plans

INF = float("inf")
TOL64 = dict(rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- #
# The oracle: per-example gradients clipped per group by hand
# --------------------------------------------------------------------------- #
def _grads(loss, params, batch):
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    g = jax.jit(jax.vmap(jax.grad(one), (None, 0)))(params, batch)
    return jax.tree.map(lambda x: np.asarray(x, np.float64), g)


def _norms(sub):
    """``[B]`` norms over every leaf of a subtree of per-example gradients (float64)."""
    leaves = jax.tree.leaves(sub)
    B = leaves[0].shape[0]
    return np.sqrt(sum(np.sum(np.square(x).reshape(B, -1), 1) for x in leaves))


def _groups(bounds, g):
    """``[(bound, subtree of g)]``: the subtree of per-example gradients under each bound
    of a tree of bounds (a prefix of g's structure), written out by hand by the tests."""
    return list(zip(jax.tree.leaves(bounds), jax.tree.structure(bounds).flatten_up_to(g)))


def clipped_by_hand(g, bounds, mean=False):
    """``sum_b min(1, C_k / ||g_b,k||) g_b,k`` per group (numpy float64), a tree like the
    parameters (without their batch axis)."""
    out = []
    for C, sub in _groups(bounds, g):
        n = _norms(sub)
        with np.errstate(divide="ignore", invalid="ignore"):
            c = np.where(n > 0, np.minimum(1.0, C / np.where(n > 0, n, 1.0)), 1.0)
        B = n.shape[0]
        s = jax.tree.map(lambda x, c=c: np.tensordot(c, x, 1), sub)
        out.append(jax.tree.map(lambda x, B=B: x / B, s) if mean else s)
    return jax.tree.structure(bounds).unflatten(out)


def median_bounds(g, template):
    """A tree of bounds shaped like ``template``: each its group's median norm, so that
    about half the examples are clipped in every group."""
    meds = [float(np.median(_norms(sub))) for _, sub in _groups(template, g)]
    return jax.tree.structure(template).unflatten(meds)


def assert_tree_close(got, want, err_msg="", **tol):
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want), err_msg
    for a, w in zip(gl, wl):
        np.testing.assert_allclose(np.asarray(a, np.float64), w, err_msg=err_msg, **tol)


def assert_close_scaled(got, want, g, rel=3e-5):
    """float32 against the float64 oracle: errors relative to each leaf's summand scale
    (rounding scales with the terms, which can cancel in the sum)."""
    scale = jax.tree.map(lambda x: float(np.abs(x).sum(0).max()) or 1.0, g)
    for a, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(scale)):
        np.testing.assert_allclose(np.asarray(a, np.float64), w, rtol=rel, atol=rel * s)


# Bounds per model: per leaf, per layer (a sub-dict), mixed.
def _mlp_per_layer(p):
    return {"l1": 1.0, "l2": 1.0, "l3": 1.0}


def _mlp_per_leaf(p):
    return jax.tree.map(lambda _: 1.0, p)


def _mlp_mixed(p):
    return {"l1": 1.0, "l2": {"w": 1.0, "b": 1.0}, "l3": 1.0}


def _cnn_per_leaf(p):
    return jax.tree.map(lambda _: 1.0, p)


def _transformer_groups(p):
    # the tied table alone, each block of layers as one group, the rest per leaf
    return {
        "embed": 1.0,
        "pos": 1.0,
        "layers": [1.0 for _ in p["layers"]],
        "lnf": {"g": 1.0, "b": 1.0},
    }


CASES = [
    ("mlp", _mlp_per_layer),
    ("mlp", _mlp_per_leaf),
    ("mlp", _mlp_mixed),
    ("cnn", _cnn_per_leaf),
    ("transformer", _transformer_groups),
]


@pytest.mark.parametrize("name,template", CASES, ids=lambda x: getattr(x, "__name__", x))
def test_per_group_clipping_matches_oracle_float64(name, template):
    with zoo.x64():
        case = zoo.get_case(name, jnp.float64)
        g = _grads(case.loss_fn, case.params, case.batch)
        bounds = median_bounds(g, template(case.params))
        stats = {"sum": js.stats.clipped_sum(bounds), "mean": js.stats.clipped_mean(bounds)}
        got = jax.jit(js.per_example_stat(case.loss_fn, stats))(case.params, case.batch)
        assert_tree_close(got["sum"], clipped_by_hand(g, bounds), "sum", **TOL64)
        assert_tree_close(got["mean"], clipped_by_hand(g, bounds, mean=True), "mean", **TOL64)
        # the groups matter: the global form differs
        glob = clipped_by_hand(g, 1.0 * np.sqrt(sum(C**2 for C in jax.tree.leaves(bounds))))
        assert max(np.max(np.abs(a - b)) for a, b in
                   zip(jax.tree.leaves(got["sum"]), jax.tree.leaves(glob))) > 1e-3


@pytest.mark.parametrize("name,template", [CASES[0], CASES[3]],
                         ids=lambda x: getattr(x, "__name__", x))
def test_per_group_clipping_matches_oracle_float32(name, template):
    with zoo.x64():
        case64 = zoo.get_case(name, jnp.float64)
        g = _grads(case64.loss_fn, case64.params, case64.batch)
    case = zoo.get_case(name, jnp.float32)
    bounds = median_bounds(g, template(case.params))
    got = jax.jit(js.per_example_stat(case.loss_fn, js.stats.clipped_sum(bounds)))(
        case.params, case.batch)
    for x in jax.tree.leaves(got):
        assert x.dtype == jnp.float32
    assert_close_scaled(got, clipped_by_hand(g, bounds), g)


# --------------------------------------------------------------------------- #
# Special bounds
# --------------------------------------------------------------------------- #
def _mlp64():
    case = zoo.get_case("mlp", jnp.float64)
    return case, _grads(case.loss_fn, case.params, case.batch)


def test_scalar_bound_is_the_global_form_and_one_group_tree_equals_it():
    with zoo.x64():
        case, g = _mlp64()
        C = float(np.median(_norms(g)))
        fn = js.per_example_stat(case.loss_fn, (js.stats.clipped_sum(C),
                                                js.stats.clipped_sum({"l1": C, "l2": C,
                                                                      "l3": C})))
        glob, per = jax.jit(fn)(case.params, case.batch)
        assert_tree_close(glob, zoo.oracle(case, "clipped_sum", clip_norm=C), **TOL64)
        assert_tree_close(per, clipped_by_hand(g, {"l1": C, "l2": C, "l3": C}), **TOL64)
        # a one-element container of the whole tree is one group: the global form
        wrapped = jax.jit(js.per_example_stat(
            lambda ps, b: case.loss_fn(ps[0], b), js.stats.clipped_sum((C,))))((case.params,),
                                                                               case.batch)
        assert_tree_close(wrapped[0], glob, **TOL64)


def test_inf_bounds_give_the_sum():
    with zoo.x64():
        case, g = _mlp64()
        bounds = {"l1": INF, "l2": {"w": INF, "b": INF}, "l3": INF}
        got = jax.jit(js.per_example_stat(case.loss_fn, js.stats.clipped_sum(bounds)))(
            case.params, case.batch)
        assert_tree_close(got, jax.tree.map(lambda x: x.sum(0), g), **TOL64)
        # inf in one group only: that group is summed, the others clipped
        C = median_bounds(g, {"l1": 1.0, "l2": 1.0, "l3": 1.0})
        mixed = {**C, "l2": INF}
        got = jax.jit(js.per_example_stat(case.loss_fn, js.stats.clipped_sum(mixed)))(
            case.params, case.batch)
        assert_tree_close(got, clipped_by_hand(g, mixed), **TOL64)
        assert_tree_close(got["l2"], jax.tree.map(lambda x: x.sum(0), g["l2"]), **TOL64)


@pytest.mark.parametrize("chunk", [1, 4])
def test_chunks(chunk):
    """chunk_size 4 of B=6 leaves a short last chunk."""
    with zoo.x64():
        case, g = _mlp64()
        bounds = median_bounds(g, _mlp_mixed(case.params))
        fn = js.per_example_stat(case.loss_fn, js.stats.clipped_mean(bounds), chunk_size=chunk)
        got = jax.jit(fn)(case.params, case.batch)
        assert_tree_close(got, clipped_by_hand(g, bounds, mean=True), **TOL64)


def test_batch_of_one():
    with zoo.x64():
        case, _ = _mlp64()
        batch = jax.tree.map(lambda x: x[2:3], case.batch)
        g = _grads(case.loss_fn, case.params, batch)
        bounds = jax.tree.map(lambda x: 0.5 * float(np.sqrt(np.sum(x**2))), g)  # all clipped
        got = js.per_example_stat(case.loss_fn, js.stats.clipped_sum(bounds))(case.params, batch)
        assert_tree_close(got, clipped_by_hand(g, bounds), **TOL64)
        # every leaf clipped to half its norm
        for a, C in zip(jax.tree.leaves(got), jax.tree.leaves(bounds)):
            np.testing.assert_allclose(np.sqrt(np.sum(np.square(a))), C, rtol=1e-12)


def test_mixed_dtype_groups():
    """A bfloat16 leaf and a float32 leaf in different groups: each gradient comes back in
    its leaf's dtype, clipped by its own group's norm."""
    r = np.random.default_rng(3)
    params = {"a": jnp.asarray(r.normal(size=(5, 3)), jnp.bfloat16),
              "b": jnp.asarray(r.normal(size=(3,)), jnp.float32)}
    batch = {"x": jnp.asarray(r.normal(size=(7, 5)), jnp.float32),
             "y": jnp.asarray(r.normal(size=(7, 3)), jnp.float32)}

    def loss(p, b):
        h = b["x"] @ p["a"].astype(jnp.float32) + p["b"]
        return jnp.mean(jnp.sum((h - b["y"]) ** 2, -1))

    g = _grads(loss, params, batch)
    bounds = median_bounds(g, {"a": 1.0, "b": 1.0})
    got = jax.jit(js.per_example_stat(loss, js.stats.clipped_sum(bounds)))(params, batch)
    assert got["a"].dtype == jnp.bfloat16 and got["b"].dtype == jnp.float32
    want = clipped_by_hand(g, bounds)
    np.testing.assert_allclose(np.asarray(got["b"], np.float64), want["b"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got["a"], np.float64), want["a"], rtol=2e-2, atol=2e-2)


def test_several_argnums_tuple_or_list_of_bounds():
    with zoo.x64():
        case, g = _mlp64()
        p = case.params

        def loss(a, b, batch):
            return case.loss_fn({"l1": a, "l2": b["l2"], "l3": b["l3"]}, batch)

        rest = {"l2": p["l2"], "l3": p["l3"]}
        ga = g["l1"]
        gb = {"l2": g["l2"], "l3": g["l3"]}
        bounds = median_bounds((ga, gb), (1.0, {"l2": 1.0, "l3": 1.0}))
        for b in (bounds, list(bounds)):
            fn = js.per_example_stat(loss, js.stats.clipped_sum(b), argnums=(0, 1),
                                     batch_argnums=2)
            got = jax.jit(fn)(p["l1"], rest, case.batch)
            assert_tree_close(got, clipped_by_hand((ga, gb), bounds), **TOL64)


def test_two_clipped_sums_one_pass_and_equal_requests_shared():
    with zoo.x64():
        case, g = _mlp64()
        b1 = median_bounds(g, _mlp_per_layer(case.params))
        b2 = jax.tree.map(lambda C: 0.5 * C, median_bounds(g, _mlp_per_leaf(case.params)))
        stats = {"a": js.stats.clipped_sum(b1), "b": js.stats.clipped_sum(b2),
                 "c": js.stats.clipped_sum(dict(b1)), "glob": js.stats.clipped_sum(1.0)}
        red = [r for s in stats.values() for r in s.reductions().values()]
        assert red[0] == red[2] and hash(red[0]) == hash(red[2])  # computed once
        assert red[0] != red[1] and red[0] != red[3]
        got = jax.jit(js.per_example_stat(case.loss_fn, stats))(case.params, case.batch)
        assert_tree_close(got["a"], clipped_by_hand(g, b1), **TOL64)
        assert_tree_close(got["b"], clipped_by_hand(g, b2), **TOL64)
        assert_tree_close(got["c"], got["a"], **TOL64)
        assert_tree_close(got["glob"], zoo.oracle(case, "clipped_sum", clip_norm=1.0), **TOL64)


# --------------------------------------------------------------------------- #
# Remat: the second, reweighted backward pass with per-leaf weights
# --------------------------------------------------------------------------- #
def _remat_mlp(params, batch):
    @jax.checkpoint
    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"])

    h = layer(batch["x"], params["l1"])
    h = layer(h, params["l2"])
    return jnp.mean(jnp.sum((h - batch["y"]) ** 2, -1))


@pytest.mark.parametrize("chunk", [None, 3])
def test_remat_second_pass_per_group(chunk):
    with zoo.x64():
        r = np.random.default_rng(0)
        n = lambda *s: jnp.asarray(r.standard_normal(s) * 0.7, jnp.float64)  # noqa: E731
        params = {"l1": {"w": n(5, 6), "b": n(6)}, "l2": {"w": n(6, 3), "b": n(3)}}
        batch = {"x": n(8, 5), "y": n(8, 3)}
        jp = jax.make_jaxpr(_remat_mlp)(params, batch).jaxpr
        assert plans.clips_by_recompute(jp)
        g = _grads(_remat_mlp, params, batch)
        b1 = median_bounds(g, {"l1": 1.0, "l2": {"w": 1.0, "b": 1.0}})
        b2 = median_bounds(g, {"l1": {"w": 1.0, "b": 1.0}, "l2": 1.0})
        stats = (js.stats.clipped_sum(b1), js.stats.clipped_mean(b2), js.stats.clipped_sum(0.3))
        got = jax.jit(js.per_example_stat(_remat_mlp, stats, chunk_size=chunk))(params, batch)
        assert_tree_close(got[0], clipped_by_hand(g, b1), **TOL64)
        assert_tree_close(got[1], clipped_by_hand(g, b2, mean=True), **TOL64)
        assert_tree_close(got[2], clipped_by_hand(g, 0.3), **TOL64)


def test_remat_scan_transformer_per_leaf_float32():
    """Stacked layers under lax.scan with remat: each stacked leaf one group."""
    with zoo.x64():
        case64 = zoo.get_case("transformer_scan_remat", jnp.float64)
        g = _grads(case64.loss_fn, case64.params, case64.batch)
    case = zoo.get_case("transformer_scan_remat", jnp.float32)
    bounds = median_bounds(g, jax.tree.map(lambda _: 1.0, case.params))
    got = jax.jit(js.per_example_stat(case.loss_fn, js.stats.clipped_sum(bounds)))(
        case.params, case.batch)
    assert_close_scaled(got, clipped_by_hand(g, bounds), g)


# --------------------------------------------------------------------------- #
# Traced bounds, bad bounds
# --------------------------------------------------------------------------- #
def test_traced_bounds_in_jit():
    with zoo.x64():
        case, g = _mlp64()
        bounds = median_bounds(g, _mlp_mixed(case.params))

        @jax.jit
        def step(params, batch, bounds):
            return js.per_example_stat(case.loss_fn, js.stats.clipped_sum(bounds))(params, batch)

        got = step(case.params, case.batch, jax.tree.map(jnp.asarray, bounds))
        assert_tree_close(got, clipped_by_hand(g, bounds), **TOL64)
        half = jax.tree.map(lambda C: 0.5 * C, bounds)
        got = step(case.params, case.batch, jax.tree.map(jnp.asarray, half))  # no retrace
        assert_tree_close(got, clipped_by_hand(g, half), **TOL64)


def test_traced_bad_bound_poisons_its_group_only():
    case = zoo.get_case("mlp")
    fn = jax.jit(lambda bounds: js.per_example_stat(case.loss_fn, js.stats.clipped_sum(bounds))(
        case.params, case.batch))
    for bad in (jnp.nan, -1.0, 0.0):
        got = fn({"l1": jnp.asarray(bad), "l2": jnp.asarray(1.0), "l3": jnp.asarray(INF)})
        assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(got["l1"]))
        assert all(np.isfinite(np.asarray(x)).all() for k in ("l2", "l3")
                   for x in jax.tree.leaves(got[k]))


@pytest.mark.parametrize("bad,err,match", [
    ({"l1": 1.0, "l2": -1.0}, ValueError, r"clipped_sum\(clip_norm=\.\.\.\): the bound at "
                                          r"\['l2'\] must be a positive number"),
    ({"l1": 1.0, "l2": {"w": float("nan")}}, ValueError, r"the bound at \['l2'\]\['w'\]"),
    ({"l1": 1.0, "l2": 0}, ValueError, r"\['l2'\] must be a positive"),
    ({"l1": np.float32(-2.0)}, ValueError, r"\['l1'\] must be a positive"),
    ({"l1": 1.0, "l2": None}, TypeError, r"the bound at \['l2'\] is None"),
    ({"l1": 1.0, "l2": True}, TypeError, r"\['l2'\]: expected a number"),
    ({"l1": "1.0"}, TypeError, r"\['l1'\]: expected a number"),
    ({"l1": jnp.ones(2)}, ValueError, r"\['l1'\] must be a real scalar.*pytree of scalars"),
    ({}, ValueError, "holds no bound"),
    (jnp.ones(3), ValueError, "clip_norm must be a real scalar"),
])
def test_bad_concrete_bounds_raise_naming_the_path(bad, err, match):
    with pytest.raises(err, match=match):
        js.stats.clipped_sum(bad)
    with pytest.raises(err, match=match.replace("clipped_sum", "clipped_mean")):
        js.stats.clipped_mean(bad)


@pytest.mark.parametrize("bounds,match", [
    ({"l1": 1.0, "l2": 1.0}, r"the parameter leaf \['l3'\]\['b'\] has no bound above it"),
    ({"l1": 1.0, "l2": 1.0, "l3": 1.0, "l4": 1.0},
     r"the bound at \['l4'\] matches no parameters"),
    ({"l1": 1.0, "l2": 1.0, "l3": {"w": 1.0, "b": {"x": 1.0}}},
     r"the bound at \['l3'\]\['b'\]\['x'\] lies below the parameter leaf \['l3'\]\['b'\]"),
    ([1.0, 1.0, 1.0], r"the bound at \[0\] matches no parameters"),
])
def test_tree_not_a_prefix_raises_naming_the_path(bounds, match):
    case = zoo.get_case("mlp")
    fn = js.per_example_stat(case.loss_fn, js.stats.clipped_sum(bounds))
    with pytest.raises(ValueError, match=match) as e:
        fn(case.params, case.batch)
    assert "per_example_stat: the clip_norm of clipped_sum/clipped_mean" in str(e.value)
    with pytest.raises(ValueError, match=match):  # explain says the same
        js.explain(case.loss_fn, js.stats.clipped_sum(bounds))(case.params, case.batch)


def test_tree_of_another_node_type_raises():
    """The same paths, another container: a list of bounds for a tuple of parameters."""
    w = (jnp.ones((3, 2)), jnp.ones(2))
    batch = {"x": jnp.arange(12.0).reshape(4, 3) / 7}
    loss = lambda p, b: jnp.mean((b["x"] @ p[0] + p[1]) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match=r"node's type differs"):
        js.per_example_stat(loss, js.stats.clipped_sum([1.0, 2.0]))(w, batch)
    got = js.per_example_stat(loss, js.stats.clipped_sum((INF, INF)))(w, batch)
    assert_tree_close(got, js.per_example_stat(loss, js.stats.sum())(w, batch), rtol=1e-6)


# --------------------------------------------------------------------------- #
# shard_map: the batch split over devices, axis_name
# --------------------------------------------------------------------------- #
@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices: tests/conftest.py")
@pytest.mark.parametrize("chunk", [None, 1])
def test_shard_map_axis_name(chunk):
    case = zoo.get_case("mlp")
    x, y = case.batch["x"], case.batch["y"]
    batch = {"x": jnp.concatenate([x, 0.7 * x[:2]]), "y": jnp.concatenate([y, y[1:3]])}  # B=8
    with zoo.x64():
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), case.params)
        g = _grads(case.loss_fn, p64, {"x": jnp.asarray(batch["x"], jnp.float64),
                                      "y": batch["y"]})
    bounds = median_bounds(g, _mlp_mixed(case.params))
    stats = {"sum": js.stats.clipped_sum(bounds), "mean": js.stats.clipped_mean(bounds)}
    fn = js.per_example_stat(case.loss_fn, stats, axis_name="d", chunk_size=chunk)
    mesh = jax.make_mesh((4,), ("d",))
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(), check_vma=True)
    rep, split = (jax.sharding.NamedSharding(mesh, s) for s in (P(), P("d")))
    out = jax.jit(sm)(jax.device_put(case.params, rep), jax.device_put(batch, split))
    assert_close_scaled(out["sum"], clipped_by_hand(g, bounds), g)
    assert_close_scaled(out["mean"], clipped_by_hand(g, bounds, mean=True),
                        jax.tree.map(lambda x: x / 8, g))


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices: tests/conftest.py")
def test_tensor_parallel_groups_combine_the_shards_first():
    """A Megatron MLP on a (data, model) mesh: a column-sharded w1/b1 and a row-sharded w2
    hold a part of each example's gradient per shard; a group's norm combines the shards'
    parts (and the group's leaves) before the bound applies."""
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    params = {"w1": f(6, 8) / 2, "b1": f(8) / 4, "w2": f(8, 6) / 2, "g": 1 + f(6) / 4}
    batch = {"x": f(8, 6), "y": f(8, 6)}
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "g": P()}

    def body(p, b, psum):
        h = jnp.tanh((b["x"] * p["g"]) @ p["w1"] + p["b1"])  # column-parallel
        return jnp.mean((psum(h @ p["w2"]) - b["y"]) ** 2)  # row-parallel

    local = lambda p, b: body(p, b, lambda y: jax.lax.psum(y, "model"))  # noqa: E731
    full = lambda p, b: body(p, b, lambda y: y)  # noqa: E731
    g = _grads(full, params, batch)
    bounds = median_bounds(g, {"w1": 1.0, "b1": 1.0, "w2": 1.0, "g": 1.0})
    bounds = {"first": {"w1": bounds["w1"], "b1": bounds["b1"]}, "w2": bounds["w2"],
              "g": bounds["g"]}
    tree = lambda p: {"first": {"w1": p["w1"], "b1": p["b1"]}, "w2": p["w2"], "g": p["g"]}  # noqa: E731
    grouped = lambda loss: lambda p, b: loss(  # noqa: E731
        {"w1": p["first"]["w1"], "b1": p["first"]["b1"], "w2": p["w2"], "g": p["g"]}, b)
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    fn = js.per_example_stat(grouped(local), js.stats.clipped_sum(bounds), axis_name="data")
    sm = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(tree(specs), P("data")),
                               out_specs=tree(specs)))
    ns = lambda s: jax.sharding.NamedSharding(mesh, s)  # noqa: E731
    got = sm(tree({k: jax.device_put(v, ns(specs[k])) for k, v in params.items()}),
             jax.device_put(batch, ns(P("data"))))
    want = clipped_by_hand(tree(g), bounds)
    assert_close_scaled(got, want, tree(g))


# --------------------------------------------------------------------------- #
# DP optimizers: noise calibrated to sqrt(sum_k C_k^2); the request carries the bounds
# --------------------------------------------------------------------------- #
def test_dp_sensitivity():
    assert jso.dp_sensitivity(2.0) == 2.0
    assert jso.dp_sensitivity({"a": 3.0, "b": {"c": 4.0}}) == 5.0
    assert jso.dp_sensitivity({"a": 3.0, "b": INF}) == INF
    t = jax.jit(jso.dp_sensitivity)({"a": 3.0, "b": 4.0})
    np.testing.assert_allclose(t, 5.0, rtol=1e-6)


def test_dp_noise_std_with_per_group_bounds():
    bounds = {"w": 3.0, "b": 4.0}  # sensitivity 5
    tx = jso.dp_aggregate(clip_norm=bounds, noise_multiplier=1.5)
    zeros = {"w": jnp.zeros((200, 50)), "b": jnp.zeros((300,))}
    u, _ = tx.update(zeros, tx.init(zeros), clipped_sum=zeros, batch_size=4, clip_norm=bounds,
                     key=jax.random.key(0))
    noise = np.concatenate([np.ravel(x) for x in jax.tree.leaves(u)]) * 4
    np.testing.assert_allclose(noise.std(), 1.5 * 5.0, rtol=0.02)
    # every group gets noise of the same std (the Gaussian mechanism on the whole vector)
    for x in jax.tree.leaves(u):
        np.testing.assert_allclose(np.std(np.asarray(x) * 4), 7.5, rtol=0.05)


def test_dp_sgd_step_from_the_request_with_per_layer_bounds():
    case = zoo.get_case("mlp")
    g = _grads(case.loss_fn, case.params, case.batch)
    bounds = median_bounds(g, _mlp_per_layer(case.params))
    opt = jso.dp_adam(0.1, clip_norm=bounds, noise_multiplier=1.0)
    request = jso.stat_request(opt)
    assert request["clipped_sum"].clip_norm == bounds

    @jax.jit
    def step(params, state, batch, key):
        stats = js.per_example_stat(case.loss_fn, request)(params, batch)
        return opt.update(stats["mean"], state, params, **jso.update_kwargs(stats, key=key))

    updates, _ = step(case.params, opt.init(case.params), case.batch, jax.random.key(0))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(updates))
    # dp_sgd without momentum: the update is -lr * clipped_sum / B exactly
    opt = jso.dp_sgd(0.1, clip_norm=bounds, noise_multiplier=0.0)
    request = jso.stat_request(opt)
    stats = js.per_example_stat(case.loss_fn, request)(case.params, case.batch)
    updates, _ = opt.update(stats["mean"], opt.init(case.params), case.params,
                            **jso.update_kwargs(stats))
    want = jax.tree.map(lambda s: -0.1 * s / 6, clipped_by_hand(g, bounds))
    assert_close_scaled(updates, want, jax.tree.map(lambda x: 0.1 * x / 6, g))
    # by name, with the bounds
    named = jso.stat_request("dp_sgd", clip_norm=bounds)
    assert named["clipped_sum"].clip_norm == bounds
    used = named["clip_norm"].finalize({}, 6)  # the bounds the clipping used, float32
    assert jax.tree.structure(used) == jax.tree.structure(bounds)
    assert_tree_close(used, bounds, rtol=1e-7)


def test_dp_bounds_checked_against_the_clipping():
    bounds = {"w": 3.0, "b": 4.0}
    tx = jso.dp_aggregate(clip_norm=bounds, noise_multiplier=1.0)
    zeros = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    kw = dict(clipped_sum=zeros, batch_size=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"clipped at clip_norm=3.5 \(the bound at \['w'\]\)"):
        tx.update(zeros, (), clip_norm={"w": 3.5, "b": 4.0}, **kw)
    with pytest.raises(ValueError, match="structure"):
        tx.update(zeros, (), clip_norm=5.0, **kw)
    u, _ = tx.update(zeros, (), clip_norm={"w": jnp.asarray(3.0), "b": jnp.asarray(4.0)}, **kw)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))
    # traced and different: the update is poisoned, never silently mis-noised
    f = jax.jit(lambda c: tx.update(zeros, (), clip_norm=c, **kw)[0])
    bad = f({"w": jnp.asarray(3.0), "b": jnp.asarray(4.5)})
    assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(bad))
    good = f({"w": jnp.asarray(3.0), "b": jnp.asarray(4.0)})
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(good))


def test_dp_bad_bounds():
    with pytest.raises(ValueError, match=r"infinite noise.*"):
        jso.dp_sgd(0.1, clip_norm={"w": 1.0, "b": INF}, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"\(the bound at \['b'\]\)"):
        jso.dp_sgd(0.1, clip_norm={"w": 1.0, "b": -1.0}, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="holds no bound"):
        jso.dp_aggregate(clip_norm={}, noise_multiplier=1.0)
    # no noise, inf bounds: plain SGD on the mean
    jso.dp_sgd(0.1, clip_norm={"w": INF, "b": INF}, noise_multiplier=0.0)


def test_inject_hyperparams_keeps_a_tree_of_bounds_static():
    case = zoo.get_case("mlp")
    bounds = {"l1": 1.0, "l2": 2.0, "l3": 0.5}
    opt = jso.inject_hyperparams(jso.dp_sgd)(
        learning_rate=optax.linear_schedule(0.1, 0.0, 10), clip_norm=bounds,
        noise_multiplier=1.0)
    state = opt.init(case.params)
    request = jso.stat_request(opt, state)
    assert request["clipped_sum"].clip_norm == bounds
    stats = jax.jit(js.per_example_stat(case.loss_fn, request))(case.params, case.batch)
    u, _ = opt.update(stats["mean"], state, case.params,
                      **jso.update_kwargs(stats, key=jax.random.key(1)))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))
    # two parts requesting different bounds under one name: refused
    with pytest.raises(ValueError, match="different statistics"):
        jso.chain(jso.dp_aggregate(bounds, 1.0), jso.dp_aggregate({**bounds, "l3": 0.6}, 1.0))
    jso.chain(jso.dp_aggregate(bounds, 1.0), jso.dp_aggregate(dict(bounds), 1.0))  # same


# --------------------------------------------------------------------------- #
# explain
# --------------------------------------------------------------------------- #
def test_explain_shows_per_layer_clipping():
    case = zoo.get_case("mlp")
    bounds = {"l1": 0.3, "l2": {"w": 0.2, "b": 0.05}, "l3": INF}
    rep = js.explain(case.loss_fn, {"c": js.stats.clipped_sum(bounds),
                                    "g": js.stats.clipped_mean(1.0)})(case.params, case.batch)
    by_path = {leaf.path: leaf for leaf in rep.leaves}
    assert by_path["['l1']['w']"].clip_groups == {"clipped_sum": ("['l1']", 0.3)}
    assert by_path["['l2']['b']"].clip_groups == {"clipped_sum": ("['l2']['b']", 0.05)}
    assert "clipped_mean" not in by_path["['l1']['w']"].clip_groups
    assert "per clip group" in by_path["['l1']['w']"].hows["clipped_sum"]
    assert "per clip group" not in by_path["['l1']['w']"].hows["clipped_mean"]
    assert "group at ['l3'], bound inf" in by_path["['l3']['b']"].detail
    text = rep.format(None)
    assert "clipped_sum: per-layer clipping, 4 groups (bound, leaves): ['l1'] 0.3 (2 leaves)" \
        in text
    assert rep.as_dict()["leaves"][0]["clip_groups"]

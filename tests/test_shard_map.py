"""jax.shard_map over a 4-device mesh, batch split on 'd', axis_name='d':
every statistic equals the single-device full-batch result (check_vma=True).

Known trap: inside shard_map JAX inserts ``pvary`` on replicated parameters; a
matcher that misses the sites silently returns zeros. Every result is checked
to be non-zero as well as equal to the oracle.
"""

from __future__ import annotations

import functools

import _models as M
import jax
import numpy as np
import pytest
import zoo
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js

NDEV = M.NDEV

pytestmark = [pytest.mark.slow, M.needs_devices]


def _mesh(axis_type=None):
    if axis_type is None:
        return jax.make_mesh((NDEV,), ("d",))
    return jax.make_mesh((NDEV,), ("d",), axis_types=(axis_type,))


def _place(mesh, params, batch):
    """Params replicated, batch split on 'd' (explicit-sharding meshes require it)."""
    rep = jax.sharding.NamedSharding(mesh, P())
    split = jax.sharding.NamedSharding(mesh, P("d"))
    return jax.device_put(params, rep), jax.device_put(batch, split)


def _out_specs(stat_names):
    return {k: (P("d") if k in M.PER_EXAMPLE else P()) for k in stat_names}


def _check(name, out, names):
    ref, ora = M.result_of(name), M.oracle_of(name)
    for k in names:
        M.assert_not_all_zero(out[k], f"{name} {k}")
        M.assert_consistent(k, out[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=f"{name} vs 1-device")
        M.assert_stat_close(k, out[k], ora[k])


@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_shard_map_every_statistic_equals_full_batch(name, chunk):
    """Also in chunks of one local example: the chunks' running statistics (the loop
    carry) vary over the mesh axis like the statistics themselves."""
    loss, params, batch = M.get(name)
    fn = js.per_example_stat(loss, M.all_stats(), axis_name="d", chunk_size=chunk)
    mesh = _mesh()
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")),
                       out_specs=_out_specs(M.STAT_NAMES), check_vma=True)
    out = jax.jit(sm)(*_place(mesh, params, batch))
    _check(name, out, M.STAT_NAMES)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_shard_map_mesh_axis_types(axis_type):
    loss, params, batch = M.get("mlp")
    names = ("mean", "variance", "sq_norms", "clipped_mean")
    fn = js.per_example_stat(loss, {k: M.STATS[k]() for k in names}, axis_name="d")
    mesh = _mesh(getattr(jax.sharding.AxisType, axis_type))
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=_out_specs(names))
    out = jax.jit(sm)(*_place(mesh, params, batch))
    _check("mlp", out, names)


def test_shard_map_value_and_stat_and_aux():
    loss, params, batch = M.get("mlp")

    def loss_aux(p, b):
        return M.mlp_loss(p, b), {"x0": b["x"][:, 0]}

    vfn = js.value_and_per_example_stat(loss_aux, js.stats.mean(), has_aux=True, axis_name="d")
    mesh = _mesh()
    sm = jax.shard_map(vfn, mesh=mesh, in_specs=(P(), P("d")),
                       out_specs=((P(), {"x0": P("d")}), P()))
    (l, aux), mean = jax.jit(sm)(*_place(mesh, params, batch))
    np.testing.assert_allclose(l, loss(params, batch), rtol=1e-6)
    np.testing.assert_allclose(aux["x0"][:, 0], batch["x"][:, 0])  # aux of a batch of 1
    M.assert_tree_close(mean, jax.grad(loss)(params, batch), err_msg="mean")


def test_shard_map_check_vma_false():
    loss, params, batch = M.get("mlp")
    names = ("mean", "variance", "sq_norms", "clipped_sum")
    fn = js.per_example_stat(loss, {k: M.STATS[k]() for k in names}, axis_name="d")
    mesh = _mesh()
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=_out_specs(names),
                       check_vma=False)
    out = jax.jit(sm)(*_place(mesh, params, batch))
    _check("mlp", out, names)


# --------------------------------------------------------------------------- #
# Tensor parallelism: a Megatron MLP on a (data, model) mesh
# --------------------------------------------------------------------------- #
def _megatron():
    r = np.random.default_rng(0)
    D, H, B = 6, 8, 8
    f = lambda *s: jax.numpy.asarray(r.normal(size=s), jax.numpy.float32)  # noqa: E731
    params = {"w1": f(D, H) / 2, "b1": f(H) / 4, "w2": f(H, D) / 2, "g": 1 + f(D) / 4}
    batch = {"x": f(B, D), "y": f(B, D)}
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "g": P()}

    def body(p, b, psum):
        h = jax.numpy.tanh((b["x"] * p["g"]) @ p["w1"] + p["b1"])  # column-parallel
        return jax.numpy.mean((psum(h @ p["w2"]) - b["y"]) ** 2)  # row-parallel

    local = lambda p, b: body(p, b, lambda y: jax.lax.psum(y, "model"))  # noqa: E731
    full = lambda p, b: body(p, b, lambda y: y)  # noqa: E731
    return local, full, params, batch, specs


TP_STATS = {
    "mean": lambda: js.stats.mean(),
    "second_moment": lambda: js.stats.second_moment(),
    "variance": lambda: js.stats.variance(),
    "sign_mean": lambda: js.stats.sign_mean(),
    "sq_norms": lambda: js.stats.sq_norms(),
    "sq_norms_per_leaf": lambda: js.stats.sq_norms(per_leaf=True),
    "clipped_mean": lambda: js.stats.clipped_mean(0.5),
}


@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("stat", sorted(TP_STATS))
def test_tensor_parallel_megatron_mlp(stat, chunk):
    """Column-sharded w1/b1, row-sharded w2, replicated gain, psum over 'model': elementwise
    statistics are exact per shard; norms and clipping sum the shards' parts. Also in
    chunks (running statistics of sharded leaves vary over 'model' too)."""
    local, full, params, batch, specs = _megatron()
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    per_ex = stat.startswith("sq_norms")
    out_specs = P("data") if stat == "sq_norms" else (
        {k: P("data") for k in specs} if per_ex else specs)
    fn = js.per_example_stat(local, TP_STATS[stat](), axis_name="data", chunk_size=chunk)
    sm = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, P("data")), out_specs=out_specs))
    ns = lambda s: jax.sharding.NamedSharding(mesh, s)  # noqa: E731
    got = sm({k: jax.device_put(v, ns(specs[k])) for k, v in params.items()},
             jax.device_put(batch, ns(P("data"))))
    want = js.per_example_stat(full, TP_STATS[stat]())(params, batch)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.any(np.asarray(w) != 0)
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-5, atol=1e-6)


def test_untyped_tensor_parallelism_refuses_whole_gradient_values():
    """The Megatron MLP under shard_map with check_vma=False: no type says w1, b1, w2 are
    split over 'model', so their per-example norms would be each device's part (were:
    squared norms off by 48, clipping by the wrong factors, silently). Norms, clipping
    and Kronecker factors are refused, naming the axis and the fix; the mean is served,
    equal to jax.grad's under the same shard_map."""
    local, _, params, batch, specs = _megatron()
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    ns = lambda s: jax.sharding.NamedSharding(mesh, s)  # noqa: E731
    args = ({k: jax.device_put(v, ns(specs[k])) for k, v in params.items()},
            jax.device_put(batch, ns(P("data"))))

    def untyped(fn, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, P("data")),
                                     out_specs=out_specs, check_vma=False))

    for stat, out in [(js.stats.sq_norms(), P("data")), (js.stats.clipped_mean(0.5), specs),
                      (js.stats.kron_moments(), P())]:
        with pytest.raises(NotImplementedError, match=r"check_vma=False.*mesh axis 'model'"
                           r".*check_vma=True"):
            untyped(js.per_example_stat(local, stat, axis_name="data", check=False), out)(*args)
    with pytest.warns(js.CrossExampleWarning):  # (the proof cannot follow 'model' untyped)
        mean = untyped(js.per_example_stat(local, js.stats.mean(), axis_name="data"), specs)(*args)
    grad = untyped(lambda p, b: jax.tree.map(lambda g: jax.lax.pmean(g, "data"),
                                             jax.grad(local)(p, b)), specs)(*args)
    for k in specs:
        np.testing.assert_allclose(np.asarray(mean[k]), np.asarray(grad[k]), rtol=1e-5,
                                   atol=1e-7, err_msg=k)


def test_untyped_check_walks_no_jaxpr_where_no_axis_is_bound(monkeypatch):
    """Outside any mapped body no collective can name a mesh axis: the untyped check
    does not walk the loss's equations there (it did on every norm or clipping call on
    one device); inside shard_map with check_vma=False it still refuses (above)."""
    from jaxpr_surgery._src import untyped

    walked = []
    inner = untyped.model_axes
    monkeypatch.setattr(untyped, "model_axes", lambda *a: walked.append(1) or inner(*a))
    _, full, params, batch, _ = _megatron()
    jax.jit(js.per_example_stat(full, js.stats.sq_norms())).lower(params, batch)
    assert not walked
    mesh = jax.make_mesh((4,), ("data",))
    # (nor under the package's own split of a batch XLA shards, devices.py)
    on = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
    jax.jit(js.per_example_stat(full, js.stats.sq_norms())).lower(params, on)
    assert not walked
    fn = js.per_example_stat(full, js.stats.sq_norms(), axis_name="data", check=False)
    batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
    jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"),
                          check_vma=False))(params, batch)
    assert walked


def test_tensor_parallel_kron_moments_raise_clearly():
    local, _, params, batch, specs = _megatron()
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    fn = js.per_example_stat(local, js.stats.kron_moments(), axis_name="data")
    sm = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, P("data")), out_specs=P()))
    ns = lambda s: jax.sharding.NamedSharding(mesh, s)  # noqa: E731
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        sm({k: jax.device_put(v, ns(specs[k])) for k, v in params.items()},
           jax.device_put(batch, ns(P("data"))))


@pytest.mark.parametrize("chunk", [None, 1])
def test_shard_map_central_moments_equal_full_batch(chunk):
    """The research statistics of central moments (kurtosis; variance beside it) under
    shard_map, also in chunks of one local example (one example's own values: its mean,
    zero about it, varying over the mesh axis): the whole batch's value on every device,
    against the vmap(grad) oracle."""
    loss, params, batch = M.get("transformer")
    stats = {"kurtosis": js.stats.kurtosis(), "variance": js.stats.variance()}
    fn = js.per_example_stat(loss, stats, axis_name="d", chunk_size=chunk)
    mesh = _mesh()
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")),
                       out_specs={k: P() for k in stats}, check_vma=True)
    out = jax.jit(sm)(*_place(mesh, params, batch))
    g = jax.jit(M.per_example_grads, static_argnums=0)(loss, params, batch)
    for k in stats:
        want = zoo.oracle_from_grads(g, k)
        for a, b in zip(jax.tree.leaves(out[k]), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=2e-3, atol=1e-6,
                                       err_msg=k)


def test_parameter_gathered_over_a_model_axis_refused_clearly():
    """A weight sharded over the model axis of a (data, model) mesh and gathered over it
    in the loss, the batch over 'data' (axis_name): a NotImplementedError naming the leaf,
    the collective and the axis (was a custom-VJP type error from jax about varying
    manual axes); jax.grad runs."""
    mesh = jax.make_mesh((2, NDEV // 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    params = {"w": jax.numpy.asarray(rng.normal(size=(8, 4 * NDEV)), jax.numpy.float32),
              "v": jax.numpy.asarray(rng.normal(size=(8,)), jax.numpy.float32)}
    batch = {"x": jax.numpy.asarray(rng.normal(size=(8, 8)), jax.numpy.float32)}

    def local(p, b):
        w = jax.lax.all_gather(p["w"], "model", axis=1, tiled=True)
        return jax.numpy.mean(jax.numpy.tanh(b["x"] @ w) ** 2) + jax.numpy.sum(p["v"] ** 2)

    specs = {"w": P(None, "model"), "v": P()}
    grad = jax.shard_map(jax.grad(local), mesh=mesh, in_specs=(specs, P("data")),
                         out_specs=specs, check_vma=False)
    jax.jit(grad)(params, batch)
    stat = jax.shard_map(js.per_example_stat(local, js.stats.second_moment(), axis_name="data"),
                         mesh=mesh, in_specs=(specs, P("data")), out_specs=specs)
    with pytest.raises(NotImplementedError, match=r"\['w'\] go through all_gather over mesh "
                       r"axis 'model'.*not split on"):
        jax.jit(stat)(params, batch)


def _replicated_leaf_loss(form, cast_u=False):
    """A loss whose replicated weight JAX casts to varying (shard_map's types) inside
    something the package evaluates as it stands: a view of the weight (``tanh(W)``,
    ``diag(W)``: the cast comes after the view), a ``fori_loop`` closing over it (the
    cast inside the loop's body). `test_random_models.py` crosses more. ``cast_u``: the
    loss also casts another weight to varying itself (``jax.lax.pcast``), which it may
    only do to a value that does not vary yet; the loss returned then takes whether to
    (outside shard_map, for the oracle, it may not)."""
    jnp = jax.numpy

    def loss(p, b, cast=cast_u):
        x = b["x"]
        if form == "through_tanh":
            h = x @ jnp.tanh(p["w"])
        elif form == "dense_and_diagonal":
            h = x @ p["w"] + x * jnp.diag(p["w"])
        else:  # a fori_loop closing over the weight
            h = jax.lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c @ p["w"]), x)
        if "u" in p:
            h = h * (M.cast_to_varying(p["u"], "d") if cast else p["u"])
        return jnp.mean((jnp.tanh(h) @ p["v"] - b["y"]) ** 2)

    return loss


@pytest.mark.parametrize("cast_u", [False, True])
@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("form", ["through_tanh", "dense_and_diagonal", "fori_loop"])
def test_replicated_leaf_cast_inside_the_loss_exact(form, chunk, cast_u):
    """Each device's per-example gradients of a replicated weight that JAX casts to
    varying inside the loss (`api.replicated_leaves`): every statistic equals the oracle
    of the whole batch. Before, each of these raised a type error from jax (a per-example
    gradient summed over the devices by the cast's transpose, or a cast of a copy that
    varied already); and, where the loss also cast another weight itself
    (``cast_u``: `api.cast_elsewhere`), each still did."""
    loss = _replicated_leaf_loss(form, cast_u)
    rng = np.random.default_rng(3)
    with zoo.x64():
        params = {"w": jax.numpy.asarray(rng.normal(size=(4, 4)) * 0.5),
                  "v": jax.numpy.asarray(rng.normal(size=(4,)))}
        if cast_u:
            params["u"] = jax.numpy.asarray(rng.normal(size=(4,)))
        batch = {"x": jax.numpy.asarray(rng.normal(size=(2 * NDEV, 4))),
                 "y": jax.numpy.asarray(rng.normal(size=(2 * NDEV,)))}
        stats = {"mean": js.stats.mean(), "second_moment": js.stats.second_moment(),
                 "variance": js.stats.variance(), "clipped_mean": js.stats.clipped_mean(0.2)}
        _assert_data_parallel_exact(loss, params, batch, stats, {"clip_norm": 0.2}, chunk,
                                    form, functools.partial(loss, cast=False))


def _assert_data_parallel_exact(loss, params, batch, stats, clip, chunk, what, oracle=None):
    """``stats`` of ``loss`` with the batch split over the mesh by shard_map
    (``axis_name``, parameters replicated) equal the oracle of the whole batch (float64):
    the per-example gradients of ``oracle`` (default ``loss``)."""
    fn = js.per_example_stat(loss, stats, axis_name="d", chunk_size=chunk)
    mesh = _mesh(jax.sharding.AxisType.Auto)
    out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))(
        params, batch)
    oracle = loss if oracle is None else oracle
    g = jax.vmap(jax.grad(lambda p, ex: oracle(p, jax.tree.map(lambda t: t[None], ex))),
                 (None, 0))(params, batch)
    for k in stats:
        want = zoo.oracle_from_grads(g, k, **(clip if k.startswith("clipped") else {}))
        for leaf in params:
            np.testing.assert_allclose(np.asarray(out[k][leaf]), want[leaf], rtol=1e-9,
                                       atol=1e-12, err_msg=f"{what} {k} {leaf}")


@pytest.mark.parametrize("names", [("mean",), ("mean", "clipped_sum"),
                                   ("mean", "second_moment", "clipped_sum")])
@pytest.mark.parametrize("per_device", [1, 2])
def test_convolution_kernel_sums_under_shard_map_exact(per_device, names):
    """A convolution's plain sum over the examples (the mean, where no other statistic
    forms the per-example gradients) is the transpose of one convolution in its kernel,
    typed inside shard_map as the data are: before, the kernel's type was invariant and
    the transpose raised a type error from jax (each device's sum would have been summed
    over the devices)."""
    jnp = jax.numpy

    def loss(p, b):
        h = jax.lax.conv_general_dilated(b["x"], p["k"], (1,), "SAME",
                                         dimension_numbers=("NWC", "WIO", "NWC"))
        return jnp.mean((jnp.tanh(h) @ p["o"] - b["y"]) ** 2)

    rng = np.random.default_rng(4)
    with zoo.x64():
        params = {"k": jnp.asarray(rng.normal(size=(3, 5, 5)) * 0.3),
                  "o": jnp.asarray(rng.normal(size=(5,)))}
        B = per_device * NDEV
        batch = {"x": jnp.asarray(rng.normal(size=(B, 3, 5))),
                 "y": jnp.asarray(rng.normal(size=(B, 3)))}
        every = {"mean": js.stats.mean(), "second_moment": js.stats.second_moment(),
                 "clipped_sum": js.stats.clipped_sum(0.05)}
        _assert_data_parallel_exact(loss, params, batch, {k: every[k] for k in names},
                                    {"clip_norm": 0.05}, None, "conv")

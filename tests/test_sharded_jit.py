"""jit with the batch placed with NamedSharding(mesh, P('d')) (params replicated):
results equal the unsharded computation.

Both Auto mesh axes and Explicit axes (sharding in types; the default of
``jax.make_mesh`` in jax 0.10) are supported: with Explicit axes the core runs
in Auto mode for those axes, its outputs typed like jax.grad's (the parameters' and
the batch's shardings).
"""

from __future__ import annotations

import contextlib
import warnings

import _models as M
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js

NDEV = M.NDEV

pytestmark = [pytest.mark.slow, M.needs_devices]


def _placed(name, axis_type):
    loss, params, batch = M.get(name)
    mesh = jax.make_mesh((NDEV,), ("d",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put(batch, NamedSharding(mesh, P("d")))
    return loss, params, batch, mesh


@pytest.mark.parametrize(
    "name,axis_type",
    [("mlp", "Auto"), ("transformer", "Auto"),
     ("mlp", "Explicit"), ("transformer", "Explicit")],
)
def test_batch_sharded_jit_equals_unsharded(name, axis_type):
    loss, params, batch, mesh = _placed(name, axis_type)
    assert len(jax.tree.leaves(batch)[0].sharding.device_set) == NDEV
    out = jax.jit(js.per_example_stat(loss, M.all_stats()))(params, batch)
    ref, ora = M.result_of(name), M.oracle_of(name)
    for k in M.STAT_NAMES:
        M.assert_not_all_zero(out[k], f"{name} {k}")
        M.assert_consistent(k, out[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=f"{name} vs unsharded")
        M.assert_stat_close(k, out[k], ora[k])


def test_explicit_axes_eager_and_value():
    loss, params, batch, _ = _placed("mlp", "Explicit")
    l, out = js.value_and_per_example_stat(loss, js.stats.mean())(params, batch)
    np.testing.assert_allclose(l, loss(params, batch), rtol=1e-5)
    M.assert_stat_close("mean", out, M.oracle_of("mlp")["mean"])


def test_batch_sharded_jit_with_mesh_context_and_chunks():
    """Under ``jax.set_mesh``, chunked, value + aux."""
    loss, params, batch, mesh = _placed("mlp", "Auto")

    def loss_aux(p, b):
        return M.mlp_loss(p, b), b["y"]

    stat = {"variance": js.stats.variance(), "norms": js.stats.norms()}
    vfn = js.value_and_per_example_stat(loss_aux, stat, has_aux=True, chunk_size=2)
    set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    with set_mesh(mesh):
        (l, aux), out = jax.jit(vfn)(params, batch)
    np.testing.assert_allclose(l, loss(params, batch), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux)[:, 0], np.asarray(batch["y"]))
    ora = M.oracle_of("mlp")
    M.assert_stat_close("variance", out["variance"], ora["variance"])
    M.assert_stat_close("norms", out["norms"], ora["norms"])


def _typed_model(dtype, seed=0, bwd_spec=None):
    """A loss written for sharding in types on a ("data", "model") mesh (activations
    annotated with ``out_sharding=``, ``jax.sharding.reshard``, a jitted layer inside a
    ``lax.scan`` over a stack, a ``custom_vjp`` whose forward annotates (its backward
    too with ``bwd_spec``), ``jax.nn.relu``'s ``custom_jvp``, ``jax.checkpoint`` in a
    ``cond``, ``jnp.zeros(out_sharding=)``, an einsum), its unannotated twin,
    parameters and a batch."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), dtype)  # noqa: E731
    d = 2 * NDEV
    params = {"w1": f(6, d) / 2, "ws": f(3, d, d) / 4, "w2": f(d, 3) / 4}
    batch = {"x": f(8, 6), "y": f(8, 3)}

    @jax.custom_vjp
    def act(h):
        return jnp.tanh(h)

    def act_bwd(h, g):
        g = g * (1 - jnp.tanh(h) ** 2)
        return (g if bwd_spec is None else jax.sharding.reshard(g, bwd_spec),)

    act.defvjp(lambda h: (jnp.tanh(jax.sharding.reshard(h, P("data", None))), h), act_bwd)

    @jax.jit
    def layer(h, w):
        return jnp.tanh(jnp.matmul(h, w, out_sharding=P("data", "model")))

    @jax.checkpoint
    def block(h):
        return jax.sharding.reshard(jax.nn.relu(h) + h, P("data", None))

    def typed(p, b):
        h = act(jnp.matmul(b["x"], p["w1"], out_sharding=P("data", None)))
        h, _ = jax.lax.scan(
            lambda h, w: (jax.sharding.reshard(layer(h, w), P("data", None)), None), h, p["ws"])
        h = jax.lax.cond(b["x"].shape[0] > 0, block, lambda h: h, h)
        h = h + jnp.zeros(h.shape, h.dtype, out_sharding=P("data", None))
        out = jnp.einsum("bd,do->bo", h, p["w2"], out_sharding=P("data", None))
        return jnp.mean((out - b["y"]) ** 2)

    def plain(p, b):
        h = jnp.tanh(b["x"] @ p["w1"])
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["ws"])
        return jnp.mean(((jax.nn.relu(h) + h) @ p["w2"] - b["y"]) ** 2)

    return typed, plain, params, batch


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_explicit_annotations_in_the_loss_are_dropped(dtype):
    """A loss written for sharding in types (its activations annotated for the mesh's
    Explicit axes) runs with its annotations dropped (explicit.py): every statistic
    equals the vmap(grad) oracle of its unannotated twin, under jit and eagerly, with
    the batch sharded, with everything replicated, and from numpy arrays under
    ``jax.set_mesh``; the mean equals jax.grad's; the results are typed like jax.grad's
    gradients; explain reports it. Before, every statistic raised NotImplementedError
    ("PartitionSpec passed to dot_general cannot contain axis names that are of type
    Auto"), and a replicated batch raised jax's "does not evenly divide" on the batch of
    one each example's gradient is traced on."""
    mesh = jax.make_mesh((2, NDEV // 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == "float64" else {}
    with M.x64() if dtype == "float64" else contextlib.nullcontext():
        typed, plain, params, batch = _typed_model(getattr(np, dtype))
        ora = M.oracle(plain, params, batch)
        stats = M.all_stats()
        with jax.set_mesh(mesh):
            spec = {"w1": P(None, "model"), "ws": P(None, None, "model"), "w2": P()}
            p = {k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in params.items()}
            b = jax.device_put(batch, NamedSharding(mesh, P("data")))
            grad = jax.jit(jax.grad(typed))(p, b)
            runs = {
                "jit": jax.jit(js.per_example_stat(typed, stats))(p, b),
                "eager": js.per_example_stat(typed, stats)(p, b),
                "replicated": jax.jit(js.per_example_stat(typed, stats))(
                    p, jax.device_put(batch, NamedSharding(mesh, P()))),
                "numpy": jax.jit(js.per_example_stat(typed, stats))(params, batch),
            }
            report = str(js.explain(typed, js.stats.variance())(p, b))
        for run, out in runs.items():
            for k in M.STAT_NAMES:
                M.assert_not_all_zero(out[k], f"{run} {k}")
                M.assert_stat_close(k, out[k], ora[k], **tol)
        for k in params:
            np.testing.assert_allclose(runs["jit"]["mean"][k], grad[k], rtol=1e-5, atol=1e-7)
            assert (jax.typeof(runs["jit"]["variance"][k]).sharding.spec
                    == jax.typeof(grad[k]).sharding.spec), k
        assert tuple(jax.typeof(runs["jit"]["norms"]).sharding.spec) == ("data",)
    assert "['ws']" in report and "dense" in report, report


def test_explicit_annotation_in_a_backward_rule_refused_clearly():
    """A custom_vjp backward rule that annotates runs when the statistics differentiate,
    in Auto mode, after the loss's annotations were dropped: a NotImplementedError that
    says so (jax's "cannot contain axis names that are of type Auto" before)."""
    mesh = jax.make_mesh((2, NDEV // 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    typed, _, params, batch = _typed_model(np.float32, bwd_spec=P("data", None))
    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        b = jax.device_put(batch, NamedSharding(mesh, P("data")))
        jax.jit(jax.grad(typed))(p, b)
        with pytest.raises(NotImplementedError, match=r"custom_vjp's backward rule"):
            jax.jit(js.per_example_stat(typed, js.stats.mean()))(p, b)


def test_explicit_annotations_with_a_placed_constant_refused_clearly():
    """A loss that closes over an array placed on an Explicit mesh cannot run in Auto
    mode (jax: "context mesh ... should match the aval mesh"), nor, with annotations,
    on the stand-in mesh they are dropped on: with or without annotations, a
    NotImplementedError that names the axes and the fix (pass the array as an
    argument), never a number (before: jax's ValueError); passed as an argument, the
    statistics are exact."""
    import jax.numpy as jnp

    mesh = jax.make_mesh((2, NDEV // 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    typed, plain, params, batch = _typed_model(np.float32, seed=1)
    rng = np.random.default_rng(2)
    table = jnp.asarray(rng.normal(size=(2 * NDEV, 2 * NDEV)), jnp.float32) / 4
    with jax.set_mesh(mesh):
        placed = jax.device_put(table, NamedSharding(mesh, P(None, "model")))
        p = jax.device_put(params, NamedSharding(mesh, P()))
        b = jax.device_put(batch, NamedSharding(mesh, P("data")))

        def closing(p, b):  # closes over ``placed``
            h = jnp.matmul(b["x"], p["w1"], out_sharding=P("data", "model")) @ placed
            return jnp.mean((jnp.tanh(h) @ p["w2"] - b["y"]) ** 2)

        def unannotated(p, b):
            return jnp.mean((jnp.tanh(b["x"] @ p["w1"] @ placed) @ p["w2"] - b["y"]) ** 2)

        def taking(p, b, t):  # the same loss, the table an argument
            h = jnp.matmul(b["x"], p["w1"], out_sharding=P("data", "model")) @ t
            return jnp.mean((jnp.tanh(h) @ p["w2"] - b["y"]) ** 2)

        for loss in (closing, unannotated):
            with pytest.raises(NotImplementedError, match=r"Explicit axes.*as arguments"):
                jax.jit(js.per_example_stat(loss, js.stats.mean()))(p, b)
        got = jax.jit(js.per_example_stat(taking, js.stats.variance()))(p, b, placed)
    def twin(p, b):  # (unannotated, the table closed over: outside any mesh)
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"] @ table) @ p["w2"] - b["y"]) ** 2)

    M.assert_stat_close("variance", got, M.oracle(twin, params, batch)["variance"])


def test_explicit_axes_statistics_typed_like_the_gradients():
    """Sharding in types: parameter-shaped statistics come back typed with the
    parameters' shardings, as jax.grad's gradients do, per-example vectors with the
    batch's; the values equal the unsharded ones."""
    mesh = jax.make_mesh((2, NDEV // 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    f32 = lambda *s: jax.numpy.asarray(rng.normal(size=s), jax.numpy.float32)  # noqa: E731
    params, batch = {"w1": f32(6, 4 * NDEV) / 2, "w2": f32(4 * NDEV, 3) / 4}, {
        "x": f32(8, 6), "y": f32(8, 3)}

    def loss(p, b):
        return jax.numpy.mean((jax.numpy.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    stats = {"mean": js.stats.mean(), "var": js.stats.variance(), "norms": js.stats.norms()}
    ref = js.per_example_stat(loss, stats)(params, batch)
    with jax.set_mesh(mesh):
        p = {"w1": jax.device_put(params["w1"], NamedSharding(mesh, P(None, "model"))),
             "w2": jax.device_put(params["w2"], NamedSharding(mesh, P()))}
        b = jax.device_put(batch, NamedSharding(mesh, P("data")))
        grad = jax.jit(jax.grad(loss))(p, b)
        out = jax.jit(js.per_example_stat(loss, stats))(p, b)
    for k in ("w1", "w2"):
        assert jax.typeof(out["mean"][k]).sharding.spec == jax.typeof(grad[k]).sharding.spec
        assert jax.typeof(out["var"][k]).sharding.spec == jax.typeof(grad[k]).sharding.spec
    assert tuple(jax.typeof(out["norms"]).sharding.spec) == ("data",)
    assert tuple(jax.typeof(out["mean"]["w1"]).sharding.spec) == (None, "model")
    for g, w in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def _share_combined(r, value, parts=4, pick=lambda c: c):
    """``pick`` of ``value`` (the same on every part, unmapped) combined at the end of a
    batch split over ``parts`` by device, as api.py combines a site's share."""
    from jaxpr_surgery._src import api, cuts, devices

    def one(_):
        return pick(api._combined(r, value, 2, 2 * parts, devices.AXIS))

    with cuts.split_over(parts, devices.AXIS):
        out = jax.vmap(one, axis_name=devices.AXIS)(np.zeros(parts))
    return jax.tree.map(lambda x: x[0], out)


@pytest.mark.parametrize("kind", ["variance", "kurtosis"])
def test_a_share_is_combined_without_its_mean(kind):
    """A centred share (the same on every part of a batch split by device: combined at
    its site) is the whole batch's with its sums times the parts and no read of its mean
    or odd sums. Before, the end's Pebay merge read every field (exactly zero terms),
    so XLA kept a scan stack's means and third sums stacked over its layers: the
    kurtosis of the benchmark's tensor-parallel scan stack took 1.48x grad's memory,
    now 1.17x. The value equals the merge of the copies (float64)."""
    import jax.numpy as jnp

    from jaxpr_surgery._src import stats as S
    from jaxpr_surgery._src import stats_research as R

    rng = np.random.default_rng(3)
    with M.x64():
        f = lambda: jnp.asarray(rng.normal(size=5) + 1e3, jnp.float64)  # noqa: E731
        if kind == "variance":
            r, value = S.Centered(), S.Moments(f(), jnp.abs(f()))
        else:
            r, value = R.CentralMoments(), R.CentralSums(f(), jnp.abs(f()), f(), jnp.abs(f()))
        got = _share_combined(r, value)
        want = value
        for n in (2, 4, 6):
            want = r.merge(want, n, value, 2)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12)
        fields = value._fields

        def last(*xs):  # the even sums alone read the fields they need
            return _share_combined(r, type(value)(*xs), pick=lambda c: c[-1])

        jaxpr = jax.make_jaxpr(last)(*value).jaxpr
    live = {id(v) for v in jaxpr.outvars}  # (what the last field depends on)
    for e in reversed(jaxpr.eqns):
        if any(id(v) in live for v in e.outvars):
            live |= {id(v) for v in e.invars}
    unread = [f for f, v in zip(fields, jaxpr.invars) if id(v) not in live]
    assert "mean" in unread, (kind, unread)
    if kind == "kurtosis":
        assert "m3" in unread, unread


def test_explain_reports_the_device_split():
    """explain states how a batch XLA shards runs (in parts, one per device, as
    `per_example_stat` runs it: devices.py) and the chunk each part runs with; before,
    it reported the whole batch's chunk, which the call never runs."""
    loss, params, batch, _ = _placed("mlp", "Auto")
    B = jax.tree.leaves(batch)[0].shape[0]
    D = np.gcd(B, NDEV)
    rep = js.explain(loss, js.stats.variance(), chunk_size=D)(params, batch)
    (note,) = [n for n in rep.notes if "sharded by XLA" in n]
    assert f"runs as {D} parts of {B // D} examples" in note, note
    assert B // D > 1 and rep.chunk_size == 1, (rep.chunk_size, note)  # (per part)
    assert "in chunks of 1 example;" in note, note
    plain = js.explain(loss, js.stats.variance(), chunk_size=D)(*jax.device_get((params, batch)))
    assert not [n for n in plain.notes if "sharded by XLA" in n]
    assert plain.chunk_size == D


def test_a_subclass_combining_its_own_way_keeps_combine_axis_for_copies():
    """A reduction whose class overrides `combine_axis` but not `combine_copies` (its
    parent's copies rule would not be its combination's) is combined by its own
    `combine_axis`, copies or not; within derivatives in the example weights (a part may
    hold raw sums) a centred value is too."""
    import dataclasses

    import jax.numpy as jnp

    from jaxpr_surgery._src import example_weights as ew
    from jaxpr_surgery._src import stats as S

    @dataclasses.dataclass(frozen=True)
    class Own(S.Centered):
        def combine_axis(self, value, n_local, N, axis_name):
            return value._replace(m2=jax.lax.pmax(value.m2, axis_name))

    v = S.Moments(jnp.arange(3.0), jnp.ones(3))
    assert S.combined_copies(Own(), v, 4) is None
    got = _share_combined(Own(), v)
    np.testing.assert_allclose(got.m2, np.ones(3))  # (its pmax, not the copies' sum)
    np.testing.assert_allclose(S.combined_copies(S.Centered(), v, 4).m2, 4 * np.ones(3))
    with ew.opened():
        assert S.combined_copies(S.Centered(), v, 4) is None


def test_explicit_placement_of_a_weight_kept_of_an_example_dropped():
    """Under Explicit axes the loss's placements are dropped (explicit.py), except that of
    a value no example reaches: FSDP's ``reshard(w, P())`` gathers the weight before use,
    and is kept as a sharding constraint (XLA then gathers the weight, as under jax.grad,
    rather than moving activations). One of an activation (an example reaches it) names
    the batch's axis, which one example's trace cannot take: dropped. The variance equals
    that of the unannotated loss."""
    from jaxpr_surgery._src import compat, walker

    mesh = jax.make_mesh((NDEV,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    r = np.random.default_rng(0)
    params = {"w": r.normal(size=(8, 8)).astype(np.float32),
              "v": r.normal(size=(8,)).astype(np.float32)}
    batch = {"x": r.normal(size=(8, 8)).astype(np.float32)}

    def plain(p, b):
        return jax.numpy.mean((jax.numpy.tanh(b["x"] @ p["w"]) @ p["v"]) ** 2)

    def typed(p, b):
        w = jax.sharding.reshard(p["w"], P())
        h = jax.sharding.reshard(jax.numpy.tanh(b["x"] @ w), P("d", None))
        return jax.numpy.mean((h @ p["v"]) ** 2)

    with jax.set_mesh(mesh):
        p = {"w": jax.device_put(params["w"], P("d", None)), "v": jax.device_put(params["v"], P())}
        b = jax.device_put(batch, P("d"))
        fn = js.per_example_stat(typed, js.stats.variance())
        kept = [e for e in walker.equations(jax.make_jaxpr(fn)(p, b).jaxpr)
                if e.primitive is compat.sharding_constraint_p]
        got = jax.jit(fn)(p, b)
    assert [(tuple(e.params["sharding"].spec), e.invars[0].aval.shape) for e in kept] == [
        ((None, None), (8, 8))]
    want = js.per_example_stat(plain, js.stats.variance())(params, batch)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5,
                                   atol=1e-7)


def test_explicit_mesh_shard_map_inside_the_loss():
    """A loss that runs a hand-written tensor-parallel layer in jax.shard_map, on a mesh
    of Explicit axes. Given the mesh in context (no ``mesh=``), the shard_map takes the
    Auto-switched mesh where the statistics are computed: exact (its leaves on the
    exact per-example fallback), and proved per-example (no warning: the proof enters
    the body, whose psum over 'm' adds up parts of the same examples). Given ``mesh=``
    the Explicit mesh itself, it cannot run there: a clear NotImplementedError saying to
    leave out ``mesh=`` (before, jax's "context mesh ... should match the mesh passed
    to shard_map")."""
    mesh = jax.make_mesh((NDEV,), ("m",), axis_types=(jax.sharding.AxisType.Explicit,))
    r = np.random.default_rng(1)
    params = {"w": r.normal(size=(8, 16)).astype(np.float32),
              "v": r.normal(size=(16, 3)).astype(np.float32)}
    batch = {"x": r.normal(size=(6, 5, 8)).astype(np.float32),
             "y": r.normal(size=(6, 5, 3)).astype(np.float32)}
    jnp = jax.numpy

    def mlp(x, w, v):  # (w by columns, v by rows over "m": one psum)
        return jax.lax.psum(jnp.tanh(x @ w) @ v, "m")

    def loss_with(**kw):
        def loss(p, b):
            f = jax.shard_map(mlp, in_specs=(P(), P(None, "m"), P("m", None)),
                              out_specs=P(), **kw)
            return jnp.mean((f(b["x"], p["w"], p["v"]) - b["y"]) ** 2)
        return loss

    def plain(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["v"] - b["y"]) ** 2)

    stats = {"var": js.stats.variance(), "norms": js.stats.sq_norms()}
    want = js.per_example_stat(plain, stats)(params, batch)
    with jax.set_mesh(mesh), warnings.catch_warnings():
        # (the batch-of-one proof enters the typed body, which keeps the batch whole)
        warnings.simplefilter("error", js.CrossExampleWarning)
        got = jax.jit(js.per_example_stat(loss_with(), stats))(params, batch)
    np.testing.assert_allclose(got["norms"], want["norms"], rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(got["var"][k], want["var"][k], rtol=1e-4, atol=1e-6)
    with jax.set_mesh(mesh), pytest.raises(NotImplementedError, match=r"leave out mesh="):
        js.per_example_stat(loss_with(mesh=mesh), stats)(params, batch)

"""jit with the batch placed with NamedSharding(mesh, P('d')) (params replicated):
results equal the unsharded computation.

Both Auto mesh axes and Explicit axes (sharding in types; the default of
``jax.make_mesh`` in jax 0.10) are supported: with Explicit axes the core runs
in Auto mode for those axes, its outputs typed like jax.grad's (the parameters' and
the batch's shardings).
"""

from __future__ import annotations

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


def test_explicit_annotations_in_the_loss_refused_clearly():
    """A loss written for sharding in types (``out_sharding=`` naming the batch's Explicit
    axis) cannot be typed on the batch of one each example's gradient is traced on: a
    NotImplementedError that names the axes and the Auto-mode fix (it was jax's
    "PartitionSpec passed to dot_general cannot contain axis names that are of type
    Auto"); jax.grad runs. The Auto-mode rewrite of the same loss is exact."""
    loss, params, batch, mesh = _placed("mlp", "Explicit")
    auto = jax.make_mesh((NDEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def head(p, b, h):
        logits = jax.numpy.tanh(h + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jax.numpy.mean(jax.numpy.take_along_axis(logp, b["y"][:, None], axis=-1))

    def typed(p, b):  # a model written for explicit sharding
        return head(p, b, jax.numpy.matmul(b["x"], p["l1"]["w"], out_sharding=P("d", None)))

    with jax.set_mesh(mesh):
        jax.jit(jax.grad(typed))(params, batch)
        with pytest.raises(NotImplementedError, match=r"Explicit mode.*AxisType.Auto"):
            jax.jit(js.per_example_stat(typed, js.stats.mean()))(params, batch)

    def hinted(p, b):  # the same model for XLA's partitioner
        h = b["x"] @ p["l1"]["w"]
        return head(p, b, jax.lax.with_sharding_constraint(h, NamedSharding(auto, P("d", None))))

    _, aparams, abatch, _ = _placed("mlp", "Auto")
    got = jax.jit(js.per_example_stat(hinted, js.stats.mean()))(aparams, abatch)
    want = js.per_example_stat(hinted, js.stats.mean())(*jax.device_get((aparams, abatch)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


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

"""Partials (``js.per_example_partial``, ``merge_partials``, ``finalize_partial``):
merged partials of uneven micro-batches equal one call on the concatenated batch, for
every statistic of ``js.stats`` on the MLP and every kind of reduction on other zoo
models (float64 tight, float32 loose, and against the ``vmap(grad)`` oracle); with
``chunk_size``; under ``jit`` and in a ``lax.scan`` carry; under ``shard_map`` with
``axis_name``; and the errors of mismatched partials.
"""

from __future__ import annotations

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from conftest import (
    REDUCTION_STAT_IDS,
    STAT_IDS,
    check_against_reference,
    combined_result,
    reference,
)
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js

SPLITS = {  # the zoo batch as uneven micro-batches (few distinct sizes: few compiles)
    "mlp": (1, 4, 1),
    "transformer": (1, 4, 1),
    "cnn": (3, 1, 1),
}


def _pieces(batch, sizes):
    out, at = [], 0
    for n in sizes:
        out.append(jax.tree.map(lambda x, a=at, n=n: x[a : a + n], batch))
        at += n
    return out


def _extras():
    """The statistics of js.stats that the oracle matrix's list (conftest.STATS) lacks."""
    return {
        "norm_quantile_scalar": js.stats.norm_quantiles(0.5, per_leaf=False),
        "noise_scale_components": js.stats.noise_scale_components(),
        "example_count": js.optim.example_count(),
    }


def _stat_ids(case_name):
    """Every statistic of the oracle matrix's list on the MLP (each one's finalize of
    merged values), one per kind of reduction elsewhere (the merges are per reduction)."""
    return STAT_IDS if case_name == "mlp" else REDUCTION_STAT_IDS


def _request(case_name, case):
    """The statistics of `_stat_ids` (with the conftest clip norms) and the rest of
    js.stats."""
    ref = reference(case_name)
    return {**{sid: ref.stat(sid) for sid in _stat_ids(case_name)}, **_extras()}


def _assert_close(actual, expected, dtype, what):
    """Tight in float64 (both sides exact up to rounding), loose in float32 (Chan's
    merges round differently from the one-pass chunked sums): relative to each leaf's
    largest magnitude."""
    rtol = 1e-10 if dtype == "float64" else 2e-4
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    assert a_def == e_def, (what, a_def, e_def)
    for a, e in zip(a_leaves, e_leaves, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, (what, a.shape, e.shape)
        finite = np.isfinite(e)
        if "kurtosis" not in what:
            np.testing.assert_array_equal(np.isfinite(a), finite, err_msg=what)
        ok = finite & np.isfinite(a)
        scale = np.max(np.abs(e[ok]), initial=0.0)
        np.testing.assert_allclose(a[ok], e[ok], rtol=rtol, atol=rtol * scale + 1e-30,
                                   err_msg=what)


@pytest.mark.parametrize(("case_name", "dtype"), [
    pytest.param("transformer", "float64", marks=pytest.mark.slow),  # the oracle matrix's
    pytest.param("cnn", "float64", marks=pytest.mark.slow),
    ("mlp", "float32"),
])
def test_merged_partials_equal_the_concatenated_batch(case_name, dtype):
    case = zoo.get_case(case_name, dtype)
    with zoo._maybe_x64(case.params):
        stats = _request(case_name, case)
        part = jax.jit(js.per_example_partial(case.loss_fn, stats))
        # the whole batch: the oracle matrix's call (cached per process: the same worker
        # runs a zoo case's tests) and the extras
        status, whole = combined_result(case_name, dtype, STAT_IDS)
        assert status == "ok", whole
        whole = {**whole, **jax.jit(js.per_example_stat(case.loss_fn, _extras()))(
            case.params, case.batch)}
        sizes = SPLITS[case_name]
        parts = [part(case.params, b) for b in _pieces(case.batch, sizes)]
        assert all(jax.tree.structure(p) == jax.tree.structure(parts[0]) for p in parts)
        merged = js.merge_partials(*parts)
        assert int(merged.num_examples) == sum(sizes)
        assert float(merged.total_weight) == sum(sizes)
        assert merged.example_weights is None and merged.per_example
        assert jax.tree.structure(merged) == jax.tree.structure(parts[0])
        out = jax.tree.map(np.asarray, js.finalize_partial(merged))
        for k, v in out.items():
            _assert_close(v, whole[k], dtype, f"{case_name} {sizes} {k}")
        # against the vmap(grad) oracle of the whole batch, with the suite's error model
        for sid in _stat_ids(case_name):
            check_against_reference(out[sid], case_name, sid, dtype)
        # two partials at a time (uneven: 5 + 1 and 1 + 5), in either grouping: the
        # same values as the three at once
        for pair in (js.merge_partials(js.merge_partials(parts[0], parts[1]), parts[2]),
                     js.merge_partials(parts[0], js.merge_partials(parts[1], parts[2]))):
            _assert_close(jax.tree.leaves(pair), jax.tree.leaves(merged), dtype,
                          f"{case_name} regrouped")


def test_finalize_of_one_partial_is_per_example_stat():
    """No merge: finalize_partial(per_example_partial(...)) == per_example_stat(...),
    eagerly and with the same dtypes."""
    loss, params, batch = M.make_mlp(seed=3, batch_size=5)
    stats = {"mean": js.stats.mean(), "var": js.stats.variance(), "n": js.stats.norms(),
             "snr": js.stats.snr(bias_corrected=True), "k": js.stats.kron_moments()}
    out = js.finalize_partial(js.per_example_partial(loss, stats)(params, batch))
    ref = js.per_example_stat(loss, stats)(params, batch)
    for a, e in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


def test_chunk_size_and_batch_of_one():
    """Chunks that do not divide the micro-batches, micro-batches of one example."""
    case = zoo.get_case("mlp", "float64")
    stats = {"mean": js.stats.mean(), "var": js.stats.variance(), "sq": js.stats.sq_norms(),
             "clip": js.stats.clipped_sum(0.3), "kron": js.stats.kron_moments(),
             "noise": js.stats.gradient_noise_scale()}
    with zoo.x64():
        whole = js.per_example_stat(case.loss_fn, stats)(case.params, case.batch)
        chunked = jax.jit(js.per_example_partial(case.loss_fn, stats, chunk_size=2))
        single = jax.jit(js.per_example_partial(case.loss_fn, stats, chunk_size=None))
        b1, b2 = _pieces(case.batch, (1, 5))  # chunks of 2, 2 and 1
        merged = js.merge_partials(single(case.params, b1), chunked(case.params, b2))
        out = js.finalize_partial(merged)
        for k in stats:
            _assert_close(out[k], whole[k], "float64", f"chunked {k}")
        # a partial of one example: a variance over it is undefined, said when finalized
        one = single(case.params, b1)
        with pytest.raises(ValueError, match=r"\(ddof=1\) needs more than 1 example"):
            js.finalize_partial(one)


def test_jit_and_scan_carry():
    """A request without per-example outputs: partials of equal micro-batches ride in a
    lax.scan carry (one treedef, fixed shapes), all inside jit; the statistics are built
    afresh inside the loop body (equal requests have one treedef)."""

    def make_stats():
        return {"mean": js.stats.mean(), "var": js.stats.variance(),
                "m2": js.stats.second_moment(), "clip": js.stats.clipped_mean(0.5),
                "kurt": js.stats.kurtosis(), "kron": js.stats.kron_moments()}

    with M.x64():
        loss, params, batch = M.make_mlp(dtype=jnp.float64, seed=4, batch_size=8)
        micro = jax.tree.map(lambda x: x.reshape((4, 2) + x.shape[1:]), batch)

        @jax.jit
        def accumulated(params, micro):
            pfn = js.per_example_partial(loss, make_stats())
            first = pfn(params, jax.tree.map(lambda x: x[0], micro))

            def body(p, b):
                q = js.per_example_partial(loss, make_stats())(params, b)
                return js.merge_partials(p, q), None

            p, _ = jax.lax.scan(body, first, jax.tree.map(lambda x: x[1:], micro))
            return js.finalize_partial(p), p

        out, p = accumulated(params, micro)
        assert int(p.num_examples) == 8
        whole = js.per_example_stat(loss, make_stats())(params, batch)
        for k in whole:
            _assert_close(out[k], whole[k], "float64", f"scan {k}")


def test_equal_requests_have_one_treedef():
    loss, params, batch = M.make_mlp(seed=5, batch_size=3)
    a = js.per_example_partial(loss, {"v": js.stats.variance(), "c": js.stats.clipped_sum(1.0)})
    b = js.per_example_partial(loss, {"v": js.stats.variance(), "c": js.stats.clipped_sum(1.0)})
    pa, pb = a(params, batch), b(params, batch)
    assert jax.tree.structure(pa) == jax.tree.structure(pb)
    assert hash(jax.tree.structure(pa)) == hash(jax.tree.structure(pb))
    assert not pa.per_example
    c = js.per_example_partial(loss, {"v": js.stats.variance(), "c": js.stats.clipped_sum(2.0)})
    assert jax.tree.structure(c(params, batch)) != jax.tree.structure(pa)
    # the arrays are the partial's leaves: tree_map reaches them, paths name them
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(pa)]
    assert any(".values" in s for s in paths) and any(".total_weight" in s for s in paths)
    doubled = jax.tree.map(lambda x: x, pa)
    assert isinstance(doubled, js.Partial)
    assert "variance(ddof=1)" in repr(pa) and "num_examples=3" in repr(pa)


def test_bf16_parameters_and_norms_per_example():
    """Odd dtypes: bfloat16 parameters (gradient-like results in bf16, the rest in at
    least float32, like per_example_stat); per-example outputs concatenated."""
    loss, params, batch = M.make_mlp(seed=6, batch_size=7)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    stats = {"mean": js.stats.mean(), "m2": js.stats.second_moment(),
             "n": js.stats.norms(per_leaf=True)}
    f = jax.jit(js.per_example_partial(loss, stats))
    parts = [f(params, b) for b in _pieces(batch, (2, 4, 1))]
    out = js.finalize_partial(js.merge_partials(*parts))
    ref = js.per_example_stat(loss, stats)(params, batch)
    for a, e in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32),
                                   rtol=2e-2, atol=1e-3)
    assert out["n"]["l1"]["w"].shape == (7,)


# --------------------------------------------------------------------------- #
# Across devices
# --------------------------------------------------------------------------- #
NDEV = 4


@pytest.mark.skipif(jax.device_count() < NDEV, reason=f"needs {NDEV} devices")
def test_shard_map_partials_equal_the_concatenated_batch():
    """Inside shard_map with axis_name: every device holds the partial of its whole
    micro-batch; merged, the statistics are those of both micro-batches (quantiles and
    diversity over every example), per-example norms stay with their device."""
    loss, params, batch = M.make_mlp(seed=7, batch_size=12)
    b1, b2 = _pieces(batch, (4, 8))
    stats = {"mean": js.stats.mean(), "var": js.stats.variance(),
             "noise": js.stats.gradient_noise_scale(), "q": js.stats.norm_quantiles(),
             "div": js.stats.gradient_diversity(), "sq": js.stats.sq_norms()}
    pfn = js.per_example_partial(loss, stats, axis_name="d")

    def both(params, b1, b2):
        p = js.merge_partials(pfn(params, b1), pfn(params, b2))
        return js.finalize_partial(p), js.merge_partials(
            js.per_example_partial(loss, {"var": js.stats.variance()}, axis_name="d")(params, b1),
            js.per_example_partial(loss, {"var": js.stats.variance()}, axis_name="d")(params, b2))

    mesh = jax.make_mesh((NDEV,), ("d",), devices=jax.devices()[:NDEV])
    specs = {k: P("d") if k == "sq" else P() for k in stats}
    sm = jax.shard_map(both, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                       out_specs=(specs, P()), check_vma=True)
    rep, split = (jax.sharding.NamedSharding(mesh, P()), jax.sharding.NamedSharding(mesh, P("d")))
    out, p = jax.jit(sm)(jax.device_put(params, rep), jax.device_put(b1, split),
                         jax.device_put(b2, split))
    assert int(p.num_examples) == 12  # the whole batch's count, on every device
    whole = js.per_example_stat(loss, stats)(params, batch)
    for k in ("mean", "var", "noise", "q", "div"):
        _assert_close(out[k], whole[k], "float32", f"shard_map {k}")
    np.testing.assert_allclose(js.finalize_partial(p)["var"]["l1"]["w"], whole["var"]["l1"]["w"],
                               rtol=2e-4, atol=1e-7)
    # device d holds b1's example d, then b2's examples 2d, 2d+1
    sq = js.per_example_stat(loss, js.stats.sq_norms())
    s1, s2 = np.asarray(sq(params, b1)), np.asarray(sq(params, b2)).reshape(NDEV, 2)
    expected = np.concatenate([s1[:, None], s2], axis=1).reshape(-1)
    np.testing.assert_allclose(out["sq"], expected, rtol=2e-4)


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #
def test_mismatched_partials_raise():
    loss, params, batch = M.make_mlp(seed=8, batch_size=3)
    var = js.per_example_partial(loss, js.stats.variance())(params, batch)
    with pytest.raises(ValueError, match=r"partial 1 holds other statistics .*mean\(\)"):
        js.merge_partials(var, js.per_example_partial(loss, js.stats.mean())(params, batch))
    with pytest.raises(ValueError, match=r"partial 1 holds other statistics"):
        js.merge_partials(var, js.per_example_partial(loss, js.stats.variance(ddof=0))(
            params, batch))
    # parameters of another structure: only the first layer differentiated
    p1 = js.per_example_partial(lambda p, b: loss({**params, "l1": p}, b),
                                js.stats.variance())(params["l1"], batch)
    with pytest.raises(ValueError, match=r"partial 1 was computed for parameters of another "
                                         r"structure"):
        js.merge_partials(var, p1)
    # other dtypes
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    p2 = js.per_example_partial(loss, js.stats.variance())(half, batch)
    with pytest.raises(ValueError, match=r"other shapes or dtypes \(leaf \['l1'\]\['b'\]: "
                                         r"bfloat16\[7\] instead of float32\[7\]"):
        js.merge_partials(var, p2)
    with pytest.raises(TypeError, match=r"argument 1 is of type dict, not a partial"):
        js.merge_partials(var, {"mean": 0})
    with pytest.raises(TypeError, match=r"expected one or more partials"):
        js.merge_partials()
    with pytest.raises(TypeError, match=r"finalize_partial: argument 0 is of type int"):
        js.finalize_partial(3)
    with pytest.raises(TypeError, match=r"per_example_partial: fn must be callable"):
        js.per_example_partial(3, js.stats.mean())
    assert js.merge_partials(var) is var


@pytest.mark.skipif(jax.device_count() < NDEV, reason=f"needs {NDEV} devices")
def test_partials_with_and_without_axis_name_do_not_merge():
    """A partial with axis_name holds the whole batch's norms for norm_quantiles; one
    without holds the device's own: they do not merge (raised while tracing)."""
    loss, params, batch = M.make_mlp(seed=9, batch_size=4)
    stat = js.stats.norm_quantiles()

    def both(params, batch):
        across = js.per_example_partial(loss, stat, axis_name="d")(params, batch)
        local = js.per_example_partial(loss, stat)(params, batch)
        return js.finalize_partial(js.merge_partials(across, local))

    mesh = jax.make_mesh((NDEV,), ("d",), devices=jax.devices()[:NDEV])
    sm = jax.shard_map(both, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(), check_vma=False)
    rep, split = (jax.sharding.NamedSharding(mesh, P()), jax.sharding.NamedSharding(mesh, P("d")))
    with pytest.raises(ValueError, match=r"partial 1 was computed without axis_name and the "
                                         r"first with"):
        jax.jit(sm)(jax.device_put(params, rep), jax.device_put(batch, split))


def test_partials_with_and_without_example_weights_do_not_merge():
    """The example_weights field (None until weighted calls exist) must agree."""
    loss, params, batch = M.make_mlp(seed=10, batch_size=2)
    p = js.per_example_partial(loss, js.stats.variance())(params, batch)
    leaves, treedef = jax.tree.flatten(p)
    weighted = jax.tree.unflatten(treedef, leaves)
    weighted.example_weights = jnp.ones(2)
    merged = js.merge_partials(weighted, weighted)
    assert merged.example_weights.shape == (4,) and merged.per_example
    with pytest.raises(ValueError, match=r"partial 1 has no example_weights and the first has"):
        js.merge_partials(weighted, p)

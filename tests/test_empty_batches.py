"""Empty and poisoned batches (issue 50, item 2).

* An all-padding batch (Poisson sampling draws one now and then): the sum-type
  statistics (``sum``, ``clipped_sum``, the per-example outputs, the optimizers'
  ``example_count`` / ``max_weight``) are defined, exactly 0, eagerly and under ``jit``;
  the statistics that divide by the total weight (means, variances, ...) are not: NaN,
  and eagerly a request of nothing but those raises. A DP step on it is the noise alone,
  divided by the fixed (expected) batch size; with the batch size read from the batch
  (0) it refuses.
* An example whose gradient is not finite (a NaN loss, an infinite input): clipped sums
  drop it by default (it adds 0; ``js.stats.nonfinite_count()`` counts it), on every
  route a clipped sum takes (one pass over kept ingredients or kept products, per-example
  copies of a fallback leaf, a tied leaf, chunks, the remat second pass, per-layer
  bounds, example weights, shard_map); ``nonfinite="propagate"`` lets the NaN through.

Every value is checked against ``jax.vmap(jax.grad(per-example loss))`` of the batch
without the offending examples, clipped by hand in float64.
"""

from __future__ import annotations

import _models as M
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

B = 8


# --------------------------------------------------------------------------- #
# Models: the per-example loss times ``s_b`` (NaN poisons example b)
# --------------------------------------------------------------------------- #
def _mlp(p, b):
    h = jnp.tanh(b["x"] @ p["l1"]["w"] + p["l1"]["b"])
    out = h @ p["l2"]["w"] + p["l2"]["b"]
    return jnp.mean(jnp.sum((out - b["y"]) ** 2, -1) * b["s"])


def _rnn(p, b):
    """``w``: a token-axis dense layer (products kept for the clipped sum); ``u``: closed
    over by a scan (a fallback leaf: per-example copies)."""
    x = jnp.tanh(b["x"] @ p["w"])  # [B, T, 4]

    def step(h, xt):
        return jnp.tanh(h @ p["u"] + xt), None

    h, _ = jax.lax.scan(step, jnp.zeros((x.shape[0], 4), x.dtype), jnp.swapaxes(x, 0, 1))
    return jnp.mean(jnp.sum((h - b["y"]) ** 2, -1) * b["s"])


def _remat(p, b):
    @jax.checkpoint
    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"])

    h = layer(b["x"], p["l1"])
    h = layer(h, p["l2"])
    return jnp.mean(jnp.sum((h - b["y"]) ** 2, -1) * b["s"])


def _tied(p, b):
    """The embedding table read by the ids and again as the output layer (a leaf of two
    sites)."""
    h = jnp.tanh(p["table"][b["ids"]] @ p["w"])  # [B, T, D]
    logits = h @ p["table"].T
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["t"][..., None], -1)[..., 0]
    return jnp.mean(jnp.mean(nll, -1) * b["s"])


def _case(name, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)

    def n(*shape, scale=0.7):
        return jnp.asarray(r.standard_normal(shape) * scale, dtype)

    s = jnp.ones((B,), dtype)
    if name in ("mlp", "remat"):
        p = {"l1": {"w": n(5, 6), "b": n(6)}, "l2": {"w": n(6, 3), "b": n(3)}}
        return _mlp if name == "mlp" else _remat, p, {"x": n(B, 5), "y": n(B, 3), "s": s}
    if name == "rnn":
        p = {"w": n(3, 4), "u": n(4, 4, scale=0.3)}
        return _rnn, p, {"x": n(B, 16, 3), "y": n(B, 4), "s": s}
    if name == "tied":
        V, D, T = 7, 4, 5
        p = {"table": n(V, D), "w": n(D, D)}
        ids = jnp.asarray(r.integers(0, V, (B, T)), jnp.int32)
        t = jnp.asarray(r.integers(0, V, (B, T)), jnp.int32)
        return _tied, p, {"ids": ids, "t": t, "s": s}
    raise ValueError(name)


def _poisoned(batch, bad, how="nan"):
    """``batch`` with the examples ``bad`` (indices) made non-finite: a NaN loss, or an
    infinite input."""
    if how == "nan":
        return {**batch, "s": batch["s"].at[np.asarray(bad)].set(jnp.nan)}
    return {**batch, "x": batch["x"].at[np.asarray(bad), 0].set(jnp.inf)}


# --------------------------------------------------------------------------- #
# The oracle
# --------------------------------------------------------------------------- #
def _grads(loss, params, batch):
    g = zoo.vmap_grads(loss, params, batch)
    return jax.tree.map(lambda x: np.asarray(x, np.float64), g)


def _norms(sub):
    leaves = jax.tree.leaves(sub)
    return np.sqrt(sum(np.sum(np.square(x).reshape(B, -1), 1) for x in leaves))


def _clipped_sum(g, C, keep, w=None):
    """``sum_b w_b keep_b min(1, C_k/|g_b,k|) g_b,k`` (``C`` a bound or a dict of bounds
    over the top-level keys), in float64; the examples not kept never enter (NaN and
    all)."""
    w = np.ones(B) if w is None else np.asarray(w, np.float64)
    wk = np.where(keep, w, 0.0)

    def one(sub, Cg):
        with np.errstate(invalid="ignore", divide="ignore"):
            c = np.minimum(1.0, Cg / _norms(sub))
        c = np.where(keep, c, 0.0) * wk
        return jax.tree.map(
            lambda x: np.tensordot(c, np.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0),
                                   1), sub)

    if isinstance(C, dict):
        return {k: one(g[k], C[k]) for k in g}
    return one(g, C)


def _median_norm(loss, params, batch):
    return float(np.median(_norms(_grads(loss, params, batch))))


def _close(got, want, rtol=2e-5, atol=1e-6):
    """float32 against float64: ``atol`` at least ``rtol`` of the leaf's largest entry (an
    entry that cancels keeps the rounding of the terms it sums: 5e-6 at a leaf of 11)."""
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(gl) == len(wl)
    for a, b in zip(gl, wl):
        tol = max(atol, rtol * float(np.abs(b).max(initial=0.0)))
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol, atol=tol)


def _exactly_zero(tree):
    for x in jax.tree.leaves(tree):
        np.testing.assert_array_equal(np.asarray(x), 0.0)


def _all_nan(tree):
    return all(np.all(np.isnan(np.asarray(x))) for x in jax.tree.leaves(tree))


def _finite(tree):
    return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree))


EVERYTHING = jnp.ones((B,), bool)  # every slot padding: an empty Poisson batch


def _modes():
    return [pytest.param(False, id="eager"), pytest.param(True, id="jit")]


def _maybe_jit(f, jit):
    return jax.jit(f) if jit else f


def _on_mesh(f, *args):
    """``f(params, *per-example args)`` under ``shard_map`` over 4 devices, the examples
    split on ``'d'`` (the parameters replicated), every output replicated."""
    if jax.device_count() < M.NDEV:
        pytest.skip(f"needs {M.NDEV} devices")
    mesh = jax.make_mesh((M.NDEV,), ("d",))
    rep, split = (jax.sharding.NamedSharding(mesh, P(s)) for s in (None, "d"))
    placed = [jax.device_put(args[0], rep)] + [jax.device_put(a, split) for a in args[1:]]
    sm = jax.shard_map(f, mesh=mesh, in_specs=(P(),) + (P("d"),) * (len(args) - 1),
                       out_specs=P(), check_vma=True)
    return jax.jit(sm)(*placed)


# --------------------------------------------------------------------------- #
# 1. All-padding batches
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("jit", _modes())
@pytest.mark.parametrize("name, chunk", [("mlp", None), ("mlp", 3), ("rnn", None),
                                         ("rnn", 3), ("remat", None), ("tied", None)])
def test_all_padding_sums_are_exactly_zero(name, chunk, jit):
    loss, p, b = _case(name)
    stats = {"clipped": js.stats.clipped_sum(1.0), "sum": js.stats.sum(),
             "per_layer": js.stats.clipped_sum(jax.tree.map(lambda _: 0.5, dict(p))),
             "norms": js.stats.norms(), "count": js.stats.nonfinite_count()}
    f = js.per_example_stat(loss, stats, chunk_size=chunk)
    out = _maybe_jit(lambda p, b, pad: f(p, b, is_padding_example=pad), jit)(p, b, EVERYTHING)
    _exactly_zero(out)
    # example weights all zero: the same
    w0 = jnp.zeros((B,), jnp.float32)
    out = _maybe_jit(lambda p, b, w: f(p, b, example_weights=w), jit)(p, b, w0)
    _exactly_zero(out)


@pytest.mark.parametrize("jit", _modes())
def test_all_padding_mixed_request_only_the_undefined_are_nan(jit):
    """Means, variances, ... divide by the total weight W = 0: NaN; the sums beside
    them are 0. Padded examples may have a NaN loss (a token mean over no tokens)."""
    loss, p, b = _case("mlp")
    b = _poisoned(b, [1, 4])  # padded anyway
    request = {"mean": js.stats.mean(), "variance": js.stats.variance(),
               "second_moment": js.stats.second_moment(),
               "clipped_mean": js.stats.clipped_mean(1.0),
               "sum": js.stats.sum(), "clipped_sum": js.stats.clipped_sum(1.0),
               "sq_norms": js.stats.sq_norms(), "count": jso.example_count()}
    f = js.value_and_per_example_stat(loss, request)
    loss_value, out = _maybe_jit(lambda p, b, pad: f(p, b, is_padding_example=pad), jit)(
        p, b, EVERYTHING)
    assert np.isnan(loss_value)  # the mean of no loss
    for k in ("mean", "variance", "second_moment", "clipped_mean"):
        assert _all_nan(out[k]), k
    for k in ("sum", "clipped_sum", "sq_norms", "count"):
        _exactly_zero(out[k])


def test_all_padding_request_of_only_undefined_statistics_raises_eagerly():
    loss, p, b = _case("mlp")
    f = js.per_example_stat(loss, {"mean": js.stats.mean(), "v": js.stats.variance()})
    with pytest.raises(ValueError, match="every example has weight 0"):
        f(p, b, is_padding_example=EVERYTHING)
    # under jit: NaN
    out = jax.jit(lambda pad: f(p, b, is_padding_example=pad))(EVERYTHING)
    assert _all_nan(out)


def test_all_padding_bad_weights_still_poison_everything():
    """A negative (traced) weight makes every result NaN, sums included."""
    loss, p, b = _case("mlp")
    f = js.per_example_stat(loss, {"s": js.stats.sum(), "c": js.stats.clipped_sum(1.0)})
    w = jnp.zeros((B,)).at[2].set(-1.0)
    assert _all_nan(jax.jit(lambda w: f(p, b, example_weights=w))(w))


def test_all_padding_under_shard_map():
    loss, p, b = _case("mlp")
    f = js.per_example_stat(loss, {"c": js.stats.clipped_sum(1.0), "n": js.stats.nonfinite_count(),
                                   "m": js.stats.mean()}, axis_name="d")
    out = _on_mesh(lambda p, b, pad: f(p, b, is_padding_example=pad), p, b, EVERYTHING)
    _exactly_zero(out["c"])
    _exactly_zero(out["n"])
    assert _all_nan(out["m"])


def _dp_parts(name, lr, C, z, batch_size):
    """The DP optimizer and the transforms after its aggregation (to form by hand the
    step on a given noised mean)."""
    if name == "dp_sgd":
        opt = jso.dp_sgd(learning_rate=lr, clip_norm=C, noise_multiplier=z, batch_size=batch_size)
        rest = optax.scale_by_learning_rate(lr)
    else:
        opt = jso.dp_adam(learning_rate=lr, clip_norm=C, noise_multiplier=z, batch_size=batch_size)
        rest = optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(lr))
    return opt, rest


@pytest.mark.parametrize("jit", _modes())
@pytest.mark.parametrize("name", ["dp_sgd", "dp_adam"])
def test_dp_step_on_an_empty_batch_is_the_noise_over_the_expected_batch_size(name, jit):
    loss, p, b = _case("mlp")
    C, z, expected_B, lr = 1.0, 1.1, 4, 0.1
    opt, rest = _dp_parts(name, lr, C, z, expected_B)
    request = jso.stat_request(opt)
    f = js.per_example_stat(loss, request)

    def step(p, state, pad, key):
        stats = f(p, b, is_padding_example=pad)
        return opt.update(stats["mean"], state, p, **jso.update_kwargs(stats, key=key))

    key = jax.random.key(3)
    updates, _ = _maybe_jit(step, jit)(p, opt.init(p), EVERYTHING, key)
    assert _finite(updates)
    # the noise alone (the clipped sum of no example is 0), over the expected batch size
    agg = jso.dp_aggregate(C, z, expected_B)
    zeros = jax.tree.map(jnp.zeros_like, p)
    noised, _ = agg.update(zeros, agg.init(p), clipped_sum=zeros, key=key)
    assert not any(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(noised))
    want, _ = rest.update(noised, rest.init(p), p)
    _close(updates, jax.tree.map(lambda x: np.asarray(x, np.float64), want), rtol=1e-6)


def test_dp_step_reading_the_batch_size_refuses_an_empty_batch():
    """``batch_size=None`` divides by the batch's own size (its total weight): 0 here.
    Eagerly a ValueError naming the fix; under jit the update is NaN."""
    loss, p, b = _case("mlp")
    opt = jso.dp_sgd(learning_rate=0.1, clip_norm=1.0, noise_multiplier=1.1)
    f = js.per_example_stat(loss, jso.stat_request(opt))

    def step(p, pad, key):
        stats = f(p, b, is_padding_example=pad)
        return opt.update(stats["mean"], opt.init(p), p, **jso.update_kwargs(stats, key=key))[0]

    with pytest.raises(ValueError, match="batch_size"):
        step(p, EVERYTHING, jax.random.key(0))
    assert _all_nan(jax.jit(step)(p, EVERYTHING, jax.random.key(0)))
    # a batch with examples: finite, as before
    assert _finite(jax.jit(step)(p, EVERYTHING.at[3].set(False), jax.random.key(0)))


def test_clipped_grad_empty_batch_and_nan_padding():
    loss, p, b = _case("mlp")
    f = js.privacy.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    bad = _poisoned(b, [0, 5])
    for run in (f, jax.jit(f)):
        grad, aux = run(p, bad, is_padding_example=EVERYTHING)
        _exactly_zero(grad)
        _exactly_zero(aux.grad_norms)


# --------------------------------------------------------------------------- #
# 2. Non-finite per-example gradients
# --------------------------------------------------------------------------- #
ROUTES = [
    # (model, chunk_size, per-layer bounds): the one-pass route over kept ingredients,
    # a fallback leaf's per-example copies and kept products (rnn), a tied leaf, the
    # remat second pass; whole and in chunks
    pytest.param("mlp", None, False, id="mlp-whole"),
    pytest.param("mlp", 3, False, id="mlp-chunks"),
    pytest.param("mlp", None, True, id="mlp-per-layer"),
    pytest.param("mlp", 3, True, id="mlp-per-layer-chunks"),
    pytest.param("rnn", None, False, id="rnn-whole"),
    pytest.param("rnn", 2, True, id="rnn-per-layer-chunks"),
    pytest.param("tied", None, False, id="tied-whole"),
    pytest.param("remat", None, False, id="remat-whole"),
    pytest.param("remat", 3, True, id="remat-per-layer-chunks"),
]


def _bounds(p, C, per_layer):
    if not per_layer:
        return C
    return {k: C * (0.5 + 0.25 * i) for i, k in enumerate(p)}


@pytest.mark.parametrize("how", ["nan", "inf"])
@pytest.mark.parametrize("name, chunk, per_layer", ROUTES)
def test_nonfinite_examples_are_dropped_from_clipped_sums(name, chunk, per_layer, how):
    loss, p, b = _case(name)
    if how == "inf" and "x" not in b:
        pytest.skip("integer inputs")
    if name == "remat":
        assert plans.clips_by_recompute(jax.make_jaxpr(loss)(p, b).jaxpr)
    C = _bounds(p, _median_norm(loss, p, b), per_layer)
    bad = [2, 5]
    keep = ~np.isin(np.arange(B), bad)
    pb = _poisoned(b, bad, how)
    g = _grads(loss, p, pb)  # the other examples' gradients are finite
    assert not all(np.all(np.isfinite(x[bad])) for x in jax.tree.leaves(g))
    stats = {"sum": js.stats.clipped_sum(C), "mean": js.stats.clipped_mean(C),
             "count": js.stats.nonfinite_count(), "norms": js.stats.norms()}
    got = jax.jit(js.per_example_stat(loss, stats, chunk_size=chunk))(p, pb)
    want = _clipped_sum(g, C, keep)
    _close(got["sum"], want)
    _close(got["mean"], jax.tree.map(lambda x: x / B, want))  # (counted in B)
    assert int(got["count"]) == len(bad)
    assert not np.any(np.isfinite(np.asarray(got["norms"])[bad]))  # the norms say why
    # propagate: NaN, as before
    prop = js.stats.clipped_sum(C, nonfinite="propagate")
    out = jax.jit(js.per_example_stat(loss, prop, chunk_size=chunk))(p, pb)
    assert any(np.isnan(np.asarray(x)).any() for x in jax.tree.leaves(out))
    # a clean batch: the count is 0 and the sums are the plain ones
    clean = jax.jit(js.per_example_stat(loss, stats, chunk_size=chunk))(p, b)
    assert int(clean["count"]) == 0
    _close(clean["sum"], _clipped_sum(_grads(loss, p, b), C, np.ones(B, bool)))


@pytest.mark.parametrize("name", ["mlp", "remat", "rnn"])
def test_nonfinite_with_example_weights(name):
    """A weighted batch: a padded example with a NaN loss is removed by its weight 0 (not
    counted), a weighted example with a NaN gradient is dropped (counted)."""
    loss, p, b = _case(name)
    C = _median_norm(loss, p, b)
    w = np.array([1.0, 0.0, 2.0, 0.5, 1.0, 3.0, 0.0, 1.0], np.float32)
    pb = _poisoned(b, [1, 5])  # 1 padded, 5 weighted 3
    keep = ~np.isin(np.arange(B), [1, 5])
    g = _grads(loss, p, pb)
    stats = {"sum": js.stats.clipped_sum(C), "count": js.stats.nonfinite_count()}
    for chunk in (None, 3):
        got = jax.jit(js.per_example_stat(loss, stats, chunk_size=chunk))(
            p, pb, example_weights=jnp.asarray(w))
        _close(got["sum"], _clipped_sum(g, C, keep, w))
        assert int(got["count"]) == 1


@pytest.mark.parametrize("bad", [[0], [0, 1, 2, 3, 4, 5, 6, 7], [1, 3, 4, 5, 6, 7]],
                         ids=["first", "every", "all-but-one"])
@pytest.mark.parametrize("how", ["nan", "inf"])
def test_remat_drop_in_the_one_second_pass(bad, how):
    """Under remat the one second pass reads the dropped examples as zeros at every site
    (`clipping.clipped_sums`): the first example dropped, all but one, and every one (the
    sums are zeros, not NaN), whole and in chunks."""
    loss, p, b = _case("remat")
    C = _median_norm(loss, p, b)
    keep = ~np.isin(np.arange(B), bad)
    pb = _poisoned(b, bad, how)
    g = _grads(loss, p, pb)
    stats = {"sum": js.stats.clipped_sum(C), "count": js.stats.nonfinite_count()}
    for chunk in (None, 3):  # (chunks of 3, 3 and 2: some with no finite example)
        got = jax.jit(js.per_example_stat(loss, stats, chunk_size=chunk))(p, pb)
        _close(got["sum"], _clipped_sum(g, C, keep))
        assert int(got["count"]) == len(bad)


def test_remat_drop_with_a_padded_example_of_nan_data():
    """Example weights and a dropped example in the one second pass: a padded example
    (weight 0) first in the batch with NaN inputs, a weighted one dropped."""
    loss, p, b = _case("remat")
    C = _median_norm(loss, p, b)
    w = np.ones(B, np.float32)
    w[0] = 0.0
    pb = {**b, "x": b["x"].at[0].set(jnp.nan)}
    pb = _poisoned(pb, [2])
    keep = ~np.isin(np.arange(B), [0, 2])
    g = _grads(loss, p, pb)
    got = jax.jit(js.per_example_stat(loss, js.stats.clipped_sum(C)))(
        p, pb, example_weights=jnp.asarray(w))
    _close(got, _clipped_sum(g, C, keep, w))


def test_nonfinite_mixed_modes_in_one_request():
    """A dropping and a propagating clipped sum of one call: each its own."""
    loss, p, b = _case("remat")
    C = _median_norm(loss, p, b)
    pb = _poisoned(b, [3])
    g = _grads(loss, p, pb)
    out = jax.jit(js.per_example_stat(loss, (js.stats.clipped_sum(C),
                                             js.stats.clipped_sum(C, nonfinite="propagate"))))(
        p, pb)
    _close(out[0], _clipped_sum(g, C, np.arange(B) != 3))
    assert any(np.isnan(np.asarray(x)).any() for x in jax.tree.leaves(out[1]))


def test_nonfinite_statistic_arguments():
    with pytest.raises(ValueError, match="nonfinite"):
        js.stats.clipped_sum(1.0, nonfinite="zero")
    a, b = js.stats.clipped_sum(1.0), js.stats.clipped_sum(1.0, nonfinite="propagate")
    assert a.reductions()["c"] != b.reductions()["c"]
    assert "propagate" in repr(b)


def test_nonfinite_under_shard_map():
    loss, p, b = _case("mlp")
    C = _median_norm(loss, p, b)
    bad = [1, 6]  # on two devices
    pb = _poisoned(b, bad)
    g = _grads(loss, p, pb)
    f = js.per_example_stat(loss, {"c": js.stats.clipped_sum(C),
                                   "n": js.stats.nonfinite_count()}, axis_name="d")
    out = _on_mesh(f, p, pb)
    _close(out["c"], _clipped_sum(g, C, ~np.isin(np.arange(B), bad)))
    assert int(out["n"]) == len(bad)


def test_dp_step_with_a_nonfinite_example_equals_the_step_without_it():
    loss, p, b = _case("mlp")
    C = _median_norm(loss, p, b)
    opt = jso.dp_sgd(learning_rate=0.1, clip_norm=C, noise_multiplier=1.0, batch_size=B)
    request = jso.stat_request(opt)
    f = js.per_example_stat(loss, request)

    @jax.jit
    def step(p, batch, pad, key):
        stats = f(p, batch, is_padding_example=pad)
        updates, _ = opt.update(stats["mean"], opt.init(p), p,
                                **jso.update_kwargs(stats, key=key))
        return optax.apply_updates(p, updates)

    key = jax.random.key(7)
    no_pad = jnp.zeros((B,), bool)
    got = step(p, _poisoned(b, [4]), no_pad, key)
    assert _finite(got)
    want = step(p, b, no_pad.at[4].set(True), key)  # example 4 padded away
    _close(got, jax.tree.map(lambda x: np.asarray(x, np.float64), want), rtol=1e-6)


def test_clipped_grad_nan_safe_on_every_route():
    """``clipped_grad``'s ``nan_safe`` is the statistic's drop: chunks, per-layer bounds
    and remat, with padding."""
    for name, chunk, per_layer in [("mlp", 3, True), ("remat", None, False), ("rnn", 2, False)]:
        loss, p, b = _case(name)
        C = _bounds(p, _median_norm(loss, p, b), per_layer)
        pb = _poisoned(b, [2])
        pad = jnp.zeros((B,), bool).at[6].set(True)
        keep = ~np.isin(np.arange(B), [2, 6])
        g = _grads(loss, p, pb)
        f = js.privacy.clipped_grad(loss, l2_clip_norm=C, microbatch_size=chunk)
        _close(f(p, pb, is_padding_example=pad), _clipped_sum(g, C, keep), rtol=1e-5)
        unsafe = js.privacy.clipped_grad(loss, l2_clip_norm=C, microbatch_size=chunk,
                                         nan_safe=False)
        assert any(np.isnan(np.asarray(x)).any()
                   for x in jax.tree.leaves(unsafe(p, pb, is_padding_example=pad)))

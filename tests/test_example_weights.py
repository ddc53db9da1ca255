"""``example_weights`` / ``is_padding_example``: every statistic is the weighted one.

Oracle: frequency weights. With integer weights, the weighted statistic equals the
statistic of the batch in which example ``b`` appears ``w_b`` times (a weight 0 removes
it), computed from ``vmap(grad)`` of the per-example loss and reduced in numpy float64;
per-example outputs (norms) read 0 at weight 0. The noise scale's batch size is Kish's
effective size ``W^2 / sum w^2``: it is checked with 0/1 weights (the batch without the
padded examples) and against its formula.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from test_reduction_protocol import MaxAbs

import jaxpr_surgery as js

STATS = ("mean", "sum", "second_moment", "variance", "sign_mean", "abs_mean",
         "fourth_moment", "kurtosis", "gradient_diversity", "kron_moments")


def _f64(t):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), t)


def _oracle(g, name, **kw):
    return zoo.oracle_from_grads(g, name, **kw)


def _repeat(g, w):
    return jax.tree.map(lambda x: np.repeat(np.asarray(x), w, axis=0), g)


def _close(actual, expected, rtol, what):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        fin = np.abs(e[np.isfinite(e)])
        scale = float(fin.max()) if fin.size else 0.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale + 1e-300, err_msg=what)


def _int_weights(B, seed=0):
    w = np.random.default_rng(seed).integers(0, 4, size=B)
    w[0], w[-1] = 0, 2  # a removed example, a doubled one
    if w.sum() < 3:
        w[1:3] = 1
    return w


def _request(clip):
    req = {n: getattr(js.stats, n)() for n in STATS}
    req["clipped_mean"] = js.stats.clipped_mean(clip)
    req["sq_norms"] = js.stats.sq_norms()
    req["norms_per_leaf"] = js.stats.norms(per_leaf=True)
    return req


def _check_case(name, dtype, chunk_size, rtol, seed=0):
    with zoo.x64():
        ref_case = zoo.get_case(name, jnp.float64)
        g = _f64(zoo.per_example_grads(ref_case))
    case = zoo.get_case(name, dtype) if dtype != jnp.float64 else ref_case
    B = jax.tree.leaves(case.batch)[0].shape[0]
    w = _int_weights(B, seed)
    clip = float(np.median(np.sqrt(zoo.oracle_from_grads(g, "sq_norms"))))
    gr = _repeat(g, w)

    def run():
        f = js.per_example_stat(case.loss_fn, _request(clip), chunk_size=chunk_size)
        return f(case.params, case.batch, example_weights=jnp.asarray(w, dtype))

    if dtype == jnp.float64:
        with zoo.x64():
            out = run()
    else:
        out = run()
    for n in STATS:
        kr = rtol * (1e4 if n == "kurtosis" and dtype != jnp.float64 else 1)
        _close(out[n], _oracle(gr, n), kr, f"{name} {n}")
    _close(out["clipped_mean"], zoo.oracle_from_grads(gr, "clipped_mean", clip_norm=clip), rtol,
           f"{name} clipped_mean")
    keep = w > 0
    _close(out["sq_norms"], zoo.oracle_from_grads(g, "sq_norms") * keep, rtol, f"{name} sq_norms")
    assert np.all(np.asarray(out["sq_norms"])[~keep] == 0)
    per_leaf = zoo.oracle_from_grads(g, "norms", per_leaf=True)
    _close(out["norms_per_leaf"], jax.tree.map(lambda x: x * keep, per_leaf), rtol,
           f"{name} norms")


# Models that take every route: dense/rank-one (mlp), conv patches (cnn), token sites,
# tied embedding and attention (transformer), layers in a scan under remat (clipped
# sums by a second pass), a scan with closed-over weights (rnn), residual leaves
# (custom_vjp_and_cond), a one-hot embedding.
CASES = ("mlp", "cnn", "transformer", "transformer_scan_remat", "rnn", "custom_vjp_and_cond",
         "embedding_modes",
         "equinox_mlp")


@pytest.mark.parametrize("name", CASES)
def test_weighted_matches_frequency_oracle_f64(name):
    _check_case(name, jnp.float64, None, 1e-9)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_weighted_f32(name):
    _check_case(name, jnp.float32, None, 2e-4)


@pytest.mark.parametrize("name", ["mlp", "transformer_scan_remat"])
def test_weighted_in_chunks(name):
    # chunks of 3 (the batch is no multiple of 3): carries count weights, not examples
    _check_case(name, jnp.float64, 3, 1e-9, seed=1)


def _tiny():
    """A token model whose loss is written the way LM trainers write it."""
    rng = np.random.default_rng(0)
    B, T, V, d = 5, 6, 11, 4
    params = {"emb": jnp.asarray(rng.normal(size=(V, d)), jnp.float32),
              "w": jnp.asarray(rng.normal(size=(d, V)) / 2, jnp.float32),
              "b": jnp.asarray(rng.normal(size=(V,)) / 4, jnp.float32)}
    ids = jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32)
    mask = np.ones((B, T), np.float32)
    mask[1, 3:] = 0
    mask[3, :] = 0  # a fully padded example
    mask[4, 1:] = 0
    return params, {"ids": ids, "mask": jnp.asarray(mask)}


def _nll(params, batch):
    h = jnp.tanh(params["emb"][batch["ids"]])
    logits = h @ params["w"] + params["b"]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["ids"][..., None], -1)[..., 0]


def _token_mean_per_example(params, batch):
    """Per example: its own token mean (NaN for an example without tokens)."""
    nll = _nll(params, batch)
    m = batch["mask"]
    return jnp.mean(jnp.sum(m * nll, -1) / jnp.sum(m, -1))


def test_token_count_weights_give_grad_of_token_normalised_loss():
    params, batch = _tiny()

    def batch_loss(p, b):  # what an LM trainer writes: the batch's token count
        return jnp.sum(b["mask"] * _nll(p, b)) / jnp.sum(b["mask"])

    with pytest.raises(js.CrossExampleError):
        js.per_example_stat(batch_loss, js.stats.mean())(params, batch)
    counts = jnp.sum(batch["mask"], -1)
    f = js.value_and_per_example_stat(_token_mean_per_example,
                                      {"mean": js.stats.mean(), "var": js.stats.variance()})
    loss, out = f(params, batch, example_weights=counts)
    expect = jax.grad(batch_loss)(params, batch)
    _close(out["mean"], expect, 1e-5, "mean")
    np.testing.assert_allclose(loss, batch_loss(params, batch), rtol=1e-6)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))


def test_padding_removes_examples_exactly_even_with_nan_loss():
    params, batch = _tiny()
    pad = jnp.asarray([False, False, False, True, False])
    req = {"mean": js.stats.mean(), "var": js.stats.variance(), "m2": js.stats.second_moment(),
           "sign": js.stats.sign_mean(), "snr": js.stats.snr(bias_corrected=True),
           "noise": js.stats.noise_scale_components(),
           "q": js.stats.norm_quantiles((0.0, 0.5, 1.0)),
           "norms": js.stats.norms(), "clip": js.stats.clipped_mean(0.3),
           "div": js.stats.gradient_diversity(), "kurt": js.stats.kurtosis()}
    out = js.per_example_stat(_token_mean_per_example, req)(params, batch, is_padding_example=pad)
    keep = np.flatnonzero(~np.asarray(pad))
    sub = jax.tree.map(lambda x: x[keep], batch)
    ref = js.per_example_stat(_token_mean_per_example, req)(params, sub)
    for k in req:
        if k == "norms":
            np.testing.assert_allclose(np.asarray(out[k])[keep], ref[k], rtol=1e-5)
            assert float(out[k][3]) == 0.0
        else:
            _close(out[k], ref[k], 2e-5, k)
    # the same through weights, in chunks of two (the padded example alone in one)
    f = js.per_example_stat(_token_mean_per_example, req, chunk_size=2)
    out2 = f(params, batch, example_weights=jnp.asarray([1.0, 1, 1, 0, 1]))
    for k in req:
        _close(out2[k], out[k], 2e-5, k)


def test_noise_scale_uses_the_effective_batch_size():
    with zoo.x64():
        case = zoo.get_case("mlp", jnp.float64)
        g = _f64(zoo.per_example_grads(case))
        B = jax.tree.leaves(g)[0].shape[0]
        w = np.random.default_rng(3).uniform(0.2, 2.0, size=B)
        out = js.per_example_stat(case.loss_fn, js.stats.noise_scale_components())(
            case.params, case.batch, example_weights=jnp.asarray(w))
        W = w.sum()
        n_eff = W**2 / np.sum(w**2)
        leaves = jax.tree.leaves(g)
        mu = [np.tensordot(w, x, (0, 0)) / W for x in leaves]
        tr = sum(np.tensordot(w, (x - m) ** 2, (0, 0)).sum() for x, m in zip(leaves, mu)) / (W - 1)
        g2 = sum((m**2).sum() for m in mu) - tr / n_eff
        np.testing.assert_allclose(out.batch_size, n_eff, rtol=1e-12)
        np.testing.assert_allclose(out.trace_cov, tr, rtol=1e-10)
        np.testing.assert_allclose(out.grad_sq_norm, g2, rtol=1e-9)


def test_float_weights_variance_is_frequency_weighted():
    with zoo.x64():
        case = zoo.get_case("transformer", jnp.float64)
        g = _f64(zoo.per_example_grads(case))
        B = jax.tree.leaves(g)[0].shape[0]
        w = np.random.default_rng(4).uniform(0.0, 3.0, size=B)
        out = js.per_example_stat(case.loss_fn, (js.stats.mean(), js.stats.variance()))(
            case.params, case.batch, example_weights=jnp.asarray(w))
        _close(out[0], zoo.oracle_from_grads(g, "mean", weights=w), 1e-9, "mean")
        _close(out[1], zoo.oracle_from_grads(g, "variance", weights=w), 1e-9, "variance")


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake CPU) devices: conftest.py")
def test_weights_under_shard_map_split_with_the_batch():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("data",))
    case = zoo.get_case("mlp", jnp.float32)
    B = jax.tree.leaves(case.batch)[0].shape[0]
    n = (B // 4) * 4
    batch = jax.tree.map(lambda x: x[:n], case.batch)
    w = jnp.asarray(_int_weights(n, 5), jnp.float32)
    req = {"mean": js.stats.mean(), "var": js.stats.variance(), "m2": js.stats.second_moment(),
           "q": js.stats.norm_quantiles(0.5), "noise": js.stats.gradient_noise_scale()}
    f = js.per_example_stat(case.loss_fn, req, axis_name="data")
    sharded = jax.jit(jax.shard_map(
        lambda p, b, w: f(p, b, example_weights=w), mesh=mesh,
        in_specs=(P(), P("data"), P("data")), out_specs=P(), check_vma=True))
    split = jax.sharding.NamedSharding(mesh, P("data"))
    rep = jax.sharding.NamedSharding(mesh, P())
    out = sharded(jax.device_put(case.params, rep), jax.device_put(batch, split),
                  jax.device_put(w, split))
    ref = js.per_example_stat(case.loss_fn, req)(case.params, batch, example_weights=w)
    for k in req:
        _close(out[k], ref[k], 2e-5, k)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake CPU) devices: conftest.py")
def test_weights_with_explicitly_sharded_arguments():
    """Sharding in types (Explicit mesh axes): the weights go into auto mode with the batch."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    case = zoo.get_case("mlp", jnp.float32)
    n = (jax.tree.leaves(case.batch)[0].shape[0] // 4) * 4
    batch = jax.tree.map(lambda x: x[:n], case.batch)
    w = _int_weights(n, 6)
    req = {"mean": js.stats.mean(), "var": js.stats.variance(), "norms": js.stats.norms()}
    f = js.per_example_stat(case.loss_fn, req)
    ref = f(case.params, batch, example_weights=w)
    placed = (jax.device_put(case.params, NamedSharding(mesh, P())),
              jax.device_put(batch, NamedSharding(mesh, P("d"))))
    wd = jax.device_put(jnp.asarray(w, jnp.float32), NamedSharding(mesh, P("d")))
    for out in (f(*placed, example_weights=wd), jax.jit(f)(*placed, example_weights=wd)):
        for k in req:
            _close(out[k], ref[k], 2e-5, k)
    with pytest.raises(ValueError, match="example_weights"):
        f(*placed, example_weights=-np.ones(n))
    g = jax.tree.map(lambda x: x[:n], _f64(zoo.per_example_grads(case)))
    _close(ref["mean"], _oracle(_repeat(g, w), "mean"), 2e-5, "mean vs the frequency oracle")


def test_weights_compose_with_jit_vmap_and_grad():
    params, batch = _tiny()
    f = js.per_example_stat(_token_mean_per_example, js.stats.mean())
    ws = jnp.asarray([[1.0, 2, 1, 0, 1], [0.0, 1, 3, 0, 2]])
    many = jax.jit(jax.vmap(lambda w: f(params, batch, example_weights=w)))(ws)
    for k in range(2):
        one = f(params, batch, example_weights=ws[k])
        _close(jax.tree.map(lambda x, k=k: x[k], many), one, 1e-6, "vmap")
    # a derivative through the weights (float64, central differences)
    with zoo.x64():
        p64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
        b64 = {"ids": batch["ids"], "mask": jnp.asarray(batch["mask"], jnp.float64)}
        g = js.per_example_stat(_token_mean_per_example, js.stats.variance())
        proj = jnp.asarray(np.random.default_rng(1).normal(size=p64["w"].shape))

        def total(w):
            return jnp.sum(proj * g(p64, b64, example_weights=w)["w"])

        w0 = jnp.asarray([1.0, 2, 1, 0.5, 1])
        gw = jax.grad(total)(w0)
        for b in (0, 2):
            e = jnp.zeros(5).at[b].set(1e-5)
            fd = (total(w0 + e) - total(w0 - e)) / 2e-5
            np.testing.assert_allclose(gw[b], fd, rtol=1e-5)


@pytest.mark.parametrize(
    "w, err, match",
    [
        (np.array([1.0, -1, 1, 1, 1]), ValueError, "negative at examples \\[1\\]"),
        (np.array([1.0, np.nan, 1, 1, 1]), ValueError, "NaN or inf"),
        (np.zeros(5), ValueError, "every example has weight 0"),
        (np.ones(4), ValueError, "shape \\(5,\\)"),
        (np.array([1.0, 0, 0, 0, 0]), ValueError, "variance\\(ddof=1\\) divides by W - ddof"),
    ],
)
def test_bad_weights_raise(w, err, match):
    params, batch = _tiny()
    f = js.per_example_stat(_token_mean_per_example, js.stats.variance())
    with pytest.raises(err, match=match):
        f(params, batch, example_weights=jnp.asarray(w))


def test_bad_traced_weights_poison_and_argument_errors():
    params, batch = _tiny()
    f = js.per_example_stat(_token_mean_per_example, js.stats.mean())
    out = jax.jit(lambda w: f(params, batch, example_weights=w))(
        jnp.asarray([1.0, -1, 1, 1, 1]))
    assert all(np.all(np.isnan(x)) for x in jax.tree.leaves(out))
    with pytest.raises(ValueError, match="not both"):
        f(params, batch, example_weights=jnp.ones(5), is_padding_example=jnp.zeros(5, bool))
    with pytest.raises(TypeError, match="bool"):
        f(params, batch, is_padding_example=jnp.zeros(5))


def test_reduction_without_weighted_form_says_so():
    class Stat(js.stats.Statistic):
        def reductions(self):
            return {"m": MaxAbs()}

        def finalize(self, values, count):
            return values["m"]

    params, batch = _tiny()
    f = js.per_example_stat(_token_mean_per_example, Stat())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NotImplementedError, match="MaxAbs has no weighted form"):
            f(params, batch, example_weights=jnp.ones(5))


def test_explain_reports_the_weights():
    params, batch = _tiny()
    req = {"v": js.stats.variance(), "m2": js.stats.second_moment()}
    w = jnp.asarray([1.0, 2, 1, 0, 1])
    text = str(js.explain(_token_mean_per_example, req)(params, batch, example_weights=w))
    assert "example_weights: every statistic over the weighted examples" in text, text
    flat = " ".join(text.split())  # (the notes are wrapped)
    assert "4 of 5 examples weighted" in flat and "The rules above run weighted" in flat, text
    # the rules are those of the unweighted call (weighted forms of the same rules)
    plain = js.explain(_token_mean_per_example, req)(params, batch)
    assert [leaf.rules for leaf in plain.leaves] == [
        leaf.rules for leaf in js.explain(_token_mean_per_example, req)(
            params, batch, example_weights=w).leaves]
    with pytest.raises(ValueError, match="negative"):
        js.explain(_token_mean_per_example, req)(params, batch, example_weights=-w)


def test_weighted_partials_merge_to_one_weighted_call():
    params, batch = _tiny()
    w = jnp.asarray([2.0, 1, 0, 0, 3])
    req = {"mean": js.stats.mean(), "var": js.stats.variance(), "q": js.stats.norm_quantiles(0.5),
           "noise": js.stats.noise_scale_components(), "norms": js.stats.norms(),
           "div": js.stats.gradient_diversity()}
    f = js.per_example_partial(_token_mean_per_example, req)
    cut = [(0, 2), (2, 4), (4, 5)]  # the middle part all padding (one example's loss NaN)
    parts = [f(params, jax.tree.map(lambda x, a=a, b=b: x[a:b], batch), example_weights=w[a:b])
             for a, b in cut]
    out = js.finalize_partial(js.merge_partials(*parts))
    ref = js.per_example_stat(_token_mean_per_example, req)(params, batch, example_weights=w)
    for k in req:
        _close(out[k], ref[k], 2e-5, k)
    with pytest.raises(ValueError, match="example_weights"):
        js.merge_partials(parts[0], f(params, batch))


@pytest.mark.parametrize("B,T", [(5, 3), (4, 1)])  # T=1: the rank-one rules, weighted
def test_weighted_ragged_moe(B, T):
    """Grouped-matmul MoE (jax.lax.ragged_dot sites) under weights: the frequency oracle
    from a loop of per-example grads (vmap cannot map ragged_dot)."""
    import test_moe as TM

    with zoo.x64():
        p, batch = TM._cast(TM.make(B, T, seed=B + T), jnp.float64)
        g = TM.per_example_grads(TM.ragged_moe, p, batch)
        w = np.array([0, 2, 1, 3, 1][:B])
        req = {n: getattr(js.stats, n)() for n in ("variance", "sign_mean", "second_moment",
                                                   "mean")}
        # (check=False: the batch-wide sort of the dispatch couples examples for the check)
        out = js.per_example_stat(TM.ragged_moe, req, check=False)(p, batch, example_weights=w)
    for n in req:
        _close(out[n], _oracle(_repeat(g, w), n), 1e-9, n)


@pytest.mark.parametrize("tied", [False, True])
def test_examples_of_weight_zero_are_never_recomputed_alone(monkeypatch, tied):
    """The ghost form flags an all-zero example (its terms' scale is 0) for an exact
    recomputation; an example of weight 0 reads as zeros at every site, but its norms are
    zeroed after, so it must not pay that loop (a quarter of padding once cost sq_norms
    and the clipped mean about a fifth of their time). A host callback in the exact
    per-example product records every example it forms; a tied table (norms of a leaf
    several sites share) and a single dense site both."""
    from jaxpr_surgery._src.sites import dense as D

    seen = []
    inner = D.DenseKernel._tile_G

    def spy(self, x, dy, b0, size, *args, **kw):
        jax.debug.callback(lambda b: seen.append(int(b)), b0)
        return inner(self, x, dy, b0, size, *args, **kw)

    monkeypatch.setattr(D.DenseKernel, "_tile_G", spy)
    rng = np.random.default_rng(0)
    B, T, d, V = 6, 3, 24, 40  # T << d: the ghost form at every dense site
    params = {"emb": jnp.asarray(rng.normal(size=(V, d)) / 4, jnp.float32),
              "w": jnp.asarray(rng.normal(size=(d, d)) / 5, jnp.float32),
              "out": jnp.asarray(rng.normal(size=(d, V)) / 5, jnp.float32)}
    batch = {"ids": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)}

    def loss(p, b):
        h = jnp.tanh(p["emb"][b["ids"]] @ p["w"])
        head = p["emb"].T if tied else p["out"]
        return jnp.mean(jax.nn.logsumexp(h @ head, -1))

    w = jnp.asarray([1.0, 0, 2, 0, 1, 0])
    req = {"sq": js.stats.sq_norms(), "clip": js.stats.clipped_mean(0.05)}
    out = jax.jit(lambda p, b: js.per_example_stat(loss, req)(p, b, example_weights=w))(
        params, batch)
    jax.effects_barrier()
    assert not set(seen) & {1, 3, 5}, seen
    keep = np.flatnonzero(np.asarray(w) > 0)
    sub = jax.tree.map(lambda x: x[keep], batch)
    ref = js.per_example_stat(loss, req)(params, sub, example_weights=w[keep])
    np.testing.assert_allclose(np.asarray(out["sq"])[keep], ref["sq"], rtol=1e-5)
    assert np.all(np.asarray(out["sq"])[[1, 3, 5]] == 0)
    _close(out["clip"], ref["clip"], 1e-5, "clip")


# --------------------------------------------------------------------------- #
# Derivatives through weighted statistics
# --------------------------------------------------------------------------- #
def _weighted_oracle(g, w, name, clip=None):
    """The one oracle (zoo.py), weighted, in JAX: differentiable in ``w``."""
    return zoo.oracle_from_grads(g, name, xp=jnp, weights=w, clip_norm=clip)


ORACLE_STATS = ("mean", "sum", "second_moment", "variance", "sign_mean", "abs_mean",
                "fourth_moment", "kurtosis", "gradient_diversity", "clipped_mean",
                "clipped_sum", "sq_norms")


def _vjps(f, w, names, values=None):
    """Per statistic of ``f(w)`` (a dict), the gradient in ``w`` of a fixed random
    projection of it (``values``: a dict, receives ``f(w)``). Compiled (eagerly, each
    operation of ``vjp`` would compile alone): the value, and one pull-back program
    called once per statistic."""
    out = jax.jit(f)(w)
    if values is not None:
        values.update(out)
    # (a random projection of the finite entries: kurtosis is NaN where the variance is 0)
    proj = {k: jax.tree.map(lambda x, k=k: jnp.where(jnp.isfinite(x), jnp.asarray(
        np.random.default_rng(len(k)).normal(size=np.shape(x)), x.dtype), 0), v)
        for k, v in out.items()}
    pull = jax.jit(lambda w, ct: jax.vjp(f, w)[1](ct)[0])
    res = {}
    for n in names:
        ct = {k: jax.tree.map(jnp.zeros_like, v) if k != n else proj[k] for k, v in out.items()}
        res[n] = np.asarray(pull(w, ct))
    return res


def _stat(n, clip):
    if n.startswith("clipped"):
        return getattr(js.stats, n)(clip)
    return getattr(js.stats, n)()


# every route: dense/rank-one in chunks (a chunk may start with, or hold only, examples of
# weight 0), dense and embedding sites over tokens; in the extended tier attention and a
# tied embedding, conv, clipped sums by a second pass (remat), a scan, residual leaves,
# the embedding modes
_EXT = pytest.mark.extended


# (the statistics that take their own route at a token site: the rest, on the mlp)
_TOKEN_STATS = ("mean", "second_moment", "variance", "clipped_mean", "gradient_diversity",
                "sq_norms")


@pytest.mark.parametrize("name,chunk,stats", [
    ("mlp", 2, ORACLE_STATS), ("tiny_lm", None, _TOKEN_STATS),
    pytest.param("transformer", None, ORACLE_STATS, marks=_EXT),
    pytest.param("mlp", None, ORACLE_STATS, marks=_EXT),
    pytest.param("cnn", None, ORACLE_STATS, marks=_EXT),
    pytest.param("transformer_scan_remat", None, ORACLE_STATS, marks=_EXT),
    pytest.param("rnn", None, ORACLE_STATS, marks=_EXT),
    pytest.param("custom_vjp_and_cond", None, ORACLE_STATS, marks=_EXT),
    pytest.param("embedding_modes", None, ORACLE_STATS, marks=_EXT)],
    ids=lambda x: "all" if x is ORACLE_STATS else "tokens" if x is _TOKEN_STATS else None)
def test_derivative_in_a_weight_of_zero_is_exact(name, chunk, stats):
    """d stat / d w at weights holding exact zeros equals jax.grad of the statistic
    written with explicit weights: an example of weight 0 takes part in the derivative
    in its weight (d mean / d w_k = (g_k - mean) / W), whatever the route."""
    with zoo.x64():
        if name == "tiny_lm":  # (tokens: dense and embedding sites over a token axis)
            params, batch = _tiny()
            params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
            case = zoo.ZooCase(name, lambda p, b: jnp.mean(_nll(p, b)), params, batch)
            g = zoo.vmap_grads(case.loss_fn, case.params, case.batch)
        else:
            case = zoo.get_case(name, jnp.float64)
            g = jax.tree.map(jnp.asarray, _f64(zoo.per_example_grads(case)))
        B = jax.tree.leaves(g)[0].shape[0]
        rng = np.random.default_rng(2)
        w = rng.uniform(0.5, 2.0, size=B)
        w[[0, B // 2]] = 0.0  # (a first tile of weight 0)
        if chunk:
            w[chunk:2 * chunk] = 0.0  # (and a whole chunk)
        w = jnp.asarray(w)
        clip = float(np.median(np.sqrt(zoo.oracle_from_grads(g, "sq_norms"))))
        req = {n: _stat(n, clip) for n in stats}
        f = js.per_example_stat(case.loss_fn, req, chunk_size=chunk)
        values = {}
        got = _vjps(lambda w: f(case.params, case.batch, example_weights=w), w, req, values)
        want = {}
        exp = _vjps(lambda w: {n: _weighted_oracle(g, w, n, clip) for n in req}, w, req, want)
    for n in req:
        assert np.all(np.isfinite(got[n])), (n, got[n])
        _close(got[n], exp[n], 1e-7, f"{name} d {n} / d w")
        _close(values[n], want[n], 1e-9, f"{name} {n}")  # (the values, as they are)


def _projected(out, keep=None):
    """A fixed random projection of every statistic of ``out`` (a scalar); per-example
    outputs (``[B]``) projected over the examples ``keep`` only."""
    total = 0.0
    for k, v in sorted(out.items()):
        for i, x in enumerate(jax.tree.leaves(v)):
            x = jnp.asarray(x)
            if k in ("sq", "norms") and keep is not None:
                x = x[keep]
            proj = np.random.default_rng(100 * len(k) + i).normal(size=x.shape)
            total = total + jnp.sum(jnp.asarray(proj, x.dtype) * x)
    return total


@pytest.mark.parametrize("chunk", [None, pytest.param(2, marks=_EXT)])
def test_derivatives_through_a_padded_example_with_nan_loss(chunk):
    """jax.grad of the statistics through a padded example whose loss is NaN (a token mean
    over no tokens) equals jax.grad of those of the batch without it: with respect to the
    parameters, the batch data, the loss returned, and the other examples' weights (the
    NaN never enters a differentiated pass). The padded example's own derivatives (its
    data, its weight) are 0."""
    params, batch = _tiny()  # example 3: no tokens
    keep = np.array([0, 1, 2, 4])
    sub = jax.tree.map(lambda x: x[keep], batch)
    req = {"mean": js.stats.mean(), "m2": js.stats.second_moment(), "var": js.stats.variance(),
           "sq": js.stats.sq_norms(), "norms": js.stats.norms(per_leaf=True),
           "clip": js.stats.clipped_mean(0.3), "noise": js.stats.noise_scale_components(),
           "div": js.stats.gradient_diversity()}
    f = js.value_and_per_example_stat(_token_mean_per_example, req, chunk_size=chunk)
    w = jnp.asarray([1.0, 2.0, 0.5, 0.0, 1.5])

    def padded(p, mask, w):
        loss, out = f(p, {**batch, "mask": mask}, example_weights=w)
        return _projected(out, keep) + 3.0 * loss

    def alone(p, mask, w):
        loss, out = f(p, {**sub, "mask": mask}, example_weights=w)
        return _projected(out) + 3.0 * loss

    gp, gb, gw = jax.jit(jax.grad(padded, argnums=(0, 1, 2)))(params, batch["mask"], w)
    rp, rb, rw = jax.jit(jax.grad(alone, argnums=(0, 1, 2)))(params, sub["mask"], w[keep])
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((gp, gb, gw)))
    _close(gp, rp, 1e-5, "d / d params")
    _close(gb[keep], rb, 1e-5, "d / d data")
    assert np.all(np.asarray(gb)[3] == 0)
    _close(gw[keep], rw, 1e-5, "d / d weights")
    assert float(gw[3]) == 0.0  # (the derivative in the weight of an example of NaN loss)
    # eagerly too, with is_padding_example
    pad = jnp.asarray([False, False, False, True, False])
    g = jax.grad(lambda p: _projected(f(p, batch, is_padding_example=pad)[1], keep))(params)
    r = jax.grad(lambda p: _projected(f(p, sub)[1]))(params)
    _close(g, r, 1e-5, "d / d params, is_padding_example")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_weights_eager_and_under_jit(dtype):
    """bfloat16 / float16 weights are accepted eagerly as under jit (both read them as
    float32, exact for such values) and checked alike."""
    params, batch = _tiny()
    f = js.per_example_stat(_token_mean_per_example, {"v": js.stats.variance(),
                                                      "m": js.stats.mean()})
    w = jnp.asarray([1.0, 2, 1, 0, 3], dtype)
    eager = f(params, batch, example_weights=w)
    jitted = jax.jit(lambda w: f(params, batch, example_weights=w))(w)
    ref = f(params, batch, example_weights=w.astype(jnp.float32))
    _close(eager, ref, 1e-6, "eager")
    _close(jitted, ref, 1e-6, "jit")
    with pytest.raises(ValueError, match="negative at examples \\[1\\]"):
        f(params, batch, example_weights=jnp.asarray([1.0, -1, 1, 1, 1], dtype))


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake CPU) devices: conftest.py")
def test_derivative_in_the_weights_under_shard_map_with_a_device_of_weight_zero():
    """Across devices (axis_name) the derivative in the weights is exact too, also where a
    device's examples all weigh 0 (its value then holds raw sums that the merge of the
    devices keeps)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("data",))
    with zoo.x64():
        case = zoo.get_case("mlp", jnp.float64)
        batch = jax.tree.map(lambda x: x[:4], case.batch)
        g = jax.tree.map(lambda x: jnp.asarray(x)[:4], _f64(zoo.per_example_grads(case)))
        w = jnp.asarray([0.0, 0.0, 1.3, 0.8])  # one example per device
        names = ("mean", "variance")
        f = js.per_example_stat(case.loss_fn, {n: getattr(js.stats, n)() for n in names},
                                axis_name="data")
        sharded = jax.shard_map(lambda p, b, w: f(p, b, example_weights=w), mesh=mesh,
                                in_specs=(P(), P("data"), P("data")), out_specs=P())
        split = jax.sharding.NamedSharding(mesh, P("data"))
        rep = jax.sharding.NamedSharding(mesh, P())
        args = (jax.device_put(case.params, rep), jax.device_put(batch, split))
        got = _vjps(lambda w: sharded(*args, w), jax.device_put(w, split), names)
        exp = _vjps(lambda w: {n: _weighted_oracle(g, w, n) for n in names}, w, names)
    for n in names:
        _close(got[n], exp[n], 1e-9, f"d {n} / d w across devices")

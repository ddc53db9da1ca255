"""Variance numerics: the forms the engine takes where one-pass formulas cancel.

1. Token-free dense sites (``G_b = x_b d_b^T``). The raw form ``sum x^2 d^2 - (sum x d)^2
   / B`` costs two contractions; it is kept only where its worst-case rounding error is
   below ``sqrt(eps)`` of the result, else the centred expansion (and past that the exact
   tiles) take over. Large batches take it in groups, each held to its own bound, merged
   exactly. These tests sweep the mean against the spread through the threshold, check
   each branch is the one taken, and hold every result to the float64 oracle.
2. One-pass centred sums in the tile loop (tiling.reduce_tiles without a mean). Variance
   at token-axis sites takes one pass over the per-example products, shifted by the
   running mean and re-centred in groups (Chan's rule), instead of contracting the exact
   mean first. These tests hold it to the two-pass's accuracy on the inputs where
   one-pass formulas fail: a mean far larger than the spread, a first example that is an
   outlier (the shift), a single non-zero example, heavy tails; and check the plain sum
   derived from it, odd batch and tile sizes, and a whole model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from _models import x64

import jaxpr_surgery as js
from jaxpr_surgery._src import cuts, tiling
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.sites import dense, dense_layout


def _model(B, ratio, dtype, C=6, F=5, seed=0):
    """Per-example gradients ``x_b c_b^T`` whose mean is ``ratio`` times their spread."""
    rng = np.random.default_rng(seed)
    x = ratio * rng.uniform(0.5, 1.5, (1, C)) + rng.normal(size=(B, C))
    c = rng.uniform(0.5, 1.5, (1, F)) + rng.normal(size=(B, F)) / max(ratio, 1.0)
    w = rng.normal(size=(C, F))

    def loss(w, batch):
        xb, cb = batch
        return jnp.mean(jnp.sum((xb @ w) * cb, -1))

    return loss, jnp.asarray(w, dtype), (jnp.asarray(x, dtype), jnp.asarray(c, dtype))


def _oracle(B, ratio, dtype=jnp.float32):
    """Per-example gradients (float64) of the ``dtype``-rounded inputs, and their variance."""
    with x64():
        loss, w, batch = _model(B, ratio, dtype)
        w, batch = jax.tree.map(lambda a: a.astype(jnp.float64), (w, batch))
        rows = jax.tree.map(lambda a: a[:, None], batch)  # each example a batch of one
        g = np.asarray(jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(w, rows))
        return g, zoo.oracle_from_grads(g, "variance")


def _float32_slack(g):
    """What rounding each ``G_b`` to float32 alone may move the variance by (as vmap(grad)
    would): first and second order in ``e = 4 eps max_b |G_b|``."""
    e = 4 * np.finfo(np.float32).eps * np.abs(g).max(0)
    dev = np.abs(g - g.mean(0))
    return (4 * dev * e + 4 * e**2).sum(0) / (g.shape[0] - 1)


def _variance(B, ratio, dtype=jnp.float32):
    loss, w, batch = _model(B, ratio, dtype)
    return np.asarray(jax.jit(js.per_example_stat(loss, js.stats.variance()))(w, batch))


def _poisoned(monkeypatch):
    """The centred expansion returns NaN: a NaN result shows it was the branch taken."""

    def nan(self, x, d):
        k, c, f = self.c.K, self.c.C, self.c.F
        z = jnp.full((k, c, f), jnp.nan, self.acc)
        return S.Moments(self.to_view(z), self.to_view(z))

    monkeypatch.setattr(dense.DenseKernel, "_centered_expansion", nan)


@pytest.mark.parametrize("B", [2, 7, 32, 200, 301])
@pytest.mark.parametrize("ratio", [0.0, 1.0, 3.0, 10.0, 30.0, 100.0, 1e3, 1e4])
def test_raw_form_within_its_bound_where_kept(monkeypatch, B, ratio):
    _poisoned(monkeypatch)  # NaN: the raw form was refused
    got, (g, ref) = _variance(B, ratio), _oracle(B, ratio)
    if np.all(np.isnan(got)):
        # (two examples may agree in some element by chance: refused there too)
        assert ratio >= 3.0 or B == 2, "refused where the mean is within the spread"
        return
    assert ratio <= 100.0, "kept where its terms cancel to within float32 rounding"
    # its worst case is sqrt(eps) of the result; on top, what the per-example
    # products' own float32 rounding allows (as for vmap(grad))
    bound = np.sqrt(np.finfo(np.float32).eps) * ref + _float32_slack(g)
    bad = np.abs(got - ref) > bound
    assert not np.any(bad), (got[bad], ref[bad], bound[bad])


@pytest.mark.parametrize("B", [2, 7, 32, 300])
@pytest.mark.parametrize("ratio", [0.0, 3.0, 100.0, 1e4])
def test_float32_through_the_threshold(B, ratio):
    got, (_, ref) = _variance(B, ratio), _oracle(B, ratio)
    # the centred forms behind the raw one hold the near-cancelling elements to the
    # same tolerance as the one-pass centred sums below
    np.testing.assert_allclose(got, ref, rtol=2e-2)


def test_float64_is_tight():
    for ratio in (0.0, 10.0, 1e4):
        with x64():
            got = _variance(64, ratio, jnp.float64)
        np.testing.assert_allclose(got, _oracle(64, ratio, jnp.float64)[1], rtol=1e-9)


@pytest.mark.parametrize("B", [8, 128])
def test_raw_form_taken_where_it_cannot_cancel(monkeypatch, B):
    _poisoned(monkeypatch)
    got = _variance(B, 1.0)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _oracle(B, 1.0)[1], rtol=1e-4)


def test_centred_form_taken_where_the_raw_form_cancels(monkeypatch):
    _poisoned(monkeypatch)
    # mean 1e3 spreads: (sum x d)^2 / B matches sum x^2 d^2 to ~1e-6, past float32's bound
    assert np.all(np.isnan(_variance(32, 1e3)))


@pytest.mark.parametrize("B", [129, 300, 301, 515])
def test_large_float32_batches_take_the_raw_form_in_groups(monkeypatch, B):
    """Past one group (float32: 128 examples) the raw form runs per group, each held to
    its own bound, and the groups merge exactly: still the raw form (no NaN from the
    poisoned expansion), within the raw form's bound of the oracle."""
    groups = dense_layout.raw_groups(B, jnp.float32)
    assert sum(c * n for c, n in groups) == B and sum(c for c, _ in groups) > 1
    assert max(n for _, n in groups) - min(n for _, n in groups) <= 1
    assert max(n for _, n in groups) <= dense_layout.raw_group_size(jnp.float32) == 128
    _poisoned(monkeypatch)
    for ratio in (0.0, 1.0):
        got, (g, ref) = _variance(B, ratio), _oracle(B, ratio)
        assert np.all(np.isfinite(got)), ratio
        bound = np.sqrt(np.finfo(np.float32).eps) * ref + _float32_slack(g)
        assert np.all(np.abs(got - ref) <= bound), ratio


def test_one_group_where_the_bound_allows():
    assert dense_layout.raw_groups(128, jnp.float32) == [(1, 128)]
    assert dense_layout.raw_groups(7, jnp.float32) == [(1, 7)]
    assert dense_layout.raw_groups(10**5, jnp.float64) == [(1, 10**5)]  # float64: tau stays small


def test_a_cancelling_group_sends_the_batch_to_the_centred_form(monkeypatch):
    """One group whose mean dwarfs its spread (the others fine) is enough."""
    _poisoned(monkeypatch)
    loss, w, (x, c) = _model(300, 1.0, jnp.float32)
    _, _, (x2, c2) = _model(300, 1e3, jnp.float32, seed=1)
    x = x.at[200:].set(x2[200:])
    c = c.at[200:].set(c2[200:])
    got = np.asarray(jax.jit(js.per_example_stat(loss, js.stats.variance()))(w, (x, c)))
    assert np.all(np.isnan(got))


def test_grouped_raw_form_differentiates():
    """jax.grad through the grouped raw form (a scan of merges) against vmap(grad)."""
    B, C, F = 300, 6, 5
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(B, C)) + 0.5, jnp.float32)
    w = jnp.asarray(rng.normal(size=(C, F)) / 2, jnp.float32)
    u = jnp.asarray(rng.normal(size=(C, F)), jnp.float32)

    def loss(w, xb):
        return jnp.mean(jnp.sum(jnp.tanh(xb @ w) ** 2, -1))

    var = js.per_example_stat(loss, js.stats.variance())
    ours = jax.jit(jax.grad(lambda w: jnp.sum(var(w, x) * u)))(w)

    def ref_var(w):
        g = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(w, x[:, None])
        return jnp.sum(jnp.var(g, axis=0, ddof=1) * u)

    np.testing.assert_allclose(ours, jax.jit(jax.grad(ref_var))(w), rtol=2e-3, atol=1e-6)

def _weights(B, seed=0):
    w = np.random.default_rng(seed).integers(0, 4, size=B).astype(np.float64)
    w[0], w[-1] = 0.0, 2.5  # a removed example, a fractional weight
    return w


def _weighted_oracle(g, w):
    """Frequency-weighted variance ``sum_b w_b (g_b - m)^2 / (W - 1)`` in float64."""
    return zoo.oracle_from_grads(g, "variance", weights=w)


@pytest.mark.parametrize("B,ratio", [(7, 0.0), (32, 1.0), (300, 1.0), (301, 3.0),
                                     (32, 1e3), (300, 1e4)])
def test_weighted_variance_through_the_threshold(B, ratio):
    """example_weights at a rank-one site: the raw weighted sums (in groups past 128
    examples, merged by their weights), and where they cancel the exact weighted tiles;
    against the frequency-weighted oracle."""
    w = _weights(B, B)
    loss, wt, batch = _model(B, ratio, jnp.float32)
    f = jax.jit(js.per_example_stat(loss, js.stats.variance()))
    got = np.asarray(f(wt, batch, example_weights=jnp.asarray(w, jnp.float32)))
    g, _ = _oracle(B, ratio)
    np.testing.assert_allclose(got, _weighted_oracle(g, w), rtol=2e-2)
    with x64():
        loss, wt, batch = _model(B, ratio, jnp.float64)
        f = jax.jit(js.per_example_stat(loss, js.stats.variance()))
        got = np.asarray(f(wt, batch, example_weights=w))
    np.testing.assert_allclose(got, _weighted_oracle(_oracle(B, ratio, jnp.float64)[0], w),
                               rtol=1e-9)


def test_weighted_raw_form_is_the_rule_taken(monkeypatch):
    """Weights keep the rank-one rule (no tile loop over the examples): with the exact
    branch returning NaN and the generic path raising, the result is still right where
    the raw form cannot cancel."""
    def boom(*a, **k):
        raise AssertionError("the tile loop over per-example products was traced")

    def nan(self, x, d, w):
        z = jnp.full((self.c.K, self.c.C, self.c.F), jnp.nan, self.acc)
        return S.Moments(self.to_view(z), self.to_view(z))

    B = 40
    w = _weights(B, 1)
    loss, wt, batch = _model(B, 1.0, jnp.float32)
    monkeypatch.setattr(dense.DenseKernel, "_centered_tiles", nan)
    monkeypatch.setattr(dense.DenseKernel, "from_examples", boom)
    got = np.asarray(jax.jit(js.per_example_stat(loss, js.stats.variance()))(
        wt, batch, example_weights=jnp.asarray(w, jnp.float32)))
    np.testing.assert_allclose(got, _weighted_oracle(_oracle(B, 1.0)[0], w), rtol=1e-4)


# --------------------------------------------------------------------------- #
# Every per-example gradient equal: the variance is 0 to rounding
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

    (zoo.in_x64 if dtype == jnp.float64 else lambda f: f())(run)


# --------------------------------------------------------------------------- #
# One-pass centred sums in the tile loop
# --------------------------------------------------------------------------- #
def _reduce(G, tile, reductions, exact_mean=False):
    B = G.shape[0]
    make = lambda b0, size: jax.lax.dynamic_slice_in_dim(G, b0, size, 0)  # noqa: E731
    if exact_mean:  # the two-pass form: sums against the exact mean
        reductions = [S.CenteredAbout(jnp.sum(G, 0) / B) if isinstance(r, S.Centered) else r
                      for r in reductions]
    f = jax.jit(
        lambda: tiling.reduce_tiles(make, B, reductions, tile, shape=G.shape[1:], dtype=G.dtype)
    )
    return f()


def _cases(B, n=4000, seed=0):
    rng = np.random.default_rng(seed)
    yield "gaussian", rng.normal(size=(B, n))
    yield "offset 1e3", 1e3 + rng.normal(size=(B, n))
    g = rng.normal(size=(B, n)) * 1e-3
    g[0] += 1.0
    yield "first an outlier", g
    g = np.zeros((B, n))
    g[0] = rng.normal(size=n)
    yield "only the first non-zero", g
    yield "cauchy", rng.standard_cauchy(size=(B, n))


def _rel(x, truth):
    x = np.asarray(x, np.float64)
    ok = truth > 0
    return float(np.max(np.abs(x - truth)[ok] / truth[ok]))


@pytest.mark.parametrize("B", [2, 7, 33, 100, 257])
@pytest.mark.parametrize("tile", [1, 3])
def test_one_pass_float32_as_accurate_as_two_pass(B, tile):
    for name, G in _cases(B):
        truth = np.sum((G - G.mean(0)) ** 2, 0)
        G32 = jnp.asarray(G, jnp.float32)
        one = _reduce(G32, tile, [S.Centered()])[0]
        two = _reduce(G32, tile, [S.Centered()], exact_mean=True)[0]
        e1, e2 = _rel(one.m2, truth), _rel(two.m2, truth)
        # about the two-pass's error; never the E[g^2]-E[g]^2 cancellation (which
        # loses every digit on "offset 1e3" in float32)
        assert e1 <= max(40 * e2, 1e-4), (name, e1, e2)
        scale = np.abs(G).mean(0) + 1e-300
        assert np.max(np.abs(np.asarray(one.mean, np.float64) - G.mean(0)) / scale) < 1e-4, name


@pytest.mark.parametrize("B,tile", [(1, 1), (5, 2), (40, 1), (67, 4), (129, 1)])
def test_one_pass_float64_tight_with_sum_and_others(B, tile):
    g = 3.0 + np.random.default_rng(B).normal(size=(B, 6, 5))
    with x64():
        out = _reduce(jnp.asarray(g), tile, [S.SUM, S.Centered(), S.SQUARE, S.SqNorms()])
        out = jax.tree.map(np.asarray, out)
    np.testing.assert_allclose(out[0], g.sum(0), rtol=1e-12)
    np.testing.assert_allclose(out[1].mean, g.mean(0), rtol=1e-12)
    np.testing.assert_allclose(out[1].m2, ((g - g.mean(0)) ** 2).sum(0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out[2], (g**2).sum(0), rtol=1e-12)
    np.testing.assert_allclose(out[3], (g**2).sum((1, 2)), rtol=1e-12)


def test_regrouping_bounds_the_shift_for_large_batches():
    """With one shift for all of B = 257 examples, a single non-zero first example
    loses about B-fold to rounding; groups re-centred on the running mean keep it
    within `MAX_SHIFT_AMPLIFICATION`."""
    B = 257
    G = np.zeros((B, 4000))
    G[0] = np.random.default_rng(1).normal(size=4000)
    truth = np.sum((G - G.mean(0)) ** 2, 0)
    out = _reduce(jnp.asarray(G, jnp.float32), 1, [S.Centered()])[0]
    eps = float(np.finfo(np.float32).eps)
    assert _rel(out.m2, truth) < 2 * S.MAX_SHIFT_AMPLIFICATION * 32 * eps


def _near_cancelling_dense(dtype):
    """A token-axis dense layer whose per-example gradients agree to 1e-3."""
    B, T, C, F = 9, 5, 6, 4
    rng = np.random.default_rng(3)
    x = rng.normal(size=(T, C)) + 1e-3 * rng.normal(size=(B, T, C))
    c = rng.normal(size=(T, F)) + 1e-3 * rng.normal(size=(B, T, F))
    w = rng.normal(size=(C, F))

    def loss(w, batch):
        xb, cb = batch
        return jnp.mean(jnp.sum((xb @ w) * cb, axis=(-2, -1)))

    return loss, jnp.asarray(w, dtype), (jnp.asarray(x, dtype), jnp.asarray(c, dtype))


def test_variance_near_cancellation_through_a_model():
    loss, w, batch = _near_cancelling_dense(jnp.float32)
    got = js.per_example_stat(loss, js.stats.variance())(w, batch)
    with x64():
        loss64, w64, batch64 = _near_cancelling_dense(jnp.float64)
        g = jax.jit(jax.vmap(jax.grad(loss64), in_axes=(None, 0)))(w64, batch64)
        ref = np.var(np.asarray(g), axis=0, ddof=1)
        got64 = js.per_example_stat(loss64, js.stats.variance())(w64, batch64)
    np.testing.assert_allclose(got64, ref, rtol=1e-9)
    # the spread is 1e-3 of the gradient: E[g^2] - E[g]^2 would keep no digit here
    np.testing.assert_allclose(got, ref, rtol=2e-2)


@pytest.mark.parametrize("features", [False, True])
@pytest.mark.parametrize("B,cs,tile", [(10, 3, 1), (12, 4, 2), (40, 13, 1), (9, 9, 5)])
def test_carried_chunks_match_the_whole_batch(B, cs, tile, features):
    """`reduce_tiles` with a `Carry` (api.py's chunks): sums of phi start from the
    running ones, centred sums continue `Shifted` sums against the first tile's mean;
    chunk by chunk they give the whole batch's values (float64), with or without
    feature blocks, and the plain sum derived from the carried mean."""
    shape = (5, 7)
    g = 3.0 + np.random.default_rng(B + cs).normal(size=(B,) + shape)
    reds = [S.SQUARE, S.Centered(), S.SUM, S.SqNorms(), S.SIGN]
    with x64():
        G = jnp.asarray(g)

        def run(Gc, carry):
            make = lambda b0, size: jax.lax.dynamic_slice_in_dim(Gc, b0, size, 0)  # noqa: E731
            feats = None
            if features:  # blocks of 3 on axis 1 (a remainder of 1)
                feats = (1, 3, lambda b0, size, cut: cuts.take(cut, make(b0, size), 2))
            return tiling.reduce_tiles(make, Gc.shape[0], reds, tile, shape=shape,
                                       dtype=Gc.dtype, features=feats, carry=carry)

        z = jnp.zeros(shape)
        acc = [z, reds[1].empty(shape, z.dtype), z, None, z]
        sq = []
        for b0 in range(0, B, cs):
            out = jax.jit(run)(G[b0 : b0 + cs], S.Carry(acc, jnp.asarray(b0, jnp.int32)))
            sq.append(out[3])
            acc = [None if isinstance(r, S.SqNorms) else o for r, o in zip(reds, out)]
        acc[1] = reds[1].finish(acc[1], B)
        acc[3] = jnp.concatenate(sq)
        ref = run(G, None)
        for r, a, b in zip(reds, acc, ref):
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-11,
                                           atol=1e-11, err_msg=repr(r))
    np.testing.assert_allclose(np.asarray(acc[1].m2), ((g - g.mean(0)) ** 2).sum(0), rtol=1e-10)


@pytest.mark.parametrize("chunk", [None, 4])
def test_token_site_variance_at_the_two_pass_accuracy_in_float32(chunk):
    """Issue 50: the variance at token-axis dense sites in float32 is as accurate as the
    per-example gradients themselves allow (float32 ``vmap(grad)`` then a two-pass
    variance, what BackPACK and Opacus do), at a batch of 32 on a transformer block:
    each tile's moments merged by Chan's rule, where a fixed shift's rounding grew with
    every example after it (3e-6 against 8e-7)."""
    from benchmarks import models

    m = models.transformer(T=32, d=64, V=512, layers=1, heads=4)
    p, b = m.params, m.make_batch(32)

    def per_ex(p, ex):
        return m.loss(p, jax.tree.map(lambda t: t[None], ex))

    with x64():
        p64 = jax.tree.map(lambda x: x.astype(jnp.float64), p)
        g64 = jax.jit(jax.vmap(jax.grad(per_ex), (None, 0)))(p64, b)
        ref = jax.tree.map(lambda g: np.var(np.asarray(g), axis=0, ddof=1), g64)
    with jax.default_matmul_precision("highest"):
        g32 = jax.jit(jax.vmap(jax.grad(per_ex), (None, 0)))(p, b)
        peer = jax.tree.map(lambda g: jnp.var(g, axis=0, ddof=1), g32)
        got = jax.jit(js.per_example_stat(m.loss, js.stats.variance(), chunk_size=chunk))(p, b)

    def err(x):
        return max(
            float(np.max(np.abs(np.asarray(a, np.float64) - r)) / np.max(np.abs(r)))
            for a, r in zip(jax.tree.leaves(x), jax.tree.leaves(ref))
        )

    assert err(got) <= max(1.5 * err(peer), 2e-6), (err(got), err(peer))

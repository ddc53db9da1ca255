"""One-pass centred sums in the tile loop (tiling.reduce_tiles without a mean).

Variance at token-axis sites takes one pass over the per-example products, shifted
by the running mean and re-centred in groups (Chan's rule), instead of contracting
the exact mean first. These tests hold it to the two-pass's accuracy on the inputs
where one-pass formulas fail: a mean far larger than the spread, a first example
that is an outlier (the shift), a single non-zero example, heavy tails; and check
the plain sum derived from it, odd batch and tile sizes, and a whole model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import x64

import jaxpr_surgery as js
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src import tiling


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
        g = jax.vmap(jax.grad(loss64), in_axes=(None, 0))(w64, batch64)
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
                feats = (1, 3, lambda b0, size, f0, fs: jax.lax.dynamic_slice_in_dim(
                    make(b0, size), f0, fs, 2))
            return tiling.reduce_tiles(make, Gc.shape[0], reds, tile, shape=shape,
                                       dtype=Gc.dtype, features=feats, carry=carry)

        z = jnp.zeros(shape)
        acc = [z, S.Shifted(z, z, z), z, None, z]
        sq = []
        for b0 in range(0, B, cs):
            out = jax.jit(run)(G[b0 : b0 + cs], S.Carry(acc, jnp.asarray(b0, jnp.int32)))
            sq.append(out[3])
            acc = [None if isinstance(r, S.SqNorms) else o for r, o in zip(reds, out)]
        acc[1] = S.shifted_moments(acc[1], B)
        acc[3] = jnp.concatenate(sq)
        ref = run(G, None)
        for r, a, b in zip(reds, acc, ref):
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-11,
                                           atol=1e-11, err_msg=repr(r))
    np.testing.assert_allclose(np.asarray(acc[1].m2), ((g - g.mean(0)) ** 2).sum(0), rtol=1e-10)

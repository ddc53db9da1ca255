"""chunk_size in {1, 3, B, None} (3 leaves a remainder with B = 8) gives the same
statistics (variance merged exactly with Chan's rule), per-example norms in
order, loss and aux."""

from __future__ import annotations

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery as js

CHUNKS = [None, M.B, 3, 1]


def _mlp_aux(p, b):
    # aux: a per-example quantity (the example's own loss) and a data leaf
    return M.mlp_loss(p, b), {"loss": M.mlp_loss(p, b), "y": b["y"]}


_cache: dict = {}


def _run(chunk):
    if chunk not in _cache:
        _, params, batch = M.get("mlp")
        vfn = js.value_and_per_example_stat(_mlp_aux, M.all_stats(), has_aux=True,
                                            chunk_size=chunk)
        _cache[chunk] = jax.jit(vfn)(params, batch)
    return _cache[chunk]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_mlp_every_statistic(chunk):
    loss, params, batch = M.get("mlp")
    (l, aux), out = _run(chunk)
    ora = M.oracle_of("mlp")
    per = jax.vmap(M.per_example_loss(loss), in_axes=(None, 0))(params, batch)
    np.testing.assert_allclose(l, jnp.mean(per), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(aux["loss"]), np.asarray(per), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(aux["y"])[:, 0], np.asarray(batch["y"]))
    for k in M.STAT_NAMES:
        M.assert_stat_close(k, out[k], ora[k])
    if chunk is not None:
        (l0, aux0), ref = _run(None)
        np.testing.assert_allclose(l, l0, rtol=1e-6)
        for k in M.STAT_NAMES:
            M.assert_consistent(k, out[k], ref[k], err_msg=f"chunk {chunk}")


def test_chunked_tied_embedding_with_remainder():
    """Multi-site (tied) embedding: its per-example gradients are materialised per chunk."""
    loss, params, batch = M.get("tied")
    names = ("mean", "second_moment", "variance", "sq_norms", "clipped_mean",
             "gradient_noise_scale")
    out = jax.jit(js.per_example_stat(loss, {k: M.STATS[k]() for k in names}, chunk_size=3))(
        params, batch)
    ora = M.oracle_of("tied")
    for k in names:
        M.assert_stat_close(k, out[k], ora[k])


def _shifted_loss(w, batch):
    # per-example gradient g_b = x_b exactly: large common value, small spread
    return jnp.mean(batch["x"] @ w)


@pytest.mark.parametrize("chunk", [None, 3, 1])
def test_chunked_variance_is_accurate_when_examples_agree(chunk):
    """E[g^2] - mean^2 would lose everything here in float32; Chan merging does not."""
    rng = np.random.default_rng(0)
    spread = rng.standard_normal((M.B, 4))
    x = (1000.0 + spread).astype(np.float32)
    w = jnp.zeros((4,), jnp.float32)
    stat = {"var": js.stats.variance(), "snr": js.stats.snr(),
            "gns": js.stats.gradient_noise_scale()}
    out = jax.jit(js.per_example_stat(_shifted_loss, stat, chunk_size=chunk))(w, {"x": x})
    xs = x.astype(np.float64)
    var = xs.var(0, ddof=1)
    np.testing.assert_allclose(out["var"], var, rtol=1e-3)
    np.testing.assert_allclose(out["snr"], np.square(xs.mean(0)) / var, rtol=1e-3)
    g2 = np.square(xs.mean(0)).sum() - var.sum() / M.B  # unbiased |G|^2
    np.testing.assert_allclose(out["gns"], var.sum() / g2, rtol=1e-3)


@pytest.mark.parametrize("chunk", [3, 1])
def test_chunked_float32_model_under_x64(chunk):
    """With ``jax_enable_x64`` on, a float32 model's centred sums stay float32 through
    the chunk loop: merging them by a traced chunk count must not promote them to
    float64 (once a scan-carry type error), and every statistic keeps its dtype."""
    import zoo

    loss, params, batch = M.get("mlp")
    stat = {"var": js.stats.variance(), "snr": js.stats.snr(),
            "gns": js.stats.gradient_noise_scale(), "mean": js.stats.mean()}
    with zoo.x64():
        out = jax.jit(js.per_example_stat(loss, stat, chunk_size=chunk))(params, batch)
        whole = jax.jit(js.per_example_stat(loss, stat))(params, batch)
    for k in stat:
        for a, b in zip(jax.tree.leaves(out[k]), jax.tree.leaves(whole[k])):
            assert a.dtype == b.dtype == jnp.float32, (k, a.dtype, b.dtype)
    ora = M.oracle_of("mlp")
    M.assert_stat_close("variance", out["var"], ora["variance"])
    M.assert_stat_close("mean", out["mean"], ora["mean"])
    np.testing.assert_allclose(out["gns"], whole["gns"], rtol=1e-4)


def test_chunked_variance_with_large_counts():
    """Chunks of 50000 examples: Chan's weight ``n_a n_b / n`` must not be formed as an
    int32 product of the traced counts (it overflowed past 2**31 and the variance came
    out negative, silently)."""
    cs = 50_000
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3 * cs, 2)).astype(np.float32)
    x[cs:] += 3.0  # later chunks' means differ: the merge's cross term matters
    w = jnp.asarray([0.5, -0.25], jnp.float32)
    stat = {"var": js.stats.variance(), "gns": js.stats.gradient_noise_scale()}
    out = jax.jit(js.per_example_stat(_shifted_loss, stat, chunk_size=cs))(w, {"x": x})
    whole = jax.jit(js.per_example_stat(_shifted_loss, stat))(w, {"x": x})
    np.testing.assert_allclose(out["var"], x.astype(np.float64).var(0, ddof=1), rtol=1e-4)
    np.testing.assert_allclose(out["gns"], whole["gns"], rtol=1e-4)


def test_chunk_larger_than_batch_is_one_chunk():
    loss, params, batch = M.get("mlp")
    out = jax.jit(js.per_example_stat(loss, js.stats.sq_norms(), chunk_size=10 * M.B))(
        params, batch)
    M.assert_stat_close("sq_norms", out, M.oracle_of("mlp")["sq_norms"])


@pytest.mark.parametrize("chunk", [1, 2, 3, 4])
def test_each_chunk_size_is_traced_once(chunk, monkeypatch):
    """Every full chunk runs in one loop body, traced once (the first continues running
    values at zero); a remainder is a second size."""
    from jaxpr_surgery._src import engine

    sizes = []
    run = engine.run

    def counting(plan, diff, ex, other, b, axes, carry=None, weights=None):
        sizes.append(b)
        return run(plan, diff, ex, other, b, axes, carry=carry, weights=weights)

    monkeypatch.setattr(engine, "run", counting)
    loss, params, batch = M.get("mlp")
    jax.jit(js.per_example_stat(loss, js.stats.variance(), chunk_size=chunk)).lower(
        params, batch
    )
    want = [chunk] + ([M.B % chunk] if M.B % chunk else [])
    assert sorted(sizes) == sorted(want), (sizes, want)


def _token_sum_loss(w, x):
    # x [B, 2, C] with x[:, 1] = 0 and w [C, 1]: two tokens (a tile-loop site), and
    # every example's gradient is its first token, x[b, 0]
    return jnp.mean(jnp.sum(x @ w, axis=(1, 2)))


_token_fns: dict = {}


@pytest.mark.parametrize("B", [100, 257])
def test_chunked_one_pass_variance_keeps_the_shift_bound(B):
    """Chunks continue the running one-pass centred sums against one shift (no merge
    per chunk), re-centred once the examples after the shift reach 31 times those it
    is the mean of. On the inputs that break one-pass formulas (a mean 1000 times the
    spread, an outlier or the only non-zero example first, heavy tails), float32
    chunks of 1, 3 and 7 stay within the bound of `MAX_SHIFT_AMPLIFICATION`, as the
    whole batch does (B = 257 with chunks of 1 re-centres at 32 examples)."""
    from test_variance_numerics import _cases, _rel

    from jaxpr_surgery._src import stats as S

    eps = float(np.finfo(np.float32).eps)
    bound = 2 * S.MAX_SHIFT_AMPLIFICATION * 32 * eps
    for name, G in _cases(B, n=500):
        truth = np.sum((G - G.mean(0)) ** 2, 0) / (B - 1)
        x = np.zeros((B, 2, G.shape[1]), np.float32)
        x[:, 0] = G
        w = jnp.zeros((G.shape[1], 1), jnp.float32)
        for cs in (None, 1, 3, 7):
            key = (B, cs)
            if key not in _token_fns:
                _token_fns[key] = jax.jit(
                    js.per_example_stat(_token_sum_loss, js.stats.variance(), chunk_size=cs)
                )
            got = np.asarray(_token_fns[key](w, jnp.asarray(x)))[:, 0]
            assert _rel(got, truth) < bound, (name, cs, _rel(got, truth))

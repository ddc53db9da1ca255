"""Feature blocks (``tiling.feature_tile``): one example's ``G`` cut along one axis.

Where one example's per-example gradient is large (a vocabulary-sized tied table),
the tile loop runs over blocks of features outside and examples inside. Real
models reach it only with big leaves, so the zoo runs here with the block size
shrunk to 100 bytes: many blocks, with remainders, on every token site.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from _models import assert_tree_close, oracle, per_example_grads
from conftest import REDUCTION_STAT_IDS, check_against_reference, reference, run_stat

import jaxpr_surgery as js
from jaxpr_surgery._src import cuts, tiling
from jaxpr_surgery._src import stats as S

pytestmark = pytest.mark.slow

# token-axis dense sites, tied tables, layers inside a scan
CASES = ["transformer", "transformer_rms_swiglu", "transformer_scan_remat"]


# every case in float64 (the tight tolerances), float32 on the first; one statistic per
# kind of reduction (conftest.REDUCTION_STAT_IDS: the blocks loop over reductions, and
# each case compiles them in tiny blocks: the suite's time)
@pytest.mark.parametrize(
    "case_name,dtype", [(c, "float64") for c in CASES] + [(CASES[0], "float32")])
def test_zoo_in_tiny_feature_blocks(blocks, case_name, dtype):
    ref = reference(case_name)
    case = zoo.get_case(case_name, dtype)
    out = run_stat(case, {sid: ref.stat(sid) for sid in REDUCTION_STAT_IDS})
    for sid in REDUCTION_STAT_IDS:
        check_against_reference(out[sid], case_name, sid, dtype)
    assert blocks, "no site was cut into feature blocks"
    assert any(shape[axis] % size for axis, size, shape in blocks), "no remainder block"


def _tied(V, d, T, B, dtype, seed=0):
    """A tied LM head: ``table[ids]`` in, ``h @ table.T`` out; ``V`` rows no block divides."""
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    params = {
        "table": (0.5 * jax.random.normal(k[0], (V, d))).astype(dtype),
        "w": (jax.random.normal(k[1], (d, d)) / np.sqrt(d)).astype(dtype),
    }
    batch = {
        "ids": jax.random.randint(k[2], (B, T), 0, V).astype(jnp.uint16),
        "y": jax.random.randint(k[3], (B, T), 0, V),
    }

    def loss(p, batch):
        h = jnp.tanh(p["table"][batch["ids"]] @ p["w"])
        logits = h @ p["table"].T
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))

    return loss, params, batch


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_tied_vocabulary_table_in_blocks_by_budget(dtype):
    """No monkeypatching: a tiny budget cuts a 3001-row tied table into blocks of
    `MIN_FEATURE_TILE_BYTES` (a remainder block included); every statistic of the
    table, and mean + second moment + variance in one call, match ``vmap(grad)``."""
    with zoo.x64() if dtype == jnp.float64 else jax.default_matmul_precision("highest"):
        loss, params, batch = _tied(3001, 64, 6, 5, dtype)
        ft = tiling.feature_tile((3001, 64), dtype, (0, 1), 1)
        assert ft is not None and 3001 % ft[1] and ft[0] == 0
        ref = oracle(loss, params, batch)
        tol = dict(rtol=1e-9, atol=1e-11) if dtype == jnp.float64 else dict(rtol=2e-4, atol=2e-5)
        stats = {
            "mean": js.stats.mean(),
            "second_moment": js.stats.second_moment(),
            "variance": js.stats.variance(),
            "sign_mean": js.stats.sign_mean(),
            "sq_norms": js.stats.sq_norms(),
        }
        for budget in (1, None):
            out = jax.jit(js.per_example_stat(loss, stats, memory_budget_bytes=budget))(
                params, batch
            )
            for name in stats:
                assert_tree_close(out[name], ref[name], err_msg=f"{name} budget={budget}", **tol)
        for combo in [("mean", "second_moment"), ("mean", "variance", "second_moment")]:
            out = jax.jit(
                js.per_example_stat(loss, tuple(stats[n] for n in combo), memory_budget_bytes=1)
            )(params, batch)
            for name, v in zip(combo, out):
                assert_tree_close(v, ref[name], err_msg=f"{name} in {combo}", **tol)


def test_explain_reports_feature_blocks():
    loss, params, batch = _tied(3001, 64, 6, 5, jnp.float32)
    rep = js.explain(loss, js.stats.second_moment(), memory_budget_bytes=1)(params, batch)
    assert "x 1001 of 3001 on axis 0/tile" in str(rep), str(rep)


def test_feature_tile_sizes():
    f32 = jnp.float32
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiling, "prefer_per_example", lambda: True)
        assert tiling.feature_tile((64, 64), f32, (0, 1), None) is None  # 16 KiB: whole
        axis, size = tiling.feature_tile((256, 8192), f32, (0, 1), None)  # 8 MiB
        assert axis == 1 and size * 256 * 4 <= tiling.CACHE_TILE_BYTES
        assert tiling.feature_tile((256, 8192), f32, (0,), None)[0] == 0  # only axis 0 cuts
        assert tiling.feature_tile((256, 8192), f32, (), None) is None
        # a budget below the cache size shrinks blocks, never below the minimum
        assert tiling.feature_tile((256, 8192), f32, (1,), 1) == (1, 256)  # 256 KiB blocks
        # a block count that divides the axis where one is near: no remainder block
        # (GPT-2's MLP weight: 5 blocks of 615 by the budget, 6 of 512 instead)
        assert tiling.feature_tile((3072, 768), f32, (0, 1), None) == (0, 512)
        assert tiling.feature_tile((50304, 768), f32, (0, 1), None) == (0, 524)
        mp.setattr(tiling, "DIVISOR_BLOCKS_FACTOR", 1)
        assert tiling.feature_tile((3072, 768), f32, (0, 1), None) == (0, 615)
        mp.setattr(tiling, "prefer_per_example", lambda: False)  # GPU: only over budget
        assert tiling.feature_tile((256, 8192), f32, (1,), None) is None
        assert tiling.feature_tile((256, 8192), f32, (1,), 1 << 20)[1] == 1024


def test_feature_tiles_under_a_device_split():
    """Under a batch split by device one example's ``G`` up to `SPLIT_TILE_BYTES` is
    whole, not in cache-sized blocks: each block is combined across the devices as it
    finishes, and where XLA splits a layer's backward pass over features the loop
    regathers an example's input every block (the scan stack of shard_check.py at
    d 1024 under FSDP: the variance 1.75x -> 1.28x grad's collective bytes). A larger
    ``G`` keeps cache-sized blocks, and so does the kurtosis (many arrays per block, held
    for several parts at once); a smaller budget still bounds them."""
    f32 = jnp.float32
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiling, "prefer_per_example", lambda: True)
        shape = (1024, 4096)  # 16 MiB: cache-sized blocks of 2 MiB on one device
        assert tiling.feature_tile(shape, f32, (0, 1), None) == (1, 512)
        with cuts.split_over(8):
            assert tiling.feature_tile(shape, f32, (0, 1), None) is None  # whole
            assert tiling.feature_tile((1024, 16384), f32, (0, 1), None) == (1, 512)
            assert tiling.feature_tile(shape, f32, (0, 1), 1 << 20) == (1, 256)
            # (reductions of many arrays per block keep them: `blocks_under_split`)
            assert tiling.feature_tile(shape, f32, (0, 1), None,
                                       whole_under_split=False) == (1, 512)


def test_reduce_tiles_blocks_equal_whole():
    """The block loop against the one-tile loop on a random ``G``, every built-in
    reduction at once, with remainders on both loops."""
    with zoo.x64():
        B, shape = 7, (5, 13)
        G = jax.random.normal(jax.random.PRNGKey(1), (B,) + shape, jnp.float64) + 3.0
        mean = jnp.mean(G, 0)
        reds = [S.SQUARE, S.SIGN, S.SUM, S.Centered(), S.SqNorms(), S.CenteredAbout(mean)]
        make = lambda b0, n: jax.lax.dynamic_slice_in_dim(G, b0, n, 0)  # noqa: E731

        def make_f(b0, n, cut):
            return cuts.take(cut, make(b0, n), 2)

        whole = tiling.reduce_tiles(make, B, reds, 3, shape=shape, dtype=G.dtype)
        cut = tiling.reduce_tiles(
            make, B, reds, 2, shape=shape, dtype=G.dtype, features=(1, 4, make_f)
        )
        for w, c in zip(jax.tree.leaves(whole), jax.tree.leaves(cut)):
            np.testing.assert_allclose(np.asarray(c), np.asarray(w), rtol=1e-12)
        np.testing.assert_allclose(
            np.asarray(cut[5].m2), np.asarray(jnp.sum(jnp.square(G - mean), 0)), rtol=1e-12
        )


@pytest.mark.parametrize("nd,n", [(2, 12), (4, 16), (3, 13)])
def test_strided_blocks_equal_whole(nd, n):
    """Under a batch split over ``nd`` devices (devices.py) the blocks are strided
    (cuts.py): every built-in reduction equals the one-tile loop's; an axis no strided
    count fits (13: prime) runs whole."""
    with zoo.x64():
        B, shape = 5, (3, n)
        G = jax.random.normal(jax.random.PRNGKey(2), (B,) + shape, jnp.float64) - 2.0
        mean = jnp.mean(G, 0)
        reds = [S.SQUARE, S.SIGN, S.SUM, S.Centered(), S.SqNorms(), S.CenteredAbout(mean)]
        make = lambda b0, k: jax.lax.dynamic_slice_in_dim(G, b0, k, 0)  # noqa: E731
        seen = []

        def make_f(b0, k, cut):
            seen.append(cut)
            return cuts.take(cut, make(b0, k), 2)

        whole = tiling.reduce_tiles(make, B, reds, 3, shape=shape, dtype=G.dtype)
        with cuts.split_over(nd):
            cut = tiling.reduce_tiles(
                make, B, reds, 1, shape=shape, dtype=G.dtype, features=(1, 4, make_f)
            )
        for w, c in zip(jax.tree.leaves(whole), jax.tree.leaves(cut)):
            np.testing.assert_allclose(np.asarray(c), np.asarray(w), rtol=1e-12)
        if n % nd:
            assert not seen
        else:
            assert seen and all(isinstance(c, cuts.Strided) and c.size % nd == 0 for c in seen)


@pytest.mark.parametrize("features", [False, True])
def test_split_values_are_shares_of_the_whole_batch(features):
    """Under a batch split by device (devices.py: ``vmap`` over the parts) a finished value
    is combined across the parts at once, as each part's share
    (`Reduction.combined_share`): the same on every part (a block loop then holds one
    accumulator for every part, as grad holds one gradient), and combined at the end
    (`combine_axis`) it is the whole batch's, as each part's own value is. Before, a
    part kept its own values of every leaf to the end: per-device temporary memory
    1.5-3x grad's under FSDP (benchmarks/shard_bench.py). Within `own_values` (a chunk
    of a chunk loop) values stay the part's own."""
    from jaxpr_surgery._src import stats_research as R

    with zoo.x64():
        D, b, shape = 4, 3, (3, 8)  # 4 parts of 3 examples; 8 features (strided blocks of 4)
        G = jax.random.normal(jax.random.PRNGKey(5), (D, b) + shape, jnp.float64) * 2 + 1.5
        reds = [S.SQUARE, S.SIGN, S.SUM, S.Centered(), R.CentralMoments()]
        whole = [r.from_examples(G.reshape((D * b,) + shape)) for r in reds]

        def part(g, own):
            make = lambda b0, k: jax.lax.dynamic_slice_in_dim(g, b0, k, 0)  # noqa: E731
            feats = (1, 4, lambda b0, k, cut: cuts.take(cut, make(b0, k), 2)) if features else None
            with cuts.split_over(D, "p"), cuts.own_values(own):
                vals = tiling.reduce_tiles(make, b, reds, 2, shape=shape, dtype=g.dtype,
                                           features=feats)
            return vals, [r.combine_axis(v, b, D * b, "p") for r, v in zip(reds, vals)]

        for own in (False, True):
            vals, combined = jax.vmap(lambda g, own=own: part(g, own), axis_name="p")(G)
            for r, v, c, w in zip(reds, vals, combined, whole):
                for vx, cx, wx in zip(jax.tree.leaves(v), jax.tree.leaves(c), jax.tree.leaves(w)):
                    np.testing.assert_allclose(np.asarray(cx[0]), np.asarray(wx), rtol=1e-12,
                                               atol=1e-12, err_msg=repr(r))
                    same = bool(jnp.all(vx == vx[:1]))
                    assert same != own, (r, own)  # (shares alike; own values differ)


def test_a_subclass_combining_its_own_way_is_not_shared():
    """A reduction whose class overrides `combine_axis` but not `combined_share` (its
    parent's share would not be its combination's) is combined at the end only."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, eq=False)
    class MaxOverDevices(type(S.SQUARE)):
        def combine_axis(self, value, n_local, N, axis_name):
            return jax.lax.pmax(value, axis_name)

    r = MaxOverDevices(**{f.name: getattr(S.SQUARE, f.name)
                          for f in dataclasses.fields(S.SQUARE)})
    assert S.combined_share(r, jnp.ones(3), 2, "p", 4) is None
    got = jax.vmap(lambda v: S.combined_share(S.SQUARE, v, 2, "p", 4), axis_name="p")(
        jnp.arange(4.0))
    np.testing.assert_allclose(got, [1.5] * 4)  # (psum 6, a quarter each)


def test_any_part_takes_every_part():
    """`cuts.any_part`: a flag of one part is every part's under the split (a
    ``lax.cond`` on it takes one branch for all, and stays a cond under ``vmap``)."""
    flags = jnp.array([False, True, False])
    with cuts.split_over(3, "p"):
        got = jax.vmap(cuts.any_part, axis_name="p")(flags)
    np.testing.assert_array_equal(got, [True, True, True])
    np.testing.assert_array_equal(jax.vmap(cuts.any_part, axis_name="p")(flags), flags)


def test_strided_rows_of_a_table():
    """An embedding's ids in a strided block of rows: their place in it, ``size`` (dropped)
    outside; `cuts.put` puts a block's values back where `cuts.take` read them, into an
    accumulator in `cuts.layout` (updated in place), `cuts.merged` as the value."""
    ids = jnp.arange(12)
    c = cuts.Strided(0, 1, 4, 3)  # rows 1, 4, 7, 10
    np.testing.assert_array_equal(cuts.rows(c, ids),
                                  [4, 0, 4, 4, 1, 4, 4, 2, 4, 4, 3, 4])
    x = jnp.arange(24.0).reshape(2, 12)
    np.testing.assert_array_equal(cuts.take(c, x, 1), x[:, 1::3])
    assert cuts.layout(c, x.shape, 1) == (2, 4, 3)
    back = cuts.merged(c, cuts.put(c, jnp.zeros((2, 4, 3)), cuts.take(c, x, 1), 1), 1)
    assert back.shape == x.shape
    np.testing.assert_array_equal(back[:, 1::3], x[:, 1::3])
    assert float(jnp.sum(back)) == float(jnp.sum(x[:, 1::3]))


@pytest.mark.parametrize("T", [256, 32])
def test_cache_sized_blocks_where_they_pay(monkeypatch, T):
    """On CPU one example's G above `CACHE_TILE_BYTES` (here 8 MiB) is cut into
    cache-sized blocks for a reduction that passes over each block several times (the
    variance's mean and m2), and for any where G is cheap to produce (fewer than
    `WHOLE_G_MIN_TOKENS` tokens). A long sequence's single-pass reductions (E[g^2],
    E[sign g]) ran no faster so (T=256, d=768) and each block loop is one
    more loop for XLA to compile: within the memory budget they take G whole; above it,
    budget-sized blocks still. Values against vmap(grad) in float64."""
    from jaxpr_surgery._src import tiling

    monkeypatch.setattr(tiling, "prefer_per_example", lambda: True)
    seen = []
    inner = tiling._feature_blocks

    def spy(features, *rest):
        seen.append(features[1])
        return inner(features, *rest)

    monkeypatch.setattr(tiling, "_feature_blocks", spy)
    d, B = 1024, 3
    few = T < tiling.WHOLE_G_MIN_TOKENS
    with zoo.x64():
        k = jax.random.split(jax.random.PRNGKey(7), 3)
        params = {"w": jax.random.normal(k[0], (d, d), jnp.float64) / np.sqrt(d)}
        batch = {"x": jax.random.normal(k[1], (B, T, d), jnp.float64),
                 "y": jax.random.normal(k[2], (B, T, d), jnp.float64)}

        def loss(p, b):
            return jnp.mean(jnp.sum(jnp.tanh(b["x"] @ p["w"]) * b["y"], (-2, -1)))

        g = np.asarray(per_example_grads(loss, params, batch)["w"])  # [B, d, d]
        want = {"second_moment": np.mean(g**2, 0), "sign_mean": np.mean(np.sign(g), 0),
                "sq_norms": np.sum(g**2, (1, 2)), "variance": np.var(g, 0, ddof=1)}
        for name, blocked in (("second_moment", few), ("sign_mean", few),
                              ("sq_norms", False), ("variance", True)):  # (sq_norms: ghost)
            seen.clear()
            f = js.per_example_stat(loss, getattr(js.stats, name)(), chunk_size=None)
            got = f(params, batch)
            got = got if name == "sq_norms" else got["w"]  # (sq_norms: over every leaf)
            np.testing.assert_allclose(got, want[name], rtol=1e-10, atol=1e-12, err_msg=name)
            assert bool(seen) == blocked, (name, seen)  # 8 MiB G: blocks of 2 MiB or none
            if blocked:
                assert all(s * d * 8 <= tiling.CACHE_TILE_BYTES for s in seen), seen
        # one decision per call: with the variance in the same call, E[g^2] shares its
        # blocks, and explain says so for both (its rules are the engine's)
        seen.clear()
        pair = (js.stats.second_moment(), js.stats.variance())
        got = js.per_example_stat(loss, pair, chunk_size=None)(params, batch)
        np.testing.assert_allclose(got[0]["w"], want["second_moment"], rtol=1e-10, atol=1e-12)
        assert seen, "no feature blocks with the variance in the call"
        for stats in (pair, (js.stats.second_moment(),)):
            hows = js.explain(loss, stats, chunk_size=None)(params, batch).leaves[0].hows
            cut = {n: f"of {d} on axis" in h for n, h in hows.items()}
            assert cut == {n: few or len(stats) > 1 for n in hows}, hows
        # above the budget, single-pass reductions are cut too (budget-sized blocks)
        seen.clear()
        f = js.per_example_stat(loss, js.stats.second_moment(), chunk_size=None,
                                memory_budget_bytes=3 << 20)
        np.testing.assert_allclose(f(params, batch)["w"], want["second_moment"], rtol=1e-10)
        assert seen and all(s * d * 8 <= 3 << 20 for s in seen), seen


@pytest.mark.parametrize("nd", [1, 4])
def test_example_norm_in_blocks_strided_or_not(nd):
    """One example's norm in feature blocks (the recompute of a flagged example), past
    float32's range of squares: contiguous blocks (the last shifted back), or strided
    ones under a batch split over ``nd`` devices (cuts.py); both the exact norm."""
    from jaxpr_surgery._src import norms

    g = np.random.default_rng(nd).normal(size=(1, 3, 24)).astype(np.float32) * 1e30
    seen = []

    def make(cut):
        seen.append(cut)
        return jnp.asarray(g) if cut is None else cuts.take(cut, jnp.asarray(g), 2)

    with cuts.split_over(nd):
        got = float(norms.example_norm(make, (1, 5, 24)))
    np.testing.assert_allclose(got, np.linalg.norm(g.astype(np.float64)), rtol=1e-6)
    assert all(isinstance(c, cuts.Strided) == (nd > 1) for c in seen if c is not None)


def test_example_norm_in_blocks_inside_shard_map():
    """Inside shard_map the blocks of an example's ``G`` vary over the batch's axis: the
    loop's running norm starts varying like them (it started invariant, and jax refused
    the loop: a hand-written FSDP scan stack's clipped mean raised at trace time)."""
    from jaxpr_surgery._src import norms

    g = np.random.default_rng(3).normal(size=(2, 3, 24)).astype(np.float32)
    mesh = jax.make_mesh((1,), ("i",))

    def one(x):  # (x [1, 3, 24]: varies over "i")
        return norms.example_norm(lambda cut: cuts.take(cut, x, 2), (1, 5, 24))[None]

    P = jax.sharding.PartitionSpec
    x = jax.device_put(jnp.asarray(g[:1]), jax.sharding.NamedSharding(mesh, P("i")))
    got = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)
    np.testing.assert_allclose(float(got[0]), np.linalg.norm(g[0].astype(np.float64)),
                               rtol=1e-6)

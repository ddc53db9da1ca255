"""Convolutions as dense sites over patches formed a tile at a time (sites/conv.py).

Every ungrouped convolution keeps its input, never the whole batch's patches: the
tile loop pads and slices the patches of one tile of examples. These tests hold
every statistic to ``vmap(grad)`` over layouts, strides, rhs and lhs dilation,
negative and asymmetric padding, 1-D/2-D/3-D convs, a conv batch dim that is not
leading, batched tiles with remainders (the GPU path), feature blocks, B = 1,
float64 (tight) and float32, and check that the compiled program's memory does
not grow like the batch's patches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from _models import x64

import jaxpr_surgery as js
from jaxpr_surgery._src import tiling

C_CLIP = 0.3


def _grads(loss, w, batch):
    one = lambda w, ex: loss(w, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    return jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0)))(w, batch)


# (lhs, rhs, out) layouts, x shape without B, w shape, strides, padding, lhs/rhs dilation
CONVS = {
    "2d_nhwc_same": (
        ("NHWC", "HWIO", "NHWC"), (9, 7, 3), (3, 3, 3, 5), (1, 1), "SAME", (1, 1), (1, 1),
    ),
    "2d_nchw_strided_dilated": (
        ("NCHW", "OIHW", "NCHW"), (3, 11, 9), (4, 3, 3, 2), (2, 3), ((2, 1), (0, 2)),
        (1, 1), (2, 1),
    ),
    "2d_transposed_negative_pad": (
        ("NHWC", "HWIO", "NHWC"), (5, 6, 2), (3, 2, 2, 3), (1, 1), ((1, -1), (0, 1)),
        (2, 2), (1, 1),
    ),
    # the conv's batch dim last in the input and the feature dim first in the output
    "2d_batch_not_leading": (
        ("HWCN", "OHWI", "CHWN"), (8, 6, 2), (4, 3, 2, 2), (1, 2), "VALID", (1, 1), (1, 1),
    ),
    "1d_nwc": (("NWC", "WIO", "NWC"), (13, 3), (4, 3, 6), (2,), "SAME", (1,), (2,)),
    "3d_ndhwc": (("NDHWC", "DHWIO", "NDHWC"), (4, 5, 4, 2), (2, 3, 2, 2, 3), (1, 2, 1), "SAME",
                 (1, 1, 1), (1, 1, 1)),
}


def _case(name, B, dtype, seed=0):
    dn, xs, ws, strides, pad, ldil, rdil = CONVS[name]
    r = np.random.default_rng(seed)
    n_at = dn[0].index("N")  # where the conv's batch dim goes (x holds the other dims)
    x = jnp.asarray(r.standard_normal((B,) + xs), dtype)
    w = jnp.asarray(r.standard_normal(ws) * 0.4, dtype)
    y = jnp.asarray(r.standard_normal((B,)), dtype)

    def loss(w, batch):
        xb = jnp.moveaxis(batch["x"], 0, n_at)
        out = jax.lax.conv_general_dilated(
            xb, w, strides, pad, lhs_dilation=ldil, rhs_dilation=rdil, dimension_numbers=dn
        )
        n_out = dn[2].index("N")
        h = jnp.moveaxis(jnp.tanh(out), n_out, 0)
        h = h.reshape(h.shape[0], -1)
        return jnp.mean((jnp.sum(h, axis=1) * 0.3 - batch["y"]) ** 2)

    return loss, w, {"x": x, "y": y}


STATS = {
    "mean": js.stats.mean(),
    "second_moment": js.stats.second_moment(),
    "variance": js.stats.variance(),
    "sign_mean": js.stats.sign_mean(),
    "sq_norms": js.stats.sq_norms(),
    "clipped_mean": js.stats.clipped_mean(C_CLIP),
    "kron": js.stats.kron_moments(max_dim=4),
}


def _expect(g, name):
    B = g.shape[0]
    n2 = jnp.sum(g.reshape(B, -1) ** 2, axis=1)
    if name == "mean":
        return g.mean(0)
    if name == "second_moment":
        return (g**2).mean(0)
    if name == "variance":
        return g.var(0, ddof=1)
    if name == "sign_mean":
        return jnp.sign(g).mean(0)
    if name == "sq_norms":
        return n2
    if name == "clipped_mean":
        c = jnp.minimum(1.0, C_CLIP / jnp.sqrt(n2))
        return (g * c.reshape((B,) + (1,) * (g.ndim - 1))).mean(0)
    out = []  # kron_moments, max_dim=4
    for j in range(1, g.ndim):
        u = jnp.moveaxis(g, j, 1).reshape(B, g.shape[j], -1)
        m = jnp.einsum("bir,bjr->ij", u, u) / B
        out.append(m if g.shape[j] <= 4 else jnp.diagonal(m))
    return tuple(out)


def _check(name, B, dtype, rtol, atol, stats=STATS, **options):
    loss, w, batch = _case(name, B, dtype)
    out = jax.jit(js.per_example_stat(loss, stats, **options))(w, batch)
    g = _grads(loss, w, batch)
    assert float(jnp.max(jnp.abs(g))) > 0
    for k in stats:
        jax.tree.map(
            lambda a, e, k=k: np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=k),
            out[k], _expect(g, k),
        )
    rep = js.explain(loss)(w, batch)
    assert rep.leaves[0].kinds == ["conv"] and rep.leaves[0].rule == "streamed", str(rep)


@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_oracle_float64(name):
    with x64():
        _check(name, 5, jnp.float64, 1e-9, 1e-12)


@pytest.mark.parametrize("name", ["2d_nchw_strided_dilated", "2d_transposed_negative_pad"])
def test_conv_oracle_float32(name):
    _check(name, 6, jnp.float32, 2e-4, 1e-5)


def test_conv_single_example():
    """B = 1: every statistic but the variance (undefined there, an error by contract)."""
    with x64():
        stats = {k: v for k, v in STATS.items() if k != "variance"}
        _check("2d_nhwc_same", 1, jnp.float64, 1e-9, 1e-12, stats=stats)


@pytest.mark.parametrize("name", ["2d_nhwc_same", "2d_batch_not_leading", "3d_ndhwc"])
def test_conv_batched_tiles_with_remainder(monkeypatch, name):
    """The GPU path: several examples per tile (a batched product of stacked patches),
    B = 7 that the tile of 3 does not divide."""
    monkeypatch.setattr(tiling, "prefer_per_example", lambda: False)
    from jaxpr_surgery._src.sites import conv

    k_bytes = []
    inner = conv.PatchConvKernel.tile_bytes_per_example
    monkeypatch.setattr(
        conv.PatchConvKernel, "tile_bytes_per_example",
        lambda self: k_bytes.append(inner(self)) or inner(self),
    )
    with x64():  # a budget of 3 examples' tiles (float64, as checked below)
        loss, w, b = _case(name, 7, jnp.float64)
        jax.eval_shape(js.per_example_stat(loss, js.stats.second_moment()), w, b)
    budget = 3 * k_bytes[0]
    tiles = []
    inner_reduce = tiling.reduce_tiles

    def spy(make, B, reds, tile, **kw):
        tiles.append(tile)
        return inner_reduce(make, B, reds, tile, **kw)

    monkeypatch.setattr(tiling, "reduce_tiles", spy)
    with x64():
        _check(name, 7, jnp.float64, 1e-9, 1e-12, memory_budget_bytes=budget)
    assert 3 in tiles, tiles


def test_conv_feature_blocks(blocks, monkeypatch):
    """Blocks of output channels (one example's G cut on C_out), with a remainder: G of
    27 x 5 float64 (1080 bytes) in blocks of about 600 bytes is 3 + 2 channels."""
    monkeypatch.setattr(tiling, "CACHE_TILE_BYTES", 600)
    with x64():
        _check("2d_nhwc_same", 5, jnp.float64, 1e-9, 1e-12)
    assert blocks and all(axis == 2 for axis, _, _ in blocks), blocks
    assert any(shape[axis] % size for axis, size, shape in blocks), "no remainder block"


def test_conv_memory_is_one_tile_of_patches():
    """E[g^2] of an early layer (many positions, one channel in, 9x the input in
    patches): compiled temp memory stays near grad's, far below the batch's patches."""
    B, S = 64, 32
    r = np.random.default_rng(1)
    x = jnp.asarray(r.standard_normal((B, S, S, 1)), jnp.float32)
    w = jnp.asarray(r.standard_normal((3, 3, 1, 8)) * 0.3, jnp.float32)

    def loss(w, b):
        y = jax.lax.conv_general_dilated(b["x"], w, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(jnp.sum(jnp.tanh(y) ** 2, axis=(1, 2, 3)))

    batch = {"x": x}
    patches_bytes = B * S * S * 9 * 4
    grad_mem = jax.jit(jax.grad(loss)).lower(w, batch).compile().memory_analysis()
    js_mem = (
        jax.jit(js.per_example_stat(loss, js.stats.second_moment())).lower(w, batch).compile()
        .memory_analysis()
    )
    extra = js_mem.temp_size_in_bytes - grad_mem.temp_size_in_bytes
    assert extra < patches_bytes / 4, (extra, patches_bytes)


# --------------------------------------------------------------------------- #
# Convolutions as dense sites: strides, dilation, padding, layouts, groups
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("cfg", [
    dict(dn=("NHWC", "HWIO", "NHWC"), strides=(1, 1), pad="SAME", rdil=(1, 1), groups=1),
    dict(dn=("NCHW", "OIHW", "NCHW"), strides=(2, 1), pad=((1, 0), (2, 1)), rdil=(1, 2),
         groups=1),
    dict(dn=("NHWC", "HWIO", "NHWC"), strides=(3, 2), pad="SAME", rdil=(1, 1), groups=1,
         cout=48),
    dict(dn=("NHWC", "HWIO", "NHWC"), strides=(1, 1), pad="VALID", rdil=(1, 1), groups=2),
])
def test_conv_statistics_match_oracle(cfg):
    def run():
        r = np.random.default_rng(6)
        nhwc = cfg["dn"][0] == "NHWC"
        x = r.standard_normal((5, 7, 6, 4) if nhwc else (5, 4, 7, 6))
        co = cfg.get("cout", 6)
        w = r.standard_normal((3, 2, 4 // cfg["groups"], co) if nhwc else (co, 4, 3, 2)) * 0.3

        def loss(w, b):
            y = jax.lax.conv_general_dilated(
                b["x"], w, cfg["strides"], cfg["pad"], rhs_dilation=cfg["rdil"],
                dimension_numbers=cfg["dn"], feature_group_count=cfg["groups"])
            return jnp.mean(jnp.sum(jnp.tanh(y) ** 2, axis=(1, 2, 3)))

        w64, b64 = jnp.asarray(w), {"x": jnp.asarray(x)}
        stats = (js.stats.mean(), js.stats.second_moment(), js.stats.variance(),
                 js.stats.sq_norms(), js.stats.clipped_mean(0.5))
        out = jax.jit(js.per_example_stat(loss, stats))(w64, b64)
        g = zoo.vmap_grads(loss, w64, b64)
        o = zoo.oracle_from_grads
        ref = (o(g, "mean"), o(g, "second_moment"), o(g, "variance"), o(g, "sq_norms"),
               o(g, "clipped_mean", clip_norm=0.5))
        for a, e in zip(out, ref, strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-12)
        rep = js.explain(loss)(w64, b64)
        assert rep.leaves[0].kinds == ["conv"]
        # patches per tile (streamed) for every ungrouped conv; grouped convs keep the
        # exact per-example VJP
        patches = cfg["groups"] == 1
        assert rep.leaves[0].rule == ("streamed" if patches else "materialised"), str(rep)

    zoo.in_x64(run)

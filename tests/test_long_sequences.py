"""Long sequences (``T`` several times the width): every statistic of a small GPT-style
model against ``jax.vmap(jax.grad(per-example loss))``, and the cost model that picks
each site's form of the per-example norms (ghost form or per-example products; a tied
table's own norms and cross terms or tiles of its summed gradient).

The model has ``T = 64`` tokens at width ``d = 16`` and a 512-row tied table: there the
ghost form of the output projection costs ``2 T^2 (d + V)`` FLOPs an example against
``2 T d V`` for its products, so the cost model takes the products, where the former
memory rule (``2 T^2 <= d V``) took the ghost form. Attention weights carry head axes
(per-head ``[d, H, k]`` and ``[H, k, d]`` projections, and a ``[H, k, k]`` weight whose
head axis is a dot batch dim shared with the data). Checked in float64 (tight) and
float32, at ``B = 1`` and at sizes no tile divides (``B = 3``, ``T = 67``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import assert_stat_close, per_example_grads, stats_of_grads, x64

import jaxpr_surgery as js
from jaxpr_surgery._src.sites import dense as dense_mod
from jaxpr_surgery._src.sites.base import Candidate, cheapest

D, H, V = 16, 2, 512
K = D // H
CLIP = 0.05  # below most examples' norms: clipping is active


def _ln(x, g, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g + b


def long_loss(p, batch):
    """Pre-LN block: per-head q/k/v ``[d, H, k]``, a per-head mixing weight ``[H, k, k]``
    (head axis a dot batch dim), output ``[H, k, d]``, a GELU MLP, tied unembedding."""
    tok = batch["tok"]
    T = tok.shape[1]
    x = p["emb"][tok] + p["pos"][:T][None]
    h = _ln(x, p["ln1_g"], p["ln1_b"])
    q = jnp.einsum("btd,dhk->bhtk", h, p["wq"])
    k = jnp.einsum("btd,dhk->bhtk", h, p["wk"])
    v = jnp.einsum("btd,dhk->bhtk", h, p["wv"])
    v = jnp.einsum("bhtk,hkj->bhtj", v, p["mix"])  # per-head weight: dot batch dim h
    a = jnp.einsum("bhtk,bhsk->bhts", q, k) / np.sqrt(K)
    mask = jnp.tril(jnp.ones((T, T), bool))
    a = jax.nn.softmax(jnp.where(mask, a, -1e9), -1)
    o = jnp.einsum("bhts,bhsk->bthk", a, v)
    x = x + jnp.einsum("bthk,hkd->btd", o, p["wo"]) + p["bo"]
    h = _ln(x, p["ln2_g"], p["ln2_b"])
    x = x + jax.nn.gelu(h @ p["fc"]) @ p["out"]
    z = _ln(x, p["lnf_g"], p["lnf_b"]) @ p["emb"].T
    logp = jax.nn.log_softmax(z)
    return -jnp.mean(jnp.take_along_axis(logp, batch["tgt"][..., None], -1))


def make_long(B=3, T=64, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)

    def n(*s, scale=0.3):
        return jnp.asarray(r.normal(size=s) * scale, dtype)

    p = {
        "emb": n(V, D), "pos": n(T, D, scale=0.1),
        "ln1_g": 1 + n(D, scale=0.1), "ln1_b": n(D, scale=0.1),
        "ln2_g": 1 + n(D, scale=0.1), "ln2_b": n(D, scale=0.1),
        "lnf_g": 1 + n(D, scale=0.1), "lnf_b": n(D, scale=0.1),
        "wq": n(D, H, K), "wk": n(D, H, K), "wv": n(D, H, K), "mix": n(H, K, K),
        "wo": n(H, K, D), "bo": n(D, scale=0.1), "fc": n(D, 4 * D), "out": n(4 * D, D),
    }
    batch = {"tok": jnp.asarray(r.integers(0, V, (B, T)), jnp.int32),
             "tgt": jnp.asarray(r.integers(0, V, (B, T)), jnp.int32)}
    return p, batch


NAMES = ("mean", "second_moment", "variance", "sign_mean", "sq_norms", "clipped_mean")


def _stats(B):
    out = {
        "mean": js.stats.mean(), "second_moment": js.stats.second_moment(),
        "sign_mean": js.stats.sign_mean(), "sq_norms": js.stats.sq_norms(),
        "clipped_mean": js.stats.clipped_mean(CLIP),
    }
    if B > 1:
        out["variance"] = js.stats.variance()
    return out


def _check(B, T, dtype, rtol, atol, stats=None):
    p, batch = make_long(B, T, dtype)
    stats = stats or _stats(B)
    got = jax.jit(js.per_example_stat(long_loss, stats))(p, batch)
    g = jax.jit(per_example_grads, static_argnums=0)(long_loss, p, batch)
    want = stats_of_grads(g, clip_norm=CLIP)
    for name in stats:
        if name == "sign_mean":  # a sign flip where an entry is within rounding of 0
            a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(got[name])])
            e = np.concatenate([np.ravel(x) for x in jax.tree.leaves(want[name])])
            off = np.abs(a - e) > 1e-6
            assert np.all(np.abs(a - e)[off] <= 2 / B + 1e-6), name
            assert off.sum() <= 0.01 * a.size, f"sign_mean: {off.sum()} of {a.size} differ"
            continue
        assert_stat_close(name, got[name], want[name], rtol=rtol, atol=atol)
    # the norms are active in the clipped mean (not every example within the bound)
    assert np.sum(np.asarray(want["sq_norms"]) > CLIP**2) >= 1


@pytest.mark.parametrize("B,T", [(3, 64), (1, 64), (2, 67)])
def test_oracle_float64(B, T):
    with x64():
        _check(B, T, jnp.float64, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("B,T", [(3, 64), (1, 67)])
def test_oracle_float32(B, T):
    _check(B, T, jnp.float32, rtol=2e-4, atol=2e-5)


def test_per_layer_clip_long():
    """Per-layer clipping (a tree of bounds, a prefix of the parameters) at long T, one
    pass: each group clipped by its own norm (numpy float64 by hand)."""
    with x64():
        p, batch = make_long(3, 64, jnp.float64)
        bounds = {k: (0.02 if k in ("emb", "fc", "out") else 0.01) for k in p}
        got = jax.jit(js.per_example_stat(long_loss, js.stats.clipped_sum(bounds)))(p, batch)
        g = jax.tree.map(np.asarray, per_example_grads(long_loss, p, batch))
        for k in p:
            n = np.sqrt(np.sum(np.square(g[k]).reshape(3, -1), 1))
            c = np.minimum(1.0, bounds[k] / n)
            assert np.any(c < 1), k
            np.testing.assert_allclose(got[k], np.tensordot(c, g[k], 1), rtol=1e-9,
                                       atol=1e-12 * np.abs(g[k]).max(), err_msg=k)


# --------------------------------------------------------------------------- #
# The cost model
# --------------------------------------------------------------------------- #
def _report(B=3, T=64, stat=None):
    p, batch = make_long(B, T)
    return js.explain(long_loss, stat or js.stats.sq_norms())(p, batch)


def _leaf(report, name):
    return next(leaf for leaf in report.leaves if leaf.path == f"['{name}']")


def test_cost_model_takes_products_at_long_t():
    """At T = 64 > the widths: per-example products at every dense site (their FLOPs are
    the weight gradient's), tiles of the tied table's summed gradient; explain shows the
    candidates, the chosen (cheapest) one first."""
    rep = _report()
    for name in ("wq", "wo", "fc", "out", "mix"):
        cands = _leaf(rep, name).candidates["sq_norms"]
        assert [c.how for c in cands] == [dense_mod.PRODUCTS, dense_mod.GHOST], name
        assert cands[0].cost < cands[1].cost, name
        assert "cost model" in _leaf(rep, name).hows["sq_norms"]
    emb = _leaf(rep, "emb")
    assert "tiled products of the shared leaf" in emb.hows["sq_norms"]
    assert emb.candidates["sq_norms"][0].how.startswith("tiles")
    # the former memory rule (2 N^2 <= C F) would have taken the ghost form here
    assert 2 * 64**2 <= D * V
    # and the table (str) shows the costs
    assert "cost model:" in str(rep)


def test_cost_model_takes_ghost_at_short_t():
    """A few tokens (T = 4 < the widths): the ghost form is the cheaper at the unembedding,
    and the tied table's own norms plus cross terms beat tiles of its gradient."""
    rep = _report(T=4)
    cands = _leaf(rep, "emb").candidates["sq_norms"]
    hows = [c.how for c in cands]
    assert hows[0].startswith("own norms"), hows  # chosen first (the embedding's)
    assert hows.index(dense_mod.GHOST) < hows.index(dense_mod.PRODUCTS), hows  # the dense's
    assert "ghost cross terms" in _leaf(rep, "emb").hows["sq_norms"]
    # and it computes the same norms as the oracle
    with x64():
        p, batch = make_long(3, 4, jnp.float64)
        got = js.per_example_stat(long_loss, js.stats.sq_norms())(p, batch)
        want = stats_of_grads(per_example_grads(long_loss, p, batch), ["sq_norms"])["sq_norms"]
        np.testing.assert_allclose(got, want, rtol=1e-9)


def test_cost_model_switch_point():
    """The dense choice follows the FLOP balance ``N (C + F)`` against ``C F`` (memory
    traffic aside): ghost below, products above; candidates sorted by cost."""
    p, batch = make_long(2, 64)
    plan_rep = js.explain(long_loss, js.stats.sq_norms())(p, batch)
    assert plan_rep.leaves  # explain ran
    a = Candidate("a", 10.0, 0.0, 0.0)
    b = Candidate("b", 1.0, 1.0, 0.0)  # 1 + 4 * 1 bytes: cheaper than a
    assert [c.how for c in cheapest([a, b])] == ["b", "a"]
    for T, want in ((8, dense_mod.GHOST), (200, dense_mod.PRODUCTS)):
        rep = _report(B=1, T=T)
        got = _leaf(rep, "out").candidates["sq_norms"][0].how  # C = 64, F = 16: 12.8
        assert got == want, (T, got)


def test_clipped_mean_explain_names_one_pass():
    """The clipped mean keeps the ingredients and forms the weighted sum after the norms:
    no second backward pass without remat."""
    rep = _report(stat=js.stats.clipped_mean(1.0))
    how = _leaf(rep, "fc").hows["clipped_mean"]
    assert "kept for the weighted sum" in how and "backward pass" not in how, how
    # a site where the ghost form wins keeps x and dy instead
    how = _leaf(_report(T=4, stat=js.stats.clipped_mean(1.0)), "fc").hows["clipped_mean"]
    assert how.startswith("ghost norm") and how.endswith("then weighted sum"), how


def test_weighted_clipping_with_kept_products():
    """example_weights through the kept products of the clipped sums (global and
    per-leaf bounds), the norms and the tile loops, whole and in chunks of 2: the
    frequency oracle (example b repeated w_b times) in float64."""
    import zoo

    with x64():
        B = 5
        p, batch = make_long(B=B, T=64, dtype=jnp.float64)
        g = jax.tree.map(np.asarray, per_example_grads(long_loss, p, batch))
        w = np.array([0, 2, 1, 3, 1])
        rep = jax.tree.map(lambda x: np.repeat(x, w, axis=0), g)
        bounds = {k: CLIP * (1 + i % 3) for i, k in enumerate(p)}
        req = {"clipped_mean": js.stats.clipped_mean(CLIP), "variance": js.stats.variance(),
               "sq_norms": js.stats.sq_norms(), "per_leaf": js.stats.clipped_sum(bounds)}

        def per_leaf(x, c):
            n = np.sqrt((x.reshape(x.shape[0], -1) ** 2).sum(1))
            return np.tensordot(np.minimum(1.0, c / np.maximum(n, 1e-300)), x, 1)

        want = {
            "clipped_mean": zoo.oracle_from_grads(rep, "clipped_mean", clip_norm=CLIP),
            "variance": zoo.oracle_from_grads(rep, "variance"),
            "sq_norms": np.where(w > 0, zoo.oracle_from_grads(g, "sq_norms"), 0.0),
            "per_leaf": {k: per_leaf(rep[k], bounds[k]) for k in rep},
        }
        for chunk in (None, 2):
            out = jax.jit(js.per_example_stat(long_loss, req, chunk_size=chunk))(
                p, batch, example_weights=w)
            for k in req:
                for a, e in zip(jax.tree.leaves(out[k]), jax.tree.leaves(want[k])):
                    np.testing.assert_allclose(np.asarray(a), e, rtol=1e-8,
                                               atol=1e-10 * np.abs(e).max(), err_msg=k)


# --------------------------------------------------------------------------- #
# Dots batched over the example's own unit batch axis (keep_batch_dim)
# --------------------------------------------------------------------------- #
def _unit_batch_dots(closed):
    """``dot_general`` equations of ``closed`` (through every sub-jaxpr) with a batch
    dimension of size 1 on both operands, as ``(lhs shape, rhs shape)``."""
    from _models import all_eqns

    from jaxpr_surgery._src import compat

    found = []
    for e in all_eqns(closed):
        if e.primitive is compat.dot_general_p:
            (_, _), (lb, rb) = e.params["dimension_numbers"]
            ls, rs = e.invars[0].aval.shape, e.invars[1].aval.shape
            if any(ls[i] == 1 and rs[k] == 1 for i, k in zip(lb, rb)):
                found.append((ls, rs))
    return found


def test_unit_batch_dots_squeezed():
    """A model called on one example keeps its batch axis: attention's einsums are dots
    batched over ``b`` of size 1 (and the heads). Under the vmap over examples XLA:CPU
    lays those out with transposed copies of the ``[T, T]`` scores (1.3x ``jax.grad``
    at T=2048); the interpreter squeezes the unit batch dims, so none is left in the
    program, forward or backward."""
    p, batch = make_long(B=2, T=16)
    per_ex = jax.make_jaxpr(lambda p, b: jax.vmap(
        jax.grad(lambda p, e: long_loss(p, jax.tree.map(lambda t: t[None], e))), (None, 0)
    )(p, b))(p, batch)
    assert _unit_batch_dots(per_ex), "the oracle's vmap(grad) has unit batch dots"
    for stat in (js.stats.second_moment(), js.stats.variance(), js.stats.clipped_mean(CLIP)):
        closed = jax.make_jaxpr(js.per_example_stat(long_loss, stat))(p, batch)
        assert _unit_batch_dots(closed) == [], stat


def _attn_loss(heads, jit_attention, dtype=None):
    """One attention layer over ``[b, T, d]`` with ``heads`` heads (1: two unit batch
    dims, ``b`` and ``h``), scores ``bhts`` and output ``bthk``, optionally inside a
    ``jax.jit`` (a plain call whose dots are squeezed too) and with ``dtype`` operands
    of the score dot accumulated in float32 (``preferred_element_type``)."""
    kd = D // heads

    def attention(q, k, v):
        if dtype is not None:
            a = jax.lax.dot_general(
                q.astype(dtype), k.astype(dtype), (((3,), (3,)), ((0, 2), (0, 2))),
                preferred_element_type=jnp.float32,
            ).astype(q.dtype)  # [b, h, t, s]
        else:
            a = jnp.einsum("bthk,bshk->bhts", q, k)
        T = q.shape[1]
        a = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), a / np.sqrt(kd), -1e9), -1)
        return jnp.einsum("bhts,bshk->bthk", a, v)

    att = jax.jit(attention) if jit_attention else attention

    def loss(p, batch):
        x = batch["x"]
        bq, T, _ = x.shape
        q, k, v = (jnp.reshape(x @ p[n], (bq, T, heads, kd)) for n in ("wq", "wk", "wv"))
        o = att(q, k, v).reshape(bq, T, D)
        z = jnp.tanh(o @ p["wo"] + x) @ p["head"]
        return jnp.mean((z - batch["y"]) ** 2)

    return loss


def _attn_data(B, T, dtype, seed=1):
    r = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(r.normal(size=s) * 0.5, dtype)  # noqa: E731
    p = {"wq": n(D, D), "wk": n(D, D), "wv": n(D, D), "wo": n(D, D), "head": n(D, 3)}
    return p, {"x": n(B, T, D), "y": n(B, T, 3)}


@pytest.mark.parametrize(
    "heads,jit_attention,B,T", [(2, True, 3, 13), (1, False, 2, 8), (1, True, 1, 9)]
)
def test_unit_batch_dots_oracle(heads, jit_attention, B, T):
    """Squeezed dots keep every statistic exact: one and two unit batch dims, inside a
    ``jax.jit``, B = 1, lengths no tile divides; float64 tight, float32."""
    loss = _attn_loss(heads, jit_attention)
    for dtype, rtol, atol in ((jnp.float64, 1e-9, 1e-11), (jnp.float32, 2e-4, 2e-5)):
        with x64():
            p, batch = _attn_data(B, T, dtype)
            stats = _stats(B)
            got = jax.jit(js.per_example_stat(loss, stats))(p, batch)
            want = stats_of_grads(per_example_grads(loss, p, batch), clip_norm=CLIP)
            for name in stats:
                assert_stat_close(name, got[name], want[name], rtol=rtol, atol=atol)
            closed = jax.make_jaxpr(js.per_example_stat(loss, js.stats.second_moment()))(p, batch)
            assert B == 1 or _unit_batch_dots(closed) == []


def test_unit_batch_dots_mixed_dtype():
    """A bfloat16 score dot with a unit batch dim accumulated in float32
    (``preferred_element_type``): squeezed, it keeps its dtypes and its values."""
    loss = _attn_loss(2, False, dtype=jnp.bfloat16)
    p, batch = _attn_data(3, 11, jnp.float32)
    got = jax.jit(js.per_example_stat(loss, js.stats.second_moment()))(p, batch)
    want = stats_of_grads(per_example_grads(loss, p, batch), ["second_moment"])["second_moment"]
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), e, rtol=2e-2, atol=1e-5)
    closed = jax.make_jaxpr(js.per_example_stat(loss, js.stats.second_moment()))(p, batch)
    assert _unit_batch_dots(closed) == []

"""The DP sensitivity bound under adversarial cancellation (issue 58, item 1).

A per-example norm that comes out low lets its example through the clip with more than
``C``. Ghost forms (a token-axis dense layer's ``sum (x_n . x_m)(dy_n . dy_m)``, a tied
table's cross terms) sum products whose terms can cancel, so their rounding is bounded
by the terms' size, not the value's. Here inputs are built to cancel: tokens whose
contributions nearly undo each other (every site kind: dense, a long contraction, a tied
table, an embedding, a convolution, a scale-shift), in float32 and bfloat16. For every
example its clipped sum must not exceed ``C`` by more than the rounding of its
per-example gradient itself (twice vmap(grad)'s own distance from the float64 norm in the
model's dtype, ``64 eps`` of the sum of its tokens' gradient norms in float32, the
output's rounding): the norms clipping divides by carry the bound of their rounding
(`clip_reductions.ClipNorms`). The statistic `norms` must not fall below the float64 norm by
more than that plus ``2^-9`` of the value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js
from jaxpr_surgery._src import norms

# Each model is ``loss(params, batch)``, a mean over examples of terms linear in the
# batch's cotangent-like arrays (``c``, ``a``): masking them by token (``batch["m"]``,
# one weight per token) gives each token's own gradient, whose norms bound the rounding.


def _dense(r, B, eps):
    T, C, F = 8, 48, 40
    x = r.standard_normal((B, T // 2, C))
    x = np.concatenate([x, x + eps * r.standard_normal(x.shape)], 1)
    c = r.standard_normal((B, T // 2, F))
    c = np.concatenate([c, -c * (1 + eps)], 1)

    def loss(W, b):
        return jnp.mean(jnp.sum((b["x"] @ W) * b["c"] * b["m"][..., None], (-1, -2)))

    return loss, r.standard_normal((C, F)) / 8, {"x": x, "c": c}, T


def _long(r, B, eps):
    """Two near-equal tokens over 16,384 features (alternating offsets: the roundings
    of a long contraction line up), cotangents that nearly cancel."""
    C, F = 16384, 8
    base = r.choice([1.0, 1 / 3, 0.7], size=(B, 1, 1))
    x1 = np.broadcast_to(base, (B, 1, C))
    x2 = x1 + eps * np.where(np.arange(C) % 2, 1.0, -1.0) * (1 + 0.1 * r.random((B, 1, 1)))
    c1 = r.standard_normal((B, 1, F))
    c2 = -c1 * (1 + eps * r.uniform(0.01, 1, (B, 1, 1)))

    def loss(W, b):
        return jnp.mean(jnp.sum((b["x"] @ W) * b["c"] * b["m"][..., None], (-1, -2)))

    x, c = np.concatenate([x1, x2], 1), np.concatenate([c1, c2], 1)
    return loss, r.standard_normal((C, F)) / 128, {"x": x, "c": c}, 2


def _tied(r, B, eps):
    """A tied table: ``E[ids] . a`` and ``(h @ E^T) . c`` with ``c`` the one-hot of the
    ids and ``h = -a (1 + eps)``: the dense use's gradient rows undo the embedding's."""
    V, d, T = 24, 16, 4
    ids = np.stack([r.permutation(V)[:T] for _ in range(B)])
    a = 30 * r.standard_normal((B, T, d))
    h = a * (1 + eps)
    c = -np.eye(V)[ids]

    def loss(E, b):  # (one weight per token and use: the terms of both uses)
        m = b["m"][..., None]
        emb = jnp.take(E, b["ids"], axis=0)
        return jnp.mean(jnp.sum(emb * b["a"] * m[:, :T], (-1, -2))
                        + jnp.sum((b["h"] @ E.T) * b["c"] * m[:, T:], (-1, -2)))

    return loss, r.standard_normal((V, d)), {"ids": ids, "a": a, "h": h, "c": c}, 2 * T


def _embedding(r, B, eps):
    """Repeated ids whose cotangents nearly cancel in the row's segment sum."""
    V, d, T = 16, 12, 6
    ids = np.stack([np.repeat(r.permutation(V)[: T // 2], 2) for _ in range(B)])
    a = 20 * r.standard_normal((B, T // 2, d))
    a = np.stack([a, -a * (1 + eps)], 2).reshape(B, T, d)

    def loss(E, b):
        emb = jnp.take(E, b["ids"], axis=0)
        return jnp.mean(jnp.sum(emb * b["a"] * b["m"][..., None], (-1, -2)))

    return loss, r.standard_normal((V, d)), {"ids": ids, "a": a}, T


def _conv(r, B, eps):
    """Two image halves (apart by more than the kernel) whose outputs' cotangents undo
    each other; tokens: the halves."""
    H, Wd, Ci, Co = 6, 4, 3, 5
    x = r.standard_normal((B, H, Wd, Ci))
    gap = np.zeros((B, H, 3, Ci))
    x = np.concatenate([x, gap, x + eps * r.standard_normal(x.shape)], 2)
    c = r.standard_normal((B, H - 2, Wd - 2, Co))
    cg = np.zeros((B, H - 2, 5, Co))  # the output columns that reach into the gap
    c = np.concatenate([c, cg, -c * (1 + eps)], 2)
    half = np.concatenate([np.zeros(Wd - 2), np.full(5, -1), np.ones(Wd - 2)])

    def loss(W, b):
        y = jax.lax.conv_general_dilated(b["x"], W, (1, 1), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        # the batch's token weights: [B, 2] -> each output column's half
        m = jnp.where(half < 0, 0.0, jnp.where(half > 0, b["m"][:, 1:2], b["m"][:, 0:1]))
        return jnp.mean(jnp.sum(y * b["c"] * m[:, None, :, None].astype(y.dtype), (1, 2, 3)))

    return loss, r.standard_normal((3, 3, Ci, Co)) / 4, {"x": x, "c": c}, 2


def _scale_shift(r, B, eps):
    T, d = 6, 32
    x = r.standard_normal((B, T // 2, d))
    x = np.concatenate([x, x + eps * r.standard_normal(x.shape)], 1)
    c = 10 * r.standard_normal((B, T // 2, d))
    c = np.concatenate([c, -c * (1 + eps)], 1)

    def loss(p, b):
        y = b["x"] * p["g"] + p["b"]
        return jnp.mean(jnp.sum(y * b["c"] * b["m"][..., None], (-1, -2)))

    return loss, {"g": 1 + r.standard_normal(d) / 4, "b": r.standard_normal(d)}, {
        "x": x, "c": c}, T


MODELS = {"dense": _dense, "long_contraction": _long, "tied": _tied,
          "embedding": _embedding, "conv": _conv, "scale_shift": _scale_shift}


def _cast(tree, dtype):
    return jax.tree.map(
        lambda v: jnp.asarray(v, dtype) if np.issubdtype(np.asarray(v).dtype, np.floating)
        else jnp.asarray(v), tree)


def _truth(loss, params, batch, T):
    """float64 from the same (rounded) inputs: each example's gradient norm, and the sum
    of its tokens' own gradient norms (the size of the terms that cancel)."""

    def run():
        p = jax.tree.map(lambda v: jnp.asarray(np.asarray(v, np.float64)), params)
        b = jax.tree.map(lambda v: jnp.asarray(np.asarray(v).astype(np.float64))
                         if jnp.issubdtype(v.dtype, jnp.floating) else jnp.asarray(v), batch)

        def norms_with(m):
            g = zoo.vmap_grads(loss, p, dict(b, m=m))
            flat = jnp.concatenate([x.reshape(x.shape[0], -1) for x in jax.tree.leaves(g)], 1)
            return np.asarray(jnp.linalg.norm(flat, axis=1))

        B = len(jax.tree.leaves(batch)[0])
        true = norms_with(jnp.ones((B, T)))
        terms = sum(norms_with(jnp.broadcast_to(jnp.eye(T)[t], (B, T))) for t in range(T))
        return true, terms

    return zoo.in_x64(run)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("model", list(MODELS))
def test_clipping_norms_never_fall_below_the_true_norm(model, dtype):
    B = 4
    acc_eps = float(jnp.finfo(jnp.float32).eps)  # (statistics accumulate in float32)
    out_eps = float(jnp.finfo(dtype).eps)
    fns = {}
    for seed, eps in enumerate([3e-2, 1e-2, 1e-3, 1e-4]):
        r = np.random.default_rng(100 + seed)
        loss, params, batch, T = MODELS[model](r, B, eps)
        params, batch = _cast(params, dtype), _cast(batch, dtype)
        batch = dict(batch, m=jnp.ones((B, T), dtype))
        true, terms = _truth(loss, params, batch, T)
        if not fns:
            fns["norms"] = jax.jit(js.per_example_stat(loss, js.stats.norms()))

            def alone(p, b, w, clip, loss=loss):  # each example alone: the others weighted 0
                return js.per_example_stat(loss, js.stats.clipped_sum(clip))(
                    p, b, example_weights=w)

            fns["alone"] = jax.jit(jax.vmap(alone, in_axes=(None, None, 0, None)))
        got = np.asarray(fns["norms"](params, batch), np.float64)
        # the rounding of the per-example gradient itself: how far vmap(grad) in the
        # model's dtype is from the truth (bfloat16 models form it in bfloat16), and
        # 64 eps of the terms in float32
        ref = zoo.vmap_grads(loss, params, batch)
        ref = np.sqrt(sum(np.sum(np.square(np.asarray(v, np.float64)).reshape(B, -1), 1)
                          for v in jax.tree.leaves(ref)))
        slack = 2 * np.abs(ref - true) + 64 * acc_eps * terms
        assert np.all(np.isfinite(got)), (model, eps, got)
        assert np.all(got >= true - slack - 2**-9 * true), (model, eps, got / true, terms / true)
        clip = float(np.median(true))
        if clip == 0:  # (bfloat16 rounded the two tokens' difference away)
            continue
        ones = jnp.eye(B, dtype=jnp.float32)
        g1 = fns["alone"](params, batch, ones, jnp.float32(clip))
        n1 = np.sqrt(sum(np.sum(np.square(np.asarray(v, np.float64)).reshape(B, -1), 1)
                         for v in jax.tree.leaves(g1)))
        # (an example whose true gradient is 0 contributes its rounding alone)
        rel = np.divide(slack * clip, true, out=slack.copy(), where=true > 0)
        bound = clip * (1 + 4 * out_eps) + rel
        assert np.all(n1 <= bound), (model, eps, n1 / clip)


def test_tied_table_whose_uses_cancel_is_not_reported_zero():
    """The audit's case: a tied table whose embedding and output contributions nearly
    cancel read 0.0 (its cross term's rounding had no guard), so ``clipped_sum(0.1)``
    passed the example's whole gradient, 10x the clip norm."""
    r = np.random.default_rng(0)
    loss, E, batch, T = _tied(r, 4, 1e-4)
    E, batch = _cast(E, jnp.float32), _cast(batch, jnp.float32)
    batch = dict(batch, m=jnp.ones((4, T), jnp.float32))
    true, _ = _truth(loss, E, batch, T)
    got = np.asarray(js.per_example_stat(loss, js.stats.norms())(E, batch), np.float64)
    np.testing.assert_allclose(got, true, rtol=1e-3)
    sq = np.asarray(js.per_example_stat(loss, js.stats.sq_norms())(E, batch), np.float64)
    np.testing.assert_allclose(sq, true**2, rtol=2e-3)


def test_ghost_bound_grows_with_the_contraction():
    """The bound of a ghost form's rounding scales with the contraction lengths
    (`norms.rounding`): a 16,384-feature layer's exceeds the fixed ``1024 eps`` of its
    terms' scale that guarded it; a value is untrusted where the bound exceeds it (or
    it is not finite)."""
    assert norms.rounding(16384, jnp.float32) > 1024 * float(jnp.finfo(jnp.float32).eps)
    assert norms.rounding(10, jnp.float64) < 1e-14
    assert norms.rounding(2**25, jnp.float32) == float("inf")
    v = jnp.array([1.0, 1.0, -1.0, 0.0, 0.0, jnp.nan, jnp.inf])
    e = jnp.array([0.0, 1.0, 0.0, 0.0, 1e-30, 0.0, 0.0])
    assert norms.untrusted(v, e, 0.5).tolist() == [False, True, True, False, True, True, True]

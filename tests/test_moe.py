"""Mixture-of-experts layers: grouped matmuls (``jax.lax.ragged_dot``), the one-hot
dispatch einsum and per-token gathered expert weights, against the per-example
gradients of a loop over examples (``jax.vmap`` of a ``ragged_dot`` with shared
weights is not implemented in jax, so the oracle cannot be ``vmap(grad)`` there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from jax import lax

import jaxpr_surgery as js


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #
def _head(o, y, wh):
    lp = jax.nn.log_softmax(o @ wh)
    return -jnp.mean(jnp.take_along_axis(lp, y[..., None], -1))


def ragged_moe(p, batch, drop_last=False):
    """Top-1 MoE as MoE code writes it: the batch's tokens flattened, sorted by
    expert, two grouped matmuls, unsorted. ``drop_last``: the last expert's group
    size is set to 0, so its tokens fall past the groups (zero output)."""
    x, y = batch
    B, T, d = x.shape
    E = p["w1"].shape[0]
    tok = x.reshape(B * T, d)
    logits = tok @ p["wr"]
    eid = jnp.argmax(logits, -1)
    gate = jnp.max(jax.nn.softmax(logits, -1), -1)
    order = jnp.argsort(eid)
    gs = jnp.bincount(eid, length=E).astype(jnp.int32)
    if drop_last:
        gs = gs.at[-1].set(0)
    h = jnp.tanh(lax.ragged_dot(tok[order], p["w1"], gs))
    o = lax.ragged_dot(h, p["w2"], gs)
    o = o[jnp.argsort(order)] * gate[:, None]
    return _head(o.reshape(B, T, d) + x, y, p["wh"])


def _moe_params(r, d, f, E, C, dtype):
    n = lambda *s: jnp.asarray(r.standard_normal(s).astype(np.float32), dtype)  # noqa: E731
    return dict(wr=n(d, E), w1=n(E, d, f), w2=n(E, f, d) / 2, wh=n(d, C))


def make_batch(r, B, T, d, C, dtype):
    x = jnp.asarray(r.standard_normal((B, T, d)).astype(np.float32), dtype)
    return x, jnp.asarray(r.integers(0, C, (B, T)), jnp.int32)


def make(B, T, d=3, f=4, E=3, C=2, seed=0, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    return _moe_params(r, d, f, E, C, dtype), make_batch(r, B, T, d, C, dtype)


def per_example_grads(loss, p, batch):
    """``[B, *leaf]`` per leaf: ``grad`` of the batch-of-one loss, one example at a time."""
    g1 = jax.jit(jax.grad(lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))))
    B = jax.tree.leaves(batch)[0].shape[0]
    gs = [g1(p, jax.tree.map(lambda a, b=b: a[b], batch)) for b in range(B)]
    return jax.tree.map(lambda *a: np.stack([np.asarray(x, np.float64) for x in a]), *gs)


# --------------------------------------------------------------------------- #
# Statistics and their oracles
# --------------------------------------------------------------------------- #
def _kron_oracle(g):
    def one(x):
        ents = []
        for j in range(1, x.ndim):
            U = np.moveaxis(x, j, 1).reshape(x.shape[0], x.shape[j], -1)
            ents.append(np.einsum("bij,bkj->ik", U, U) / x.shape[0])
        return tuple(ents)

    return jax.tree.map(one, g)


def stats_and_oracles(g):
    """``{name: (statistic, oracle value)}`` from per-example grads ``g``."""
    o = zoo.oracle_from_grads
    C = float(np.median(np.sqrt(o(g, "sq_norms"))))
    leaves = jax.tree.leaves(g)
    B = leaves[0].shape[0]
    sq = sum(np.sum(x.reshape(B, -1) ** 2, 1) for x in leaves)
    out = {
        "mean": (js.stats.mean(), o(g, "mean")),
        "sum": (js.stats.sum(), o(g, "sum")),
        "second_moment": (js.stats.second_moment(), o(g, "second_moment")),
        "sign_mean": (js.stats.sign_mean(), o(g, "sign_mean")),
        "abs_mean": (js.stats.abs_mean(), o(g, "abs_mean")),
        "sq_norms": (js.stats.sq_norms(), o(g, "sq_norms")),
        "sq_norms_per_leaf": (js.stats.sq_norms(per_leaf=True), o(g, "sq_norms", per_leaf=True)),
        "norms": (js.stats.norms(), o(g, "norms")),
        "clipped_mean": (js.stats.clipped_mean(C), o(g, "clipped_mean", clip_norm=C)),
        "clipped_sum": (js.stats.clipped_sum(C / 3), o(g, "clipped_sum", clip_norm=C / 3)),
        "pow4": (
            js.stats.elementwise(lambda v: v**4, multiplicative=True, name="pow4"),
            o(g, "elementwise", phi=lambda v: v**4),
        ),
        "cos": (
            js.stats.elementwise(jnp.cos, name="cos"), o(g, "elementwise", phi=np.cos),
        ),
        "fourth_moment": (js.stats.fourth_moment(), jax.tree.map(lambda x: np.mean(x**4, 0), g)),
        "gradient_diversity": (
            js.stats.gradient_diversity(),
            np.sum(sq) / sum(np.sum(x.sum(0) ** 2) for x in leaves),
        ),
        "kron_moments": (js.stats.kron_moments(), _kron_oracle(g)),
    }
    if B > 1:
        out.update(
            variance=(js.stats.variance(), o(g, "variance")),
            variance_ddof0=(js.stats.variance(ddof=0), o(g, "variance", ddof=0)),
            snr=(js.stats.snr(), o(g, "snr")),
            gradient_noise_scale=(js.stats.gradient_noise_scale(), o(g, "gradient_noise_scale")),
        )
    return out


def assert_close(actual, expected, rtol, what):
    """Every leaf within ``rtol`` of the leaf's largest oracle value (per statistic)."""
    a_leaves = jax.tree.leaves(actual)
    e_leaves = jax.tree.leaves(expected)
    assert len(a_leaves) == len(e_leaves), what
    for a, e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, (what, a.shape, e.shape)
        fin = np.isfinite(e)
        np.testing.assert_array_equal(np.isfinite(a), fin, err_msg=what)
        scale = np.max(np.abs(e[fin])) if fin.any() else 0.0
        np.testing.assert_allclose(a[fin], e[fin], rtol=rtol, atol=rtol * scale, err_msg=what)


TOL = {"float64": 1e-10, "float32": 2e-4}
# sign_mean in float32 (an element of a gradient within rounding of 0 may flip sign) and
# the ratios of moments (their rounding is amplified where the variance is small)
LOOSE32 = {"sign_mean": 0.3, "snr": 2e-2, "gradient_noise_scale": 2e-3}


def check_all(loss, p, batch, dtype, alone=(), **options):
    """Every statistic in one call, and those named in ``alone`` each by itself (the
    direct paths), against the loop over examples."""
    with zoo.x64() if dtype == "float64" else _null():
        g = per_example_grads(loss, p, batch)
        so = stats_and_oracles(g)
        names = list(so)
        fn = js.per_example_stat(loss, {k: so[k][0] for k in names}, check=False, **options)
        out = jax.jit(fn)(p, batch)
        alone = {
            k: jax.jit(js.per_example_stat(loss, so[k][0], check=False, **options))(p, batch)
            for k in alone
        }
    for k in names:
        tol = TOL[dtype] if dtype == "float64" else LOOSE32.get(k, TOL[dtype])
        assert_close(out[k], so[k][1], tol, f"{k} ({dtype})")
    for k, v in alone.items():
        assert_close(v, so[k][1], TOL[dtype], f"{k} alone ({dtype})")
    return g


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                        tree)


# --------------------------------------------------------------------------- #
# ragged_dot
# --------------------------------------------------------------------------- #
def test_ragged_dot_vmap_is_not_implemented_in_jax():
    """Why the engine maps ragged_dot itself (and why the oracle loops): jax.vmap of a
    ragged_dot with a shared weight raises. If a future jax implements it, the
    forward of the kernel may become a plain vmap."""
    p, (x, _) = make(2, 3)
    gs = jnp.array([[1, 1, 1], [3, 0, 0]], jnp.int32)
    with pytest.raises(NotImplementedError):
        jax.vmap(lambda x, gs: lax.ragged_dot(x, p["w1"], gs))(x, gs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "B,T,drop_last,dtype",
    [
        (4, 5, False, "float64"),  # tiled per-example products (2 T^2 > g k n)
        (4, 5, False, "float32"),
        (3, 2, True, "float64"),  # ghost norms; tokens past the last group
        (1, 1, False, "float64"),  # one example with one token: the rank-one rules
    ],
)
def test_ragged_moe_matches_oracle(B, T, drop_last, dtype):
    p, batch = make(B, T, seed=B + T)

    def loss(p, b):
        return ragged_moe(p, b, drop_last)

    alone = ("second_moment", "clipped_mean", "mean") if (B, dtype) == (4, "float64") else ()
    with zoo.x64() if dtype == "float64" else _null():
        p, batch = _cast((p, batch), jnp.dtype(dtype))
        check_all(loss, p, batch, dtype, alone)


def test_ragged_moe_explain_names_the_kind_and_rules():
    p, batch = make(4, 5)
    r = js.explain(ragged_moe, check=False)(p, batch)
    rows = {str(leaf.path): leaf for leaf in r.leaves}
    for w in ("['w1']", "['w2']"):
        assert rows[w].kinds == ["ragged-dense"], str(r)
        assert rows[w].rule == "streamed", str(r)
    assert "grouped" in str(r)


def test_ragged_moe_quick():
    """The main statistics of the grouped matmul against the loop over examples (the
    quick subset's check; the matrix below is marked slow)."""
    with zoo.x64():
        p, batch = _cast(make(4, 5, seed=9), jnp.float64)
        g = per_example_grads(ragged_moe, p, batch)
        so = stats_and_oracles(g)
        keys = ("mean", "second_moment", "variance", "norms", "clipped_mean")
        out = jax.jit(
            js.per_example_stat(ragged_moe, {k: so[k][0] for k in keys}, check=False)
        )(p, batch)
    for k in keys:
        assert_close(out[k], so[k][1], 1e-10, k)


@pytest.mark.slow
@pytest.mark.parametrize("options", ["chunks", "blocks"])
def test_ragged_moe_options(options, request):
    """Chunks (the tile loops continue the running sums of earlier chunks) and feature
    blocks of one example's G (outputs cut, `blocks`: tiny blocks)."""
    if options == "blocks":
        seen, kw = request.getfixturevalue("blocks"), {}
    else:
        seen, kw = None, dict(chunk_size=2)
    with zoo.x64():
        p, batch = _cast(make(5, 4, seed=3), jnp.float64)
        g = per_example_grads(ragged_moe, p, batch)
        so = stats_and_oracles(g)
        keys = ("mean", "second_moment", "variance", "norms", "clipped_mean", "pow4")
        out = jax.jit(
            js.per_example_stat(ragged_moe, {k: so[k][0] for k in keys}, check=False, **kw)
        )(p, batch)
    for k in keys:
        assert_close(out[k], so[k][1], 1e-10, f"{k} {options}")
    if seen is not None:  # the expert weights [3, 3, 4] and [3, 4, 3] in blocks of outputs
        assert {(2, (1, 9, 4)), (2, (1, 12, 3))} <= {(a, sh) for a, _, sh in seen}, seen


@pytest.mark.slow
def test_ragged_moe_per_example_dots_and_tied_leaf():
    """Statistics that take the per-example gradient of the leaf from the kernel's
    ingredients: inner products with a reference, and a weight used by two ragged
    products or by a ragged product and a generic site (the leaf's G summed over its
    sites)."""

    def tied(p, batch):
        q = dict(p, w2=jnp.swapaxes(p["w1"], 1, 2) / 2)  # w1 again, transposed
        return ragged_moe(q, batch)

    def penalised(p, batch):  # w1 also at a generic site
        return ragged_moe(p, batch) + 0.1 * jnp.sum(jnp.sin(p["w1"]))

    with zoo.x64():
        p, batch = _cast(make(3, 4, d=3, f=3, seed=5), jnp.float64)
        ref = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), p)
        for loss in (ragged_moe, tied, penalised):
            g = per_example_grads(loss, p, batch)
            stats = (js.stats.per_example_dots(ref), js.stats.second_moment(), js.stats.norms())
            dots, m2, norms = jax.jit(js.per_example_stat(loss, stats, check=False))(p, batch)
            dref = sum(
                np.sum((g[k] * np.asarray(ref[k])).reshape(g[k].shape[0], -1), 1) for k in g
            )
            np.testing.assert_allclose(np.asarray(dots), dref, rtol=1e-10)
            assert_close(m2, zoo.oracle_from_grads(g, "second_moment"), 1e-10, "m2")
            assert_close(norms, zoo.oracle_from_grads(g, "norms"), 1e-10, "norms")


def _moe_block(x2, w1, w2, wr, drop_last=False):
    """One top-1 MoE block on tokens ``x2 [M, d]`` (residual)."""
    E = w1.shape[0]
    logits = x2 @ wr
    eid = jnp.argmax(logits, -1)
    gate = jnp.max(jax.nn.softmax(logits, -1), -1)
    order = jnp.argsort(eid)
    gs = jnp.bincount(eid, length=E).astype(jnp.int32)
    h = jnp.tanh(lax.ragged_dot(x2[order], w1, gs))
    o = lax.ragged_dot(h, w2, gs)
    return x2 + o[jnp.argsort(order)] * gate[:, None]


def scanned_remat_moe(p, batch):
    """Two MoE blocks stacked in ``lax.scan`` under ``jax.checkpoint``."""
    x, y = batch
    B, T, d = x.shape

    @jax.checkpoint
    def layer(h, w):
        return _moe_block(h, w["w1"], w["w2"], w["wr"]), None

    h, _ = lax.scan(layer, x.reshape(B * T, d), p["layers"])
    return _head(h.reshape(B, T, d), y, p["wh"])


@pytest.mark.slow
def test_ragged_moe_in_scan_with_remat():
    """Sites inside ``lax.scan`` (statistics stacked per layer) under
    ``jax.checkpoint`` (clipped sums by a second, reweighted pass)."""
    with zoo.x64():
        r = np.random.default_rng(7)
        layers = [_moe_params(r, 3, 4, 3, 2, jnp.float64) for _ in range(2)]
        p = dict(
            layers={k: jnp.stack([q[k] for q in layers]) for k in ("w1", "w2", "wr")},
            wh=layers[0]["wh"],
        )
        batch = make_batch(r, 3, 4, 3, 2, jnp.float64)
        g = per_example_grads(scanned_remat_moe, p, batch)
        so = stats_and_oracles(g)
        keys = ("mean", "second_moment", "variance", "norms", "clipped_mean")
        out = jax.jit(
            js.per_example_stat(scanned_remat_moe, {k: so[k][0] for k in keys}, check=False)
        )(p, batch)
    for k in keys:
        assert_close(out[k], so[k][1], 1e-10, k)


def test_frozen_experts_and_generic_ragged_dot():
    """``ragged_dot`` outside any site (experts not differentiated: LoRA-style
    fine-tuning of a router and head) maps over the batch without copies of the
    weights; a ``ragged_dot`` whose parameter is its ungrouped operand takes the
    generic rule (exact per-example VJP, the operands broadcast)."""

    def frozen(p, experts, batch):
        return ragged_moe(dict(p, **experts), batch)

    jitted_ragged_dot = jax.jit(lax.ragged_dot)

    def frozen_in_jit(p, experts, batch):  # the frozen products inside a call of their own
        x, y = batch
        B, T, d = x.shape
        tok = x.reshape(B * T, d)
        eid, gate = _top1(tok, p["wr"])
        order = jnp.argsort(eid)
        gs = jnp.bincount(eid, length=experts["w1"].shape[0]).astype(jnp.int32)
        h = jnp.tanh(jitted_ragged_dot(tok[order], experts["w1"], gs))
        o = jitted_ragged_dot(h, experts["w2"], gs)[jnp.argsort(order)] * gate[:, None]
        return _head(o.reshape(B, T, d), y, p["wh"])

    def lhs_param(p, batch):
        x, _ = batch  # the example's tokens as the grouped operand [2, T, d]
        rhs = jnp.stack([x[0], 2 * x[0]])
        m = p["a"].shape[0]
        o = lax.ragged_dot(p["a"], rhs, jnp.array([2, m - 2], jnp.int32))
        return jnp.sum(jnp.tanh(o))

    with zoo.x64():
        p, batch = _cast(make(3, 4, seed=11), jnp.float64)
        q = {k: p[k] for k in ("wr", "wh")}
        experts = {k: p[k] for k in ("w1", "w2")}
        for loss in (frozen, frozen_in_jit):
            g = per_example_grads(lambda q, b, loss=loss: loss(q, experts, b), q, batch)
            m2 = js.per_example_stat(loss, js.stats.second_moment(), batch_argnums=2, check=False)
            assert_close(jax.jit(m2)(q, experts, batch), zoo.oracle_from_grads(g, "second_moment"),
                         1e-10, f"frozen experts ({loss.__name__})")

        pa = {"a": jnp.asarray(np.random.default_rng(1).standard_normal((5, 4)))}
        r = js.explain(lhs_param, check=False)(pa, batch)
        assert r.leaves[0].kinds == ["generic"], str(r)
        g = per_example_grads(lhs_param, pa, batch)
        out = jax.jit(js.per_example_stat(
            lhs_param, (js.stats.variance(), js.stats.norms()), check=False))(pa, batch)
    assert_close(out[0], zoo.oracle_from_grads(g, "variance"), 1e-10, "lhs variance")
    assert_close(out[1], zoo.oracle_from_grads(g, "norms"), 1e-10, "lhs norms")


@pytest.mark.slow
def test_check_per_example_on_ragged_moe():
    """The check the cross-example error points to runs on a ``ragged_dot`` model (one
    example at a time where jax cannot vectorise it), passes the plain MoE and
    catches a load-balancing loss taken over the batch's tokens."""

    def balanced(p, batch):
        x, _ = batch
        probs = jax.nn.softmax(x.reshape(-1, x.shape[-1]) @ p["wr"], -1)
        return ragged_moe(p, batch) + jnp.sum(jnp.square(jnp.mean(probs, 0)))

    p, batch = make(3, 4, seed=2)
    assert js.check_per_example(ragged_moe)(p, batch) is None
    with pytest.raises(ValueError, match="interact"):
        js.check_per_example(balanced)(p, batch)
    with pytest.raises(ValueError, match="sorts along the batch axis"):
        js.per_example_stat(ragged_moe, js.stats.mean())(p, batch)


# --------------------------------------------------------------------------- #
# Per-token gathered expert weights, and the one-hot dispatch form
# --------------------------------------------------------------------------- #
def _top1(x, wr):
    logits = x @ wr
    return jnp.argmax(logits, -1), jnp.max(jax.nn.softmax(logits, -1), -1)


def gathered_moe(p, batch, gather=lambda w, top: w[top]):
    """Each token's expert weights gathered (``w[top] : [B, T, d, f]``), then a
    per-token matmul."""
    x, y = batch
    top, gate = _top1(x, p["wr"])
    h = jnp.tanh(jnp.einsum("btd,btdf->btf", x, gather(p["w1"], top))) * gate[..., None]
    return _head(h, y, p["wh"])


def vmapped_gather(w, top):
    """``w[i]`` written for one token and mapped over tokens (a batched dynamic slice:
    a gather with an index per axis of ``w``, in clip mode)."""
    return jax.vmap(jax.vmap(lambda i: w[i]))(top)


def dispatch_moe(p, batch):
    """The same layer in the one-hot dispatch form: tokens routed by a one-hot einsum,
    each expert one dense product with its weight (a dense site with the experts as a
    dot batch axis)."""
    x, y = batch
    top, gate = _top1(x, p["wr"])
    oh = jax.nn.one_hot(top, p["w1"].shape[0], dtype=x.dtype)  # [B, T, E]
    xe = jnp.einsum("btd,bte->betd", x, oh)
    he = jnp.einsum("betd,edf->betf", xe, p["w1"])
    h = jnp.tanh(jnp.einsum("betf,bte->btf", he, oh)) * gate[..., None]
    return _head(h, y, p["wh"])


def _gathered_params(r, d, f, E, C, dtype):
    n = lambda *s: jnp.asarray(r.standard_normal(s).astype(np.float32), dtype)  # noqa: E731
    return dict(wr=n(d, E), w1=n(E, d, f), wh=n(f, C))


@pytest.mark.slow
@pytest.mark.parametrize("gather", [lambda w, t: w[t], vmapped_gather], ids=["index", "vmap"])
def test_gathered_experts_are_row_gathers(gather):
    """Gathered expert weights are rows of the expert table gathered by token: the
    embedding rule (segment sums of the tokens routed to one expert), never the
    per-example table ``[B, E, d, f]``; the dispatch form is a dense site. All three give
    the statistics of the loop over examples."""
    with zoo.x64():
        r = np.random.default_rng(4)
        p = _gathered_params(r, 3, 4, 3, 2, jnp.float64)
        batch = make_batch(r, 4, 5, 3, 2, jnp.float64)

        def loss(p, b):
            return gathered_moe(p, b, gather)

        r1 = js.explain(loss)(p, batch)
        r2 = js.explain(dispatch_moe)(p, batch)
        g = per_example_grads(loss, p, batch)
        so = stats_and_oracles(g)
        keys = ("mean", "second_moment", "variance", "sign_mean", "norms", "clipped_mean")
        stats = {k: so[k][0] for k in keys}
        out = jax.jit(js.per_example_stat(loss, stats))(p, batch)
        out_d = jax.jit(js.per_example_stat(dispatch_moe, stats))(p, batch)
    w1 = {str(leaf.path): leaf for leaf in r1.leaves}["['w1']"]
    assert (w1.kinds, w1.rule) == (["embedding"], "streamed"), str(r1)
    w1 = {str(leaf.path): leaf for leaf in r2.leaves}["['w1']"]
    assert (w1.kinds, w1.rule) == (["dense"], "streamed"), str(r2)
    for k in keys:
        assert_close(out[k], so[k][1], 1e-10, k)
        assert_close(out_d[k], so[k][1], 1e-10, f"{k} (dispatch)")

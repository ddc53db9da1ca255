"""Parameter-only preludes before a site keep the site's fast rule (issue 39, item 12).

A weight scaled by a constant (``x @ (W / 16)``, ``-W``, a muP multiplier passed as an
argument, a per-row or per-column constant multiplier), sliced (``W[:k]``,
``W[:, a:b]``, strided, ``lax.dynamic_slice`` at constant starts) or gathered with
``jnp.take_along_axis`` is the site's *view*: every statistic is still exact (oracle:
``vmap(grad)`` in float64) and `explain` reports the site's own rule and the view.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js

B, T, D, F = 7, 3, 6, 5  # B = 7: chunks of 3 leave a remainder of one example
V, V2, DE = 9, 6, 4  # vocabulary, tied rows, embedding width
MAX_DIM = 4  # kron_moments: axes beyond 4 give their diagonal


# --------------------------------------------------------------------------- #
# Models: loss(params, batch, consts); consts is neither differentiated nor batched
# --------------------------------------------------------------------------- #
def _scale_literal(p, b, c):
    h = jnp.tanh(b["x"] @ (p["w1"] / 16))  # tokens: tiled products
    z = h.mean(1) @ (-p["w2"] * 0.5)  # one token: rank-one rules
    return jnp.mean(jnp.sin(z) + z**2)


def _scale_argument(p, b, c):
    h = jnp.tanh(b["x"] @ (p["w1"] * c["mu"]))  # a muP multiplier passed as an argument
    h = jnp.tanh(h @ (p["w2"] * c["col"]))  # a constant per-column multiplier: into dy
    h = h @ (p["w3"] / c["row"][:, None])  # a constant per-row divisor: into x
    return jnp.mean(jnp.sin(h)) + jnp.mean(jnp.cos(h @ (p["w4"] * c["full"])))


def _chained(p, b, c):
    # transpose, two scales, reshape, then an einsum (its own jit: the scale's value
    # reaches the site inside it)
    w = ((p["w"].T * c["mu"]) / 3.0).reshape(D, 2, 3)
    q = jnp.einsum("btd,dhk->bthk", b["x"], w)
    return jnp.mean(jnp.cos(q)) + jnp.mean(jnp.sin(b["x"] @ (2.0 * p["v"][::2]).T))


def _scan(p, b, c):
    def body(h, w):
        return jnp.tanh(h @ (w / 2.0)[:, :D]), None  # a literal scale and a slice inside

    h, _ = jax.lax.scan(body, b["x"], p["ws"] * c["mu"])  # a scale of the stacked weights
    return jnp.mean(h**2 + jnp.sin(h))


def _two_slices(p, b, c):
    x = b["x"]
    h = jnp.tanh(x[..., :4] @ p["w"][:4] + x[..., 4:] @ p["w"][4:])  # disjoint rows
    z = h @ p["w"][2:5].T  # overlapping rows, transposed: three sites on one leaf
    return jnp.mean(jnp.sin(z) * z)


def _tied_slice(p, b, c):
    e = p["emb"][b["tok"]]
    h = jnp.tanh(e @ p["wh"])
    logits = h @ p["emb"][:V2].T  # unembedding tied to the first V2 rows of the table
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, b["tgt"][..., None], -1))


def _take_along_axis(p, b, c):
    e = jnp.take_along_axis(p["emb"][None], b["tok"][..., None], axis=1)  # [1, T, DE]
    z = e @ p["w"][:, 1:3]  # the leaf's only site: columns 0 and 3 get a zero gradient
    u = jax.lax.dynamic_slice(p["u"], (1, 0), (DE, 2))  # constant starts
    return jnp.mean(jnp.cos(z)) + jnp.mean(jnp.sin(e @ u) ** 2)


def _repeated(p, b, c):
    # identical layers but for their literal scale: one trace per structure must not
    # reuse another layer's scale
    h = b["x"]
    for k, s in enumerate((2.0, 4.0, 8.0, 16.0)):
        h = jnp.tanh(h @ (p[f"w{k}"] / s))
    return jnp.mean(h**2)


def _models():
    r = np.random.default_rng(0)
    n = lambda *s: r.normal(size=s)  # noqa: E731
    x = n(B, T, D)
    tok = r.integers(0, V, (B, T))
    tgt = r.integers(0, V2, (B, T))
    consts = {
        "mu": np.float32(0.7),
        "col": r.uniform(0.5, 1.5, F),
        "row": r.uniform(0.5, 1.5, F),
        "full": r.uniform(0.5, 1.5, (3, 3)),
    }
    return {
        "scale_literal": (_scale_literal, {"w1": n(D, F), "w2": n(F, 3)}, {"x": x}, consts),
        "scale_argument": (
            _scale_argument,
            {"w1": n(D, F), "w2": n(F, F), "w3": n(F, 3), "w4": n(3, 3)},
            {"x": x},
            consts,
        ),
        "chained": (_chained, {"w": n(6, D), "v": n(2 * T, D)}, {"x": x}, consts),
        "scan": (_scan, {"ws": n(3, D, D + 2)}, {"x": x}, consts),
        "two_slices": (_two_slices, {"w": n(D, F)}, {"x": x}, consts),
        "tied_slice": (
            _tied_slice, {"emb": n(V, DE), "wh": n(DE, DE)}, {"tok": tok, "tgt": tgt}, consts
        ),
        "take_along_axis": (
            _take_along_axis,
            {"emb": n(V, DE), "w": n(DE, 4), "u": n(DE + 3, 2)},
            {"tok": tok},
            consts,
        ),
        "repeated": (_repeated, {f"w{k}": n(D, D) for k in range(4)}, {"x": x}, consts),
    }


MODELS = _models()

# the leaves that must keep a fast (non-generic) site, with their layer kinds
FAST = {
    "scale_literal": {"w1": ["dense"], "w2": ["dense"]},
    "scale_argument": {"w1": ["dense"], "w2": ["dense"], "w3": ["dense"]},
    "chained": {"w": ["dense"], "v": ["dense"]},
    "scan": {"ws": ["dense"]},
    "two_slices": {"w": ["dense", "dense", "dense"]},
    "tied_slice": {"emb": ["embedding", "dense"]},
    "take_along_axis": {"emb": ["embedding"], "w": ["dense"], "u": ["dense"]},
    "repeated": {f"w{k}": ["dense"] for k in range(4)},
}


def _cast(tree, dtype):
    return jax.tree.map(
        lambda a: jnp.asarray(a, dtype) if np.issubdtype(np.asarray(a).dtype, np.floating)
        else jnp.asarray(a),
        tree,
    )


def _instance(name, dtype):
    loss, p, b, c = MODELS[name]
    return loss, _cast(p, dtype), _cast(b, dtype), _cast(c, dtype)


def _grads(loss, p, b, c):
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex), c)  # noqa: E731
    g = jax.jit(jax.vmap(jax.grad(one), (None, 0)))(p, b)
    return jax.tree.map(lambda a: np.asarray(a, np.float64), g)


def _kron(g):
    out = []
    for j in range(1, g.ndim):
        u = np.moveaxis(g, j, 1).reshape(B, g.shape[j], -1)
        m = np.einsum("bir,bjr->ij", u, u) / B
        out.append(m if g.shape[j] <= MAX_DIM else np.diagonal(m).copy())
    return tuple(out)


def _reference(p):
    """A reference gradient for per_example_dots (random, shaped like the parameters)."""
    r = np.random.default_rng(1)
    return jax.tree.map(lambda a: jnp.asarray(r.normal(size=np.shape(a)), a.dtype), p)


def _stats(clip, sign=True, cos=True):
    s = {
        "mean": js.stats.mean(),
        "second_moment": js.stats.second_moment(),
        "variance": js.stats.variance(),
        "sq_norms": js.stats.sq_norms(per_leaf=True),
        "clipped_mean": js.stats.clipped_mean(clip),
        "kron_moments": js.stats.kron_moments(MAX_DIM),
    }
    if sign:
        s["sign_mean"] = js.stats.sign_mean()
    if cos:  # phi(0) = 1: a sliced-away part of the leaf reads 1, not 0
        s["cos"] = js.stats.elementwise(jnp.cos)
    return s


def _oracle(g, clip, ref=None):
    o = {name: zoo.oracle_from_grads(g, name) for name in
         ("mean", "second_moment", "variance", "sign_mean")}
    o["sq_norms"] = zoo.oracle_from_grads(g, "sq_norms", per_leaf=True)
    o["clipped_mean"] = zoo.oracle_from_grads(g, "clipped_mean", clip_norm=clip)
    o["cos"] = jax.tree.map(lambda a: np.cos(a).mean(0), g)
    o["kron_moments"] = jax.tree.map(_kron, g)
    if ref is not None:
        o["dots"] = jax.tree.map(
            lambda a, r: (a * np.asarray(r, np.float64)[None]).reshape(B, -1).sum(1), g, ref
        )
    return o


def _clip(g):
    return float(np.median(np.sqrt(zoo.oracle_from_grads(g, "sq_norms"))))


def _assert_close(got, want, rtol, what):
    gp = jax.tree_util.tree_flatten_with_path(want)[0]
    gl = jax.tree.leaves(got)
    assert len(gl) == len(gp), what
    for (path, w), a in zip(gp, gl):
        a = np.asarray(a, np.float64)
        w = np.asarray(w, np.float64)
        where = f"{what}{jax.tree_util.keystr(path)}"
        assert a.shape == w.shape, f"{where}: shape {a.shape}, expected {w.shape}"
        scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 1e-12)
        err = float(np.max(np.abs(a - w))) / scale if w.size else 0.0
        assert err <= rtol, f"{where}: relative error {err:.2e} > {rtol:.0e}"


# --------------------------------------------------------------------------- #
# Statistics against the oracle
# --------------------------------------------------------------------------- #
@pytest.mark.slow  # the oracle matrix (test_oracle.py's kind)
@pytest.mark.parametrize("name", list(MODELS))
def test_float64_against_vmap_grad(name):
    """Every statistic, each leaf's one site running directly in the backward pass."""
    with zoo.x64():
        loss, p, b, c = _instance(name, jnp.float64)
        g = _grads(loss, p, b, c)
        clip = _clip(g)
        got = js.per_example_stat(loss, _stats(clip))(p, b, c)
        want = _oracle(g, clip)
        for k in got:
            _assert_close(got[k], want[k], 1e-10, f"{name} {k}")


@pytest.mark.slow  # the oracle matrix (test_oracle.py's kind)
@pytest.mark.parametrize("name", ["scan", "two_slices", "take_along_axis"])
def test_float64_chunks_with_a_remainder(name):
    """Chunks of 3 of 7 examples: a sliced view's values outside the slice are those of
    each chunk's own zero gradients, merged rather than continued."""
    with zoo.x64():
        loss, p, b, c = _instance(name, jnp.float64)
        g = _grads(loss, p, b, c)
        clip = _clip(g)
        got = js.per_example_stat(loss, _stats(clip), chunk_size=3)(p, b, c)
        want = _oracle(g, clip)
        for k in got:
            _assert_close(got[k], want[k], 1e-10, f"{name} {k}")


@pytest.mark.slow  # the oracle matrix (test_oracle.py's kind)
@pytest.mark.parametrize("name", list(MODELS))
def test_float64_per_example_dots(name):
    """Dots with a reference: each site contracts the reference sliced like its view."""
    with zoo.x64():
        loss, p, b, c = _instance(name, jnp.float64)
        g = _grads(loss, p, b, c)
        ref = _reference(p)
        got = js.per_example_stat(loss, js.stats.per_example_dots(ref, per_leaf=True))(p, b, c)
        _assert_close(got, _oracle(g, 1.0, ref)["dots"], 1e-10, f"{name} dots")


@pytest.mark.slow  # the oracle matrix (test_oracle.py's kind)
@pytest.mark.parametrize("name", list(MODELS))
def test_float32_against_float64_oracle(name):
    with zoo.x64():
        g = _grads(*_instance(name, jnp.float64))
    clip = _clip(g)
    loss, p, b, c = _instance(name, jnp.float32)
    got = js.per_example_stat(loss, _stats(clip, sign=False))(p, b, c)
    want = _oracle(g, clip)
    for k in got:
        _assert_close(got[k], want[k], 2e-4, f"{name} {k}")


# --------------------------------------------------------------------------- #
# explain: the site's fast rule, and the view it runs on
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", list(MODELS))
def test_explain_reports_the_fast_rule_and_the_view(name):
    loss, p, b, c = _instance(name, jnp.float32)
    rep = js.explain(loss)(p, b, c)
    leaves = {leaf.path: leaf for leaf in rep.leaves}
    for leaf_name, kinds in FAST[name].items():
        leaf = leaves[f"['{leaf_name}']"]
        assert sorted(leaf.kinds) == sorted(kinds), str(rep)
        for stat in ("mean", "second_moment", "variance", "sq_norms"):
            assert leaf.rules[stat] == "streamed", str(rep)
    assert rep.fallback_leaves == [], str(rep)


def test_explain_names_the_view():
    rep = js.explain(_chained)(*_instance("chained", jnp.float32)[1:])
    w = {leaf.path: leaf for leaf in rep.leaves}["['w']"]
    view = "view (the rules run on it): transpose (1, 0), reshaped, times a constant, divided by 3"
    assert view in w.detail, w.detail
    rep = js.explain(_two_slices)(*_instance("two_slices", jnp.float32)[1:])
    detail = rep.leaves[0].detail
    for view in ("slice [0:4, :]", "slice [4:6, :]", "slice [2:5, :], transpose (1, 0)"):
        assert view in detail, detail
    rep = js.explain(_scale_argument)(*_instance("scale_argument", jnp.float32)[1:])
    leaves = {leaf.path: leaf for leaf in rep.leaves}
    assert "scaled elementwise by a constant array along axis 1" in leaves["['w2']"].detail
    assert "scaled elementwise by a constant array along axis 0" in leaves["['w3']"].detail


def test_a_multiplier_varying_along_both_axes_stays_exact_per_example():
    """``x @ (W * M)`` with ``M`` varying along inputs and outputs folds into neither
    ``x`` nor ``dy``: the exact per-example VJP of the site (materialised)."""
    loss, p, b, c = _instance("scale_argument", jnp.float32)
    rep = js.explain(loss)(p, b, c)
    w4 = {leaf.path: leaf for leaf in rep.leaves}["['w4']"]
    assert w4.kinds == ["generic"] and w4.rule == "materialised", str(rep)


# --------------------------------------------------------------------------- #
# The views, unit by unit
# --------------------------------------------------------------------------- #
def test_take_along_axis_forms_are_embeddings():
    """``take_along_axis`` along the rows, on the table or on ``table[None]``; along
    the columns (not whole rows) keeps the per-example VJP."""
    r = np.random.default_rng(3)
    p = {"emb": jnp.asarray(r.normal(size=(V, DE)))}
    b = {"tok": jnp.asarray(r.integers(0, V, (B, T)))}

    def rows_2d(p, b):
        e = jax.vmap(lambda t: jnp.take_along_axis(p["emb"], t[:, None], axis=0))(b["tok"])
        return jnp.mean(jnp.sin(e))

    def rows_3d(p, b):
        e = jnp.take_along_axis(p["emb"][None], b["tok"][..., None], axis=1)
        return jnp.mean(jnp.sin(e))

    def columns(p, b):
        e = jnp.take_along_axis(p["emb"][None], b["tok"][:, None, :] % DE, axis=2)
        return jnp.mean(jnp.sin(e))

    for loss, kind in ((rows_2d, "embedding"), (rows_3d, "embedding"), (columns, "generic")):
        rep = js.explain(loss)(p, b)
        assert rep.leaves[0].kinds == [kind], (loss.__name__, str(rep))
        with zoo.x64():
            p64, b64 = _cast(p, jnp.float64), b
            g = _grads(lambda p, b, c, loss=loss: loss(p, b), p64, b64, None)
            got = js.per_example_stat(loss, _stats(1.0))(p64, b64)
            want = _oracle(g, 1.0)
            for k in got:
                _assert_close(got[k], want[k], 1e-10, f"{loss.__name__} {k}")


def test_strided_and_dynamic_slices_pad_with_a_zero_gradient():
    from jaxpr_surgery._src.analysis_types import LayoutOp
    from jaxpr_surgery._src.views import Step

    op = LayoutOp(Step.SLICE, (7, 5), (3, 2), start=(1, 2), stride=(2, 1))
    v = jnp.arange(6.0).reshape(3, 2) + 1
    full = op.inverse(v[None], fill=-1.0)[0]
    want = -np.ones((7, 5))
    want[1:6:2, 2:4] = np.asarray(v)
    np.testing.assert_array_equal(np.asarray(full), want)
    np.testing.assert_array_equal(np.asarray(op.forward(full[None])[0]), np.asarray(v))


def test_a_scale_defined_inside_a_call_returning_the_view_stays_exact():
    """A jitted helper that scales by a value it computes (not visible outside) is one
    parameter-only step, applied again at the site: exact, per-example VJP."""

    @jax.jit
    def scaled(w):
        return w * jnp.sqrt(jnp.asarray(2.0, w.dtype))

    def loss(p, b):
        return jnp.mean(jnp.sin(b["x"] @ scaled(p["w"])))

    with zoo.x64():
        r = np.random.default_rng(4)
        p = {"w": jnp.asarray(r.normal(size=(D, F)))}
        b = {"x": jnp.asarray(r.normal(size=(B, T, D)))}
        g = _grads(lambda p, b, c: loss(p, b), p, b, None)
        got = js.per_example_stat(loss, _stats(1.0))(p, b)
        want = _oracle(g, 1.0)
        for k in got:
            _assert_close(got[k], want[k], 1e-10, k)


def test_tied_square_table_gathered_through_a_transpose():
    """Regression: the ghost cross term of a tied table assumed the embedding gathers
    the leaf's rows; ``E.T[ids]`` with a square ``E`` gathers its columns, and the
    per-example norms (and clipping) came out wrong."""
    r = np.random.default_rng(5)
    n = 5
    b = {"tok": jnp.asarray(r.integers(0, n, (B, T))), "tgt": jnp.asarray(r.integers(0, n, (B, T)))}

    def loss(p, b):
        e = p["E"].T[b["tok"]]
        logits = jnp.tanh(e) @ p["E"].T
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, b["tgt"][..., None], -1))

    with zoo.x64():
        p = {"E": jnp.asarray(r.normal(size=(n, n)))}
        g = _grads(lambda p, b, c: loss(p, b), p, b, None)
        clip = _clip(g)
        stats = {"sq_norms": js.stats.sq_norms(), "clipped_mean": js.stats.clipped_mean(clip)}
        got = js.per_example_stat(loss, stats)(p, b)
        _assert_close(got["sq_norms"], zoo.oracle_from_grads(g, "sq_norms"), 1e-10, "norms")
        want = zoo.oracle_from_grads(g, "clipped_mean", clip_norm=clip)
        _assert_close(got["clipped_mean"], want, 1e-10, "clipped_mean")


def test_onehot_table_contracted_on_its_second_axis_with_phi_of_zero_not_zero():
    """Regression: at a one-hot embedding site whose table is contracted on its second
    axis (``einsum("btv,dv->btd", one_hot, E)``), a phi with phi(0) != 0 (the
    materialised per-example table) was mapped to the table's layout twice."""
    r = np.random.default_rng(6)
    b = {"tok": jnp.asarray(r.integers(0, V, (B, T)))}

    def loss(p, b):
        oh = jax.nn.one_hot(b["tok"], V, dtype=p["E"].dtype)
        return jnp.mean(jnp.sin(jnp.einsum("btv,dv->btd", oh, p["E"])) ** 2)

    with zoo.x64():
        p = {"E": jnp.asarray(r.normal(size=(DE, V)))}
        assert js.explain(loss)(p, b).leaves[0].kinds == ["onehot-embedding"]
        g = _grads(lambda p, b, c: loss(p, b), p, b, None)
        got = js.per_example_stat(loss, _stats(1.0))(p, b)
        want = _oracle(g, 1.0)
        for k in got:
            _assert_close(got[k], want[k], 1e-10, k)


def test_a_helper_returning_the_scaled_weight_keeps_the_fast_rule():
    """``jax.jit(lambda w, c: w * c)(W, c)``: the helper's input ``c`` is the value passed
    in, so the scale is the view's; one computed inside the helper is not (see above)."""
    helper = jax.jit(lambda w, c: w * c)

    def loss(p, b, c):
        return jnp.mean(jnp.sin(b["x"] @ helper(p["w"], c["mu"])))

    r = np.random.default_rng(7)
    p = {"w": r.normal(size=(D, F))}
    b = {"x": r.normal(size=(B, T, D))}
    c = {"mu": np.float32(0.7)}
    rep = js.explain(loss)(*(_cast(t, jnp.float32) for t in (p, b, c)))
    assert rep.leaves[0].kinds == ["dense"] and "times a constant" in rep.leaves[0].detail
    with zoo.x64():
        p, b, c = (_cast(t, jnp.float64) for t in (p, b, c))
        g = _grads(loss, p, b, c)
        got = js.per_example_stat(loss, _stats(1.0))(p, b, c)
        want = _oracle(g, 1.0)
        for k in got:
            _assert_close(got[k], want[k], 1e-10, k)


def test_clipping_under_remat_folds_the_view_scale():
    """Clipped sums under ``jax.checkpoint`` run a second, reweighted backward pass
    (plans.clips_by_recompute): its sites must apply the view's scale as the first pass
    does, or ``x @ (W / 16)`` clips 16 times too large a gradient."""

    def loss(p, b):
        h = jax.checkpoint(lambda x: jnp.tanh(x @ (p["w"] / 16.0)))(b["x"])
        return jnp.mean((h @ p["v"] - b["y"]) ** 2)

    r = np.random.default_rng(3)
    with zoo.x64():
        p = {"w": jnp.asarray(r.standard_normal((5, 4))),
             "v": jnp.asarray(r.standard_normal((4,)))}
        b = {"x": jnp.asarray(r.standard_normal((6, 5))),
             "y": jnp.asarray(r.standard_normal((6,)))}
        g = jax.jit(jax.vmap(jax.grad(lambda p, x, y: loss(p, {"x": x[None], "y": y[None]})),
                     in_axes=(None, 0, 0)))(p, b["x"], b["y"])
        norms = np.sqrt(sum(np.sum(np.asarray(x).reshape(6, -1) ** 2, 1) for x in g.values()))
        C = float(np.median(norms))
        fac = np.minimum(1.0, C / norms)
        got = js.per_example_stat(loss, js.stats.clipped_mean(C))(p, b)
        for k in p:
            want = np.tensordot(fac, np.asarray(g[k]), axes=(0, 0)) / 6
            np.testing.assert_allclose(got[k], want, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- #
# Parameter-only calls: position tables looked up by constant positions inside a jit
# (jnp.take, Flax nn.Embed on arange as in Hugging Face GPT-2 and BERT)
# --------------------------------------------------------------------------- #
def _positions_model(kind):
    @jax.jit
    def scaled(t):  # a parameter-only jit whose input is already transformed
        return 2.0 * t

    def loss(p, b):
        T = b["x"].shape[1]
        if kind == "take":
            pos = jnp.take(p["pos"], jnp.arange(T), axis=0)
        elif kind == "nested":
            pos = jax.jit(lambda t: jnp.take(t, jnp.arange(T) % 3, axis=0) * 0.5)(p["pos"])
        else:  # "pre": sliced outside, then through a jit
            pos = scaled(p["pos"][:T] + 1.0)
        h = jnp.tanh(b["x"] @ p["w"] + pos)
        return jnp.mean(jnp.sum(h * b["y"], axis=(-1, -2)))

    return loss


@pytest.mark.parametrize("kind", ["take", "nested", "pre"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_parameter_only_calls_are_sites_not_fallbacks(kind, dtype):
    def run():
        r = np.random.default_rng(5)
        B, T, d = 5, 4, 3
        p = {"pos": jnp.asarray(r.standard_normal((6, d)), dtype),
             "w": jnp.asarray(r.standard_normal((d, d)), dtype)}
        b = {"x": jnp.asarray(r.standard_normal((B, T, d)), dtype),
             "y": jnp.asarray(r.standard_normal((B, T, d)), dtype)}
        loss = _positions_model(kind)
        rep = js.explain(loss, js.stats.second_moment())(p, b)
        assert not rep.fallback_leaves, str(rep)
        got = js.per_example_stat(
            loss, (js.stats.mean(), js.stats.variance(), js.stats.sq_norms()))(p, b)
        g = zoo.vmap_grads(loss, p, b)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-11)
        mean, var = zoo.oracle_from_grads(g, "mean"), zoo.oracle_from_grads(g, "variance")
        for k in p:
            np.testing.assert_allclose(got[0][k], mean[k], **tol)
            np.testing.assert_allclose(got[1][k], var[k], **tol)
        np.testing.assert_allclose(got[2], zoo.oracle_from_grads(g, "sq_norms"), **tol)

    if dtype == jnp.float64:
        zoo.in_x64(run)
    else:
        run()

"""Bad input gets a clear error (type and message); NaN propagates like jax.grad;
zero-gradient examples give no NaN; check_per_example catches batch norm."""

from __future__ import annotations

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from jax import lax

import jaxpr_surgery as js


@pytest.fixture(scope="module")
def mlp():
    return M.get("mlp")


def _mean_fn(loss=None, **kw):
    return js.per_example_stat(loss or M.mlp_loss, js.stats.mean(), **kw)


# --------------------------------------------------------------------------- #
# The loss
# --------------------------------------------------------------------------- #
def test_loss_not_scalar(mlp):
    _, params, batch = mlp

    def per_example_losses(p, b):
        return jax.vmap(lambda x, y: M.mlp_loss(p, {"x": x[None], "y": y[None]}))(b["x"], b["y"])

    with pytest.raises(ValueError, match="scalar"):
        _mean_fn(per_example_losses)(params, batch)


def test_loss_integer(mlp):
    _, params, batch = mlp
    with pytest.raises(ValueError, match="scalar floating-point loss"):
        _mean_fn(lambda p, b: jnp.sum(b["y"]))(params, batch)


def test_has_aux_but_fn_returns_scalar(mlp):
    _, params, batch = mlp
    with pytest.raises(TypeError, match="has_aux=True requires fn to return a pair"):
        _mean_fn(has_aux=True)(params, batch)


def test_fn_not_callable():
    with pytest.raises(TypeError, match="callable"):
        js.per_example_stat("not a function", js.stats.mean())


# --------------------------------------------------------------------------- #
# The batch
# --------------------------------------------------------------------------- #
def test_batch_leaves_with_different_leading_sizes(mlp):
    _, params, batch = mlp
    bad = {"x": batch["x"], "y": batch["y"][:-1]}
    with pytest.raises(ValueError, match="different leading sizes"):
        _mean_fn()(params, bad)


def test_empty_batch(mlp):
    _, params, batch = mlp
    empty = jax.tree.map(lambda x: x[:0], batch)
    with pytest.raises(ValueError, match="empty"):
        _mean_fn()(params, empty)


def test_scalar_batch_leaf(mlp):
    _, params, batch = mlp
    with pytest.raises(ValueError, match="leading example axis"):
        _mean_fn(lambda p, b: M.mlp_loss(p, b) * b["t"])(params, {**batch, "t": jnp.float32(2)})


def test_batch_with_no_arrays(mlp):
    _, params, _ = mlp
    with pytest.raises(ValueError, match="hold no arrays"):
        _mean_fn(lambda p, b: jnp.sum(p["l1"]["w"]))(params, {})


# --------------------------------------------------------------------------- #
# argnums / batch_argnums
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(argnums=2), "argnums=2 is out of range"),
        (dict(argnums=-3), "argnums=-3 is out of range"),
        (dict(batch_argnums=5), "batch_argnums=5 is out of range"),
        (dict(argnums=1, batch_argnums=1), "overlap"),
        (dict(argnums=(0, 1)), "overlap"),
        (dict(argnums=(0, 0), batch_argnums=1), "same argument twice"),
        (dict(argnums=()), "at least one"),
    ],
)
def test_argnums_errors(mlp, kw, match):
    _, params, batch = mlp
    with pytest.raises(ValueError, match=match):
        _mean_fn(**kw)(params, batch)


def test_argnums_wrong_type(mlp):
    _, params, batch = mlp
    with pytest.raises(TypeError, match="argnums must be an int or a tuple of ints"):
        _mean_fn(argnums="0")(params, batch)


# --------------------------------------------------------------------------- #
# Parameters
# --------------------------------------------------------------------------- #
def test_integer_parameter_leaf_is_skipped(mlp):
    """Integer leaves are skipped as under eqx.filter_grad (tests/test_nonfloat_leaves.py);
    complex leaves raise, naming the leaf and its dtype."""
    _, params, batch = mlp
    out = _mean_fn()({**params, "step": jnp.int32(3)}, batch)
    assert out["step"] is None
    with pytest.raises(NotImplementedError, match=r"\['z'\].*complex64"):
        _mean_fn()({**params, "z": jnp.ones(2, jnp.complex64)}, batch)


def test_non_array_parameter_leaf_is_static(mlp):
    """Non-array leaves are static (the eqx.filter_grad convention): passed through,
    None in every statistic."""
    loss, params, batch = mlp
    odd = {**params, "act": "tanh", "flag": True, "fn": jnp.tanh}
    out = _mean_fn()(odd, batch)
    assert out["act"] is None and out["flag"] is None and out["fn"] is None
    ref = _mean_fn()(params, batch)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves({k: out[k] for k in params}),
                    strict=True):
        np.testing.assert_allclose(a, b)


# --------------------------------------------------------------------------- #
# Statistics and options
# --------------------------------------------------------------------------- #
def test_not_a_statistic():
    with pytest.raises(TypeError, match="is not a statistic"):
        js.per_example_stat(M.mlp_loss, "mean")
    with pytest.raises(TypeError, match="is not a statistic"):
        js.per_example_stat(M.mlp_loss, {"m": js.stats.mean(), "bad": 3})
    with pytest.raises(TypeError, match="is not a statistic"):
        js.per_example_stat(M.mlp_loss, js.stats.mean)  # the constructor, not a statistic


class _JunkList(js.stats.Statistic):
    def reductions(self):
        return ["square"]

    def finalize(self, values, count):
        return values


class _JunkValue(js.stats.Statistic):
    def reductions(self):
        return {"s": "square"}

    def finalize(self, values, count):
        return values


class _Empty(js.stats.Statistic):
    def reductions(self):
        return {}

    def finalize(self, values, count):
        return values


def test_reductions_returning_junk():
    with pytest.raises(TypeError, match="must return a non-empty mapping"):
        js.per_example_stat(M.mlp_loss, _JunkList())
    with pytest.raises(TypeError, match="must return a non-empty mapping"):
        js.per_example_stat(M.mlp_loss, _Empty())
    with pytest.raises(TypeError, match=r"\['s'\] is 'square', not a reduction"):
        js.per_example_stat(M.mlp_loss, _JunkValue())


def test_empty_stat_tree():
    with pytest.raises(TypeError, match="empty tree"):
        js.per_example_stat(M.mlp_loss, {})


class _Pow(js.stats.Statistic):
    """A user's statistic whose reductions() builds a new PhiSum (and lambda) per call."""

    def __init__(self, p=4):
        self.p = p

    def reductions(self):
        p = self.p
        return {"p": js.stats.PhiSum(lambda g: g**p, multiplicative=True, name="pow")}

    def finalize(self, values, count):
        return jax.tree.map(lambda s: s / count, values["p"])


def test_same_name_for_different_functions_is_refused(mlp):
    """Regression: elementwise(cos, name="f") and elementwise(exp, name="f") silently
    shared one reduction (both gave E[cos g])."""
    cos = js.stats.elementwise(jnp.cos, name="f")
    exp = js.stats.elementwise(jnp.exp, name="f")
    for stat in ({"c": cos, "e": exp}, (cos, [exp])):
        with pytest.raises(ValueError, match=r"name='f'.*cos.*exp") as err:
            js.per_example_stat(M.mlp_loss, stat)
        msg = str(err.value)
        assert "stat" in msg and "different name" in msg
    with pytest.raises(ValueError, match=r"\['c'\].*\['e'\]"):
        js.value_and_per_example_stat(M.mlp_loss, {"c": cos, "e": exp})
    with pytest.raises(ValueError, match="name='pow'"):
        js.per_example_stat(M.mlp_loss, (_Pow(4), _Pow(3)))
    with pytest.raises(ValueError, match="name='f'"):
        js.explain(M.mlp_loss, {"c": cos, "e": exp})(*mlp[1:])


def test_same_name_for_the_same_function_is_shared(mlp):
    _, params, batch = mlp
    a, b = js.stats.elementwise(jnp.cos, name="f"), js.stats.elementwise(jnp.cos, name="f")
    out = js.per_example_stat(M.mlp_loss, (a, b, js.stats.elementwise(jnp.exp)))(params, batch)
    alone = js.per_example_stat(M.mlp_loss, js.stats.elementwise(jnp.exp))(params, batch)
    M.assert_tree_close(out[0], out[1])
    M.assert_tree_close(out[2], alone)
    # a statistic building the same lambda afresh in each reductions() call
    p4 = js.per_example_stat(M.mlp_loss, (_Pow(4), _Pow(4)))(params, batch)
    M.assert_tree_close(p4[0], p4[1])
    want = jax.tree.map(lambda g: np.mean(np.asarray(g, np.float64) ** 4, 0),
                        M.per_example_grads(M.mlp_loss, params, batch))
    M.assert_tree_close(p4[0], want, rtol=1e-4)


def test_same_name_judges_functions_by_code_and_environment():
    """One name for functions rebuilt alike (closures, partials, jit wrappers) is shared;
    a different captured value, argument or code is a clash."""
    import functools

    def power(p):
        return lambda g: g**p

    def scaled(a):
        return lambda g: g * a

    arr = np.ones(3)
    same = [(power(4), power(4)), (power(np.float32(2.5)), power(np.float32(2.5))),
            (functools.partial(jnp.power, x2=2), functools.partial(jnp.power, x2=2)),
            (jax.jit(power(3)), jax.jit(power(3))), (scaled(arr), scaled(arr))]
    differ = [(power(4), power(3)), (functools.partial(jnp.power, x2=2),
                                     functools.partial(jnp.power, x2=3)),
              (jax.jit(power(3)), jax.jit(power(2))), (scaled(arr), scaled(np.ones(3))),
              (power(2), scaled(2.0))]
    for f, g in same:
        js.per_example_stat(M.mlp_loss, (js.stats.elementwise(f, name="n"),
                                         js.stats.elementwise(g, name="n")))
    for f, g in differ:
        with pytest.raises(ValueError, match="name='n'"):
            js.per_example_stat(M.mlp_loss, (js.stats.elementwise(f, name="n"),
                                             js.stats.elementwise(g, name="n")))


@pytest.mark.parametrize("clip", [0, 0.0, -1.0, float("nan")])
@pytest.mark.parametrize("ctor", [js.stats.clipped_mean, js.stats.clipped_sum])
def test_clip_norm_not_positive(ctor, clip):
    with pytest.raises(ValueError, match="clip_norm must be a positive number"):
        ctor(clip)


def test_other_constructor_arguments():
    with pytest.raises(ValueError, match="ddof must be a non-negative int"):
        js.stats.variance(ddof=-1)
    with pytest.raises(TypeError, match="phi must be callable"):
        js.stats.elementwise(2.0)


@pytest.mark.parametrize("chunk", [0, -2, 1.5])
def test_chunk_size_invalid(mlp, chunk):
    _, params, batch = mlp
    with pytest.raises(ValueError, match="chunk_size must be a positive int, None"):
        _mean_fn(chunk_size=chunk)(params, batch)


# --------------------------------------------------------------------------- #
# strict=True
# --------------------------------------------------------------------------- #
def _cond_loss(p, b):
    # the branch depends on a sum over the batch (examples interact: check=False below)
    h = jnp.tanh(b["x"] @ p["w_dense"])
    h = lax.cond(jnp.sum(b["x"]) > 0, lambda h, w: jnp.tanh(h @ w), lambda h, w: h @ w,
                 h, p["w_cond"])
    return jnp.mean(jnp.sum(jnp.square(h), axis=-1))


def _cond_case():
    r = np.random.default_rng(4)
    p = {"w_dense": jnp.asarray(r.standard_normal((3, 4)) * 0.5, jnp.float32),
         "w_cond": jnp.asarray(r.standard_normal((4, 4)) * 0.5, jnp.float32)}
    return p, {"x": jnp.asarray(r.standard_normal((M.B, 3)), jnp.float32)}


def test_strict_raises_naming_the_leaf_inside_cond():
    p, b = _cond_case()
    with pytest.raises(NotImplementedError, match=r"\['w_cond'\]") as e:
        js.per_example_stat(_cond_loss, js.stats.second_moment(), strict=True,
                            check=False)(p, b)
    assert "['w_dense']" not in str(e.value), "w_dense has a fast rule and must not be named"
    assert "cond" in str(e.value)


def test_non_strict_falls_back_exactly_inside_cond():
    p, b = _cond_case()
    stat = {k: M.STATS[k]() for k in ("mean", "second_moment", "variance", "sq_norms",
                                      "clipped_mean")}
    out = jax.jit(js.per_example_stat(_cond_loss, stat, check=False))(p, b)
    ora = M.oracle(_cond_loss, p, b)
    for k in stat:
        M.assert_stat_close(k, out[k], ora[k])
    rep = js.explain(_cond_loss)(p, b)
    assert rep.fallback_leaves == ["['w_cond']"], str(rep)


# --------------------------------------------------------------------------- #
# Numerics at the edges
# --------------------------------------------------------------------------- #
def test_nan_in_data_propagates_like_jax_grad(mlp):
    loss, params, batch = mlp
    x = np.array(batch["x"])
    x[2, 1] = np.nan
    bad = {**batch, "x": jnp.asarray(x)}
    stat = M.all_stats()
    out = jax.jit(js.per_example_stat(loss, stat))(params, bad)  # no crash
    ora = M.oracle(loss, params, bad)
    # NaN exactly where the vmap(grad) oracle has NaN, equal elsewhere; the clipped
    # statistics drop the example instead (nonfinite="drop", tests/test_empty_batches.py)
    clipped = ("clipped_mean", "clipped_sum")
    for k in M.STAT_NAMES:
        if k in clipped:
            continue
        for a, e in zip(jax.tree.leaves(out[k]), jax.tree.leaves(ora[k]), strict=True):
            np.testing.assert_array_equal(np.isnan(np.asarray(a)), np.isnan(e), err_msg=k)
    rest = M.oracle(loss, params, jax.tree.map(lambda a: np.delete(np.asarray(a), 2, 0), bad))
    B = x.shape[0]
    M.assert_tree_close(out["clipped_sum"], rest["clipped_sum"])
    M.assert_tree_close(out["clipped_mean"], jax.tree.map(lambda a: a * (B - 1) / B,
                                                          rest["clipped_mean"]))
    kept = jax.jit(js.per_example_stat(loss, js.stats.clipped_sum(M.CLIP, "propagate")))(
        params, bad)
    assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree.leaves(kept))
    sq = np.asarray(out["sq_norms"])
    assert np.isnan(sq[2]) and np.all(np.isfinite(np.delete(sq, 2))), sq
    M.assert_stat_close("sq_norms", sq, ora["sq_norms"])
    assert np.all(np.isnan(np.asarray(jax.tree.leaves(out["mean"])[0])))


def _masked_loss(p, b):
    h = jnp.tanh(b["x"] @ p["l1"]["w"] + p["l1"]["b"])
    logits = h @ p["l2"]["w"] + p["l2"]["b"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, b["y"][:, None], axis=-1)[:, 0]
    return jnp.mean(b["weight"] * nll)


def test_zero_gradient_examples_give_no_nan(mlp):
    _, params, batch = mlp
    weight = jnp.array([1, 0, 1, 1, 0, 1, 1, 0], jnp.float32)
    b = {**batch, "weight": weight}
    names = ("norms", "sq_norms", "clipped_mean", "clipped_sum", "mean", "variance", "sign_mean")
    out = jax.jit(js.per_example_stat(_masked_loss, {k: M.STATS[k]() for k in names}))(params, b)
    for k in names:
        for x in jax.tree.leaves(out[k]):
            assert np.all(np.isfinite(np.asarray(x))), k
    np.testing.assert_array_equal(np.asarray(out["norms"])[[1, 4, 7]], 0.0)
    ora = M.oracle(_masked_loss, params, b)
    for k in names:
        M.assert_stat_close(k, out[k], ora[k])


def test_all_examples_zero_gradient():
    """Every g_b = 0: clipped statistics are 0, snr is 0 (not NaN), norms 0."""
    p = {"w": jnp.ones((3,))}
    b = {"x": jnp.ones((M.B, 3)), "weight": jnp.zeros((M.B,))}
    stat = {"cm": js.stats.clipped_mean(1.0), "n": js.stats.norms(), "snr": js.stats.snr()}
    out = jax.jit(js.per_example_stat(lambda p, b: jnp.mean(b["weight"] * (b["x"] @ p["w"])),
                                      stat))(p, b)
    np.testing.assert_array_equal(out["cm"]["w"], 0.0)
    np.testing.assert_array_equal(out["n"], 0.0)
    np.testing.assert_array_equal(out["snr"]["w"], 0.0)


# --------------------------------------------------------------------------- #
# check_per_example
# --------------------------------------------------------------------------- #
def _batchnorm_loss(p, b):
    z = b["x"] @ p["w"]
    z = (z - jnp.mean(z, axis=0)) / jnp.sqrt(jnp.var(z, axis=0) + 1e-5)  # batch statistics
    h = jnp.tanh(z * p["g"] + p["b"])
    return jnp.mean(jnp.sum(jnp.square(h - b["y"]), axis=-1))


def test_check_per_example_rejects_batch_norm():
    r = np.random.default_rng(5)
    f32 = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.float32)  # noqa: E731
    p = {"w": f32(3, 4), "g": jnp.ones(4), "b": jnp.zeros(4)}
    b = {"x": f32(M.B, 3), "y": f32(M.B, 4)}
    with pytest.raises(ValueError, match="examples of this model interact"):
        js.check_per_example(_batchnorm_loss)(p, b)


def test_check_per_example_rejects_in_batch_normalisation(mlp):
    _, params, batch = mlp
    # normalising by the whole batch's total instead of per example
    def loss(p, b):
        return jnp.sum(b["x"] @ p["l1"]["w"]) / jnp.sum(jnp.abs(b["x"]))

    with pytest.raises(ValueError, match="interact"):
        js.check_per_example(loss)(params, batch)


def test_check_per_example_passes_on_mlp(mlp):
    loss, params, batch = mlp
    assert js.check_per_example(loss)(params, batch) is None
    loss_t, params_t, batch_t = M.get("tied")
    assert js.check_per_example(loss_t)(params_t, batch_t) is None


@jax.custom_vjp
def _soft_clip(x):
    """tanh with a hand-written backward (a custom-gradient op, as in Griffin/Hawk)."""
    return jnp.tanh(x)


def _soft_clip_fwd(x):
    y = jnp.tanh(x)
    return y, y


def _soft_clip_bwd(y, g):
    return (g * (1 - y * y),)


_soft_clip.defvjp(_soft_clip_fwd, _soft_clip_bwd)


@jax.custom_vjp
def _batch_scaled_grad(x):
    """Identity whose backward rescales the cotangent by a statistic of the whole batch:
    the examples interact through the gradient only."""
    return x


def _bsg_fwd(x):
    return x, None


def _bsg_bwd(_, g):
    return (g / jnp.mean(jnp.abs(g)),)


_batch_scaled_grad.defvjp(_bsg_fwd, _bsg_bwd)


def _custom_vjp_case():
    r = np.random.default_rng(9)
    f32 = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.float32)  # noqa: E731
    p = {"w": f32(3, 4), "v": f32(4)}
    b = {"x": f32(6, 3), "y": f32(6)}
    return p, b


def test_check_per_example_supports_custom_vjp_ops():
    """Regression: the gradient comparison used forward mode and raised TypeError ("can't
    apply forward-mode autodiff (jvp) to a custom_vjp function") on models with a
    custom-gradient op; it compares reverse-mode gradients along a random direction."""
    p, b = _custom_vjp_case()

    def loss(p, b):
        return jnp.mean((_soft_clip(b["x"] @ p["w"]) @ p["v"] - b["y"]) ** 2)

    assert js.check_per_example(loss)(p, b) is None
    assert js.check_per_example(lambda p, b: 3.0 * b["x"].shape[0] * loss(p, b))(p, b) is None
    with M.x64():
        p64, b64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (p, b))
        assert js.check_per_example(loss)(p64, b64) is None

    def leaky(p, b):  # value per example, gradient scaled by a batch statistic
        per = (_soft_clip(b["x"] @ p["w"]) @ p["v"] - b["y"]) ** 2
        s = jnp.std(b["x"] @ p["w"])
        return jnp.mean(per) + jnp.mean(per) * (s - jax.lax.stop_gradient(s))

    with pytest.raises(ValueError, match="gradients do not"):
        js.check_per_example(leaky)(p, b)

    def hidden(p, b):  # the interaction lives in a custom backward pass
        h = _batch_scaled_grad(b["x"] @ p["w"])
        return jnp.mean((_soft_clip(h) @ p["v"] - b["y"]) ** 2)

    with pytest.raises(ValueError, match="gradients do not"):
        js.check_per_example(hidden)(p, b)


def test_check_per_example_with_aux_and_several_argnums():
    p, b = _custom_vjp_case()

    def loss(w, v, b):
        out = jnp.mean((_soft_clip(b["x"] @ w) @ v - b["y"]) ** 2)
        return out, {"n": jnp.asarray(3)}

    assert js.check_per_example(loss, argnums=(0, 1), batch_argnums=2, has_aux=True)(
        p["w"], p["v"], b) is None


# --------------------------------------------------------------------------- #
# A user's statistic never aliases a built-in of the same name
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", ["square", "sign", "abs", "identity"])
def test_user_names_do_not_alias_builtins(name):
    loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)  # noqa: E731
    r = np.random.default_rng(3)
    w = jnp.asarray(r.standard_normal(3), jnp.float32)
    b = {"x": jnp.asarray(r.standard_normal((5, 3)), jnp.float32),
         "y": jnp.asarray(r.standard_normal(5), jnp.float32)}
    cube = js.stats.elementwise(lambda g: g**3, multiplicative=True, name=name)
    builtin = {"square": js.stats.second_moment(), "sign": js.stats.sign_mean(),
               "abs": js.stats.abs_mean(), "identity": js.stats.mean()}[name]
    got_cube, got_b = js.per_example_stat(loss, (cube, builtin))(w, b)
    g = zoo.vmap_grads(loss, w, b)
    cube_ref = zoo.oracle_from_grads(g, "elementwise", phi=lambda x: x**3)
    np.testing.assert_allclose(got_cube, cube_ref, rtol=1e-5)
    ref = {"square": "second_moment", "sign": "sign_mean", "abs": "abs_mean",
           "identity": "mean"}[name]
    np.testing.assert_allclose(got_b, zoo.oracle_from_grads(g, ref), rtol=1e-5)


# --------------------------------------------------------------------------- #
# Clipping bounds; estimates undefined at the batch size
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), np.float32(0), np.float64("nan"),
                                 np.float32(-2), jnp.asarray(-1.0), jnp.asarray(0.0)])
def test_bad_concrete_clip_bounds_raise(bad):
    with pytest.raises(ValueError, match="clip_norm"):
        js.stats.clipped_mean(bad)
    with pytest.raises(ValueError, match="clip_norm"):
        js.stats.clipped_sum(bad)


def test_concrete_numpy_bound_works():
    loss = lambda w, b: jnp.mean((b["x"] @ w) ** 2)  # noqa: E731
    w, b = jnp.ones(3), {"x": jnp.arange(12.0).reshape(4, 3)}
    a = js.per_example_stat(loss, js.stats.clipped_mean(np.float32(2.0)))(w, b)
    c = js.per_example_stat(loss, js.stats.clipped_mean(2.0))(w, b)
    np.testing.assert_allclose(a, c)


@pytest.mark.parametrize("bound", [float("nan"), 0.0, -1.0])
def test_traced_bad_bound_poisons(bound):
    loss = lambda w, b: jnp.mean((b["x"] @ w) ** 2)  # noqa: E731
    w, b = jnp.ones(3), {"x": jnp.arange(12.0).reshape(4, 3)}
    f = jax.jit(lambda w, b, C: js.per_example_stat(loss, js.stats.clipped_mean(C))(w, b))
    out = f(w, b, jnp.float32(bound))
    assert np.all(np.isnan(out)), out
    ok = f(w, b, jnp.float32(np.inf))
    np.testing.assert_allclose(ok, jax.grad(loss)(w, b), rtol=1e-5)


@pytest.mark.parametrize("stat,B", [(lambda: js.stats.variance(), 1),
                                    (lambda: js.stats.variance(ddof=3), 3),
                                    (lambda: js.stats.snr(), 1),
                                    (lambda: js.stats.gradient_noise_scale(), 1)])
def test_undefined_estimates_raise(stat, B):
    loss = lambda w, b: jnp.mean((b["x"] @ w) ** 2)  # noqa: E731
    w, b = jnp.ones(3), {"x": jnp.arange(3.0 * B).reshape(B, 3)}
    with pytest.raises(ValueError, match=f"B={B}"):
        js.per_example_stat(loss, stat())(w, b)


# --------------------------------------------------------------------------- #
# check_per_example compares gradients, accepts sum losses; aux must be arrays
# --------------------------------------------------------------------------- #
def test_check_per_example_catches_gradient_only_interaction():
    w, b = M.lin_case()

    def loss(w, b):  # value: the mean loss; gradient scaled by a batch statistic
        per = (b["x"] @ w - b["y"]) ** 2
        s = jnp.std(b["x"] @ w)
        return jnp.mean(per) + jnp.mean(per) * (s - jax.lax.stop_gradient(s))

    # the loss value equals the mean of per-example losses ...
    np.testing.assert_allclose(loss(w, b), jnp.mean((b["x"] @ w - b["y"]) ** 2), rtol=1e-6)
    with pytest.raises(ValueError, match="gradients do not"):
        js.check_per_example(loss)(w, b)


def test_check_per_example_accepts_sum_losses_and_rejects_jit():
    w, b = M.lin_case()
    sum_loss = lambda w, b: jnp.sum((b["x"] @ w - b["y"]) ** 2)  # noqa: E731
    assert js.check_per_example(sum_loss)(w, b) is None
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda w, b: js.check_per_example(sum_loss)(w, b))(w, b)
    with pytest.raises(ValueError, match="empty"):
        js.check_per_example(sum_loss)(w, {"x": b["x"][:0], "y": b["y"][:0]})


def test_string_in_aux_is_a_clear_error():
    w, b = M.lin_case()

    def loss(w, b):
        return jnp.mean((b["x"] @ w - b["y"]) ** 2), {"note": "hello"}

    with pytest.raises(TypeError, match="not an array in its aux output"):
        js.per_example_stat(loss, js.stats.mean(), has_aux=True)(w, b)


# --------------------------------------------------------------------------- #
# Every entry point names itself
# --------------------------------------------------------------------------- #
_ENTRIES = {
    "per_example_stat": js.per_example_stat,
    "value_and_per_example_stat": js.value_and_per_example_stat,
    "per_example_partial": js.per_example_partial,
    "explain": js.explain,
}


def _bad_calls(params, batch):
    B = batch["x"].shape[0]
    return {
        "batch sizes": (lambda f: f(params, {"x": batch["x"], "y": batch["y"][:-1]}),
                        ValueError, "different leading sizes"),
        "empty batch": (lambda f: f(params, jax.tree.map(lambda x: x[:0], batch)),
                        ValueError, "the batch is empty"),
        "weights shape": (lambda f: f(params, batch, example_weights=jnp.ones((B, 1))),
                          ValueError, r"must have shape \(8,\), one entry per example"),
        "weights shape, jit": (lambda f: jax.jit(lambda w: f(params, batch, example_weights=w))(
            jnp.ones((B, 1))), ValueError, r"must have shape \(8,\)"),
        "negative weights": (lambda f: f(params, batch, example_weights=-jnp.ones(B)),
                             ValueError, "negative at examples"),
        "padding dtype": (lambda f: f(params, batch, is_padding_example=jnp.zeros(B)),
                          TypeError, "must be a bool array"),
        "both": (lambda f: f(params, batch, example_weights=jnp.ones(B),
                             is_padding_example=jnp.zeros(B, bool)), ValueError, "not both"),
    }


@pytest.mark.parametrize("entry", list(_ENTRIES))
def test_each_entry_point_names_itself(mlp, entry):
    """A user error names the function the user called (per_example_stat used to say
    value_and_per_example_stat), and an eager call's weights of the wrong shape speak
    of the batch, not of a device."""
    _, params, batch = mlp
    f = _ENTRIES[entry](M.mlp_loss, js.stats.variance())
    for what, (call, err, match) in _bad_calls(params, batch).items():
        with pytest.raises(err, match=match) as info:
            call(f)
        msg = str(info.value)
        assert msg.startswith(f"{entry}: "), (what, msg)
        assert "device" not in msg, (what, msg)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (fake CPU) devices: conftest.py")
def test_weights_of_the_wrong_shape_per_device_say_so():
    """Under axis_name each device passes the weights of its own examples: there the
    message says so."""
    _, params, batch = M.get("mlp")
    f = js.per_example_stat(M.mlp_loss, js.stats.mean(), axis_name="i")
    split = jax.tree.map(lambda x: x.reshape((2, -1) + x.shape[1:]), batch)
    B = split["x"].shape[1]
    g = jax.pmap(lambda b, w: f(params, b, example_weights=w), axis_name="i")
    with pytest.raises(ValueError, match=r"per_example_stat: example_weights must have shape "
                                         rf"\({B},\).*on this device: each device passes"):
        g(split, jnp.ones((2, 2 * B)))

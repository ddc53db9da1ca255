"""``jaxpr_surgery.extend``: custom_vjp and custom_jvp ops registered with a reference
function or a rule.

A registered op is differentiated as its reference: the layers inside get the package's
rules (explain says ``streamed`` where it said ``materialised``) and every statistic equals
vmap(grad) of the model as JAX differentiates it (through the op's own backward pass).
``check_rule`` catches a reference that is not what the op computes or whose derivative
is not the op's backward.
"""

from __future__ import annotations

import functools

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery as js

B, T, D, F = 5, 3, 4, 6


# a fused dense layer: x @ w with a hand-written backward pass
@jax.custom_vjp
def dense(w, x):
    return x @ w


def _dense_fwd(w, x):
    return x @ w, (w, x)


def _dense_bwd(res, dy):
    w, x = res
    return jnp.einsum("...i,...j->ij", x, dy), dy @ w.T


dense.defvjp(_dense_fwd, _dense_bwd)


# a fused affine layer on a dict of parameters
@jax.custom_vjp
def affine(p, x):
    return x @ p["w"] + p["b"]


def _affine_bwd(res, dy):
    p, x = res
    sum_axes = tuple(range(dy.ndim - 1))
    dp = {"w": jnp.einsum("...i,...j->ij", x, dy), "b": jnp.sum(dy, axis=sum_axes)}
    return dp, dy @ p["w"].T


affine.defvjp(lambda p, x: (affine.fun(p, x), (p, x)), _affine_bwd)


def _dense_ref(w, x):
    return x @ w


def _affine_ref(p, x):
    return jnp.einsum("...i,ij->...j", x, p["w"]) + p["b"]


def _loss(p, batch):
    h = jnp.tanh(affine(p["in"], batch["x"]))  # [b, T, F]

    def layer(h, w):
        return jnp.tanh(dense(w, h)), None

    h, _ = jax.lax.scan(layer, h, p["stack"])  # the op inside a scan
    h = jax.checkpoint(lambda h: jnp.tanh(dense(p["mid"], h)))(h)  # inside a remat
    out = jax.jit(dense)(p["out"], h)  # inside a jit
    return jnp.mean(jnp.sum((out - batch["y"]) ** 2, axis=(1, 2)))


def _case(dtype=jnp.float64):
    r = np.random.default_rng(0)

    def a(*shape, s=1.0):
        return jnp.asarray(r.normal(size=shape) * s, dtype)

    p = {
        "in": {"w": a(D, F, s=0.5), "b": a(F, s=0.1)},
        "stack": a(2, F, F, s=0.4),
        "mid": a(F, F, s=0.4),
        "out": a(F, 2, s=0.4),
    }
    return p, {"x": a(B, T, D), "y": a(B, T, 2)}


STATS = {
    "mean": js.stats.mean(),
    "second_moment": js.stats.second_moment(),
    "variance": js.stats.variance(),
    "sq_norms": js.stats.sq_norms(per_leaf=True),
    "clipped_mean": js.stats.clipped_mean(0.5),
}


def _oracle(p, batch, loss=None):
    """The statistics from vmap(grad) of ``loss`` (default `_loss`): through the ops' own
    derivatives."""
    loss = _loss if loss is None else loss
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    g = jax.jit(jax.vmap(jax.grad(one), (None, 0)))(p, batch)
    g = jax.tree.map(lambda v: np.asarray(v, np.float64), g)
    sq = jax.tree.map(lambda v: np.sum(v.reshape(B, -1) ** 2, 1), g)
    c = np.minimum(1, 0.5 / np.sqrt(sum(jax.tree.leaves(sq))))
    return {
        "mean": jax.tree.map(lambda v: v.mean(0), g),
        "second_moment": jax.tree.map(lambda v: (v**2).mean(0), g),
        "variance": jax.tree.map(lambda v: v.var(0, ddof=1), g),
        "sq_norms": sq,
        "clipped_mean": jax.tree.map(lambda v: np.tensordot(c, v, 1) / B, g),
    }


@pytest.fixture
def registered():
    with js.extend.register_custom_op(dense, _dense_ref), js.extend.register_custom_op(
        affine, _affine_ref
    ):
        yield


def _rules(p, batch):
    rep = js.explain(_loss, STATS)(p, batch)
    return {str(leaf.path): leaf.rule for leaf in rep.leaves}


def _check(out, want, rtol, atol):
    for name in STATS:
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out[name]),
                                jax.tree.leaves(want[name])):
            np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol, atol=atol,
                                       err_msg=f"{name}{jax.tree_util.keystr(path)}")


def test_a_registered_op_gets_the_rules_of_its_reference(registered):
    with jax.enable_x64(True):
        p, batch = _case()
        rules = _rules(p, batch)  # (a bias: its per-example gradients, small)
        assert rules.pop("['in']['b']") == "materialised", rules
        assert set(rules.values()) == {"streamed"}, rules
        out = jax.jit(js.per_example_stat(_loss, STATS))(p, batch)
        _check(out, _oracle(p, batch), rtol=1e-11, atol=1e-13)


def test_a_registered_op_in_float32(registered):
    p, batch = _case(jnp.float32)
    out = jax.jit(js.per_example_stat(_loss, STATS))(p, batch)
    _check(out, _oracle(p, batch), rtol=2e-4, atol=1e-5)


def test_an_unregistered_op_takes_the_exact_route():
    with jax.enable_x64(True):
        p, batch = _case()
        rules = _rules(p, batch)
        # (the op's exact per-example VJP, the view shared: materialised per-example
        # gradients; an op of two parameters reads them per example)
        assert {rules[k] for k in ("['stack']", "['mid']", "['out']")} == {"materialised"}
        assert rules["['in']['w']"] == rules["['in']['b']"] == "fallback", rules
        out = js.per_example_stat(_loss, STATS)(p, batch)
        _check(out, _oracle(p, batch), rtol=1e-11, atol=1e-13)


def test_explain_names_the_registered_ops(registered):
    with jax.enable_x64(True):
        p, batch = _case()
        rep = js.explain(_loss, js.stats.mean())(p, batch)
        note = next(n for n in rep.notes if "js.extend" in n)
        assert "dense (by its reference" in note and "affine (by its reference" in note
        assert "Custom ops registered with js.extend" in str(rep)


def test_explain_names_an_op_registered_with_a_rule():
    with js.extend.register_custom_op(dense, rule=DenseRule()):
        rep = js.explain(_loss, js.stats.mean())(*_case(jnp.float32))
        assert any("dense (by its rule DenseRule)" in n for n in rep.notes), rep.notes


def test_a_removed_registration_applies_to_later_traces():
    with jax.enable_x64(True):
        p, batch = _case()
        with js.extend.register_custom_op(dense, _dense_ref) as reg:
            assert reg.active and _rules(p, batch)["['stack']"] == "streamed"
        assert not reg.active and "removed" in repr(reg)
        assert _rules(p, batch)["['stack']"] == "materialised"
        reg.remove()  # (a second removal: nothing to do)


def test_check_rule_passes_a_faithful_op(registered):
    with jax.enable_x64(True):
        p, batch = _case()
        assert sorted(js.extend.check_rule(_loss)(p, batch)) == ["affine", "dense"]


# a straight-through sign: forward x @ sign(w), backward as if x @ w
@jax.custom_vjp
def ste(w, x):
    return x @ jnp.sign(w)


ste.defvjp(
    lambda w, x: (x @ jnp.sign(w), (w, x)),
    lambda r, dy: (jnp.einsum("...i,...j->ij", r[1], dy), dy @ jnp.sign(r[0]).T),
)


def _ste_loss(w, batch):
    return jnp.mean(jnp.sum(jnp.tanh(ste(w, batch["x"])) ** 2, axis=(1, 2)))


def test_check_rule_catches_a_straight_through_backward():
    """The reference computes the op's forward, but its derivative is not the op's
    backward (zero almost everywhere): the statistics would describe another model."""
    with jax.enable_x64(True):
        _, batch = _case()
        w = jnp.asarray(np.random.default_rng(1).normal(size=(D, F)))
        with js.extend.register_custom_op(ste, lambda w, x: x @ jnp.sign(w)):
            with pytest.raises(ValueError, match=r"custom op ste: the per-example gradients"):
                js.extend.check_rule(_ste_loss)(w, batch)


def test_check_rule_catches_a_reference_of_another_forward():
    with jax.enable_x64(True):
        _, batch = _case()
        w = jnp.asarray(np.random.default_rng(1).normal(size=(D, F)))
        with js.extend.register_custom_op(ste, _dense_ref):
            with pytest.raises(ValueError, match=r"custom op ste: the per-example losses"):
                js.extend.check_rule(_ste_loss)(w, batch)


def test_check_rule_needs_a_registered_op():
    with jax.enable_x64(True):
        p, batch = _case()
        with pytest.raises(ValueError, match="calls no registered custom op"):
            js.extend.check_rule(_loss)(p, batch)


def test_the_op_own_forward_as_reference():
    """``reference=None``: the op's forward function, for a backward pass that is its
    exact derivative written by hand (here: recomputing instead of saving)."""

    @jax.custom_vjp
    def recomputed(w, x):
        return jnp.tanh(x @ w)

    def bwd(res, dy):
        w, x = res
        _, pull = jax.vjp(lambda w, x: jnp.tanh(x @ w), w, x)
        return pull(dy)

    recomputed.defvjp(lambda w, x: (recomputed.fun(w, x), (w, x)), bwd)

    def loss(w, batch):
        return jnp.mean(jnp.sum(recomputed(w, batch["x"]) ** 2, axis=(1, 2)))

    with jax.enable_x64(True):
        _, batch = _case()
        w = jnp.asarray(np.random.default_rng(2).normal(size=(D, F)) / 2)
        with js.extend.register_custom_op(recomputed):
            assert js.extend.check_rule(loss)(w, batch) == ["recomputed"]
            rep = js.explain(loss, js.stats.second_moment())(w, batch)
            assert rep.leaves[0].rule == "streamed"
            got = js.per_example_stat(loss, js.stats.second_moment())(w, batch)
        one = lambda w, ex: loss(w, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
        g = jax.vmap(jax.grad(one), (None, 0))(w, batch)
        np.testing.assert_allclose(got, jnp.mean(g**2, 0), rtol=1e-12, atol=1e-15)


def test_ops_sharing_a_backward_function_are_told_apart():
    """Only the registered op's calls are replaced: another op with the same backward
    function but another forward keeps the exact route (and its own backward)."""

    @jax.custom_vjp
    def twice(w, x):  # another forward, the dense op's backward function
        return 2.0 * (x @ w)

    twice.defvjp(lambda w, x: (twice.fun(w, x), (w, x)), _dense_bwd)

    def loss(p, batch):
        return jnp.mean(jnp.sum(jnp.tanh(twice(p["b"], dense(p["a"], batch["x"]))) ** 2,
                                axis=(1, 2)))

    with jax.enable_x64(True):
        _, batch = _case()
        r = np.random.default_rng(3)
        p = {"a": jnp.asarray(r.normal(size=(D, F)) / 2), "b": jnp.asarray(r.normal(size=(F, 2)))}
        with js.extend.register_custom_op(dense, _dense_ref):
            with pytest.raises(ValueError, match="shares its backward function"):
                js.extend.register_custom_op(twice)
            rep = js.explain(loss, js.stats.second_moment())(p, batch)
            rules = {str(leaf.path): leaf.rule for leaf in rep.leaves}
            assert rules == {"['a']": "streamed", "['b']": "materialised"}, rules
            got = js.per_example_stat(loss, js.stats.second_moment())(p, batch)
        one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
        g = jax.vmap(jax.grad(one), (None, 0))(p, batch)
        for k in p:  # (the twice op's backward misses its factor 2: as JAX differentiates)
            np.testing.assert_allclose(got[k], jnp.mean(g[k] ** 2, 0), rtol=1e-12)


def test_a_reference_of_other_outputs_is_refused():
    with jax.enable_x64(True):
        p, batch = _case()
        with js.extend.register_custom_op(dense, lambda w, x: (x @ w)[..., :1]):
            with pytest.raises(ValueError, match=r"returns \(float64\[1, 3, 1\]\) where the op "
                                                 r"returns \(float64\[1, 3, 6\]\)"):
                js.per_example_stat(_loss, js.stats.mean())(p, batch)


def test_registration_errors():
    @jax.custom_jvp
    def act(x):
        return jnp.tanh(x)

    act.defjvp(lambda primals, tangents: (act(primals[0]), tangents[0]))
    js.extend.register_custom_op(act, jnp.tanh).remove()  # (custom_jvp ops: below)
    with pytest.raises(TypeError, match="op must be a jax.custom_vjp or jax.custom_jvp"):
        js.extend.register_custom_op(_dense_ref, _dense_ref)

    @jax.custom_vjp
    def bare(w, x):
        return x @ w

    with pytest.raises(ValueError, match=r"no derivative rule yet; call op.defvjp"):
        js.extend.register_custom_op(bare, _dense_ref)

    @jax.custom_jvp
    def bare_jvp(w, x):
        return x @ w

    with pytest.raises(ValueError, match=r"no derivative rule yet; call op.defjvp"):
        js.extend.register_custom_op(bare_jvp, _dense_ref)

    with pytest.raises(NotImplementedError, match=r"nondiff_argnums=\(2,\): a rule reads"):
        js.extend.register_custom_op(act_dense, rule=DenseRule())
    with pytest.raises(TypeError, match="reference must be a function"):
        js.extend.register_custom_op(dense, 3.0)
    with js.extend.register_custom_op(dense, _dense_ref):
        with pytest.raises(ValueError, match="already registered"):
            js.extend.register_custom_op(dense, _dense_ref)


def test_explain_prices_an_unregistered_op_by_its_vjp():
    """An unregistered op's parameter (the exact per-example route: the op's own VJP per
    example) is priced with the VJP's products, as a dense site's per-example products
    are: the fused dense layer's leaf within 2x of the same layer written plainly (its
    per-example products ``x_b^T dy_b``, 2 B T D F FLOPs). Before, only the reduction
    of the formed gradients was counted (2 B (out + view)): 10x less here, and the
    reverse of the measured times against a fast rule."""
    r = np.random.default_rng(6)
    Bx, Tx, Dx, Fx = 4, 16, 32, 32
    w = jnp.asarray(r.normal(size=(Dx, Fx)) / 8, jnp.float32)
    x = jnp.asarray(r.normal(size=(Bx, Tx, Dx)), jnp.float32)
    fused = js.explain(lambda w, x: jnp.mean(jnp.tanh(dense(w, x)) ** 2),
                       js.stats.second_moment())(w, x).leaves[0]
    plain = js.explain(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2),
                       js.stats.second_moment())(w, x).leaves[0]
    products = 2.0 * Bx * Tx * Dx * Fx
    assert fused.rule == "materialised" and plain.rule == "streamed", (fused, plain)
    assert products <= fused.extra_flops <= 2 * products, (fused.extra_flops, products)
    assert 0.5 <= fused.extra_flops / plain.extra_flops <= 2, (fused, plain)


# --------------------------------------------------------------------------- #
# Ops with non-differentiable arguments (nondiff_argnums)
# --------------------------------------------------------------------------- #
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def act_dense(w, x, act):
    return act(x @ w)


def _act_dense_fwd(w, x, act):
    y = x @ w
    return act(y), (w, x, y)


def _act_dense_bwd(act, res, g):
    w, x, y = res
    dy = jax.vjp(act, y)[1](g)[0]
    return jnp.einsum("...i,...j->ij", x, dy), dy @ w.T


act_dense.defvjp(_act_dense_fwd, _act_dense_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def scaled_dense(k, w, x):
    return k * (x @ w)


@scaled_dense.defjvp
def _scaled_dense_jvp(k, primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    return scaled_dense(k, w, x), k * (dx @ w + x @ dw)


def _nondiff_loss(p, batch):
    h = act_dense(p["in"], batch["x"], jnp.tanh)
    h = act_dense(p["mid"], h, jax.nn.softplus)  # the same op, another static argument
    out = scaled_dense(0.5, p["out"], h)
    return jnp.mean(jnp.sum((out - batch["y"]) ** 2, axis=(1, 2)))


def test_ops_with_nondiff_argnums_get_the_reference_rules():
    """A custom_vjp op with a static argument (an activation function) and a custom_jvp
    op with one (a scale): registered with their forward functions as references (which
    take the static arguments, as the ops do), each call is replaced with its own static
    values; the parameters get the dense rules instead of the exact per-example route,
    the statistics equal vmap(grad) through the ops' own derivatives, and check_rule
    passes. Before, register_custom_op refused them (NotImplementedError)."""
    r = np.random.default_rng(4)
    a = lambda *shape: jnp.asarray(r.normal(size=shape) * 0.5, jnp.float64)  # noqa: E731
    with M.x64():
        p = {"in": a(D, F), "mid": a(F, F), "out": a(F, 2)}
        batch = {"x": a(B, T, D), "y": a(B, T, 2)}
        before = js.explain(_nondiff_loss, STATS)(p, batch)
        with js.extend.register_custom_op(act_dense), js.extend.register_custom_op(scaled_dense):
            rules = {str(leaf.path): leaf.rule for leaf in
                     js.explain(_nondiff_loss, STATS)(p, batch).leaves}
            out = js.per_example_stat(_nondiff_loss, STATS)(p, batch)
            assert js.extend.check_rule(_nondiff_loss)(p, batch) == [
                "act_dense", "scaled_dense"]
        _check(out, _oracle(p, batch, _nondiff_loss), 1e-10, 1e-12)
    assert {leaf.rule for leaf in before.leaves} <= {"materialised", "fallback"}, before
    assert set(rules.values()) <= {"streamed", "ghost"}, rules


def test_a_nondiff_reference_that_differs_fails_check_rule():
    """check_rule compares each call's reference, with that call's static values,
    against the op's own backward: a reference that ignores the static argument fails."""
    r = np.random.default_rng(5)
    a = lambda *shape: jnp.asarray(r.normal(size=shape) * 0.5, jnp.float64)  # noqa: E731
    with M.x64():
        p = {"in": a(D, F), "mid": a(F, F), "out": a(F, 2)}
        batch = {"x": a(B, T, D), "y": a(B, T, 2)}
        with js.extend.register_custom_op(act_dense, lambda w, x, act: jnp.tanh(x @ w)):
            with pytest.raises(ValueError, match="act_dense"):
                js.extend.check_rule(_nondiff_loss)(p, batch)


# --------------------------------------------------------------------------- #
# Rules without a reference: js.extend.CustomOpRule
# --------------------------------------------------------------------------- #
class DenseRule(js.extend.CustomOpRule):
    """``x @ w``'s per-example gradient: ``x_b^T dy_b`` over the example's tokens."""

    def per_example_grad(self, site):
        w, x = site.operands
        (dy,) = site.cotangents
        return jnp.einsum("b...i,b...j->bij", x, dy)


class GhostDenseRule(DenseRule):
    """With a ghost norm and a weighted contraction: no per-example gradient formed."""

    def sq_norms(self, site):
        w, x = site.operands
        (dy,) = site.cotangents
        x, dy = x.reshape(x.shape[0], -1, x.shape[-1]), dy.reshape(dy.shape[0], -1, dy.shape[-1])
        return jnp.einsum("bts,bts->b", x @ jnp.swapaxes(x, 1, 2), dy @ jnp.swapaxes(dy, 1, 2))

    def summed_grad(self, site):
        w, x = site.operands
        (dy,) = site.cotangents
        return jnp.einsum("b...i,b...j->ij", x, dy)


@pytest.mark.parametrize("rule", [DenseRule, GhostDenseRule])
def test_a_rule_serves_its_op_exactly(rule):
    with jax.enable_x64(True):
        p, batch = _case()
        with js.extend.register_custom_op(dense, rule=rule()), js.extend.register_custom_op(
                affine, _affine_ref):
            rep = js.explain(_loss, STATS)(p, batch)
            kinds = {str(leaf.path): leaf.kinds for leaf in rep.leaves}
            assert all("custom-op" in kinds[k] for k in ("['stack']", "['mid']", "['out']"))
            out = jax.jit(js.per_example_stat(_loss, STATS))(p, batch)
            _check(out, _oracle(p, batch), rtol=1e-11, atol=1e-13)
            assert sorted(js.extend.check_rule(_loss)(p, batch)) == ["affine", "dense"]
            norms = js.explain(_loss, js.stats.sq_norms())(p, batch)
            want = "streamed" if rule is GhostDenseRule else "materialised"
            assert {leaf.rule for leaf in norms.leaves if "custom-op" in leaf.kinds} == {want}


def test_a_rule_in_float32_with_weights_and_chunks():
    p, batch = _case(jnp.float32)
    w = jnp.asarray([1.0, 0.0, 2.0, 1.0, 0.5], jnp.float32)
    with js.extend.register_custom_op(dense, rule=GhostDenseRule()):
        got = js.per_example_stat(_loss, STATS, chunk_size=2)(p, batch, example_weights=w)
        plain = js.per_example_stat(_loss, STATS, chunk_size=2)
    with js.extend.register_custom_op(dense, _dense_ref):  # (the reference route: dense rules)
        want = js.per_example_stat(_loss, STATS, chunk_size=2)(p, batch, example_weights=w)
    del plain
    for name in STATS:
        for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name])):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5, err_msg=name)


class _Twice(DenseRule):
    def per_example_grad(self, site):
        return 2 * super().per_example_grad(site)


class _BadNorms(DenseRule):
    def sq_norms(self, site):
        return jnp.sum(self.per_example_grad(site), axis=(1, 2)) ** 2  # not the squares' sum


class _BadSum(DenseRule):
    def summed_grad(self, site):
        return jnp.sum(self.per_example_grad(site), axis=0) / site.batch_size  # a mean


@pytest.mark.parametrize("rule, method", [(_Twice, "per_example_grad"),
                                          (_BadNorms, "sq_norms"), (_BadSum, "summed_grad")])
def test_check_rule_names_the_method_that_breaks_its_law(rule, method):
    with jax.enable_x64(True):
        p, batch = _case()
        with js.extend.register_custom_op(dense, rule=rule()), js.extend.register_custom_op(
                affine, _affine_ref):
            with pytest.raises(ValueError, match=f"The rule's {method} "):
                js.extend.check_rule(_loss)(p, batch)


def test_a_rule_of_the_wrong_shape_is_refused():
    class Flat(DenseRule):
        def per_example_grad(self, site):
            return super().per_example_grad(site).reshape(site.batch_size, -1)

    with jax.enable_x64(True):
        p, batch = _case()
        with js.extend.register_custom_op(dense, rule=Flat()):
            with pytest.raises(ValueError, match=r"Flat.per_example_grad \(the rule of custom op "
                                                 r"dense\) returned shape"):
                js.per_example_stat(_loss, js.stats.second_moment())(p, batch)


def test_rule_registration_errors():
    with pytest.raises(ValueError, match="either a reference or a rule"):
        js.extend.register_custom_op(dense, _dense_ref, rule=DenseRule())
    with pytest.raises(TypeError, match="rule must be a js.extend.CustomOpRule"):
        js.extend.register_custom_op(dense, rule=DenseRule)  # the class, not an instance
    with pytest.raises(TypeError, match="must override per_example_grad"):
        js.extend.register_custom_op(dense, rule=js.extend.CustomOpRule())


@pytest.mark.parametrize("how", ["unregistered", "reference", "rule"])
def test_inside_shard_map(monkeypatch, how):
    """Data parallel in ``shard_map`` (the weight cast to varying before the op, as
    jax.grad of such a model needs): exact against the one-device oracle, the registered
    op recognised there (its call's types carry the manual axes, which the forward
    traced for the comparison does not: compared without them)."""
    from jax.sharding import PartitionSpec as P

    from jaxpr_surgery._src import custom_ops

    hits = []
    inner = custom_ops.entry_of
    monkeypatch.setattr(custom_ops, "entry_of",
                        lambda eqn: hits.append(inner(eqn)) or hits[-1])

    ndev = len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))

    def loss(w, b):
        return jnp.mean(jnp.sum(jnp.tanh(dense(M.cast_to_varying(w, "data"), b)) ** 2, axis=(1, 2)))

    def plain(w, b):
        return jnp.mean(jnp.sum(jnp.tanh(dense(w, b)) ** 2, axis=(1, 2)))

    with jax.enable_x64(True):
        r = np.random.default_rng(4)
        w = jnp.asarray(r.normal(size=(D, F)) / 2)
        x = jnp.asarray(r.normal(size=(2 * ndev, T, D)))
        g = jax.vmap(jax.grad(lambda w, ex: plain(w, ex[None])), (None, 0))(w, x)
        stats = {"second_moment": js.stats.second_moment(), "sq_norms": js.stats.sq_norms()}
        reg = {"unregistered": None,
               "reference": lambda: js.extend.register_custom_op(dense, _dense_ref),
               "rule": lambda: js.extend.register_custom_op(dense, rule=GhostDenseRule())}[how]
        handle = reg() if reg else None
        try:
            f = jax.shard_map(
                lambda w, x: js.per_example_stat(loss, stats, axis_name="data")(w, x),
                mesh=mesh, in_specs=(P(), P("data")),
                out_specs={"second_moment": P(), "sq_norms": P("data")})
            got = jax.jit(f)(w, x)
        finally:
            if handle is not None:
                handle.remove()
        np.testing.assert_allclose(got["second_moment"], jnp.mean(g**2, 0), rtol=1e-12)
        np.testing.assert_allclose(got["sq_norms"], jnp.sum(g**2, axis=(1, 2)), rtol=1e-12)
        assert any(h is not None for h in hits) == (how != "unregistered"), hits


# --------------------------------------------------------------------------- #
# custom_jvp ops: recognised by the JVP given to defjvp
# --------------------------------------------------------------------------- #
@jax.custom_jvp
def jdense(w, x):
    return x @ w


@jdense.defjvp
def _jdense_jvp(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    return jdense(w, x), x @ dw + dx @ w


# a straight-through sign written as a custom_jvp: forward x @ sign(w), JVP as x @ w's
@jax.custom_jvp
def jste(w, x):
    return x @ jnp.sign(w)


@jste.defjvp
def _jste_jvp(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    return jste(w, x), x @ dw + dx @ jnp.sign(w)


def _jloss(p, batch):
    h = jnp.tanh(jdense(p["in"], batch["x"]))

    def layer(h, w):
        return jnp.tanh(jdense(w, h)), None

    h, _ = jax.lax.scan(layer, h, p["stack"])  # the op inside a scan
    h = jax.checkpoint(lambda h: jnp.tanh(jdense(p["mid"], h)))(h)  # inside a remat
    out = jax.jit(jdense)(p["out"], h)  # inside a jit
    return jnp.mean(jnp.sum((out - batch["y"]) ** 2, axis=(1, 2)))


def _jcase(dtype=jnp.float64):
    p, batch = _case(dtype)
    return dict(p, **{"in": p["in"]["w"]}), batch


@pytest.mark.parametrize("how", ["reference", "own_forward", "rule"])
def test_a_registered_custom_jvp_op(how):
    """A ``custom_jvp`` op, registered with a reference, its own forward or a rule, gets
    the rules (``streamed``, or the rule's ``custom-op`` sites; ``materialised`` before)
    and every statistic equals vmap(grad) through its own JVP, inside a scan, a remat
    and a jit alike."""
    with jax.enable_x64(True):
        p, batch = _jcase()
        before = js.explain(_jloss, STATS)(p, batch)
        assert {leaf.rule for leaf in before.leaves} == {"materialised"}
        arg = {"reference": (_dense_ref,), "own_forward": (), "rule": ()}[how]
        kw = {"rule": DenseRule()} if how == "rule" else {}
        with js.extend.register_custom_op(jdense, *arg, **kw):
            rep = js.explain(_jloss, STATS)(p, batch)
            if how == "rule":
                assert all("custom-op" in leaf.kinds for leaf in rep.leaves), rep
            else:
                assert {leaf.rule for leaf in rep.leaves} == {"streamed"}, rep
            out = jax.jit(js.per_example_stat(_jloss, STATS))(p, batch)
            assert js.extend.check_rule(_jloss)(p, batch) == ["jdense"]
        _check(out, _oracle(p, batch, _jloss), rtol=1e-11, atol=1e-13)


def test_a_registered_custom_jvp_op_in_float32():
    p, batch = _jcase(jnp.float32)
    with js.extend.register_custom_op(jdense, _dense_ref):
        out = jax.jit(js.per_example_stat(_jloss, STATS))(p, batch)
    _check(out, _oracle(p, batch, _jloss), rtol=2e-4, atol=1e-5)


def test_check_rule_catches_a_straight_through_custom_jvp():
    with jax.enable_x64(True):
        _, batch = _case()
        w = jnp.asarray(np.random.default_rng(1).normal(size=(D, F)))
        loss = lambda w, b: jnp.mean(jnp.sum(jnp.tanh(jste(w, b["x"])) ** 2, axis=(1, 2)))  # noqa: E731
        with js.extend.register_custom_op(jste, lambda w, x: x @ jnp.sign(w)):
            with pytest.raises(ValueError, match=r"custom op jste: the per-example gradients"):
                js.extend.check_rule(loss)(w, batch)


def test_custom_jvp_ops_sharing_a_jvp_are_told_apart():
    """Two custom_jvp ops built from one JVP function (a factory's) are told apart by
    their forward programs: registering one leaves the other on the exact route."""

    def make(scale):
        @jax.custom_jvp
        def op(w, x):
            return scale * (x @ w)

        op.defjvp(_shared_jvp)
        return op

    one, two = make(1.0), make(2.0)
    with jax.enable_x64(True):
        _, batch = _case()
        w = jnp.asarray(np.random.default_rng(2).normal(size=(D, F)))
        loss = lambda w, b: jnp.mean(jnp.tanh(two(w, b["x"])) ** 2)  # noqa: E731
        with js.extend.register_custom_op(one, _dense_ref):
            assert js.explain(loss, js.stats.mean())(w, batch).leaves[0].rule == "materialised"
            with pytest.raises(ValueError, match="already registered"):
                js.extend.register_custom_op(two, _dense_ref)


def _shared_jvp(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    return x @ w, x @ dw + dx @ w

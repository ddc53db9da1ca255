"""Tripwire: every primitive in the per-example jaxprs of the model zoo is either
handled by the analysis (sites, layout views, recursion, residual constructs)
or explicitly allowed to pass through (elementwise math on data, reductions,
...). A primitive in neither list fails with its name, so a new or renamed JAX
primitive shows up here rather than as a silently wrong statistic.
"""

from __future__ import annotations

import _models as M
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpr_surgery as js
from jaxpr_surgery._src import compat

try:
    import zoo
except ImportError:  # pragma: no cover - zoo.py is owned by another test module
    zoo = None

# --------------------------------------------------------------------------- #
# What the analysis handles (compared by object, as the package does)
# --------------------------------------------------------------------------- #
HANDLED = {
    # sites: where a parameter view meets example data
    "site": [compat.dot_general_p, compat.gather_p, compat.conv_p, compat.mul_p, compat.add_p,
             compat.sub_p],
    # injective layout views of a parameter
    "layout": [compat.convert_p, compat.reshape_p, compat.squeeze_p, compat.broadcast_p,
               compat.transpose_p, compat.copy_p, compat.sharding_constraint_p,
               *compat.vma_cast_prims],
    # recursed into
    "recursion": [compat.jit_p, compat.closed_call_p, compat.call_p, compat.remat_p,
                  compat.scan_p],
    # parameters inside them are residual (exact per-example gradients)
    "residual": [*compat.custom_prims, compat.cond_p, compat.while_p],
}
HANDLED_PRIMS = {p for group in HANDLED.values() for p in group if p is not None}

# Primitives that only ever see example data or parameter-only values here, or
# that are a "generic" site with an exact per-example VJP. Names, so that the
# list reads as documentation; extend it deliberately when a new one shows up.
PASS_THROUGH = frozenset({
    # elementwise arithmetic and math
    "neg", "div", "max", "min", "integer_pow", "pow", "square", "sqrt", "rsqrt", "cbrt",
    "exp", "exp2", "log", "log1p", "expm1", "logistic", "tanh", "sin", "cos", "tan", "atan2",
    "erf", "erfc", "erf_inv", "abs", "sign", "floor", "ceil", "round", "clamp", "nextafter",
    "is_finite", "rem", "select_n", "stop_gradient",
    # comparisons / logic
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    # reductions and scans over axes of one example
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_or", "reduce_and",
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cumlogsumexp", "reduce_precision",
    # structure
    "iota", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "rev",
    "scatter-add", "scatter_add", "scatter", "select_and_scatter_add", "reduce_window_sum",
    "sort", "split", "expand_dims",
    # randomness (per-example keys)
    "random_bits", "random_wrap", "random_unwrap", "random_seed", "threefry2x32",
    "shift_right_logical", "shift_left", "bitcast_convert_type",
})


def _primitives(loss, params, batch):
    example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
    closed = jax.make_jaxpr(M.per_example_loss(loss))(params, example)
    seen = {}  # primitive -> its first equation
    for eqn in M.all_eqns(closed):
        seen.setdefault(eqn.primitive, eqn)
    return seen


def _abstract(make):
    """``make() -> (loss, params, batch)`` traced abstractly: no compilation, no compute."""
    holder = {}

    def build():
        loss, params, batch = make()
        holder["loss"] = loss
        return params, batch

    params, batch = jax.eval_shape(build)
    return holder["loss"], params, batch


def _check(model, prims):
    unknown = sorted({p.name for p in prims if p not in HANDLED_PRIMS and p.name not in
                      PASS_THROUGH})
    assert not unknown, (
        f"{model}: primitive(s) {unknown} are neither handled by the analysis nor in the "
        "pass-through allow-list of tests/test_tripwire.py. Check how analysis.py treats them "
        "(a parameter reaching one becomes a generic site or residual) and extend a list."
    )


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #
def _extras_loss(p, b):
    """Common layer ops not in the other models: gelu(erf), softplus, concat, pad,
    cumsum, dynamic_slice, clip, one_hot, argmax-free softmax, sort, rev."""
    x = b["x"]  # [b, 6]
    h = jax.nn.gelu(x @ p["w"], approximate=False)
    h = jnp.concatenate([h, jax.nn.softplus(h)], axis=-1)
    h = jnp.pad(h, ((0, 0), (1, 1)))
    h = jnp.cumsum(h, axis=-1) * 0.1
    h = lax.dynamic_slice_in_dim(h, 2, 4, axis=-1)
    h = jnp.clip(h, -3.0, 3.0) + jnp.sort(h, axis=-1)[..., ::-1]
    oh = jax.nn.one_hot(b["y"], 4, dtype=h.dtype)
    logits = h @ p["head"] + p["bias"]
    return jnp.mean(-jnp.sum(oh * jax.nn.log_softmax(logits), axis=-1))


def _extras_case():
    r = np.random.default_rng(9)
    f32 = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.float32)  # noqa: E731
    p = {"w": f32(6, 5) * 0.4, "head": f32(4, 4), "bias": jnp.zeros(4)}
    b = {"x": f32(M.B, 6), "y": jnp.asarray(r.integers(0, 4, M.B), jnp.int32)}
    return _extras_loss, p, b


_OWN = ["mlp", "transformer", "lora", "tied"]
_ZOO = list(zoo.ZOO) if zoo is not None else []


def test_handled_primitives_resolved():
    """compat found every primitive object the analysis relies on (JAX churn guard)."""
    for group in ("site", "recursion"):
        for p in HANDLED[group]:
            assert p is not None, f"compat failed to resolve a {group} primitive"
    for name in ("convert_p", "reshape_p", "squeeze_p", "broadcast_p", "transpose_p",
                 "cond_p", "while_p"):
        assert getattr(compat, name) is not None, name
    assert compat.custom_prims, "no custom_jvp/custom_vjp primitives found"
    assert compat.vma_cast_prims, "no pvary/pcast primitive found (shard_map vma casts)"
    # nothing handled is also in the pass-through list
    assert not {p.name for p in HANDLED_PRIMS} & PASS_THROUGH


@pytest.mark.parametrize("name", _OWN)
def test_own_models(name):
    make = {**M.MODELS, "lora": M.make_lora, "tied": M.make_tied}[name]
    _check(name, _primitives(*_abstract(make)))


def test_extras_model():
    loss, params, batch = _extras_case()
    prims = _primitives(loss, params, batch)
    _check("extras", prims)
    # the analysis walks the same jaxpr and sees a subset of these primitives
    rep = js.explain(loss)(params, batch)
    assert set(rep.primitives) <= {str(p) for p in prims}
    assert rep.fallback_leaves == [], str(rep)


@pytest.mark.parametrize("name", _ZOO)
def test_zoo_models(name):
    try:
        if name in zoo.FRAMEWORK_ZOO:  # frameworks initialise with numpy: build concretely
            case = zoo.get_case(name)
            loss, params, batch = case.loss_fn, case.params, case.batch
        else:
            loss, params, batch = _abstract(lambda: tuple(zoo.ZOO[name]())[1:])
    except ImportError as e:  # framework not installed
        pytest.skip(f"{name}: {e}")
    _check(name, _primitives(loss, params, batch))


def test_tripwire_catches_unknown_primitive():
    """Sanity of the tripwire itself: a primitive outside both lists fails by name."""
    prims = _primitives(lambda p, b: jnp.mean(lax.cumlogsumexp(b["x"] @ p, axis=1)),
                        jnp.ones((6, 3)), {"x": jnp.ones((M.B, 6))})
    fake = jex.core.Primitive("definitely_new_primitive")
    with pytest.raises(AssertionError, match="definitely_new_primitive"):
        _check("fake", {**prims, fake: None})



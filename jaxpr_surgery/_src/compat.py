"""The one place that touches JAX internals or churn-prone names.

Everything version-sensitive (primitive objects, parameter names, the vma
type system of shard_map) is resolved here, by feature detection, so the rest
of the package compares primitives by object and never by name string.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import lax
from jax._src import core as _core  # noqa: F401  (Literal/Var types)
from jax._src.lax import control_flow as _cf
from jax._src.lax import convolution as _conv
from jax._src.lax import lax as _lax
from jax._src.lax import slicing as _slicing

ClosedJaxpr = jex.core.ClosedJaxpr
Jaxpr = jex.core.Jaxpr
Literal = jex.core.Literal
Var = jex.core.Var
JaxprEqn = jex.core.JaxprEqn
Primitive = jex.core.Primitive


# A trace of one's own between a function and the transformations around it (jax's
# "stackless" tracing, jax >= 0.4.36): a subclass of `Trace` handles each primitive bound
# on its `Tracer`s (a Tracer is built as ``Tracer(trace, aval)``), under
# ``set_current_trace``; ``take_current_trace()`` is the trace a function is called under.
# Used by benchmarks/one_trace.py's prototype of statistics emitted inside grad's trace.
Trace = _core.Trace
Tracer = _core.Tracer
set_current_trace = _core.set_current_trace
take_current_trace = _core.take_current_trace


def is_array_like(v) -> bool:
    """A jax array or a tracer (values with no structural key)."""
    return isinstance(v, (jax.Array, _core.Tracer))


def _first(*getters):
    for g in getters:
        try:
            p = g()
        except (AttributeError, ImportError):
            continue
        if p is not None:
            return p
    return None


# --------------------------------------------------------------------------- #
# Primitives (objects)
# --------------------------------------------------------------------------- #
dot_general_p = _lax.dot_general_p
ragged_dot_p = _lax.ragged_dot_general_p  # jax.lax.ragged_dot / ragged_dot_general
conv_p = _conv.conv_general_dilated_p
gather_p = _slicing.gather_p
mul_p = _lax.mul_p
add_p = _lax.add_p
sub_p = _lax.sub_p
div_p = _lax.div_p
neg_p = _lax.neg_p
slice_p = _slicing.slice_p
dynamic_slice_p = _slicing.dynamic_slice_p
iota_p = _lax.iota_p
eq_p = _lax.eq_p
convert_p = _lax.convert_element_type_p
reshape_p = _lax.reshape_p
transpose_p = _lax.transpose_p
squeeze_p = _lax.squeeze_p
broadcast_p = _lax.broadcast_in_dim_p
copy_p = _first(lambda: _lax.copy_p)
copy_p2 = _first(lambda: __import__("jax._src.lax.lax", fromlist=["x"]).copy_p)
scan_p = _cf.loops.scan_p
while_p = _cf.loops.while_p
cond_p = _cf.conditionals.cond_p


jit_p = _first(lambda: __import__("jax._src.pjit", fromlist=["x"]).jit_p,
              lambda: __import__("jax._src.pjit", fromlist=["x"]).pjit_p)
closed_call_p = _first(lambda: _core.closed_call_p)
call_p = _first(lambda: _core.call_p)
remat_p = __import__("jax._src.ad_checkpoint", fromlist=["x"]).remat_p
shard_map_p = _first(lambda: __import__("jax._src.shard_map", fromlist=["x"]).shard_map_p)


def thunk_like(thunk, fn):
    """``fn`` wrapped as jax wraps a lazily traced rule (custom_vjp's ``fwd_jaxpr_thunk``)."""
    from jax._src import linear_util as lu

    return lu.wrap_init(fn, debug_info=thunk.debug_info)


def bwd_checks_off():
    """A context without jax's check of a custom_vjp backward rule's output types."""
    return __import__("jax._src.config", fromlist=["x"]).disable_bwd_checks(True)


def _custom_prims():
    from jax._src import custom_derivatives as cd

    names = ("custom_jvp_call_p", "custom_vjp_call_p", "custom_vjp_call_jaxpr_p")
    return tuple(getattr(cd, n) for n in names if getattr(cd, n, None) is not None)


custom_prims = _custom_prims()
custom_vjp_call_p = _first(
    lambda: __import__("jax._src.custom_derivatives", fromlist=["x"]).custom_vjp_call_p)
custom_jvp_call_p = _first(
    lambda: __import__("jax._src.custom_derivatives", fromlist=["x"]).custom_jvp_call_p)

sharding_constraint_p = _first(
    lambda: __import__("jax._src.pjit", fromlist=["x"]).sharding_constraint_p,
    lambda: __import__("jax._src.sharding_impls", fromlist=["x"]).sharding_constraint_p,
)
# jax.sharding.reshard and jax.device_put inside a trace: they place values, none changes one
placement_prims = tuple(p for p in (
    _first(lambda: __import__("jax._src.pjit", fromlist=["x"]).reshard_p),
    _first(lambda: __import__("jax._src.dispatch", fromlist=["x"]).device_put_p),
    sharding_constraint_p) if p is not None)


def placement_specs(eqn) -> tuple:
    """Per operand of a placement equation (`placement_prims`), the PartitionSpec it places
    the operand at (its entries only), or None where it names none (a device)."""
    p = eqn.params
    if "dst_sharding" in p:  # reshard
        targets = (p["dst_sharding"],) * len(eqn.invars)
    elif "devices" in p:  # device_put
        targets = tuple(p["devices"])
    else:  # sharding_constraint
        targets = (p.get("sharding"),) * len(eqn.invars)
    out = []
    for t in targets:
        spec = getattr(t, "spec", None)
        out.append(None if spec is None else jax.sharding.PartitionSpec(*spec))
    return tuple(out)


class UnitRelease(NamedTuple):
    """A sharding constraint on one example's values with its unit axes released
    (`constraint_unit_release`): ``params``, its new parameters (None: nothing to
    release); ``unit_axes``, the mesh axes it named on its axes of size one (a tuple per
    such axis); ``other_axes``, those it names on its other axes; ``sizes``, each mesh
    axis's size."""

    params: dict | None
    unit_axes: tuple
    other_axes: frozenset
    sizes: dict


def _axis_names(entry) -> tuple:
    if entry is None or entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def constraint_unit_release(eqn) -> UnitRelease | None:
    """For a sharding constraint ``eqn`` (``with_sharding_constraint``) traced on one
    example: its parameters with every axis of size one that names mesh axes left
    unconstrained, and which axes it named where (`UnitRelease`); None for any other
    equation, or a constraint not given by a ``NamedSharding``."""
    if eqn.primitive is not sharding_constraint_p or len(eqn.invars) != 1:
        return None
    s = eqn.params.get("sharding")
    shape = getattr(eqn.invars[0].aval, "shape", None)
    if not isinstance(s, jax.sharding.NamedSharding) or shape is None:
        return None
    P = jax.sharding.PartitionSpec
    entries = list(s.spec) + [None] * (len(shape) - len(s.spec))
    unit = [i for i, (n, e) in enumerate(zip(shape, entries)) if n == 1 and _axis_names(e)]
    unit_axes = tuple(_axis_names(entries[i]) for i in unit)
    other = frozenset(a for i, e in enumerate(entries) if i not in unit for a in _axis_names(e))
    sizes = dict(zip(s.mesh.axis_names, s.mesh.axis_sizes))
    if not unit:
        return UnitRelease(None, (), other, sizes)
    for i in unit:
        entries[i] = P.UNCONSTRAINED
    sharding = jax.sharding.NamedSharding(s.mesh, P(*entries), memory_kind=s.memory_kind)
    dims = frozenset(eqn.params.get("unconstrained_dims", ())) | frozenset(unit)
    return UnitRelease({**eqn.params, "sharding": sharding, "unconstrained_dims": dims},
                       unit_axes, other, sizes)


def is_spmd_axis_conflict(e: Exception) -> bool:
    """``e`` is jax's refusal of a sharding constraint naming a ``vmap``'s
    ``spmd_axis_name`` (one the per-example jaxpr did not hold: traced later, in a
    custom_vjp's backward rule)."""
    return isinstance(e, ValueError) and "spmd_axis_name" in str(e)


def _vma_cast_prims():
    """pvary / pcast and other identity casts of the shard_map type system."""
    from jax._src.lax import parallel

    out = []
    for n in ("pvary_p", "pcast_p", "core_pvary_p"):
        p = getattr(parallel, n, None)
        if p is not None:
            out.append(p)
    p = getattr(_core, "pvary_p", None)
    if p is not None:
        out.append(p)
    return tuple(out)


vma_cast_prims = _vma_cast_prims()


def _collective_prims():
    """The primitives that communicate over named mesh axes (psum, all_gather,
    psum_scatter, ppermute, all_to_all, pmax, ...): every primitive of jax's parallel
    module but the identity casts of the shard_map type system and ``axis_index``."""
    from jax._src.lax import parallel

    out = set()
    for n in dir(parallel):
        p = getattr(parallel, n)
        if n.endswith("_p") and isinstance(p, _core.Primitive):
            out.add(p)
    return frozenset(out - set(vma_cast_prims) - {parallel.axis_index_p})


collective_prims = _collective_prims()
all_gather_p = _first(lambda: __import__("jax._src.lax.parallel", fromlist=["x"]).all_gather_p)
reduce_scatter_p = _first(
    lambda: __import__("jax._src.lax.parallel", fromlist=["x"]).reduce_scatter_p)


def collective_axes(eqn) -> frozenset:
    """The named mesh axes ``eqn`` communicates over (empty for any other equation;
    positional axes, ints, are not named)."""
    if eqn.primitive not in collective_prims:
        return frozenset()
    names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    names = names if isinstance(names, (tuple, list)) else (names,)
    return frozenset(a for a in names if not isinstance(a, int))

# Primitives that jax.vmap batches only with every operand batched on axis 0 (any other
# mix raises "ragged_dot vmap over any dim but 0 - NYI"): the engine broadcasts their
# unbatched operands to the batch before it maps them.
BATCH_EVERY_OPERAND = frozenset({ragged_dot_p})

# Primitives of reductions that make examples interact when applied to the
# batch axis (used by the interaction heuristics of explain).
reduce_sum_p = _lax.reduce_sum_p


# --------------------------------------------------------------------------- #
# Binding an equation
# --------------------------------------------------------------------------- #
def bind_eqn(eqn, invals, **changes):
    """Evaluates one jaxpr equation on values (``eval_jaxpr`` for one eqn), with the
    parameters in ``changes`` replaced (a ``dot_general``'s ``dimension_numbers``).

    A cast to varying (``pvary``) of a value that the interpreter made varying
    already (a parameter copied per example inside ``shard_map``) is a no-op, where
    binding it would raise."""
    if eqn.primitive in vma_cast_prims and len(invals) == len(eqn.outvars):
        want = [_aval_vma(o.aval) for o in eqn.outvars]
        if all(w is not None and vma_of(x) <= w for x, w in zip(invals, want)):
            return [make_varying(x, w) for x, w in zip(invals, want)]
    params = {**eqn.params, **changes} if changes else eqn.params
    with eqn.ctx.manager:
        return bind(eqn.primitive, invals, params)


def bind(prim, invals, params):
    """``prim`` bound on values with a jaxpr equation's ``params``, as a list of outputs
    (in the caller's context: no equation's recorded mesh or compute type)."""
    bp = prim.get_bind_params(params)
    subfuns, bp = bp if isinstance(bp, tuple) else ((), bp)  # jax < 0.9.2: (subfuns, params)
    out = prim.bind(*subfuns, *invals, **bp)
    return list(out) if prim.multiple_results else [out]


def jaxpr_as_fun(closed):
    return jex.core.jaxpr_as_fun(closed)


def eval_jaxpr(jaxpr, consts, *args):
    return jaxpr_as_fun(ClosedJaxpr(jaxpr, consts))(*args)


def source_line(eqn) -> str:
    """``file:line (function)`` of the user's code that emitted ``eqn`` (file name
    without its directory), or '' where jax records none."""
    try:
        import os

        from jax._src import source_info_util

        frame = source_info_util.user_frame(eqn.source_info.traceback)
        if frame is None:
            return ""
        return f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"
    except Exception:  # noqa: BLE001 - no source info in this jax
        return ""


class EqnPrinter:
    """Prints equations of one jaxpr (and its sub-jaxprs) with consistent variable names;
    falls back to ``str(eqn)`` where jax's printer is unavailable."""

    def __init__(self):
        try:
            self._ctx = _core.JaxprPpContext()
            self._settings = _core.JaxprPpSettings()
        except Exception:  # noqa: BLE001
            self._ctx = None

    def __call__(self, eqn) -> str:
        if self._ctx is not None:
            try:
                return _core.pp_eqn(eqn, self._ctx, self._settings).format()
            except Exception:  # noqa: BLE001
                pass
        return str(eqn)


def subjaxprs(eqn):
    return list(jex.core.jaxprs_in_params(eqn.params))


# --------------------------------------------------------------------------- #
# Params whose layout changed across jax's range: read by feature, never by version
# number (walker.py reads how the structured primitives nest jaxprs), raising
# `UnsupportedJaxError` naming the primitive where neither layout is found.
# --------------------------------------------------------------------------- #
class UnsupportedJaxError(RuntimeError):
    """A primitive's params have a layout this version of the package does not know."""


def unsupported(eqn, what):
    return UnsupportedJaxError(
        f"jaxpr_surgery does not understand the params of the {eqn.primitive} primitive in "
        f"jax {jax.__version__} ({what}; params: {sorted(eqn.params)}). This jax is outside "
        "the tested range (see jaxpr_surgery.TESTED_JAX); please report it."
    )


def closed_parts(j):
    """``(Jaxpr, consts)`` of a ``ClosedJaxpr`` or an open ``Jaxpr``."""
    if isinstance(j, ClosedJaxpr):
        return j.jaxpr, tuple(j.consts)
    if isinstance(j, Jaxpr):
        if j.constvars:  # pragma: no cover - not produced by any tested jax
            raise UnsupportedJaxError(
                "an open sub-jaxpr with unbound constvars; this jax is outside the tested range."
            )
        return j, ()
    raise UnsupportedJaxError(f"expected a jaxpr, got {type(j).__name__}")


def plain_call(eqn) -> bool:
    """Whether a call-like eqn (jit, closed_call, call) only names its body: no
    shardings, layouts or donation that inlining the body would drop."""
    if eqn.primitive is not jit_p:
        return True
    try:
        from jax._src.sharding_impls import UnspecifiedValue
    except ImportError:  # pragma: no cover - outside the tested range
        return False
    p = eqn.params
    shardings = (*p.get("in_shardings", ()), *p.get("out_shardings", ()))
    layouts = (*p.get("in_layouts", ()), *p.get("out_layouts", ()))
    return (
        all(isinstance(s, UnspecifiedValue) for s in shardings)
        and all(x is None for x in layouts)
        and not any(p.get("donated_invars", ()))
    )


# --------------------------------------------------------------------------- #
# shard_map varying-manual-axes (vma)
# --------------------------------------------------------------------------- #
def vma_checked() -> bool:
    """Whether the values traced now are typed by the mesh axes they vary over (inside
    ``shard_map`` with ``check_vma=True``, its default); False outside ``shard_map``,
    with ``check_vma=False`` and under ``jax.pmap``, where no type says which values
    differ between devices. (jax's own flag of the shard_map being traced; True where a
    jax has none, so that nothing is refused on a guess.)"""
    from jax._src import config

    state = getattr(config, "_check_vma", None)
    return True if state is None else bool(state.value)


def bound_axis_names():
    """The named axes bound where the trace is now (``shard_map``'s mesh axes, ``pmap``'s
    and a named ``vmap``'s axis names): a collective can only name one of them. None
    where a jax does not say (then nothing may be skipped on a guess)."""
    get = getattr(_core, "get_axis_env", None)
    sizes = getattr(get(), "axis_sizes", None) if get is not None else None
    return None if sizes is None else frozenset(sizes)


def vma_of(x) -> frozenset:
    """The manual mesh axes over which ``x`` varies (empty outside shard_map); ``x``
    may be an array, a tracer or an abstract value (``jax.eval_shape``'s
    ``ShapeDtypeStruct``, an equation's variable's ``aval``)."""
    if isinstance(x, (jax.ShapeDtypeStruct, _core.AbstractValue)):
        aval = x
    else:
        try:
            aval = jax.typeof(x)
        except Exception:  # noqa: BLE001
            return frozenset()
    for attr in ("vma",):
        v = getattr(aval, attr, None)
        if v is not None:
            return frozenset(v)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        v = getattr(mat, "varying", None)
        if v is not None:
            return frozenset(v)
    return frozenset()


def implicit_rank_promotion(fn):
    """``fn`` run with jax.numpy's implicit rank promotion allowed, whatever the user's
    ``jax_numpy_rank_promotion`` (``"raise"`` in some codebases): the package's own
    arithmetic broadcasts by rank (a mean ``[*leaf]`` against examples ``[B, *leaf]``).
    The user's functions are traced outside it, under their own setting."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.numpy_rank_promotion("allow"):
            return fn(*args, **kwargs)

    return wrapped


def named_axes_bound() -> bool:
    """Whether a named axis (shard_map's manual mesh axes, pmap's or vmap's
    ``axis_name``) is bound where this runs: outside one, no value varies over a manual
    axis (`vma_of` is empty), so its type need not be traced to learn it. True where
    this jax does not say."""
    try:
        return bool(_core.get_axis_env().axis_sizes)
    except Exception:  # noqa: BLE001 - an internal of jax that may move
        return True


def slice_at(x, start, size, axis=0):
    """``lax.dynamic_slice_in_dim`` at a ``start`` known to be non-negative (a loop's
    offset): no wrap-around of negative starts is staged (a compare, an add and a select
    per slice, each a traced ``jax.numpy`` operator: a fifth of the trace of a model's
    tile loops)."""
    return lax.dynamic_slice_in_dim(x, start, size, axis, allow_negative_indices=False)


def update_at(x, update, start, axis=0):
    """``lax.dynamic_update_slice_in_dim`` at a non-negative ``start`` (`slice_at`)."""
    return lax.dynamic_update_slice_in_dim(x, update, start, axis, allow_negative_indices=False)


def _aval_vma(aval):
    """The manual axes an abstract value varies over, or None where it has no such
    type (older jax)."""
    v = getattr(aval, "vma", None)
    if v is None:
        v = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return None if v is None else frozenset(v)


def make_varying(x, axes):
    """Casts ``x`` to vary over ``axes`` (a no-op for axes it already varies over)."""
    missing = tuple(sorted(set(axes) - vma_of(x)))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # pragma: no cover - older jax


def zeros_like_varying(x):
    """Zeros shaped and typed like ``x``, varying over the manual axes it varies over
    (``jnp.zeros_like`` gives an invariant array inside shard_map)."""
    return make_varying(jnp.zeros_like(x), vma_of(x))


def ordering_barrier(tree):
    """``lax.optimization_barrier`` of ``tree``'s leaves (none is computed from the
    outputs before all inputs are done), keeping each leaf's varying manual axes.

    jax 0.10 gives every output of a barrier the union of its operands' axes inside
    shard_map (jax 0.12 keeps each operand's); there the leaves pass one barrier per
    set of axes, so a leaf waits only for those with its own."""
    leaves, treedef = jax.tree.flatten(tree)
    out = list(lax.optimization_barrier(leaves))
    if any(vma_of(o) != vma_of(x) for o, x in zip(out, leaves)):
        groups: dict = {}
        for i, x in enumerate(leaves):
            groups.setdefault(vma_of(x), []).append(i)
        out = list(leaves)
        for idx in groups.values():
            for i, o in zip(idx, lax.optimization_barrier([leaves[i] for i in idx])):
                out[i] = o
    return jax.tree.unflatten(treedef, out)


def float0_zeros(shape):
    import numpy as np

    return np.zeros(shape, dtype=jax.dtypes.float0)


def _eager_trace_types() -> tuple:
    """jax's traces that evaluate as they go (no staging): eager evaluation, forward and
    reverse mode, batching."""
    from jax._src.interpreters import ad, batching

    found = [_core.EvalTrace]
    for mod, name in ((ad, "JVPTrace"), (ad, "LinearizeTrace"), (batching, "BatchTrace")):
        t = getattr(mod, name, None)
        if isinstance(t, type):
            found.append(t)
    return tuple(found)


_EAGER_TRACES = _eager_trace_types()


def under_eager_transformations() -> bool:
    """Whether every trace of the current stack evaluates as it goes: ``jax.grad``,
    ``jax.jvp``, ``jax.vmap`` applied outside any jit, whose operations run one at a
    time. False under anything else (jit, make_jaxpr, pmap, shard_map, a scan body,
    ...), or where jax's trace stack cannot be read."""
    try:
        stack = _core.unsafe_get_trace_stack(_core.unsafe_get_current_trace())
    except (AttributeError, TypeError):
        return False
    return all(isinstance(t, _EAGER_TRACES) for t in stack)


# --------------------------------------------------------------------------- #
# The cross-example check (independence/): primitives by object, params of the
# control-flow primitives, and how jax batches a primitive (which tells elementwise ops)
# --------------------------------------------------------------------------- #
def _find_prim(name):
    """The primitive ``<name>_p`` of jax's lax, slicing, loops, ... modules, or None."""
    import importlib

    for mod in ("jax._src.lax.lax", "jax._src.lax.slicing", "jax._src.lax.control_flow.loops",
                "jax._src.lax.windowed_reductions", "jax._src.lax.parallel", "jax._src.ad_util",
                "jax._src.ad_checkpoint", "jax._src.prng", "jax._src.random.prng",
                "jax._src.pjit", "jax._src.lax.ann", "jax._src.lax.fft", "jax._src.lax.linalg"):
        try:
            p = getattr(importlib.import_module(mod), f"{name}_p", None)
        except ImportError:  # pragma: no cover - module moved in this jax
            continue
        if p is not None:
            return p
    return None


class _Prims:
    """Primitive objects by name (None where this jax has no such primitive)."""

    def __getattr__(self, name):
        p = _find_prim(name)
        setattr(self, name, p)
        return p


prims = _Prims()

# jax 0.12's own primitives for jnp.stack / jnp.unstack; None in older jax, which writes
# them as broadcast_in_dim + concatenate and split + squeeze
stack_p = _find_prim("stack")
unstack_p = _find_prim("unstack")


def elementwise_batching(prim) -> str | None:
    """``"broadcast"`` for n-ary elementwise primitives (jax batches them with its
    broadcasting batcher), ``"vectorized"`` for those applied independently along leading
    axes (unary elementwise ops, ``random_bits``: jax's vectorized batcher), else None."""
    from jax._src.interpreters import batching

    table = getattr(batching, "fancy_primitive_batchers", None)
    if not isinstance(table, dict):  # pragma: no cover - older layout
        table = getattr(batching, "primitive_batchers", {})
    rule = table.get(prim) if isinstance(table, dict) else None
    func = getattr(rule, "func", None)
    if func is not None and func is getattr(batching, "broadcast_batcher", ()):
        return "broadcast"
    if func is not None and func is getattr(batching, "vectorized_batcher", ()):
        return "vectorized"
    return None


def custom_vjp_bwd(eqn):
    """The user's backward function of a ``jax.custom_vjp`` call equation (the one given
    to ``defvjp``), or None for any other equation. Its identity names the op: the
    equation keeps no reference to the ``custom_vjp`` object itself."""
    if eqn.primitive not in custom_prims:
        return None
    bwd = eqn.params.get("bwd")
    return getattr(bwd, "f", None)


def custom_vjp_in_tree(eqn):
    """The pytree structure of a ``jax.custom_vjp`` call's arguments (its operands past
    the hoisted constants are their leaves), or None where this jax does not record it.
    Read from the backward function's flattening step (``_flatten_bwd``), found by
    feature: the first ``PyTreeDef`` among its arguments with as many leaves as the op
    has operands."""
    bwd = eqn.params.get("bwd")
    n = len(eqn.invars) - custom_call_consts(eqn)
    for step in getattr(bwd, "transforms", ()) or ():
        args = step[1] if isinstance(step, tuple) and len(step) == 2 else ()
        for a in args if isinstance(args, tuple) else ():
            if isinstance(a, jax.tree_util.PyTreeDef):
                return a if a.num_leaves == n else None
    return None


def custom_jvp_rule(eqn):
    """``(jvp, in_tree)``: the user's JVP function of a ``jax.custom_jvp`` call equation
    (the one given to ``defjvp``; its identity names the op, as `custom_vjp_bwd`'s does)
    and the pytree structure of the call's arguments; ``(None, None)`` for any other
    equation or where this jax does not record them. Found by feature: the equation's
    ``jvp_jaxpr_fun`` closes over the rule wrapped with its flattening step
    (``_flatten_jvp``), whose arguments hold the arguments' ``PyTreeDef``."""
    if custom_jvp_call_p is None or eqn.primitive is not custom_jvp_call_p:
        return None, None
    found = _wrapped_rule(eqn)
    if found is None:
        return None, None
    n = len(eqn.invars) - custom_call_consts(eqn)
    return (found[0].f, found[1]) if found[1].num_leaves == n else (found[0].f, None)


def _wrapped_rule(eqn):
    """``(the user's rule as a WrappedFun, the arguments' PyTreeDef)`` of a custom_jvp /
    custom_vjp call: the first WrappedFun reached from its rule parameter (through
    closures) with a step holding a ``PyTreeDef`` (its flattening step), or None."""
    from jax._src import linear_util as lu

    seen = set()

    def find(obj, depth):
        if depth > 8 or id(obj) in seen:
            return None
        seen.add(id(obj))
        if isinstance(obj, lu.WrappedFun):
            for step in obj.transforms or ():
                args = step[1] if isinstance(step, tuple) and len(step) == 2 else ()
                for a in args if isinstance(args, tuple) else ():
                    if isinstance(a, jax.tree_util.PyTreeDef):
                        return obj, a
            found = find(obj.f, depth + 1)
            if found is not None:
                return found
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                found = find(cell.cell_contents, depth + 1)
            except ValueError:  # (an empty cell)
                continue
            if found is not None:
                return found
        return None

    p = eqn.params
    return find(p.get("bwd", p.get("jvp_jaxpr_fun", p.get("jvp_jaxpr_thunk"))), 0)


def custom_static_args(eqn):
    """The values of a custom_jvp / custom_vjp call's ``nondiff_argnums`` arguments, in
    order (``()`` for an op without), or None where this jax does not record them: the
    user's rule is wrapped with a step that prepends them (``_prepend_static_args``)."""
    found = _wrapped_rule(eqn)
    if found is None:
        return None
    for step in found[0].transforms or ():
        if getattr(step[0], "__name__", "") == "_prepend_static_args":
            vals = step[1][0] if step[1] and isinstance(step[1][0], tuple) else None
            unwrap = lambda v: v.val if type(v).__name__ == "Unhashable" else v  # noqa: E731
            return None if vals is None else tuple(unwrap(v) for v in vals)
    return ()


def custom_call_consts(eqn) -> int:
    """How many of a custom_jvp / custom_vjp call's operands are constants hoisted out of
    its function (not the op's own arguments)."""
    return int(eqn.params.get("num_consts", 0))


_VMA_TYPE = re.compile(r"\{V:[^}]*\}")


def jaxpr_text(j, vma=True) -> str:
    """The printed form of a jaxpr (``ClosedJaxpr`` or open), without its constants'
    values: equal for equal programs traced alike. ``vma=False``: without the manual
    mesh axes its values vary over (``{V:data}``: a program traced inside ``shard_map``
    against one traced outside)."""
    text = str(closed_parts(j)[0])
    return text if vma else _VMA_TYPE.sub("", text)


def call_eqn_of(fn, avals, name):
    """One ``jit`` call equation of ``fn`` at the abstract values ``avals``, traced by jax
    itself (its parameters are jax's own), with fresh variables: the caller rewires its
    ``invars`` / ``outvars`` (`replace_eqn_vars`). Raises ``ValueError`` naming ``name``
    where ``fn`` cannot be traced to one call (it closes over arrays jax hoists out)."""
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    outer = jax.make_jaxpr(jax.jit(fn))(*structs)
    if len(outer.jaxpr.eqns) != 1 or outer.jaxpr.constvars or outer.consts:
        raise ValueError(
            f"{name}: the function could not be traced to one call (it closes over arrays "
            "that jax hoists out of it); compute such constants inside it."
        )
    return outer.jaxpr.eqns[0]


def replace_eqn_vars(eqn, invars, outvars):
    return eqn.replace(invars=list(invars), outvars=list(outvars))


def map_subjaxprs(eqn, f):
    """``eqn`` with every sub-jaxpr ``j`` of its parameters (a ``jit``, ``scan``,
    ``cond``, ``remat`` body...) replaced by ``f(j)`` (an open ``Jaxpr`` in, one out;
    the same object where nothing changes), or ``eqn`` itself where none changed.
    ``ClosedJaxpr`` parameters keep their constants; tuples of jaxprs (``cond``'s
    branches) are mapped entry by entry."""

    def one(v):
        if isinstance(v, ClosedJaxpr):
            new = f(v.jaxpr)
            return v if new is v.jaxpr else ClosedJaxpr(new, v.consts)
        if isinstance(v, Jaxpr):
            return f(v)
        return v

    changes = {}
    for k, v in eqn.params.items():
        if isinstance(v, (ClosedJaxpr, Jaxpr)):
            new = one(v)
        elif isinstance(v, tuple) and v and all(isinstance(x, (ClosedJaxpr, Jaxpr)) for x in v):
            new = tuple(one(x) for x in v)
            new = v if all(a is b for a, b in zip(new, v)) else new
        else:
            continue
        if new is not v:
            changes[k] = new
    return eqn.replace(params={**eqn.params, **changes}) if changes else eqn


def replace_eqns(jaxpr, eqns):
    return jaxpr.replace(eqns=list(eqns))


def user_frames(eqn, stop_dir: str) -> list:
    """``file:line (function)`` of the user's frames that emitted ``eqn``, innermost first
    (file names without their directory), up to the first frame under ``stop_dir`` (the
    package's own code that called the user's function)."""
    try:
        import os

        from jax._src import source_info_util

        out = []
        for frame in source_info_util.user_frames(eqn.source_info.traceback):
            if os.path.abspath(frame.file_name).startswith(stop_dir):
                break
            out.append(
                f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"
            )
        return out
    except Exception:  # noqa: BLE001 - no source info in this jax
        return []


def mapped_over(x, axis_name) -> bool:
    """``x`` varies along the ``jax.vmap`` axis named ``axis_name`` (traced inside it)."""
    from jax._src.interpreters import batching

    if not isinstance(x, batching.BatchTracer):
        return False
    data = getattr(x._trace, "axis_data", None)
    bd, unmapped = x.batch_dim, getattr(batching, "NotMapped", ())
    return getattr(data, "name", None) == axis_name and bd is not None and not (
        isinstance(unmapped, type) and isinstance(bd, unmapped))

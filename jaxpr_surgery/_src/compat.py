"""The one place that touches JAX internals or churn-prone names.

Everything version-sensitive (primitive objects, parameter names, the vma
type system of shard_map) is resolved here, by feature detection, so the rest
of the package compares primitives by object and never by name string.
"""

from __future__ import annotations

import jax
import jax.extend as jex
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
conv_p = _conv.conv_general_dilated_p
gather_p = _slicing.gather_p
mul_p = _lax.mul_p
add_p = _lax.add_p
sub_p = _lax.sub_p
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


def _pjit_p():
    from jax._src import pjit

    return getattr(pjit, "jit_p", None) or pjit.pjit_p


jit_p = _pjit_p()
closed_call_p = _first(lambda: _core.closed_call_p)
call_p = _first(lambda: _core.call_p)


def _remat_p():
    from jax._src.ad_checkpoint import remat_p

    return remat_p


remat_p = _remat_p()


def _custom_prims():
    from jax._src import custom_derivatives as cd

    out = []
    for n in ("custom_jvp_call_p", "custom_vjp_call_p", "custom_vjp_call_jaxpr_p"):
        p = getattr(cd, n, None)
        if p is not None:
            out.append(p)
    return tuple(out)


custom_prims = _custom_prims()

sharding_constraint_p = _first(
    lambda: __import__("jax._src.pjit", fromlist=["x"]).sharding_constraint_p,
    lambda: __import__("jax._src.sharding_impls", fromlist=["x"]).sharding_constraint_p,
)


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

# Primitives of reductions that make examples interact when applied to the
# batch axis (used by the interaction heuristics of explain).
reduce_sum_p = _lax.reduce_sum_p


# --------------------------------------------------------------------------- #
# Binding an equation
# --------------------------------------------------------------------------- #
def bind_eqn(eqn, invals):
    """Evaluates one jaxpr equation on values (``eval_jaxpr`` for one eqn)."""
    bp = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bp, tuple):  # jax < 0.9.2: (subfuns, params)
        subfuns, params = bp
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    else:
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*invals, **bp)
    return list(out) if eqn.primitive.multiple_results else [out]


def eval_jaxpr(jaxpr, consts, *args):
    return jex.core.jaxpr_as_fun(ClosedJaxpr(jaxpr, consts))(*args)


def subjaxprs(eqn):
    return list(jex.core.jaxprs_in_params(eqn.params))


# --------------------------------------------------------------------------- #
# shard_map varying-manual-axes (vma)
# --------------------------------------------------------------------------- #
def vma_of(x) -> frozenset:
    """The manual mesh axes over which ``x`` varies (empty outside shard_map)."""
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


def make_varying(x, axes):
    """Casts ``x`` to vary over ``axes`` (a no-op for axes it already varies over)."""
    missing = tuple(sorted(set(axes) - vma_of(x)))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # pragma: no cover - older jax


def float0_zeros(shape):
    import numpy as np

    return np.zeros(shape, dtype=jax.dtypes.float0)


def explicit_axes(x) -> tuple:
    """Mesh axes of ``x``'s sharding that are in Explicit mode (sharding-in-types)."""
    try:
        sharding = jax.typeof(x).sharding
    except Exception:  # noqa: BLE001
        return ()
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or not hasattr(mesh, "axis_types"):
        return ()
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    out = []
    for entry in spec:
        for a in entry if isinstance(entry, tuple) else (entry,):
            if a is not None and types.get(a) == explicit:
                out.append(a)
    return tuple(out)


def explicit_mesh_axes(arrays):
    """(abstract mesh, axes) of the Explicit-mode mesh axes the arrays are sharded over, or None."""
    axes, mesh = set(), None
    for x in arrays:
        ax = explicit_axes(x)
        if ax:
            axes.update(ax)
            mesh = jax.typeof(x).sharding.mesh
    return (mesh, tuple(sorted(axes))) if axes else None


def in_auto_mode(fn, args, mesh, axes):
    """Runs ``fn(*args)`` with the Explicit mesh ``axes`` switched to Auto; outputs replicated."""
    from jax.sharding import PartitionSpec

    with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
        return jax.sharding.auto_axes(fn, axes=axes, out_sharding=PartitionSpec())(*args)

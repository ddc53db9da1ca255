"""Losses written for sharding in types (Explicit mesh axes), run in Auto mode.

The statistics are computed with a mesh's Explicit axes switched to Auto (`meshes.in_auto_mode`):
each example's gradient is traced on a batch of one, which an annotation naming the batch's axis
cannot type (``P("data")`` does not divide one example), and in Auto mode every annotation naming
the axes is invalid. `untyped` runs such a loss anyway: it traces ``fn`` on a stand-in mesh with the
same axis names, each of size one (every annotation then types every shape), and evaluates that
jaxpr in the caller's context with its annotations dropped. An annotation places a value, none
changes one: ``jax.sharding.reshard``, ``jax.device_put`` and sharding constraints become the
identity (but a placement of a value no example reaches, such as FSDP's ``reshard(w, P())``,
stays a sharding constraint on the caller's mesh, where its axes are Auto), sharding
parameters (``out_sharding=`` of a ``dot_general``, ``jnp.zeros``, ``iota``, ...) become None,
``jit`` calls are inlined and every sub-jaxpr (``scan``, ``cond``, ``remat``, custom derivatives)
is traced again in the caller's context. XLA's partitioner then places every other value, as for
a model written with ``with_sharding_constraint`` hints.

A loss the stand-in mesh cannot trace runs as written. One that closes over arrays placed on the
real mesh (or names it in a ``NamedSharding``) fails both ways, with or without annotations: it
raises `AnnotationError`, saying to pass such arrays as arguments.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, walker

_REST = "_jaxpr_surgery_rest"  # the stand-in mesh's one axis of every device


class AnnotationError(NotImplementedError):
    """A loss typed for Explicit axes that runs neither in Auto mode nor on the stand-in mesh."""


def _stand_in(mesh):
    """A mesh with ``mesh``'s axis names, each of size one and Explicit, and one Auto axis of
    every device (jax keeps a trace's mesh the same size)."""
    names = tuple(mesh.axis_names)
    n = math.prod(mesh.axis_sizes)
    Explicit, Auto = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
    return jax.sharding.AbstractMesh(
        (1,) * len(names) + (n,), names + (_REST,), axis_types=(Explicit,) * len(names) + (Auto,)
    )


def _struct(a, mesh=None, spec=()):
    """A stand-in for a value of abstract type ``a`` (on ``mesh``, if given, with ``spec``)."""
    sharding = (None if mesh is None
                else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding,
                                weak_type=getattr(a, "weak_type", False))


def _spec_of(x) -> tuple:
    """The entries of ``x``'s sharding's spec (none outside a mesh)."""
    try:
        return tuple(jax.typeof(x).sharding.spec)
    except Exception:  # noqa: BLE001 - not an array on a mesh
        return ()


def _fit(spec, ndim, ndim_like):
    """An argument's spec for the same argument of ``ndim`` dimensions: its examples' (one
    dimension fewer) drop the batch's entry."""
    spec = spec + (None,) * (ndim_like - len(spec))
    if ndim == ndim_like:
        return spec
    return spec[1:] if ndim == ndim_like - 1 else ()


def _retyped(j, stand_in):
    """A sub-jaxpr (closed or open) traced again in the caller's context, unannotated."""
    jaxpr, consts = compat.closed_parts(j)
    closed = jax.make_jaxpr(lambda *a: _evaluate(jaxpr, consts, a, stand_in))(
        *[_struct(v.aval) for v in jaxpr.invars])
    if isinstance(j, compat.ClosedJaxpr):
        return closed
    if closed.consts:  # (an open jaxpr takes no constants: the stand-in trace gives up)
        raise ValueError("a sub-jaxpr traced again holds constants")
    return closed.jaxpr


def _param(v, stand_in):
    if isinstance(v, (compat.ClosedJaxpr, compat.Jaxpr)):
        return _retyped(v, stand_in)
    if isinstance(v, tuple) and v and all(isinstance(x, compat.ClosedJaxpr) for x in v):
        return tuple(_retyped(x, stand_in) for x in v)  # (cond's branches)
    if isinstance(v, (jax.sharding.Sharding, jax.sharding.PartitionSpec)):
        return None
    if isinstance(v, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):  # (shard_map)
        raise ValueError("a mesh in an equation's parameters")
    return v


def _rule_thunk(thunk, stand_in):
    """A custom derivative's rule (custom_vjp's forward, custom_jvp's jvp), traced when
    differentiated, on the types of the call's values (the stand-in's): traced there, then
    again in the caller's context (the thunk gives ``(jaxpr, consts, *rest)``)."""

    def traced(*zeros):
        with jax.sharding.use_abstract_mesh(stand_in):
            jaxpr, consts, *rest = thunk.call_wrapped(*zeros)
        closed = _retyped(compat.ClosedJaxpr(jaxpr, consts), stand_in)
        return (closed.jaxpr, closed.consts, *rest)

    return compat.thunk_like(thunk, traced)


def _unchecked(bwd, stand_in):
    """custom_vjp's backward rule without jax's check that its cotangents have the types of
    the primal's arguments at the call: the stand-in's types, which no value of the caller's
    context has (the user's own jax.grad runs the same rule with the check)."""

    def run(*args):
        with compat.bwd_checks_off():
            return bwd.call_wrapped(*args)

    return compat.thunk_like(bwd, run)


# per custom-derivative primitive, its parameters holding rules traced when differentiated
_RULES = {compat.custom_vjp_call_p: {"fwd_jaxpr_thunk": _rule_thunk, "bwd": _unchecked},
          compat.custom_jvp_call_p: {"jvp_jaxpr_fun": _rule_thunk}}


class _Unannotated(walker.Walker):
    """Evaluates a jaxpr traced on the stand-in mesh with its annotations dropped: a call is
    inlined, every other equation is bound with its sharding parameters dropped and its
    rules traced again (`_param`, `_RULES`). A placement is the identity, except that of a
    value no example reaches (a weight gathered for FSDP by ``reshard(w, P())``): that one is
    kept as a sharding constraint of the caller's (Auto) mesh, so XLA places the weight as the
    loss says, as it does under jax.grad. ``examples``: the jaxpr's inputs an example reaches
    (the batch's), followed through the top level and the calls it inlines; inside any other
    sub-jaxpr every placement is dropped."""

    def __init__(self, stand_in, examples=frozenset()):
        self.stand_in = stand_in
        self.reached = set(examples)

    def read(self, env, v):
        return v.val if isinstance(v, compat.Literal) else env[v]

    def _reaches(self, vs):
        return any(not isinstance(v, compat.Literal) and v in self.reached for v in vs)

    def inline(self, eqn, view, ins, path):
        self.reached.update(v for v, o in zip(view.jaxpr.invars, eqn.invars)
                            if self._reaches([o]))
        outs = self.run(view.jaxpr, ins, path, consts=view.consts)
        self.reached.update(o for o, v in zip(eqn.outvars, view.jaxpr.outvars)
                            if self._reaches([v]))
        return outs

    ENTER = {walker.Nest.CALL: inline}

    def equation(self, eqn, ins, path):
        reached = self._reaches(eqn.invars)
        if reached:
            self.reached.update(eqn.outvars)
        if eqn.primitive in compat.placement_prims:
            outs = ins[: len(eqn.outvars)]
            if reached:
                return outs
            return [_constrained(x, spec) for x, spec in zip(outs, compat.placement_specs(eqn))]
        params = {k: _param(v, self.stand_in) for k, v in eqn.params.items()}
        for key, wrap in _RULES.get(eqn.primitive, {}).items():
            if key in params:
                params[key] = wrap(params[key], self.stand_in)
        return compat.bind(eqn.primitive, ins, params)


def _constrained(x, spec):
    """``x`` placed at ``spec`` on the caller's mesh (its axes Auto here: a hint to XLA's
    partitioner); ``x`` itself where that mesh cannot take the spec."""
    if spec is None:
        return x
    try:
        return jax.lax.with_sharding_constraint(x, spec)
    except Exception:  # noqa: BLE001 - a hint only: without it XLA places the value itself
        return x


def _evaluate(jaxpr, consts, args, stand_in, examples=()):
    """``jaxpr`` evaluated unannotated (`_Unannotated`); ``examples``: the indices of
    ``args`` an example reaches."""
    ev = _Unannotated(stand_in, {jaxpr.invars[i] for i in examples})
    return ev.run(jaxpr, list(args), consts=consts)


def untyped(fn, mesh, name, like, batch_argnums=None):
    """``fn`` with its sharding annotations for ``mesh``'s Explicit axes dropped (module
    docstring); called inside `meshes.in_auto_mode`, on arguments structured like ``like``
    (the call's, typed for the Explicit axes: each stand-in is typed like its argument, so
    the loss's own typing rules see what they see under jax.grad). ``batch_argnums``: the
    positional arguments holding the examples (None: every argument), whose values keep
    no placement."""
    stand_in = _stand_in(mesh)
    like = jax.tree.leaves(like)
    typed_like = [(_spec_of(x), jnp.ndim(x)) if compat.is_array_like(x) or hasattr(x, "shape")
                  else ((), None) for x in like]

    def call(*args):
        leaves, tree = jax.tree.flatten(args)
        batched = [batch_argnums is None or i in batch_argnums  # (each argument's leaves)
                   for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
        arr = [isinstance(x, (jax.Array, np.ndarray)) or compat.is_array_like(x) for x in leaves]
        typed = typed_like if len(typed_like) == len(leaves) else [((), None)] * len(leaves)
        structs = [_struct(jax.typeof(x), stand_in,
                           _fit(spec, jnp.ndim(x), jnp.ndim(x) if nd is None else nd))
                   for x, a, (spec, nd) in zip(leaves, arr, typed) if a]

        def flat(*xs):
            it = iter(xs)
            full = [next(it) if a else x for a, x in zip(arr, leaves)]
            return fn(*jax.tree.unflatten(tree, full))

        try:
            with jax.sharding.use_abstract_mesh(stand_in):
                closed, shape = jax.make_jaxpr(flat, return_shape=True)(*structs)
            batched_arrays = [b for b, a in zip(batched, arr) if a]
            examples = [j for j, b in enumerate(batched_arrays) if b]
            outs = _evaluate(closed.jaxpr, closed.consts,
                             [x for x, a in zip(leaves, arr) if a], stand_in, examples)
        except Exception as stand_in_error:  # noqa: BLE001 - run as written (module docstring)
            try:
                return fn(*args)
            except ValueError as e:
                if not is_mode_error(e):
                    raise
                raise AnnotationError(_message(name, mesh, stand_in_error, e)) from e
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return call


# jax's errors for a value typed for Explicit axes met in Auto mode: an annotation naming
# them, an array placed on the mesh (closed over) met by the arguments switched to Auto, a
# shard_map given the Explicit mesh itself
_SHARD_MAP_MESH = "should match the mesh passed to shard_map"
_MODE_ERRORS = ("of type Auto or Manual", "should match the aval mesh", _SHARD_MAP_MESH)


def is_mode_error(e) -> bool:
    """Whether ``e`` is jax's error for a value typed for Explicit axes met in Auto mode."""
    return any(m in str(e) for m in _MODE_ERRORS)


def _message(name, mesh, stand_in_error, error) -> str:
    if _SHARD_MAP_MESH in str(error):
        return (
            f"{name}: the loss calls jax.shard_map with mesh= the mesh whose Explicit axes "
            f"{tuple(mesh.axis_names)} are switched to Auto where the statistics are computed "
            "(each example's gradient is traced on a batch of one, which an Explicit "
            "annotation of the batch's axis cannot type); a shard_map given the mesh itself "
            "cannot run there. Fix: leave out mesh= (jax.shard_map then takes the mesh in "
            "context: call under jax.set_mesh(mesh)), or use a mesh with Auto axes "
            "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n)). "
            f"(jax: {str(error).splitlines()[0][:300]})"
        )
    return (
        f"{name}: the loss could not run with the mesh's Explicit axes "
        f"{tuple(mesh.axis_names)} in Auto mode, where the statistics are computed (each "
        "example's gradient is traced on a batch of one): "
        f"{type(error).__name__}: {str(error).splitlines()[0][:300]}. Its sharding "
        "annotations (out_sharding=, jax.sharding.reshard) are dropped on a stand-in mesh of "
        "those axis names, which failed too "
        f"({type(stand_in_error).__name__}: {str(stand_in_error).splitlines()[0][:300]}). "
        "A loss that closes over arrays placed on the mesh (or names the mesh itself in a "
        "NamedSharding) runs in neither: pass such arrays as arguments and write specs as "
        "PartitionSpec (resolved against the mesh in context), or write the loss for an "
        "Auto mesh with jax.lax.with_sharding_constraint hints "
        "(docs/howto/sharded.md#explicit-sharding)."
    )

"""Structural keys of equations and sites, to trace repeated layers once.

An unrolled model repeats the same layer: the same equations on values of the
same shapes, only the variables differ. The interpreter wraps the work it does
per run of ordinary equations and per site in a ``jax.jit`` keyed by the
structure below, so the second and later layers bind an already traced (and
already differentiated, batched and lowered) function instead of tracing it
again.

A key must determine the traced function completely: equal keys mean the same
computation on the same abstract inputs. Anything we cannot key exactly
(arrays or tracers in parameters, unknown objects compared by identity that
differ between layers) makes the key ``None`` -- no caching, never a wrong hit.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref

import jax
import numpy as np

from jaxpr_surgery._src import compat


class Unkeyable(Exception):
    """A value with no exact structural key."""


_ATOMS = (type(None), bool, int, float, complex, str, bytes, np.dtype, type)


def value_key(v):
    """A hashable key equal for equal values (type included: ``1`` is not ``1.0``)."""
    if isinstance(v, _ATOMS):
        return (type(v), v)
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(value_key(x) for x in v))
    if isinstance(v, dict):
        return (dict, tuple(sorted((repr(k), value_key(x)) for k, x in v.items())))
    if isinstance(v, (frozenset, set)):
        return (frozenset, frozenset(value_key(x) for x in v))
    if isinstance(v, np.ndarray):
        return (np.ndarray, v.dtype, v.shape, v.tobytes())
    if isinstance(v, np.generic):
        return (type(v), v.item())
    if compat.is_array_like(v):
        raise Unkeyable(type(v))
    try:
        hash(v)
    except TypeError:
        raise Unkeyable(type(v)) from None
    # anything else (jaxprs, primitives, avals, shardings, dtypes, functions, frozen
    # dataclasses): by its own ``==``/``hash`` -- identity for most jax objects.
    return (type(v), v)


def aval_key(a):
    return value_key(a)


class Namer:
    """Canonical names of variables: inputs by position, then outputs in order."""

    def __init__(self):
        self.names = {}

    def bind(self, v, name):
        self.names[v] = name

    def ref(self, v):
        if isinstance(v, compat.Literal):
            return ("lit", value_key(v.val), aval_key(v.aval))
        return self.names[v]


def eqns_key(eqns, namer: Namer) -> tuple:
    """Key of a run of equations whose inputs ``namer`` already names."""
    out = []
    for eqn in eqns:
        ins = tuple(namer.ref(v) for v in eqn.invars)
        for v in eqn.outvars:
            namer.bind(v, ("v", len(namer.names)))
        out.append(
            (
                eqn.primitive,
                value_key(dict(eqn.params)),
                ins,
                tuple(aval_key(v.aval) for v in eqn.outvars),
                value_key(eqn.effects),
                eqn.ctx,
            )
        )
    return tuple(out)


def keyed(fn):
    """``fn()`` or ``None`` where some part has no exact key."""
    try:
        return fn()
    except (Unkeyable, KeyError):
        return None


def site_key(site, kernel) -> tuple:
    """Everything a site's kernel computes from, but the variables' identities
    (``path`` and ``leaf``, which kernels do not read)."""
    namer = Namer()
    namer.bind(site.base, ("w",))
    for i, v in enumerate(site.ext_vars):
        namer.bind(v, ("x", i))
    comp = eqns_key((*site.pre, site.eqn), namer)
    # the view's constant factors: literals by value, others by their input position
    scales = tuple((sc.kind, None if sc.operand is None else namer.ref(sc.operand))
                   for sc in site.scales)
    state = {k: v for k, v in vars(kernel).items() if k != "site"}
    return (
        type(kernel),
        value_key(state),
        site.kind,
        site.param_pos,
        site.depth,
        value_key(site.chain),
        value_key(tuple(site.scan_lengths)),
        value_key(tuple(site.view_shape)),
        tuple(site.ext_batched),
        aval_key(site.base.aval),
        tuple(aval_key(v.aval) for v in site.ext_vars),
        comp,
        tuple(namer.ref(v) for v in site.eqn.outvars),
        scales,
        site.tap_of is not None,  # a tap computes no forward value
    )


class TraceCache:
    """``jax.jit`` functions by structural key, for one trace of the transformation.

    ``get(key, build)`` returns the cached jit of ``build()`` for ``key``, or
    ``build()`` itself (not jitted, not kept) where ``key`` is None. Plain
    values (shapes) are kept with ``value``."""

    def __init__(self):
        self._fns = {}
        self._site_keys = {}  # id(kernel) -> site key (kernels live as long as the plan)

    def site_key(self, site, kernel):
        """`site_key`, computed once per site of this trace (None: no exact key)."""
        k = id(kernel)
        if k not in self._site_keys:
            self._site_keys[k] = (kernel, keyed(lambda: site_key(site, kernel)))
        return self._site_keys[k][1]

    def get(self, key, build):
        if key is None:
            return build()
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = jax.jit(build())
        return fn

    def value(self, key, compute):
        if key is None:
            return compute()
        if key not in self._fns:
            self._fns[key] = compute()
        return self._fns[key]


# --------------------------------------------------------------------------- #
# Eager calls, compiled once per argument structure
# --------------------------------------------------------------------------- #
_EAGER = weakref.WeakSet()  # every `EagerCache` alive
_eager_x64 = None  # the x64 mode the entries of every EagerCache were traced in


class EagerCache:
    """The ``jax.jit`` of an entry point's eager calls, one per argument structure.

    ``get(key, build)`` returns the jit of ``build()`` kept for ``key`` (the argument
    structure, which leaves are arrays, the static leaves). Everything else that changes
    a trace is keyed by ``jax.jit`` itself: it traces again where jax's trace context
    differs (``jax_enable_x64``, the default matmul precision, rank and dtype
    promotion, the default device, ...), as for any jitted function.

    One thing jax.jit cannot key: JAX converts a NumPy array closed over by a traced
    function (a float64 or int64 constant) to the dtype of the x64 mode once, by the
    array's identity, and hands that conversion out again, under either mode, for as
    long as it is alive. A compiled function holds the conversions of its constants,
    so a trace under the other mode got the first mode's dtype (float32 values in
    float64 operations: a TypeError). Before a call under the other x64 mode, the
    entries of every EagerCache (two entry points may close over one array) are
    dropped, which frees those conversions where nothing else holds them (a function
    the caller jitted under the other mode does: a trace then fails as plain
    ``jax.jit``'s does). Switching the mode back and forth compiles again."""

    def __init__(self):
        self._fns = {}
        _EAGER.add(self)

    def get(self, key, build):
        global _eager_x64
        x64 = bool(jax.config.jax_enable_x64)
        if x64 != _eager_x64:
            for cache in list(_EAGER):
                cache._fns.clear()
            _eager_x64 = x64
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = jax.jit(build())
        return fn


# --------------------------------------------------------------------------- #
# Per-leaf functions traced once per leaf type
# --------------------------------------------------------------------------- #
# (function, argument structure, static leaves, state) -> its jax.jit; least recently
# used first, at most `_ONCE_SIZE` (static counts differ per batch size: a process
# calling with ever new batch sizes must not keep every one)
_ONCE = collections.OrderedDict()
_ONCE_SIZE = 1024


def _static_key(x):
    """An exact key of a non-array argument leaf: a Python scalar, a dtype, or a frozen
    dataclass of such fields (a reduction); `Unkeyable` otherwise."""
    if isinstance(x, _ATOMS) or isinstance(x, np.generic):
        return value_key(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if not type(x).__dataclass_params__.frozen:
            raise Unkeyable(type(x))
        return (type(x),) + tuple(_static_key(getattr(x, f.name)) for f in dataclasses.fields(x))
    raise Unkeyable(type(x))


def traced_once(fn):
    """Decorator of a function of arrays (per-leaf epilogues: moments, merges,
    finalizers): under a trace, its calls go through one ``jax.jit`` per argument
    structure and non-array arguments, which jax traces once per shapes, dtypes, weak
    types and varying axes of the arrays. A model's hundreds of parameter leaves have a
    dozen types, so their epilogues trace a dozen times; every other call binds one
    equation, and lowers to a call of the function lowered once.

    Non-array arguments (Python scalars, None fields, a frozen dataclass ``self`` of
    such fields) are part of the key, as they are to ``fn``; so is the state ``fn`` may
    read (`example_weights.is_open`). Anything else (an object without an exact key, a
    concrete array, examples kept by `norms.live_examples`, no traced argument) runs
    ``fn`` as it is. At most `_ONCE_SIZE` functions are kept (least recently used
    dropped)."""
    from jaxpr_surgery._src import example_weights as ew
    from jaxpr_surgery._src import norms

    @functools.wraps(fn)
    def wrapper(*args):
        leaves, tree = jax.tree.flatten(args)
        is_arr = tuple(isinstance(x, jax.core.Tracer) for x in leaves)
        if norms.live_examples_set() or not any(is_arr):
            return fn(*args)
        try:  # (a concrete array has no static key: ``fn`` may read its value)
            static = tuple(None if a else _static_key(x) for a, x in zip(is_arr, leaves))
            key = (fn, tree, is_arr, static, ew.is_open())
            hash(key)
        except (Unkeyable, TypeError):
            return fn(*args)
        jitted = _ONCE.get(key)
        if jitted is not None:
            _ONCE.move_to_end(key)
        else:
            consts = tuple(None if a else x for a, x in zip(is_arr, leaves))  # (no tracer)

            def flat_fn(arrays, consts=consts, is_arr=is_arr, tree=tree):
                it = iter(arrays)
                full = [next(it) if a else x for a, x in zip(is_arr, consts)]
                return fn(*jax.tree.unflatten(tree, full))

            flat_fn.__name__ = getattr(fn, "__name__", "traced_once")  # (named in HLO, profiles)
            jitted = _ONCE[key] = jax.jit(flat_fn)
            if len(_ONCE) > _ONCE_SIZE:
                _ONCE.popitem(last=False)
        return jitted([x for a, x in zip(is_arr, leaves) if a])

    return wrapper

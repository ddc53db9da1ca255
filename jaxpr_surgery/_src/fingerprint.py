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

"""The abstract interpreter of the independence proof: walks the batch loss's jaxpr,
giving every variable a tag (tags.py) by the rules of tables.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import numpy as np

from jaxpr_surgery._src import compat, fingerprint, walker
from jaxpr_surgery._src.independence.layout import _elementwise, _identity
from jaxpr_surgery._src.independence.tables import (
    _ACCUMULATING,
    _ADDING,
    _COLLECTIVES,
    _FOLD,
    _LINEAR,
    _LINED_RULES,
    _LINED_SOURCES,
    _RULES,
    _SIDE_BY_SIDE,
    _STRUCTURED,
    _TRACKED,
    _TRANSPARENT,
    _lined_elementwise,
)
from jaxpr_surgery._src.independence.tags import (
    _ACC_WHY,
    _MAX_ROUNDS,
    _PAIRED_FIX,
    Acc,
    Cross,
    Cur,
    Ex,
    One,
    P,
    Sum,
    Unknown,
    _cross_sum,
    _is_elementwise,
    _is_literal,
    _literal_scalar,
    _merge_positions,
    _paired,
    _partial,
    _positions,
    _reordered,
    _scaled,
    _shape,
    _single,
)


# --------------------------------------------------------------------------- #
# The interpreter
# --------------------------------------------------------------------------- #
class _Frame:
    """One run of a jaxpr by `_Interp`: its variables' tags (``env``), the enclosing
    jaxpr's atoms bound to its inputs (``outer``, in ``parent``), and the keys of its
    variables (`_Interp.key`) numbered so far (its first ``done`` equations)."""

    def __init__(self, jaxpr, env, outer, parent, serial):
        self.jaxpr, self.env, self.outer, self.parent = jaxpr, env, outer, parent
        self.serial = serial
        self.keys: dict = {}
        self.defs: dict = {}  # variable -> the equation computing it, once numbered
        self.calls: dict = {}  # id of a call-like equation -> the frame that ran its body
        self.done = 0
        self.inputs = None


class _Interp(walker.Walker):
    def __init__(self, B: int, data_axes: frozenset):
        self.B = B
        self.data_axes = data_axes
        self.levels = itertools.count()
        # integer index arrays equal to their index along one axis (jnp.arange, iota),
        # followed through broadcasts and jnp's negative-index normalisation
        self.iota: dict = {}
        self.neg_test: dict = {}  # bool var -> the var it tests for < 0
        self.comps: dict = {}  # index array concatenated on its last axis -> iota dims
        # the counter of a loop over the examples (fori_loop from 0 to B) -> its level
        self.counter: dict = {}
        # values that do not depend on the examples (tag None), per axis of size B whose
        # entries differ by position: axis -> `Lined`
        self.lined: dict = {}
        # the jaxprs being run, innermost last, and the keys of what computed a value
        # (`key`): interned nodes, jaxprs' keys by id, objects whose id is in a key
        self.frames: list = []
        self.serials = itertools.count()
        self.nodes: dict = {}
        self.jaxpr_keys: dict = {}
        self.pinned: list = []

    @staticmethod
    def acts_elementwise(prim) -> bool:
        """Whether ``prim`` acts element by element (its rule, or jax's batching)."""
        return _RULES.get(prim) is _elementwise or _is_elementwise(prim)

    def tags_of(self, jaxpr, in_tags, env=None, outer=None, call=None):
        """The tags of ``jaxpr``'s outputs; ``env`` (a dict) receives every variable's.
        ``outer``: the enclosing jaxpr's atoms bound to (some of) ``jaxpr``'s inputs;
        ``call``: the enclosing call-like equation whose body ``jaxpr`` is."""
        env = {} if env is None else env
        for v, t in zip(jaxpr.invars, in_tags):
            env[v] = t
        parent = self.frames[-1] if self.frames else None
        frame = _Frame(jaxpr, env, outer, parent, next(self.serials))
        if call is not None and parent is not None:
            parent.calls[id(call)] = frame  # its results' keys are its body's (`number`)
        self.frames.append(frame)
        try:
            self.walk(jaxpr, env, (), 0, len(jaxpr.eqns))
        finally:
            self.frames.pop()
        return [self.read(env, v) for v in jaxpr.outvars]

    def step(self, eqn, tags, path):
        if eqn.primitive in _TRACKED:
            self.track(eqn)
        if all(t is None for t in tags):
            self.follow_lined(eqn)
            return [None] * len(eqn.outvars)  # a function of constants only
        for v in eqn.outvars:  # tagged by the rules; calls pass theirs out
            self.lined.pop(v, None)
        return super().step(eqn, tags, path)  # the structured ones: `ENTER`

    # -- what computed a value: keys ------------------------------------------ #
    def intern(self, node) -> int:
        k = self.nodes.get(node)
        if k is None:
            k = self.nodes[node] = len(self.nodes)
        return k

    def pin(self, obj) -> int:
        """``id(obj)``, valid as long as this interpreter (which keeps ``obj`` alive)."""
        self.pinned.append(obj)
        return id(obj)

    def key(self, v, frame=None) -> int:
        """A key of what computed ``v`` (in the innermost jaxpr being run, or ``frame``):
        equal keys, equal operations on equal inputs (the enclosing jaxprs' inputs, by
        variable, and literals, by value), where the position of the example taken out
        of the batch axis is left out: ``f(x[0])`` and ``f(x[1])`` have one key, so the
        terms of a loop over the examples can be told to be one per-example function.
        Computed on demand, equation by equation up to ``v``'s."""
        frame = self.frames[-1] if frame is None else frame
        if _is_literal(v):
            val = np.asarray(v.val)
            return self.intern(("literal", str(val.dtype), val.shape, val.tobytes()))
        got = frame.keys.get(v)
        if got is not None:
            return got
        if frame.inputs is None:
            frame.inputs = {*frame.jaxpr.invars, *frame.jaxpr.constvars}
        if v in frame.inputs:
            src = frame.outer.get(v) if frame.outer else None
            got = (self.key(src, frame.parent) if src is not None
                   else self.intern(("input", frame.serial, self.pin(v))))
            frame.keys[v] = got
            return got
        eqns = frame.jaxpr.eqns
        while v not in frame.keys and frame.done < len(eqns):
            frame.done += 1
            self.number(eqns[frame.done - 1], frame)
        if v not in frame.keys:  # pragma: no cover - every variable is an input or defined
            frame.keys[v] = self.intern(("input", frame.serial, self.pin(v)))
        return frame.keys[v]

    def number(self, eqn, frame):
        """The keys of ``eqn``'s results (`key`); a call's are its body's."""
        body = frame.calls.get(id(eqn))
        if body is not None and len(body.jaxpr.outvars) == len(eqn.outvars):
            for o, b in zip(eqn.outvars, body.jaxpr.outvars):
                frame.keys[o] = self.key(b, body)
                frame.defs[o] = eqn
            return
        prim, params = eqn.primitive, dict(eqn.params)
        ins = [self.key(v, frame) for v in eqn.invars]
        tags = [None if _is_literal(v) else frame.env.get(v) for v in eqn.invars]
        same = False  # every result has one key (the examples' positions left out)
        t = tags[0] if tags else None
        if isinstance(t, Ex):  # moves the examples along the batch axis: say not where
            a, nd = t.axis, len(_shape(eqn.invars[0]))
            if prim is P.slice:
                for name in ("start_indices", "limit_indices", "strides"):
                    if params.get(name) is not None:
                        params[name] = tuple(None if j == a else x
                                             for j, x in enumerate(params[name]))
            elif prim is P.dynamic_slice:
                ins[1 + a] = -1
            elif prim is P.pad:
                params["padding_config"] = tuple(
                    None if j == a else tuple(c) for j, c in enumerate(params["padding_config"]))
            elif prim in (P.split, compat.unstack_p) and params["axis"] % nd == a:
                params.pop("sizes", None)
                same = True
        if prim in (P.concatenate, compat.stack_p) and any(
                isinstance(u, One) or (isinstance(u, Ex) and u.axis == params.get("dimension"))
                for u in tags):  # examples side by side along the batch axis: their order
            ins = sorted(set(ins))  # is in the tags
        node = (prim, self.params_key(eqn.primitive, params), tuple(ins))
        for k, o in enumerate(eqn.outvars):
            frame.keys[o] = self.intern((node, 0 if same else k))
            frame.defs[o] = eqn

    def constant(self, v, frame=None, depth=0):
        """The value of a scalar ``v`` computed from literals alone (the index of
        ``lax.dynamic_index_in_dim(x, i)`` after jnp's wrap-around of negative indices),
        else None."""
        frame = self.frames[-1] if frame is None else frame
        if _is_literal(v):
            return np.asarray(v.val) if np.ndim(v.val) == 0 else None
        if _shape(v) or depth > 16:
            return None
        self.key(v, frame)  # numbers the equations up to v's
        e = frame.defs.get(v)
        if e is None:
            src = frame.outer.get(v) if frame.outer else None
            return None if src is None else self.constant(src, frame.parent, depth + 1)
        if frame.calls.get(id(e)) is not None or len(e.outvars) != 1:
            return None
        ins = [self.constant(u, frame, depth + 1) for u in e.invars]
        if any(x is None for x in ins):
            return None
        if e.primitive is P.select_n:
            return ins[1 + int(ins[0])]
        if e.primitive is P.convert_element_type:
            return ins[0].astype(e.params["new_dtype"])
        fold = _FOLD.get(e.primitive)
        return None if fold is None else np.asarray(fold(*ins))

    def term_key(self, v) -> int:
        """The `key` of ``v``, a term of a partial sum, less the values added to it that
        do not depend on the examples (a sum over the batch plus a constant is one, and
        Python's ``sum`` starts from 0)."""
        frame = self.frames[-1]
        self.key(v)
        e = frame.defs.get(v)
        while e is not None and e.primitive in _ADDING:
            a, b = e.invars
            ta, tb = (None if _is_literal(u) else frame.env.get(u) for u in (a, b))
            if tb is None and isinstance(ta, One):
                v = a
            elif ta is None and isinstance(tb, One) and e.primitive is not P.sub:
                v = b
            else:
                break
            self.key(v)
            e = frame.defs.get(v)
        return self.key(v)

    def params_key(self, prim, params):
        # a custom_vjp / custom_jvp call's rules are callables: its primal is in the jaxpr
        custom = walker.NESTS.get(prim) is walker.Nest.CUSTOM
        return tuple((name, self.param_key(params[name], custom)) for name in sorted(params))

    def param_key(self, value, custom):
        if isinstance(value, compat.ClosedJaxpr):
            return ("closed", self.jaxpr_key(value.jaxpr),
                    tuple(self.pin(c) for c in value.consts))
        if isinstance(value, compat.Jaxpr):
            return ("open", self.jaxpr_key(value))
        if isinstance(value, (tuple, list)):
            return tuple(self.param_key(x, custom) for x in value)
        if custom and callable(value):
            return "rule"
        try:
            return fingerprint.value_key(value)
        except fingerprint.Unkeyable:
            return ("object", self.pin(value))

    def jaxpr_key(self, jaxpr) -> int:
        """A key of ``jaxpr`` as a function of its inputs (`key`, by position)."""
        got = self.jaxpr_keys.get(id(jaxpr))
        if got is not None and got[0] is jaxpr:
            return got[1]
        frame = _Frame(jaxpr, {}, None, None, next(self.serials))
        for i, v in enumerate(jaxpr.invars):
            frame.keys[v] = self.intern(("argument", i))
        for i, v in enumerate(jaxpr.constvars):
            frame.keys[v] = self.intern(("constant", i))
        for eqn in jaxpr.eqns:
            self.number(eqn, frame)
        frame.done = len(jaxpr.eqns)
        k = self.intern(("jaxpr", tuple(self.key(o, frame) for o in jaxpr.outvars)))
        self.jaxpr_keys[id(jaxpr)] = (jaxpr, k)
        return k

    # structured equations (`walker.Nest`): their hooks recurse, and see Cross and Unknown
    # operands themselves
    ENTER = _STRUCTURED

    def equation(self, eqn, tags, path=()):
        prim, n = eqn.primitive, len(eqn.outvars)
        for t in tags:
            if isinstance(t, Cross):
                return [t] * n
        doubt = next((t for t in tags if isinstance(t, Unknown)), None)
        if doubt is not None:
            if any(isinstance(t, Unknown) and t.under is None for t in tags):
                return [doubt] * n
            outs = self.equation(eqn, [t.under if isinstance(t, Unknown) else t for t in tags])
            return [o if o is None or isinstance(o, (Cross, Unknown))
                    else dataclasses.replace(doubt, under=o) for o in outs]
        live = [t for t in tags if t is not None]
        collective = prim in _COLLECTIVES  # a named axis may hold other examples
        if (not collective and isinstance(live[0], (Cur, One))
                and all(t == live[0] for t in live)):
            return [live[0]] * n  # any function of one example and constants
        rule = _RULES.get(prim)
        if rule is None and _is_elementwise(prim):
            rule = _elementwise
        if rule is None:
            return self.unknown(eqn, tags, "has no rule here (a primitive the check does not know)")
        one = next((t for t in live if isinstance(t, One)), None)
        if one is not None and not collective and rule not in _SIDE_BY_SIDE:
            return [self.picked(eqn, live, one)] * n
        parts = any(isinstance(t, Sum) and t.terms for t in live)
        if parts and rule is not _elementwise and sum(
                isinstance(t, (Sum, One)) for t in live) > 1:
            return [Unknown(eqn, "combines sums of examples taken out of the batch one by one "
                                 "in a way the check does not follow")] * n
        if rule is not _elementwise and not collective and any(isinstance(t, Cur) for t in live):
            return [Unknown(eqn, "combines the current example of a loop over the examples "
                                 "with other values")] * n
        acc = next((t for t in live if isinstance(t, Acc)), None)
        if acc is not None and rule is not _elementwise and rule is not _identity:
            return [Cross(eqn, _ACC_WHY, acc.origin, how="in the loop")] * n
        outs = rule(self, eqn, tags)
        if parts and rule is not _elementwise and prim not in _TRANSPARENT:
            outs = self.rekeyed(eqn, tags, outs)
        return outs

    def picked(self, eqn, live, one: One):
        """An operation (other than elementwise, or putting values side by side) on a value
        of one example taken out of the batch and on other values of the examples."""
        i = one.example
        for t in live:
            if isinstance(t, One) and t.example != i:
                return _paired(eqn, i, t)
            if isinstance(t, Sum):
                return _cross_sum(eqn, f"combines example {i}, taken out of the batch, with", t)
            if isinstance(t, (Ex, Cur)) and _single(t) != i:
                return Cross(eqn, f"combines example {i}, taken out of the batch, with the "
                                  "values of other examples", one.by,
                             how=f"example {i} taken out by", fix=_PAIRED_FIX)
        return Unknown(eqn, f"combines example {i}, taken out of the batch, with a slice of "
                            "the batch that holds it")

    def rekeyed(self, eqn, tags, outs):
        """The results of an operation other than + and - on a partial sum (`Sum.terms`)
        and constants: the keys of its terms record the operation and the constants."""
        pos = next(j for j, t in enumerate(tags) if isinstance(t, Sum) and t.terms)
        node = (eqn.primitive, self.params_key(eqn.primitive, eqn.params), pos,
                tuple(-1 if j == pos else self.key(v) for j, v in enumerate(eqn.invars)))
        res = []
        for k, o in enumerate(outs):
            if isinstance(o, Sum) and o.terms:
                o = dataclasses.replace(o, terms=frozenset(
                    (self.intern(("through", node, k, key)), w) for key, w in o.terms))
            res.append(o)
        return res

    @staticmethod
    def unknown(eqn, tags, why):
        for t in tags:
            if isinstance(t, Cross):
                return [t] * len(eqn.outvars)
        return [Unknown(eqn, why)] * len(eqn.outvars)

    # -- combining operands ------------------------------------------------ #
    def meet(self, eqn, tags):
        """Operands combined element by element: their common `Ex`/`Cur`/`One`, a
        `Cross`, or None when no operand depends on individual examples."""
        ex = [t for t in tags if isinstance(t, (Ex, Cur, One))]
        sums = [t for t in tags if isinstance(t, Sum)]
        if ex and sums:
            return _cross_sum(eqn, "combines per-example values with", sums[0])
        one = next((t for t in ex if isinstance(t, One)), None)
        if one is not None and any(t != one for t in ex):
            return self.meet_one(eqn, ex, one)
        if ex and any(t != ex[0] for t in ex):
            merged = self.merge(ex)
            if merged is not None:
                return merged
            by = next((t.by for t in ex if isinstance(t, Ex) and t.by is not None), None)
            return Cross(eqn, "combines values of different examples", by, how="reordered by")
        return ex[0] if ex else None

    def meet_one(self, eqn, ex, one: One):
        """A value of one example taken out of the batch met element by element by other
        values of the examples: a slice of the batch holding that example alone (a
        ``x[i:i + 1]``) keeps it, anything else combines examples."""
        i = one.example
        for t in ex:
            if isinstance(t, One) and t.example != i:
                return _paired(eqn, i, t)
        grid = [t for t in ex if isinstance(t, Ex)]
        if grid and len(grid) + sum(isinstance(t, One) for t in ex) == len(ex):
            merged = self.merge([dataclasses.replace(grid[0], perm=(i,), by=one.by), *grid])
            if merged is not None:
                return merged
        return Cross(eqn, f"combines example {i}, taken out of the batch, with the values of "
                          "other examples", one.by, how=f"example {i} taken out by",
                     fix=_PAIRED_FIX)

    def added(self, eqn, tags):
        """Values of single examples (`One`) and sums added or subtracted: the terms of
        a (partial) sum."""
        terms: dict = {}
        by = None
        for j, (v, t) in enumerate(zip(eqn.invars, tags)):
            sign = -1.0 if eqn.primitive is P.sub and j == 1 else 1.0
            if isinstance(t, One):
                w = np.zeros(self.B)
                w[t.example] = sign
                got = [(self.term_key(v), w)]
            elif isinstance(t, Sum):
                got = [(k, sign * np.asarray(w)) for k, w in t.terms]
            else:
                continue
            by = by or t.by
            for k, w in got:
                terms[k] = terms.get(k, 0.0) + w
        return _partial(eqn, terms, by)

    def merge(self, ex):
        """`Ex` tags along one axis whose examples agree position by position (where one
        has padding, -1, the other's example; one example alone at a size-1 axis meets
        every position): their common tag, else None."""
        first = ex[0]
        if not all(isinstance(t, Ex) and (t.axis, t.outer, t.inner) == (first.axis, 1, 1)
                   for t in ex):
            return None
        n = max(self.B if t.perm is None else len(t.perm) for t in ex)
        pos = None
        for t in ex:
            mine = _positions(t, self.B)
            if len(mine) == 1:
                mine = mine * n
            elif len(mine) != n:
                return None
            pos = mine if pos is None else _merge_positions(pos, mine)
            if pos is None:
                return None
        by = next((t.by for t in ex if t.by is not None), None)
        return _reordered(first, pos, self.B, by)

    def elementwise(self, eqn, tags):
        n = len(eqn.outvars)
        acc = next((t for t in tags if isinstance(t, Acc)), None)
        if acc is not None:
            return [self.accumulate(eqn, tags, acc)] * n
        if (eqn.primitive in _ADDING and any(isinstance(t, One) for t in tags)
                and all(t is None or isinstance(t, (One, Sum)) for t in tags)):
            return [self.added(eqn, tags)] * n  # sum(loss(x[i]) for i in range(B))
        t = self.meet(eqn, tags)
        if isinstance(t, Cross):
            return [t] * n
        if t is None:  # sums (and constants) only
            return [self.linear(eqn, tags)] * n
        if isinstance(t, Cur):
            return [t] * n
        lined = self.lined_up(eqn, tags, t)
        if lined is not None:
            return [lined] * n
        # shape-changing vectorized ops (random_bits, bitcast_convert_type) keep the
        # leading axes up to the batch axis
        src = next(_shape(v) for v, u in zip(eqn.invars, tags) if u == t)
        outs = []
        for v in eqn.outvars:
            o = _shape(v)
            ok = len(o) > t.axis and o[: t.axis + 1] == src[: t.axis + 1]
            outs.append(t if ok else Unknown(eqn, "changes the shape around the batch axis"))
        return outs

    def lined_up(self, eqn, tags, t: Ex, pairs=None, index=False):
        """A `Cross` where an operand that does not depend on the examples has, at the
        batch axis of ``t``, an axis of size B whose entries differ by position
        (`Lined`). ``pairs``: (operand, its axis that meets the batch axis), default
        every operand tagged None at ``t.axis`` (element by element). ``index``: the
        operands are indices that pick the examples (a position from ``jnp.arange`` is
        how a loss addresses its examples there, not a value)."""
        if t.outer != 1 or t.inner != 1:
            return None
        if pairs is None:
            pairs = [(v, t.axis) for v, u in zip(eqn.invars, tags) if u is None]
        for v, a in pairs:
            if _is_literal(v):
                continue
            src = self.lined.get(v, {}).get(a)
            if src is None or _shape(v)[a] != self.B:
                continue
            if src.position and (index or not jax.numpy.issubdtype(
                    eqn.outvars[0].aval.dtype, jax.numpy.inexact)):
                continue
            return Cross(
                eqn, f"lines up each example with the entry at its position along an axis of "
                f"size B={self.B} (alone in a batch of one, an example meets all {self.B} "
                f"entries) of {src.what}", src.eqn, fix=src.fix)
        return None

    def linear(self, eqn, tags):
        """An elementwise op on sums over the batch and constants. On a partial sum
        (`Sum.terms`) + and - add up the terms, a literal factor scales their weights, and
        any other linear op is recorded in their keys (`rekeyed`)."""
        prim = eqn.primitive
        sums = [t for t in tags if isinstance(t, Sum)]
        partial = any(t.terms for t in sums)
        if prim in _ADDING:
            return self.added(eqn, tags) if partial else sums[0]
        if prim in _LINEAR:
            if partial and prim is P.neg:
                return _scaled(sums[0], -1.0)
            return self.rekeyed(eqn, tags, [sums[0]])[0] if partial else sums[0]
        if prim is P.mul:
            if len(sums) > 1:
                return _cross_sum(eqn, "multiplies", sums[1])
            c = _literal_scalar(eqn.invars[1 - tags.index(sums[0])])
        elif prim is P.div:
            if tags[1] is not None:
                return _cross_sum(eqn, "divides by", tags[1])
            c = _literal_scalar(eqn.invars[1])
            c = None if not c else 1.0 / c
        elif prim is P.select_n:
            if tags[0] is not None:
                return _cross_sum(eqn, "selects by", tags[0])
            if partial and len(sums) > 1:
                return Unknown(eqn, "selects between sums of examples taken out of the batch "
                                    "one by one")
            c = None
        else:
            return _cross_sum(eqn, f"applies {prim} to", sums[0])
        if not partial:
            return sums[0]
        return _scaled(sums[0], c) if c is not None else self.rekeyed(eqn, tags, [sums[0]])[0]

    @staticmethod
    def accumulate(eqn, tags, acc):
        """An elementwise op on the running sum of a loop over the examples: it stays
        one where the op adds the current example's term (or a constant) to it."""
        prim = eqn.primitive
        ok = all(u is None or u == acc or u == Cur(acc.level) for u in tags)
        if ok and prim in _ACCUMULATING:
            if prim is not P.sub or (tags[0] == acc and tags[1] != acc):
                return acc
        return Cross(eqn, _ACC_WHY, acc.origin, how="in the loop")

    # -- loops and branches ------------------------------------------------- #
    @staticmethod
    def join(eqn, a, b, level=None):
        """The tag of a loop carry (or a branch output) that is ``a`` or ``b``."""
        if isinstance(b, Cur) and b.level == level:
            if a is None:  # maybe a running sum over the examples: the loop runs again
                return Acc(eqn, level=level)
            return Unknown(eqn, "carries a value of one example into the next iteration "
                                "of a loop over the examples")
        if a == b:
            return a
        for t in (a, b):
            if isinstance(t, Cross):
                return t
        for t in (a, b):
            if isinstance(t, Unknown):
                return t
        if a is None:
            return b
        if b is None:
            return a
        return Unknown(eqn, "holds values that depend on the examples in different ways "
                            "(in different iterations or branches)")

    def fixpoint(self, eqn, body, consts, carry, xs, level=None, outer=None):
        carry = list(carry)
        for _ in range(_MAX_ROUNDS):
            outs = self.tags_of(body, list(consts) + carry + list(xs), outer=outer)
            new = [self.join(eqn, c, o, level) for c, o in zip(carry, outs)]
            if new == carry:
                return carry, outs[len(carry) :]
            carry = new
        raise AssertionError("no fixpoint of the loop carries")  # pragma: no cover

    # -- values lined up with the batch (`Lined`) ---------------------------- #
    def enter(self, outer, inner):
        """Passes the `Lined` axes of a call's operands ``outer`` to its body's ``inner``
        variables (and back, for its results)."""
        for o, i in zip(outer, inner):
            if _is_literal(i):
                continue
            got = None if _is_literal(o) else self.lined.get(o)
            if got:
                self.lined[i] = got
            else:
                self.lined.pop(i, None)

    def follow_lined(self, eqn):
        """The `Lined` axes of the results of an equation on constants only."""
        prim = eqn.primitive
        body = walker.body(eqn)  # a call, checkpoint or custom_vjp / custom_jvp call
        if body is not None:
            self.enter(eqn.invars, body.invars)
            self.tags_of(body, [None] * len(body.invars),
                         outer=dict(zip(body.invars, eqn.invars)), call=eqn)
            self.enter(body.outvars, eqn.outvars)
            return
        ins = [None if _is_literal(v) else self.lined.get(v) for v in eqn.invars]
        rule = _LINED_SOURCES.get(prim)
        if rule is None and not any(ins):
            return
        if rule is None:
            rule = _LINED_RULES.get(prim)
            if rule is None and self.acts_elementwise(prim):
                rule = _lined_elementwise
        outs = rule(self, eqn, ins) if rule is not None else None
        for v, d in zip(eqn.outvars, outs or [None] * len(eqn.outvars)):
            if d:
                self.lined[v] = d
            else:
                self.lined.pop(v, None)

    # -- index arrays equal to their own position ---------------------------- #
    def track(self, eqn):
        prim, ins = eqn.primitive, eqn.invars
        if len(eqn.outvars) != 1:
            return
        out = eqn.outvars[0]
        first = ins[0] if ins and not _is_literal(ins[0]) else None
        if prim is P.iota:
            if _shape(out):
                self.iota[out] = eqn.params["dimension"]
        elif prim in (P.convert_element_type, P.copy) and first in self.iota:
            self.iota[out] = self.iota[first]
        elif prim in (P.convert_element_type, P.copy) and first in self.counter:
            self.counter[out] = self.counter[first]
        elif prim is P.broadcast_in_dim and first in self.iota:
            self.iota[out] = eqn.params["broadcast_dimensions"][self.iota[first]]
        elif prim is P.reshape and first in self.iota and eqn.params.get("dimensions") is None:
            d, shp, o = self.iota[first], _shape(first), _shape(out)
            for j in range(len(o)):
                if math.prod(o[:j]) == math.prod(shp[:d]) and o[j] == shp[d]:
                    self.iota[out] = j
                    break
        elif (prim is P.lt and (first in self.iota or first in self.counter)
              and _is_literal(ins[1])):
            if getattr(ins[1], "val", None) == 0:
                self.neg_test[out] = first
        elif prim is P.select_n and len(ins) == 3 and not _is_literal(ins[0]):
            a = ins[1]
            if not _is_literal(a) and self.neg_test.get(ins[0]) is a:
                # a >= 0: the normalised index is a itself
                if a in self.iota:
                    self.iota[out] = self.iota[a]
                elif a in self.counter:
                    self.counter[out] = self.counter[a]
        elif prim is P.concatenate and eqn.params["dimension"] == len(_shape(out)) - 1:
            comps = []
            for v in ins:
                k = _shape(v)[-1]
                comps.extend(self.components(v) if not _is_literal(v) else [None] * k)
            if any(c is not None for c in comps):
                self.comps[out] = tuple(comps)

    def components(self, v):
        """Per component of an index array's last axis: the axis along which it equals
        its index, or None."""
        k = _shape(v)[-1]
        d = self.iota.get(v)
        if d is not None and d != len(_shape(v)) - 1:
            return [d] * k
        return list(self.comps.get(v, [None] * k))

"""The floor of a one-trace design (issue 60, item 3): what emitting per-example statistics
from one trace of the batch loss costs to lower and compile, measured on a prototype,
against ``jax.grad``'s and the package's.

Methods, each lowered and compiled afresh (a new ``jax.jit``, jax's caches cleared),
process CPU time, ratios to grad's within a round (as ``benchmarks.compile_time``):

* ``trace``: one trace of the batch loss (``jax.make_jaxpr``), alone. A design that reads
  the loss's jaxpr (to find its sites, to prove its examples independent) pays it on
  top of grad's own work.
* ``re-evaluate``: that trace, then its jaxpr evaluated again under ``jax.grad``, with no
  rule: the floor of any design that traces the loss once and evaluates the jaxpr with
  rules at its sites (the package's engine re-evaluates a jaxpr so).
* ``prototype``: the same with a rule at every dense site (a parameter leaf contracted by
  ``dot_general`` on its leading axes against the trailing axes of a batched input, also
  inside ``jax.jit``-ed functions): a ``custom_vjp`` whose backward pass also emits
  ``sum_b G_b**2`` (``G_b = x_b^T dy_b``, materialised) as the cotangent of a zero input.
  Nothing else of the package: no chunks or tiles, no proof, no other site kind, leaves
  used elsewhere (embeddings, a scan's stack) get grad's gradient only.
* ``intercept``: the same rules emitted inside ``jax.grad``'s own trace of the loss, with
  no trace of its own: a trace between the loss and grad's (a ``jax.core.Trace`` of its
  own, whose tracers are the parameter leaves) sees each use of a leaf as grad traces it,
  makes the dense ones sites and passes everything else on (a call holding a leaf is
  entered, its equations seen one by one; a ``scan`` is not: its stack gets grad's
  gradient only). The floor of "intercept the parameters' uses as grad traces them".
* ``intercept-cached``: the same interception, but a call (``jit``), ``jax.checkpoint``
  or ``scan`` holding a leaf is evaluated as ``prototype`` evaluates it (its body's
  jaxpr, with rules at its sites; a call as one ``jax.jit`` per body and positions of
  the leaves): the rules of repeated layers are traced once, as grad traces each body
  once, and a scan's stack is served.
* ``+ proof traced``: ``intercept-cached``, and the examples' independence proved (the
  package's `independence` interpreter) on a trace of its own of the batch loss
  (``jax.make_jaxpr``), as the package proves it.
* ``+ proof from stream``: ``intercept-cached`` recording every equation it sees (every
  primitive bound while it is the current trace, a call, ``jax.checkpoint`` or ``scan``
  as one equation with its body) into a jaxpr of the batch loss, the proof run on that:
  no trace of its own (`_Stream`). ``--quick`` checks that the proofs decide alike on
  each model's loss (independent) and on its square (not a mean of per-example terms).
* ``+ proof online``: ``+ proof from stream`` with the proof run on each equation as it is
  recorded, and each site's batch layout read from its input's tag (the axis holding
  the examples, merged with its neighbours where a reshape folded them) instead of
  assuming a leading batch axis: the design's way to find the examples at a site of the
  batch loss (`folded`: a model that folds the batch into the rows and turns it
  time-major, which only this method serves).
* ``vmap``: no trace of its own and no rule: ``jax.grad`` of the mean of ``jax.vmap`` of
  the batch-of-one loss (the loss of a batch of one example, as the package reads it):
  the floor of a design that runs the per-example function under ``vmap`` (the package's
  view of a site: one example's shapes, the examples on a leading axis), with nothing
  to find in the batch loss's layout.
* ``vmap-intercept-cached``: ``intercept-cached`` inside that ``vmap``: the intercepting
  trace sits between the batch-of-one loss and ``vmap``'s, so each site sees one
  example's ``x`` and ``dy``; its backward pass emits ``G_b**2`` of its example, and
  ``vmap`` sums the sink's cotangent over the examples (the sink is not mapped).
* ``batch-evaluate``: design E: ``trace``, then the batch loss's jaxpr evaluated again
  under ``jax.grad`` with the dense rules at its sites (as ``prototype``), each repeated
  layer (the span from one layer's first site to the next layer's, found as the package's
  `interpreter.Evaluator` finds its blocks) one ``jax.jit`` cached by its structure, so
  that the later layers reuse the first one's trace, linearization and transposition;
  nothing batched again (the batch loss is already batched), the sites' sinks known
  before ``jax.grad`` traces (from the traced jaxpr), which an intercepting design does
  not have.
* ``batch-evaluate + proof``: the same, the independence proof run on that one trace.
* ``package``: ``js.per_example_stat(loss, second_moment())`` as it is.

Models (B 8): compile_check's s768 (4 layers of width 768, T 256), GPT-2 small (12 layers,
T 1024, vocabulary 50304), and GPT-2 small stacked under ``lax.scan`` + ``jax.checkpoint``;
``--quick``: a tiny one of each kind.

    python -m benchmarks.one_trace [--quick] [--reps N] \
        [--out benchmarks/results/cpu_one_trace.json]

``--quick`` also checks the prototype against ``vmap(grad)`` (E[g^2] of the leaves it
serves), so that the floor it measures is that of a correct program.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxpr_surgery as js
from benchmarks import compile_time, models, output
from jaxpr_surgery._src import compat, interpreter, walker


def _regimes(quick):
    if quick:
        return {"unrolled L2": lambda: models.transformer(T=8, d=32, V=64, layers=2, heads=2),
                "scan L2": lambda: models.scan_remat(T=8, d=32, V=64, layers=2, heads=2)}
    # compile_check's sizes (../shared/bench): s768, GPT-2 small, and GPT-2 small stacked
    # under lax.scan (here with jax.checkpoint, as benchmarks.models.scan_remat writes it)
    gpt2s = dict(T=1024, d=768, V=50304, layers=12, heads=12)
    return {"s768": lambda: models.transformer(T=256, d=768, V=32768, layers=4, heads=12),
            "gpt2s": lambda: models.transformer(**gpt2s),
            "gpt2s scan": lambda: models.scan_remat(**gpt2s)}


_LEADING = (0, 1, 1)  # the batch's layout where it is the leading axis


def _dense(params, x, w, B, tag=None, tagged=False):
    """``(m, layout)`` if ``dot_general(x, w, **params)`` is a dense site of the batch
    (else None): ``m``, the number of ``w``'s leading axes contracted with ``x``'s
    trailing ones; ``layout``, ``(axis, outer, inner)``: ``x``'s axis holding the examples
    (merged with ``outer`` positions before and ``inner`` after them, as a reshape leaves
    them). ``tagged``: that layout read from ``tag``, ``x``'s tag by the independence
    proof (`_Stream`'s online proof); else the batch is ``x``'s leading axis, of size B."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    m, nd = len(rc), jnp.ndim(x)
    if (lb or rb or not m or tuple(rc) != tuple(range(m)) or nd < m + 1
            or tuple(lc) != tuple(range(nd - m, nd))):
        return None
    if not tagged:
        return (m, _LEADING) if x.shape[0] == B else None
    if not isinstance(tag, _tags().Ex) or tag.perm is not None or tag.axis >= nd - m:
        return None  # (examples reordered, contracted, or not in x)
    if x.shape[tag.axis] != tag.outer * B * tag.inner:  # pragma: no cover - the proof's
        return None
    return m, (tag.axis, tag.outer, tag.inner)


def _tags():
    from jaxpr_surgery._src.independence import tags
    return tags


_SITES: dict = {}  # (dot_general's params, m, layout, B) -> its site


def _site(params, m, layout=_LEADING, B=None):
    """A dense site's ``custom_vjp``: grad's cotangents, and sum_b G_b**2 for the sink
    (one per ``dot_general``'s params and the batch's layout (`_dense`), so that jax's
    caches see one function)."""
    try:
        key = (tuple(sorted(params.items())), m, layout, B)
        if key in _SITES:
            return _SITES[key]
    except TypeError:  # (a parameter with no hash)
        key = None
    params = dict(params)

    def dot(x, w):
        return lax.dot_general_p.bind(x, w, **params)

    @jax.custom_vjp
    def site(x, w, sink):
        return dot(x, w)

    def fwd(x, w, sink):
        return dot(x, w), (x, w)

    def examples(t, K):  # [B, positions, K]: each example's rows of t
        if layout == _LEADING:
            return t.reshape(t.shape[0], -1, K)
        a, outer, inner = layout
        t = t.reshape(t.shape[:a] + (outer, B, inner) + t.shape[a + 1:])
        return jnp.moveaxis(t, a + 1, 0).reshape(B, -1, K)

    def bwd(res, dy):
        x, w = res
        dx, dw = jax.vjp(dot, x, w)[1](dy)
        C, F = int(np.prod(w.shape[:m])), int(np.prod(w.shape[m:]))
        G = jnp.einsum("bnc,bnf->bcf", examples(x, C), examples(dy, F))
        return dx, dw, jnp.sum(G * G, 0).reshape(w.shape)

    site.defvjp(fwd, bwd)
    if key is not None:
        _SITES[key] = site
    return site


def _evaluate(jaxpr, consts, args, sinks, B, served, tags=None):
    """``jaxpr`` on ``args``. ``sinks``: ``id(value) -> (leaf index, sink)`` of the values
    that are parameter leaves (or a scan's slices of one): a ``dot_general`` of one at a
    dense site goes through `_site` with its sink. Calls (``jit``), ``jax.checkpoint`` and
    ``scan`` whose operands hold one are entered (by the package's walker: its views of
    them), a scan's stacked leaf with a stacked sink; any other equation is bound as it
    is. ``tags``: the independence proof's tag of each of ``jaxpr``'s variables, where the
    sites' layouts are read from them (`_dense`); None: the batch leads."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for e in jaxpr.eqns:
        inv = [read(v) for v in e.invars]
        held = sinks is not None and any(id(x) in sinks for x in inv)
        nest = walker.nest_of(e) if held else None
        if held and e.primitive is lax.dot_general_p and id(inv[1]) in sinks:
            tag = None if tags is None else tags.get(e.invars[0])
            dense = _dense(e.params, inv[0], inv[1], B, tag, tags is not None)
            if dense is not None:
                i, sink = sinks[id(inv[1])]
                served.add(i)
                env[e.outvars[0]] = _site(e.params, *dense, B)(inv[0], inv[1], sink)
                continue
        in_tags = None if tags is None else [
            None if isinstance(v, jax.extend.core.Literal) else tags.get(v) for v in e.invars]
        out = (_nested(nest, walker.binding(e), inv, sinks, B, served, in_tags)
               if nest in _ENTERED else None)
        out = compat.bind_eqn(e, inv) if out is None else out
        for v, x in zip(e.outvars, out):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _nested(nest, bound, inv, sinks, B, served, in_tags=None):
    """The outputs of a call, ``jax.checkpoint`` or ``scan`` bound as ``bound`` (a
    `walker.Binding`) whose operands ``inv`` hold parameter leaves (``sinks``), its
    body evaluated by `_evaluate` (with its variables' tags where ``in_tags``, the
    operands' tags, are given: `_body_tags`)."""
    view = walker.view_of(bound)
    if nest is walker.Nest.CALL:
        return _call(view, inv, sinks, B, served, in_tags)
    if nest is walker.Nest.SCAN:
        return _scan(view, inv, sinks, B, served, in_tags)
    tags = None if in_tags is None else _body_tags(view.jaxpr, in_tags, B)

    def once(*xs):
        inner = {id(x): sinks[id(o)] for x, o in zip(xs, inv) if id(o) in sinks}
        return _evaluate(view.jaxpr, view.consts, xs, inner, B, served, tags)

    return jax.checkpoint(once, prevent_cse=view.prevent_cse, policy=view.policy)(*inv)


_ENTERED = (walker.Nest.CALL, walker.Nest.REMAT, walker.Nest.SCAN)


_CALLS: dict = {}  # (body, positions of the leaves among its operands) -> (its jit, served)


def _body_tags(jaxpr, in_tags, B):
    """The independence proof's tag of each variable of ``jaxpr`` (a body) given its
    inputs' ``in_tags`` (a scan's: its first step's), for `_evaluate`."""
    from jaxpr_surgery._src import independence as ind

    env: dict = {}
    ind._Interp(B, frozenset()).tags_of(jaxpr, in_tags, env=env)
    return env


def _call(view, inv, sinks, B, served, in_tags=None):
    """A call (``jit``) whose operands hold parameter leaves, as a ``jax.jit`` of its body
    evaluated with the leaves' sinks as operands: one per body and positions of the
    leaves, so that jax traces (and differentiates) each body once, as it does grad's
    (each layer's ``einsum`` alike)."""
    where = tuple(k for k, x in enumerate(inv) if id(x) in sinks)
    key = (view.jaxpr, where, None if in_tags is None else tuple(in_tags))
    if key not in _CALLS:
        inside: set = set()  # (the positions among ``where`` whose leaf a site served)
        tags = None if in_tags is None else _body_tags(view.jaxpr, in_tags, B)

        def body(xs, ss):
            inner = {id(xs[k]): (k, s) for k, s in zip(where, ss)}
            return _evaluate(view.jaxpr, view.consts, xs, inner, B, inside, tags)

        _CALLS[key] = (jax.jit(body), inside)
    fn, inside = _CALLS[key]
    out = fn(list(inv), [sinks[id(inv[k])][1] for k in where])
    served.update(sinks[id(inv[k])][0] for k in inside)
    return out


def _scan(loop, inv, sinks, B, served, in_tags=None):
    """A scan re-made by ``lax.scan``: its consts, carry and xs, and a stacked sink per
    stacked parameter leaf among the xs (each step's slice is the leaf of its sites).
    ``in_tags``: the operands' tags; the body's are read from its first step's (the
    scanned axis of the xs taken off), which the prototype's models keep."""
    nc, nk = loop.num_consts, loop.num_carry
    consts, carry, xs = inv[:nc], inv[nc:nc + nk], inv[nc + nk:]
    stacked = [(k, sinks[id(x)]) for k, x in enumerate(xs) if id(x) in sinks]
    held = {k: sinks[id(x)] for k, x in enumerate(consts) if id(x) in sinks}
    tags = None
    if in_tags is not None:
        Ex = _tags().Ex
        step_tags = in_tags[:nc + nk] + [
            t if not isinstance(t, Ex) else None if t.axis == 0 or t.perm is not None
            else dataclasses.replace(t, axis=t.axis - 1) for t in in_tags[nc + nk:]]
        tags = _body_tags(loop.jaxpr, step_tags, B)

    def step(carry, sliced):
        xs_k, sink_k = sliced
        inner = {id(consts[k]): v for k, v in held.items()}
        inner.update({id(xs_k[k]): (i, s) for (k, (i, _)), s in zip(stacked, sink_k)})
        out = _evaluate(loop.jaxpr, loop.consts, list(consts) + list(carry) + list(xs_k),
                        inner, B, served, tags)
        return out[:nk], out[nk:]

    carry, ys = lax.scan(step, list(carry), (list(xs), [s for _, (_, s) in stacked]),
                         length=loop.length, reverse=loop.reverse, unroll=loop.unroll)
    return list(carry) + list(ys)


_BLOCKS: dict = {}  # a layer's structural key -> (its jit, positions its sites served)


def _evaluate_blocks(closed, leaves, data, sinks, B, served):
    """Design E's floor (``batch-evaluate``): the batch loss's jaxpr ``closed`` (its
    inputs the parameter leaves, then the batch's arrays) evaluated on ``leaves`` and
    ``data`` with a dense site's rule at every ``dot_general`` of a leaf (as `_evaluate`)
    and each repeated layer (a span between successive layers' first sites, as the
    package's `interpreter.Evaluator` finds them) as one ``jax.jit`` cached by its
    structure: grad's trace of the later layers reused, nothing batched again."""
    from jaxpr_surgery._src import fingerprint as fp

    jaxpr = closed.jaxpr
    is_leaf = {v: i for i, v in enumerate(jaxpr.invars[:len(leaves)])}
    eqns = jaxpr.eqns

    def holds(e):
        return any(not isinstance(v, jax.extend.core.Literal) and v in is_leaf
                   for v in e.invars)

    special = [k for k, e in enumerate(eqns)
               if holds(e) and (e.primitive is lax.dot_general_p
                                or walker.nest_of(e) in _ENTERED)]

    def token(e):
        try:
            return (e.primitive, fp.value_key(dict(e.params)),
                    tuple(fp.aval_key(v.aval) for v in e.outvars))
        except fp.Unkeyable:
            return None

    blocks = (interpreter.layer_spans(special, [token(eqns[k]) for k in special], len(eqns))
              if len(special) >= 4 else {})
    last = {}
    for k, e in enumerate(eqns):
        for v in e.invars:
            if not isinstance(v, jax.extend.core.Literal):
                last[v] = k
    for v in jaxpr.outvars:
        if not isinstance(v, jax.extend.core.Literal):
            last[v] = len(eqns)
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, list(leaves) + list(data)))
    ids = {id(x): (i, s) for i, (x, s) in enumerate(zip(leaves, sinks))}

    def span(a, b):  # eqns[a:b] as a jaxpr of what they read, and what they define
        ins, seen, defined = [], set(), set()
        for e in eqns[a:b]:
            for v in e.invars:
                if (not isinstance(v, jax.extend.core.Literal) and v not in defined
                        and v not in seen):
                    seen.add(v)
                    ins.append(v)
            defined.update(e.outvars)
        return ins, [v for e in eqns[a:b] for v in e.outvars]

    keep: dict = {}  # (a layer's length -> its outputs' positions read after any of them,
    # so that the last layer returns what the others do and shares their trace)
    for a, b in blocks.items():
        defs = span(a, b)[1]
        keep.setdefault(b - a, set()).update(
            j for j, v in enumerate(defs) if last.get(v, -1) >= b)
    k, starts = 0, sorted(blocks)
    while k < len(eqns):
        b = blocks.get(k)
        if b is not None:
            ins, defs = span(k, b)
            outs = [defs[j] for j in sorted(keep[b - k])]
            where = tuple(j for j, v in enumerate(ins) if v in is_leaf)
            try:
                namer = fp.Namer()
                for j, v in enumerate(ins):
                    namer.bind(v, ("in", j))
                key = (fp.eqns_key(eqns[k:b], namer), tuple(fp.aval_key(v.aval) for v in ins),
                       where, tuple(namer.ref(v) for v in outs), B)
            except (fp.Unkeyable, KeyError):
                key = None
            if key is not None:
                if key not in _BLOCKS:
                    sub = jax.extend.core.Jaxpr([], ins, outs, eqns[k:b])
                    inside: set = set()

                    def fn(vals, ss, sub=sub, where=where, inside=inside):
                        inner = {id(vals[j]): (j, s) for j, s in zip(where, ss)}
                        return _evaluate(sub, [], vals, inner, B, inside)

                    _BLOCKS[key] = (jax.jit(fn), inside)
                fn, inside = _BLOCKS[key]
                vals = [env[v] for v in ins]
                res = fn(vals, [ids[id(vals[j])][1] for j in where])
                served.update(ids[id(vals[j])][0] for j in inside)
                env.update(zip(outs, res))
                k = b
                continue
        stop = next((s for s in starts if s > k), len(eqns))
        ins, defs = span(k, stop)
        sub = jax.extend.core.Jaxpr([], ins, defs, eqns[k:stop])
        env.update(zip(defs, _evaluate(sub, [], [env[v] for v in ins], ids, B, served)))
        k = stop
    return [env[v] if not isinstance(v, jax.extend.core.Literal) else v.val
            for v in jaxpr.outvars]


class _Leaf(compat.Tracer):
    """A parameter leaf seen by `_Sites`: its value (a tracer of the trace around) and
    index."""

    __slots__ = ("val", "leaf")

    def __init__(self, trace, val, leaf):
        self.val, self.leaf = val, leaf
        super().__init__(trace, jax.typeof(val))


class _Sites(compat.Trace):
    """The trace between the loss and ``jax.grad``'s: a ``dot_general`` of a parameter
    leaf at a dense site becomes `_site` with the leaf's sink, a call (``jit``) holding a
    leaf is evaluated under this trace (its equations seen one by one; ``cached``: a
    call, ``jax.checkpoint`` or ``scan`` by `_nested` instead), anything else is
    bound on the trace around as it is. The leaves are this trace's only tracers: every
    result is the trace around's."""

    def __init__(self, parent, sinks, B, served, cached=False, stream=None):
        super().__init__()
        self.parent, self.sinks, self.B, self.served = parent, sinks, B, served
        self.cached, self.stream = cached, stream

    def low(self, x):
        return (x.val, x.leaf) if isinstance(x, _Leaf) and x._trace is self else (x, None)

    def process_primitive(self, prim, tracers, params):
        if self.stream is None:
            return self._process(prim, tracers, params)
        out = self._process(prim, tracers, params)
        self.stream.record(prim, params, [self.low(t) for t in tracers],
                           out if prim.multiple_results else [out])
        return out

    def _process(self, prim, tracers, params):
        vals, leaves = zip(*map(self.low, tracers)) if tracers else ((), ())
        online = self.stream is not None and self.stream.online
        if prim is lax.dot_general_p and leaves[1] is not None:
            tag = self.stream.tag_of(vals[0], leaves[0]) if online else None
            dense = _dense(params, vals[0], vals[1], self.B, tag, online)
            if dense is not None:
                self.served.add(leaves[1])
                with compat.set_current_trace(self.parent):
                    return _site(params, *dense, self.B)(vals[0], vals[1],
                                                          self.sinks[leaves[1]])
        nest = walker.NESTS.get(prim)
        if self.cached and nest in _ENTERED and any(x is not None for x in leaves):
            held = {id(v): (i, self.sinks[i]) for v, i in zip(vals, leaves) if i is not None}
            body = compat.closed_parts(params["jaxpr"])[0]  # (the arity of its outputs)
            bound = walker.Binding(prim, params, len(vals), len(body.outvars))
            in_tags = ([self.stream.tag_of(v, i) for v, i in zip(vals, leaves)] if online
                       else None)
            with compat.set_current_trace(self.parent):
                outs = _nested(nest, bound, list(vals), held, self.B, self.served, in_tags)
            return outs if prim.multiple_results else outs[0]
        if nest is walker.Nest.CALL and any(x is not None for x in leaves):
            jaxpr, consts = compat.closed_parts(params["jaxpr"])
            with compat.set_current_trace(self):
                outs = compat.eval_jaxpr(jaxpr, consts, *tracers)
            outs = [self.low(o)[0] for o in outs]
            return outs if prim.multiple_results else outs[0]
        with compat.set_current_trace(self.parent):
            return prim.bind(*vals, **params)

    def process_custom_jvp_call(self, prim, fun, jvp, tracers, *, symbolic_zeros):
        vals = [self.low(t)[0] for t in tracers]
        with compat.set_current_trace(self.parent):
            return prim.bind(fun, jvp, *vals, symbolic_zeros=symbolic_zeros)

    def process_custom_vjp_call(self, prim, fun, fwd, bwd, tracers, *, out_trees,
                                symbolic_zeros):
        vals = [self.low(t)[0] for t in tracers]
        with compat.set_current_trace(self.parent):
            return prim.bind(fun, fwd, bwd, *vals, out_trees=out_trees,
                             symbolic_zeros=symbolic_zeros)


def _intercepted(loss, tree, B, served, cached=False, proof=None):
    """``loss`` of the leaves, its parameters' uses seen by `_Sites` under whatever trace
    calls it (``jax.grad``'s). ``proof``: ``"traced"``, the examples' independence proved
    on a trace of its own of the batch loss (as the package does); ``"stream"``, on the
    equations the intercepting trace saw (`_Stream`); the verdict goes to ``proof``'s
    list ``_VERDICTS``; ``"online"``, on the same equations as they are recorded, each
    site's batch layout read from its input's tag (`_Stream`'s ``B``)."""
    def run(leaves, sinks, batch):
        data = jax.tree.leaves(batch)
        stream = (_Stream(leaves, data, B if proof == "online" else None)
                  if proof in ("stream", "online") else None)
        with compat.take_current_trace() as parent:
            trace = _Sites(parent, sinks, B, served, cached, stream)
            held = [_Leaf(trace, x, i) for i, x in enumerate(leaves)]
            with compat.set_current_trace(trace):
                out = loss(jax.tree.unflatten(tree, held), batch)
            out = trace.low(out)[0]
            trace.invalidate()
        if proof == "stream":
            _VERDICTS.append(_prove(stream.closed(out), len(leaves), len(data), B))
        elif proof == "online":
            _VERDICTS.append(stream.verdict(out))
        elif proof == "traced":
            def batch_loss(leaves, data):
                return loss(jax.tree.unflatten(tree, leaves),
                            jax.tree.unflatten(jax.tree.structure(batch), data))
            closed = jax.make_jaxpr(batch_loss)(leaves, data)
            _VERDICTS.append(_prove(closed, len(leaves), len(data), B))
        return out
    return run


def _intercept(loss, B, served, cached=False, proof=None):
    """``(params, batch) ->`` grad's gradients of ``loss`` and the sinks' cotangents, the
    parameters' uses intercepted in grad's trace (`_intercepted`)."""
    def fn(params, batch):
        leaves = jax.tree.leaves(params)
        sinks = [jnp.zeros_like(x) for x in leaves]
        tree = jax.tree.structure(params)
        return jax.grad(_intercepted(loss, tree, B, served, cached, proof),
                        argnums=(0, 1))(leaves, sinks, batch)
    return fn


_VERDICTS: list = []  # the proofs' verdicts, in the order the methods were traced


class _Stream:
    """The equations an intercepting trace sees, recorded as a jaxpr of the batch loss:
    the parameter leaves and the batch's arrays its inputs, every primitive bound while
    the trace is current an equation (a call, ``jax.checkpoint`` or ``scan`` one equation
    with its body, as a trace records it), any other value it reads a constant (a
    literal where a Python scalar). Values are told apart by identity, kept alive.

    ``B`` (online): the independence proof (the package's interpreter) also runs on each
    equation as it is recorded, so that every value's tag, hence where its examples lie,
    is known when a site meets it (`tag_of`), and the verdict when the loss is out
    (`verdict`)."""

    def __init__(self, leaves, data, B=None):
        self.ids, self.keep, self.eqns, self.consts = {}, [], [], []
        self.leaves = [compat.Var(jax.typeof(x)) for x in leaves]
        self.data = [self._new(x) for x in data]
        self.online, self.B = B is not None, B
        if self.online:  # (the proof's frame over the jaxpr as it grows)
            from jaxpr_surgery._src import independence as ind

            self.it, self.env = ind._Interp(B, frozenset()), {}
            live = types.SimpleNamespace(eqns=self.eqns, invars=self.leaves + self.data,
                                         constvars=[], outvars=[])
            self.it.frames.append(ind.interp._Frame(live, self.env, None, None,
                                                    next(self.it.serials)))
            self.env.update((v, None) for v in self.leaves)
            self.env.update((v, _tags().Ex(0)) for v in self.data)

    def _new(self, x):
        v = compat.Var(jax.typeof(x))
        self.ids[id(x)] = v
        self.keep.append(x)
        return v

    def atom(self, x, leaf):
        if leaf is not None:
            return self.leaves[leaf]
        v = self.ids.get(id(x))
        if v is not None:
            return v
        if isinstance(x, (int, float, bool, complex)):
            return compat.Literal(x, jax.typeof(x))
        v = self._new(x)
        self.consts.append((v, x))
        if self.online:
            self.env[v] = None
            _line_up(self.it, v, x, self.B)
        return v

    def tag_of(self, x, leaf):
        """The online proof's tag of a value the trace saw (None: a parameter, or a
        value made outside the trace, a constant)."""
        v = None if leaf is not None else self.ids.get(id(x))
        return None if v is None else self.env.get(v)

    def record(self, prim, params, ins, outs):
        invars = [self.atom(x, leaf) for x, leaf in ins]
        outvars = [self._new(o) for o in outs]
        eqn = jax.extend.core.new_jaxpr_eqn(invars, outvars, prim, params, frozenset())
        self.eqns.append(eqn)
        if self.online:
            it = self.it
            tags = it.step(eqn, [it.read(self.env, v) for v in invars], (len(self.eqns) - 1,))
            self.env.update(zip(outvars, tags))

    def verdict(self, out):
        """The online proof's verdict on the loss ``out``."""
        return _classify(self.env.get(self.atom(out, None)))

    def closed(self, out):
        jaxpr = jax.extend.core.Jaxpr([v for v, _ in self.consts], self.leaves + self.data,
                                      [self.atom(out, None)], self.eqns)
        return compat.ClosedJaxpr(jaxpr, [x for _, x in self.consts])


def _line_up(it, v, c, B):
    """A constant ``c`` (the proof ``it``'s variable ``v``) with an axis of size ``B`` may
    be lined up with the batch (`independence.tags.Lined`), as the package reads one."""
    if B in np.shape(c):
        it.lined[v] = {a: _tags().Lined("a constant", "") for a, n in enumerate(np.shape(c))
                       if n == B}


def _prove(closed, n_leaves, n_data, B):
    """The independence proof's verdict on ``closed`` (a batch loss of ``n_leaves``
    parameter leaves, then ``n_data`` batch arrays of ``B`` examples), as the package's
    `independence.verdict` reads a traced one."""
    from jaxpr_surgery._src import independence as ind
    from jaxpr_surgery._src.independence import tags

    it = ind._Interp(B, frozenset())
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        _line_up(it, v, c, B)
    (out,) = it.tags_of(closed.jaxpr, [None] * n_leaves + [tags.Ex(0)] * n_data)[:1]
    return _classify(out)


def _classify(out):
    """The verdict of the loss's tag ``out`` (as `independence.verdict`'s)."""
    from jaxpr_surgery._src import independence as ind

    tags = _tags()
    if isinstance(out, tags.One):
        return ind.CROSS
    if out is None or (isinstance(out, tags.Sum) and not out.terms):
        return ind.INDEPENDENT
    return ind.CROSS if isinstance(out, (tags.Sum, tags.Cross)) else ind.UNDECIDED


def methods(model, B):
    """``{name: fn(params, batch)}`` of the module docstring's methods, and each
    prototype's set of the leaves its sites served (filled as it is traced)."""
    tree = jax.tree.structure(model.params)
    served = {"prototype": set(), "intercept": set(), "intercept-cached": set(),
              "vmap-intercept-cached": set(), "+ proof online": set(),
              "batch-evaluate": set()}

    def traced(leaves, batch):
        return jax.make_jaxpr(lambda l, b: model.loss(jax.tree.unflatten(tree, l), b))(
            leaves, batch)

    def trace(params, batch):
        return traced(jax.tree.leaves(params), batch).jaxpr.outvars[0].aval.dtype

    def run(params, batch, rules):
        leaves = jax.tree.leaves(params)
        closed = traced(leaves, batch)
        data = jax.tree.leaves(batch)

        def loss(leaves, sinks):
            held = None if sinks is None else {
                id(x): (i, s) for i, (x, s) in enumerate(zip(leaves, sinks))}
            return _evaluate(closed.jaxpr, closed.consts, list(leaves) + data, held, B,
                             served["prototype"])[0]

        if not rules:
            return jax.grad(lambda l: loss(l, None))(leaves)
        return jax.grad(loss, argnums=(0, 1))(leaves, [jnp.zeros_like(x) for x in leaves])

    def batch_evaluate(params, batch, proof=False):
        leaves = jax.tree.leaves(params)
        closed = traced(leaves, batch)
        data = jax.tree.leaves(batch)
        if proof:
            _VERDICTS.append(_prove(closed, len(leaves), len(data), B))

        def loss(leaves, sinks):
            return _evaluate_blocks(closed, leaves, data, sinks, B,
                                    served["batch-evaluate"])[0]

        return jax.grad(loss, argnums=(0, 1))(leaves, [jnp.zeros_like(x) for x in leaves])

    def intercept(params, batch, cached=False, proof=None):
        which = ("+ proof online" if proof == "online" else "intercept-cached" if cached
                 else "intercept")
        return _intercept(model.loss, B, served[which], cached, proof)(params, batch)

    one = lambda p, x: model.loss(p, jax.tree.map(lambda a: a[None], x))  # noqa: E731

    def vmapped(params, batch):
        return jnp.mean(jax.vmap(one, in_axes=(None, 0))(params, batch))

    def vmap_intercept(params, batch):
        leaves = jax.tree.leaves(params)
        sinks = [jnp.zeros_like(x) for x in leaves]
        run = _intercepted(one, tree, 1, served["vmap-intercept-cached"], cached=True)

        def loss(leaves, sinks):
            return jnp.mean(jax.vmap(run, in_axes=(None, None, 0))(leaves, sinks, batch))

        return jax.grad(loss, argnums=(0, 1))(leaves, sinks)

    fns = {
        "grad": jax.grad(model.loss),
        "trace": lambda p, b: jnp.zeros((), trace(p, b)),
        "re-evaluate": lambda p, b: run(p, b, False),
        "prototype": lambda p, b: run(p, b, True),
        "intercept": intercept,
        "intercept-cached": lambda p, b: intercept(p, b, True),
        "+ proof traced": lambda p, b: intercept(p, b, True, "traced"),
        "+ proof from stream": lambda p, b: intercept(p, b, True, "stream"),
        "+ proof online": lambda p, b: intercept(p, b, True, "online"),
        "batch-evaluate": batch_evaluate,
        "batch-evaluate + proof": lambda p, b: batch_evaluate(p, b, True),
        "vmap": jax.grad(vmapped),
        "vmap-intercept-cached": vmap_intercept,
        "package": js.per_example_stat(model.loss, js.stats.second_moment()),
    }
    return fns, served


def folded(T=5, d=6, f=7, V=9):
    """A token model whose layers meet the batch where it is not the leading axis: the
    batch folded into the rows (``h.reshape(-1, d) @ W``, as many codebases write a
    dense layer), time-major after an ``einsum`` (``btd,df->tbf``), and a jitted layer
    on the time-major layout; a ``models.Model``."""
    r = np.random.default_rng(0)
    params = {"emb": r.normal(size=(V, d)).astype(np.float32),
              "w1": (r.normal(size=(d, f)) / np.sqrt(d)).astype(np.float32),
              "w2": (r.normal(size=(f, d)) / np.sqrt(f)).astype(np.float32),
              "w3": (r.normal(size=(d, f)) / np.sqrt(d)).astype(np.float32),
              "head": (r.normal(size=(f, V)) / np.sqrt(f)).astype(np.float32)}

    @jax.jit
    def layer(h, w):  # [T, B, d] -> [T, B, f]
        return jnp.tanh(h @ w)

    def loss(p, b):
        Bq = b["tok"].shape[0]
        h = p["emb"][b["tok"]]  # [B, T, d]
        h = jnp.tanh(h.reshape(-1, d) @ p["w1"]).reshape(Bq, T, f)
        h = jnp.einsum("btf,fd->tbd", h, p["w2"])  # time-major
        z = layer(h, p["w3"]) @ p["head"]  # [T, B, V]
        lab = b["tgt"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), lab[..., None], -1))

    def make_batch(B):
        g = np.random.default_rng(B)
        return {"tok": jnp.asarray(g.integers(0, V, (B, T))),
                "tgt": jnp.asarray(g.integers(0, V, (B, T)))}

    return models.Model("folded", loss, jax.tree.map(jnp.asarray, params), make_batch,
                        None, {})


def check(model, B=4):
    """The prototypes' (``prototype``, ``intercept``) ``B * sum_b G_b**2`` against
    ``vmap(grad)``'s E[g^2] for each leaf they serve at one site, and their gradients
    against grad's: ``({method: leaves served}, largest relative error)``. (``intercept``
    does not enter a ``scan``: its stack is served by the two others only.)"""
    params, batch = model.params, model.make_batch(B)
    fns, served = methods(model, B)
    one = lambda p, x: model.loss(p, jax.tree.map(lambda a: a[None], x))  # noqa: E731
    per = jax.vmap(jax.grad(one), in_axes=(None, 0))(params, batch)
    want = [jnp.mean(g * g, 0) for g in jax.tree.leaves(per)]
    ref = jax.tree.leaves(jax.grad(model.loss)(params, batch))
    err = 0.0
    for m in served:
        grads, sums = jax.jit(fns[m])(params, batch)
        for i in served[m]:
            got = B * sums[i]
            err = max(err, float(jnp.max(jnp.abs(got - want[i])) / jnp.max(jnp.abs(want[i]))))
        err = max(err, max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads, ref)))
    return {m: sorted(v) for m, v in served.items()}, err


def check_proofs(model, B=4):
    """The independence proof's verdicts from the intercepted stream and from a trace of
    the batch loss, on ``model``'s loss (independent examples) and on its square (not a
    mean of per-example terms): ``{loss: [stream's, traced]}``."""
    params, batch = model.params, model.make_batch(B)
    squared = lambda p, b: model.loss(p, b) ** 2  # noqa: E731
    out = {}
    for name, loss in (("loss", model.loss), ("loss ** 2", squared)):
        got = []
        for proof in ("stream", "online", "traced"):
            del _VERDICTS[:]
            jax.jit(_intercept(loss, B, set(), True, proof)).lower(params, batch)
            got.append(_VERDICTS[-1])
        out[name] = got
    return out


def _trace_time(fn, args):
    """The CPU time of this thread tracing ``fn`` alone (``jax.jit(fn).trace``, jax's caches
    cleared): the lowering less jax's lowering of the program to XLA, which no design
    changes and whose spread hides a proof's share."""
    jax.clear_caches()
    t0 = time.thread_time()
    jax.jit(fn).trace(*args)
    return time.thread_time() - t0


def run(quick=False, reps=None, only=None):
    """``only``: the methods to measure (grad's always), default every one."""
    reps = reps or (1 if quick else 3)
    jax.jit(lambda x: x * 2).lower(1.0).compile()
    rows = []
    for name, build in _regimes(quick).items():
        model = build()
        B = 8
        params, batch = model.params, model.make_batch(B)
        fns, served = methods(model, B)
        fns = {m: f for m, f in fns.items() if only is None or m == "grad" or m in only}
        samples = {m: [] for m in fns}
        traced = {m: [] for m in fns}
        for _ in range(reps):
            for m, fn in fns.items():
                samples[m].append(compile_time._measure(fn, (params, batch))[0])
                traced[m].append(_trace_time(fn, (params, batch)))
        g = samples["grad"]
        n = len(jax.tree.leaves(params))
        for m in fns:
            s = samples[m]
            row = {"regime": name, "B": B, "method": m,
                   "lower_cpu_s": statistics.median(x[1] for x in s),
                   "lower_thread_s": min(x[4] for x in s),
                   "compile_cpu_s": statistics.median(x[3] for x in s)}
            if m != "grad":
                row["lower_cpu_x_grad"] = compile_time._paired([x[1] for x in s],
                                                               [x[1] for x in g])
                row["lower_thread_x_grad"] = row["lower_thread_s"] / min(x[4] for x in g)
                row["trace_thread_x_grad"] = min(traced[m]) / min(traced["grad"])
                row["compile_cpu_x_grad"] = compile_time._paired([x[3] for x in s],
                                                                 [x[3] for x in g])
            if m in served:
                row["leaves_served"], row["leaves"] = len(served[m]), n
            rows.append(row)
            if m != "grad":
                print(f"{name:12s} {m:16s} lower {row['lower_cpu_x_grad']:5.2f}x "
                      f"(its thread {row['lower_thread_x_grad']:5.2f}x, the trace "
                      f"{row['trace_thread_x_grad']:5.2f}x)  compile "
                      f"{row['compile_cpu_x_grad']:5.2f}x grad (cpu time)"
                      + (f"  ({len(served[m])} of {n} leaves served)" if m in served
                         else ""), flush=True)
    return rows


def main(argv=None):
    ap = output.parser(__doc__)
    ap.add_argument("--methods", default=None,
                    help="comma-separated methods to measure (grad's always; default all)")
    a = ap.parse_args(argv)
    checks = {}
    if a.quick:
        for name, build in _regimes(True).items():
            served, err = check(build())
            proofs = check_proofs(build())
            checks[name] = {"served": served, "max_rel_error": err, "proofs": proofs}
            print(f"{name}: exact to {err:.1e}, leaves served: "
                  + ", ".join(f"{m} {len(v)}" for m, v in served.items())
                  + "; proofs (stream, traced): " + ", ".join(
                      f"{k}: {' / '.join(v)}" for k, v in proofs.items()), flush=True)
    rows = run(a.quick, a.reps, None if a.methods is None else a.methods.split(","))
    if a.out:
        note = ("ratios: medians over rounds of the ratio within a round, of the "
                "process's CPU time; lower_thread: the lowering thread's CPU "
                "time, the least over rounds, as a ratio to grad's least; "
                "trace_thread: the same of tracing alone (jax.jit(f).trace); "
                "'trace' lowers a function that only traces the loss; nothing "
                "runs")
        output.write_small(a.out, note, rows, checks=checks)
    return rows, checks


if __name__ == "__main__":
    main()

"""Batched evaluation of the per-example jaxpr with the sites rewired.

Values carry a flag saying whether they are batched over examples (axis 0).
Ordinary equations run under ``jax.vmap``; every *site* runs as a
``jax.custom_vjp`` whose backward pass also emits the site's statistics (or
ingredients) as the cotangent of a zero *sink* input. Sinks of sites inside
``lax.scan`` travel as scanned inputs, so the statistics of stacked layers come
out stacked; inside ``checkpoint`` they are recomputed with the rest, keeping
remat's memory savings.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, walker
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src.sites.base import map_eqn


def _bcast(val, B):
    return jnp.broadcast_to(val, (B,) + jnp.shape(val))


_MAX_PERIODS = 8  # candidate layer periods tried per jaxpr (`Evaluator._blocks`)


def _read(env, v):
    if isinstance(v, compat.Literal):
        return v.val, False
    return env[v]


def _holds_map_alone(eqn, memo):
    """Whether a jaxpr inside ``eqn`` holds a primitive of `compat.BATCH_EVERY_OPERAND`
    (jax.vmap of the call would raise: the call is evaluated equation by equation).
    ``memo``: id(jaxpr) -> (jaxpr, answer), for one trace."""
    for j in walker.bodies(eqn):
        hit = memo.get(id(j))
        if hit is None:
            held = any(
                e.primitive in compat.BATCH_EVERY_OPERAND or _holds_map_alone(e, memo)
                for e in j.eqns
            )
            hit = memo[id(j)] = (j, held)
        if hit[1]:
            return True
    return False


def _segment_key(eqns, inputs, in_flags):
    namer = fp.Namer()
    for i, v in enumerate(inputs):
        namer.bind(v, ("in", i))
    avals = tuple(fp.aval_key(v.aval) for v in inputs)
    return ("segment", in_flags, avals, fp.eqns_key(eqns, namer))


def _unit_batch_dims(eqn) -> tuple:
    """Positions (among its batch dimensions) of the batch dimensions of size 1 on both
    operands of a ``dot_general`` ``eqn`` (per-example shapes); () for any other eqn.

    A model called on one example keeps its batch axis (``keep_batch_dim``): attention's
    ``einsum("bhts,bshk->bthk")`` is then a dot batched over ``b`` of size 1 and the
    heads. Under ``jax.vmap`` over the examples XLA:CPU lays such a dot out with a
    transposed copy of its ``[T, T]`` operand (several per layer, 0.4 s each at
    T=2048 for B=2: 1.3x ``jax.grad``); squeezed (`_bind_unit_squeezed`), it is the
    dot of ``jax.grad``."""
    if eqn.primitive is not compat.dot_general_p or eqn.params.get("out_sharding") is not None:
        return ()
    (_, _), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = (getattr(v.aval, "shape", None) for v in eqn.invars[:2])
    if ls is None or rs is None:
        return ()
    return tuple(k for k, (i, j) in enumerate(zip(lb, rb)) if ls[i] == 1 and rs[j] == 1)


def _bind_unit_squeezed(eqn, ins, units):
    """``eqn`` (a ``dot_general``) on ``ins`` with its unit batch dimensions ``units``
    (`_unit_batch_dims`) squeezed from both operands and put back in the result: the
    same sums, the layout of a dot without them."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ldrop = sorted(lb[k] for k in units)
    rdrop = sorted(rb[k] for k in units)

    def renum(dims, drop):
        return tuple(d - sum(x < d for x in drop) for d in dims)

    keep = [k for k in range(len(lb)) if k not in units]
    dn = (
        (renum(lc, ldrop), renum(rc, rdrop)),
        (renum([lb[k] for k in keep], ldrop), renum([rb[k] for k in keep], rdrop)),
    )
    lhs = jax.lax.squeeze(ins[0], ldrop)
    rhs = jax.lax.squeeze(ins[1], rdrop)
    (out,) = compat.bind_eqn(eqn, [lhs, rhs], dimension_numbers=dn)
    return [jax.lax.expand_dims(out, sorted(units))]


def _holds_unit_dot(eqn, memo) -> bool:
    """Whether a plain call ``eqn`` (`compat.plain_call`) holds, also through plain calls
    inside it, a dot with unit batch dimensions. ``memo``: id(jaxpr) -> (jaxpr, answer)."""
    if walker.nest_of(eqn) is not walker.Nest.CALL or not compat.plain_call(eqn):
        return False
    j = walker.nested(eqn).jaxpr
    hit = memo.get(id(j))
    if hit is None:
        held = any(_unit_batch_dims(e) or _holds_unit_dot(e, memo) for e in j.eqns)
        hit = memo[id(j)] = (j, held)
    return hit[1]


def _bind_ordinary(eqn, ins, memo):
    """An ordinary equation (inside `_segment_fn`'s vmap): bound as it stands, except a
    dot with unit batch dimensions, squeezed (`_bind_unit_squeezed`), and a plain call
    holding one, evaluated equation by equation so that its dots are."""
    units = _unit_batch_dims(eqn)
    if units:
        return _bind_unit_squeezed(eqn, ins, units)
    if _holds_unit_dot(eqn, memo):
        view = walker.nested(eqn)
        sub = view.jaxpr
        local = dict(zip(sub.constvars, view.consts))
        local.update(zip(sub.invars, ins))
        for e in sub.eqns:
            vals = [v.val if isinstance(v, compat.Literal) else local[v] for v in e.invars]
            local.update(zip(e.outvars, _bind_ordinary(e, vals, memo)))
        return [v.val if isinstance(v, compat.Literal) else local[v] for v in sub.outvars]
    return compat.bind_eqn(eqn, ins)


def _segment_fn(eqns, inputs, in_flags, out_flags, B):
    """``vals -> outs`` of a run of equations, vmapped over the batched inputs."""
    outs = [v for eqn in eqns for v in eqn.outvars]
    memo = {}

    def one(vals):
        local = dict(zip(inputs, vals))
        for eqn in eqns:
            ins = [v.val if isinstance(v, compat.Literal) else local[v] for v in eqn.invars]
            local.update(zip(eqn.outvars, _bind_ordinary(eqn, ins, memo)))
        return [local[v] for v in outs]

    def fn(vals):
        return jax.vmap(
            one,
            in_axes=([0 if f else None for f in in_flags],),
            out_axes=[0 if f else None for f in out_flags],
            axis_size=B,
        )(list(vals))

    return fn


def layer_spans(specials, toks, n_eqns) -> dict:
    """``{start: stop}``: the spans of a jaxpr's ``n_eqns`` equations that repeat one
    layer, from the structural tokens ``toks`` (None: matches nothing) of its special
    equations at positions ``specials`` (sites, scopes holding one): each period from one
    layer's first special equation to the next layer's (`Evaluator._blocks`).

    The candidate periods are the commonest gaps between successive occurrences of a
    token (a layer's period is the gap of every token it has once), a few only, so the
    search stays linear in the number of sites; the best covers the most equations."""
    n = len(specials)
    last, gaps = {}, collections.Counter()
    for k, t in enumerate(toks):
        if t is not None and t in last:
            gaps[k - last[t]] += 1
        last[t] = k
    periods = [P for P, _ in gaps.most_common(_MAX_PERIODS)]
    best = None  # (coverage, -period, start, repeats)
    for P in periods:
        k = 0
        while k + P < n:
            if toks[k] is None or toks[k] != toks[k + P]:
                k += 1
                continue
            s = k
            while k + P < n and toks[k] is not None and toks[k] == toks[k + P]:
                k += 1
            R = (k - s + P) // P
            if R >= 2:
                cand = (R * P, -P, s, R)
                best = cand if best is None or cand > best else best
    if best is None:
        return {}
    _, P, s, R = best
    P = -P
    starts = [specials[s + r * P] for r in range(R)]
    if s + R * P < n:
        stop = specials[s + R * P]
    else:
        stop = min(n_eqns, starts[-1] + (starts[-1] - starts[-2]))
    return dict(zip(starts, starts[1:] + [stop]))


class Evaluator(walker.Walker):
    """The batched evaluation (module docstring): a `walker.Walker` whose values are
    ``(value, batched)`` pairs and whose context is the run's environment and sinks;
    its walk evaluates each run of ordinary equations as one ``jax.vmap`` (`segment`)
    and each repeated layer as one ``jax.jit`` (`block`); a site by its kernel (`site`);
    a call, checkpoint or scan with a site inside by its hook (`ENTER`)."""

    def __init__(self, analysis, kernels, site_fn, B, cache):
        self.an = analysis
        self.kernels = kernels  # path -> Kernel
        self.site_fn = site_fn  # (site, kernel, w, ext, ext_batched, sink) -> outs
        self.B = B
        self.cache = cache  # fingerprint.TraceCache: runs of equations traced once
        # variables computed from the jaxpr's constants alone (`constant_eqn`)
        self.consts = set()
        self._holds = {}  # `_holds_map_alone`'s answers by jaxpr

    def evaluate(self, jaxpr, consts, vals, flags, sinks, path=(), outer=()):
        """``outer``: ``(var, (value, batched))`` of the enclosing scopes that sites in
        this one read (`analysis_types.Analysis.forwards`)."""
        env = dict(outer)
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = (c, False)
            self.consts.add(v)
        for v, x, f in zip(jaxpr.invars, vals, flags):
            env[v] = (x, f)

        n = len(jaxpr.eqns)
        blocks = self._blocks(jaxpr, path)
        outs = self._block_outputs(jaxpr, path, blocks) if blocks else None
        starts = sorted(blocks)
        i = 0
        while i < n:
            j = blocks.get(i)
            if j is not None and self.block(jaxpr, i, j, env, sinks, path, outs[i]):
                i = j
                continue
            j = next((s for s in starts if s > i), n)
            self.walk(jaxpr, env, path, i, j, sinks)
            i = j
        res = [_read(env, v) for v in jaxpr.outvars]
        return [a for a, _ in res], [b for _, b in res]

    def read(self, env, v):
        return _read(env, v)

    def walk(self, jaxpr, env, path, start, stop, sinks):
        """Evaluates ``jaxpr.eqns[start:stop]`` into ``env`` (var -> (value, batched)):
        each run of ordinary equations by `segment`, the others by `step`."""
        eqns = jaxpr.eqns
        read = lambda v: _read(env, v)  # noqa: E731
        i = start
        while i < stop:
            eqn, p = eqns[i], path + (i,)
            if not self._special(p, eqn):
                # a run of ordinary equations: one vmap for all of them (a vmap per
                # equation costs most of the tracing time of a large model)
                j = i + 1
                while j < stop and not self._special(path + (j,), eqns[j]):
                    j += 1
                self.segment(eqns[i:j], env, read)
                i = j
                continue
            outs = self.step(eqn, [read(v) for v in eqn.invars], p, env, sinks)
            env.update(zip(eqn.outvars, outs))
            i += 1

    def step(self, eqn, ins, p, env, sinks):
        if p in self.an.sites:
            return self.site(p, env, sinks)
        return super().step(eqn, ins, p, env, sinks)

    def equation(self, eqn, ins, p, env, sinks):
        self.segment([eqn], env, lambda v: _read(env, v))
        return [env[v] for v in eqn.outvars]

    # ------------------------------------------------------------------ #
    # Repeated layers: one jit per layer-sized block of equations
    # ------------------------------------------------------------------ #
    def _blocks(self, jaxpr, path):
        """``{start: stop}``: spans of ``jaxpr.eqns`` that repeat the same layer.

        An unrolled model (a Python loop over layers) is a periodic sequence of
        sites and scopes; each period (from one layer's first site to the next
        layer's) becomes a block, evaluated by `block` as one ``jax.jit`` cached by
        its structure. Under the engine's ``jax.vjp`` the second and later layers
        then reuse the first one's trace, linearization, transposition and
        lowering (JAX caches those per traced jaxpr), instead of going through
        the machinery site by site. Spans that turn out not to be identical just
        trace separately (`block` keys each exactly)."""
        eqns = jaxpr.eqns
        specials = [k for k, e in enumerate(eqns) if self._special(path + (k,), e)]
        if len(specials) < 4:
            return {}
        toks = [self._token(path + (k,), eqns[k]) for k in specials]
        return layer_spans(specials, toks, len(eqns))

    def _token(self, p, eqn):
        """A cheap structural token of a special equation (None: matches nothing)."""
        site = self.an.sites.get(p)
        if site is not None:
            sk = self.cache.site_key(site, self.kernels[p])
            return None if sk is None else ("site", sk)
        try:
            return (
                eqn.primitive,
                fp.value_key(dict(eqn.params)),
                tuple(fp.aval_key(v.aval) for v in eqn.outvars),
            )
        except fp.Unkeyable:
            return None

    def _block_outputs(self, jaxpr, path, blocks):
        """``{start: outvars}``: what each block returns. A value read after its block
        is returned, and so is the same value of every block of the same shape (its
        equations and their outputs counted): the last layer then returns what the
        others do (one more output, unused, that XLA drops) and shares their trace.
        (Blocks of as many equations may differ, `_blocks`: their outputs are not
        matched by position.)"""
        last = self._last_use(jaxpr, path)
        flat = {a: [v for e in jaxpr.eqns[a:b] for v in e.outvars] for a, b in blocks.items()}
        shape = {a: (b - a, len(flat[a])) for a, b in blocks.items()}
        keep = {}
        for a, b in blocks.items():
            keep.setdefault(shape[a], set()).update(
                k for k, v in enumerate(flat[a]) if last.get(v, -1) >= b
            )
        return {a: [flat[a][k] for k in sorted(keep[shape[a]])] for a in blocks}

    def block(self, jaxpr, start, stop, env, sinks, path, outs):
        """Evaluates ``jaxpr.eqns[start:stop]`` as one cached ``jax.jit``; False
        (nothing done) where the span has no exact structural key. Its equations on
        constants alone run before it, outside (`constant_eqn`), and their values
        are inputs."""
        inputs, seen, defined = [], set(), set()

        def need(v):
            if not isinstance(v, compat.Literal) and v not in defined and v not in seen:
                seen.add(v)
                inputs.append(v)

        eqns = []
        for k in range(start, stop):
            eqn = jaxpr.eqns[k]
            if not self._special(path + (k,), eqn) and self.constant_eqn(eqn):
                self.bind_constant(eqn, env)
                for v in eqn.outvars:
                    need(v)
                continue
            eqns.append(eqn)
            for site in self.an.at(path + (k,)):  # sites read their views and inputs
                need(site.base)
                for v in site.ext_vars:
                    need(v)
            for v in eqn.invars:
                need(v)
            for v in self.an.forwards.get(path + (start + k,), ()):  # read by sites inside
                need(v)
            defined.update(eqn.outvars)
        in_flags = tuple(env[v][1] for v in inputs)
        n = len(path)
        inner_sites = sorted(
            q for q in self.an.sites if len(q) > n and q[:n] == path and start <= q[n] < stop
        )
        inner_scopes = sorted(
            q for q in self.an.scopes if len(q) > n and q[:n] == path and start <= q[n] < stop
        )

        def rel(q):
            return (q[n] - start,) + q[n + 1 :]

        def make_key():
            namer = fp.Namer()
            for i, v in enumerate(inputs):
                namer.bind(v, ("in", i))
            sites = []
            for q in inner_sites:
                k = self.site_fn.key_of(self.an.sites[q], self.kernels[q], sinks[q])
                if k is None:
                    raise fp.Unkeyable(q)
                sites.append((rel(q), k))
            return (
                "block",
                in_flags,
                tuple(fp.aval_key(v.aval) for v in inputs),
                fp.eqns_key(eqns, namer),
                tuple(namer.ref(v) for v in outs),
                tuple(sites),
                tuple(rel(q) for q in inner_scopes),
                self.B,
            )

        key = fp.keyed(make_key)
        if key is None:
            return False

        def build():
            holder = {}

            def fn(vals, sink_list):
                sub = {v: (x, f) for v, x, f in zip(inputs, vals, in_flags)}
                self.walk(jaxpr, sub, path, start, stop, dict(zip(inner_sites, sink_list)))
                res = [sub[v] for v in outs]
                holder["flags"] = [f for _, f in res]
                return [x for x, _ in res]

            return jax.jit(fn), holder

        fn, holder = self.cache.value(key, build)
        vals = fn([env[v][0] for v in inputs], [sinks[q] for q in inner_sites])
        for v, o, f in zip(outs, vals, holder["flags"]):
            env[v] = (o, f)
        return True

    def _last_use(self, jaxpr, path):
        """var -> index of the last equation that reads it (``len(eqns)``: returned)."""
        last = {}
        for k, eqn in enumerate(jaxpr.eqns):
            extra = tuple(v for s in self.an.at(path + (k,)) for v in (s.base, *s.ext_vars))
            extra += self.an.forwards.get(path + (k,), ())
            for v in (*eqn.invars, *extra):
                if not isinstance(v, compat.Literal):
                    last[v] = k
        for v in jaxpr.outvars:
            if not isinstance(v, compat.Literal):
                last[v] = len(jaxpr.eqns)
        return last

    def _special(self, p, eqn):
        """A site, or a call / remat / scan with a site inside (or a primitive that jax
        maps only with every operand batched, `_maps_alone`): evaluated by hand."""
        if p in self.an.sites:
            return True
        return (p in self.an.scopes or _holds_map_alone(eqn, self._holds)) and self.enters(eqn)

    def constant_eqn(self, eqn) -> bool:
        """``eqn`` computes from the jaxpr's constants and literals alone.

        Such an equation is bound where it stands, never inside the jits and vmaps of
        `segment` and `block`: XLA folds constant expressions (a Flax BatchNorm's
        ``rsqrt(var + eps)`` on its float32 running statistics), and it rounds the
        same expression differently where the constant reaches it as an argument of a
        nested call (one float32 ulp: 1e-7 relative on every gradient of a float64
        model). Bound here, it lowers as in ``jax.jit(jax.grad(loss))``."""
        return (
            bool(eqn.outvars)
            and not eqn.effects
            and all(isinstance(v, compat.Literal) or v in self.consts for v in eqn.invars)
        )

    def bind_constant(self, eqn, env):
        """Binds a `constant_eqn` into ``env`` (unbatched), unless a block bound it
        already (its value is then one of the block's inputs)."""
        if all(v in env for v in eqn.outvars):
            return
        outs = compat.bind_eqn(eqn, [_read(env, v)[0] for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs):
            env[v] = (o, False)
        self.consts.update(eqn.outvars)

    def segment(self, eqns, env, read):
        """Ordinary equations under one ``jax.vmap`` over the examples. Whether a value
        is batched follows statically (batched iff an input is), as for one equation.
        Equations on constants alone are bound first, outside it (`constant_eqn`).

        The vmapped run is a ``jax.jit`` cached by the run's structure
        (`fingerprint.eqns_key`): the same layer repeated is traced once."""
        # a primitive jax maps only with every operand batched runs by itself
        k = next((k for k, e in enumerate(eqns) if e.primitive in compat.BATCH_EVERY_OPERAND), None)
        if k is not None:
            self.segment(eqns[:k], env, read)
            self._map_alone(eqns[k], env, read)
            self.segment(eqns[k + 1 :], env, read)
            return
        rest = []
        for eqn in eqns:
            if self.constant_eqn(eqn):
                self.bind_constant(eqn, env)
            else:
                rest.append(eqn)
        eqns = rest
        if not eqns:
            return
        flag, inputs, defined = {}, [], set()
        for eqn in eqns:
            fl = False
            for v in eqn.invars:
                if isinstance(v, compat.Literal):
                    continue
                if v in defined:
                    fl |= flag[v]
                else:
                    if v not in flag:
                        flag[v] = env[v][1]
                        inputs.append(v)
                    fl |= flag[v]
            for v in eqn.outvars:
                flag[v] = fl
                defined.add(v)
        outs = [v for eqn in eqns for v in eqn.outvars]
        if not any(flag[v] for v in inputs):
            for eqn in eqns:
                vals = compat.bind_eqn(eqn, [read(v)[0] for v in eqn.invars])
                for v, o in zip(eqn.outvars, vals):
                    env[v] = (o, False)
            return
        in_flags = tuple(flag[v] for v in inputs)
        key = fp.keyed(lambda: _segment_key(eqns, inputs, in_flags))
        fn = self.cache.get(
            key, lambda: _segment_fn(eqns, inputs, in_flags, [flag[v] for v in outs], self.B)
        )
        vals = fn([env[v][0] for v in inputs])
        for v, o in zip(outs, vals):
            env[v] = (o, flag[v])

    def _map_alone(self, eqn, env, read):
        """``eqn`` of `compat.BATCH_EVERY_OPERAND` (``ragged_dot``) for the batch: jax maps
        it only with every operand batched, so `sites.base.map_eqn` (a rule for a
        shared operand, or copies of it)."""
        ins = [read(v) for v in eqn.invars]
        vals, flags = [a for a, _ in ins], [f for _, f in ins]
        if any(flags):
            outs = map_eqn(eqn, vals, flags, self.B)
        else:
            outs = compat.bind_eqn(eqn, vals)
        for v, o in zip(eqn.outvars, outs):
            env[v] = (o, any(flags))

    # ------------------------------------------------------------------ #
    def site(self, p, env, sinks):
        """The equation at ``p`` by its site's kernel, then each of its taps (the other
        sites at it, `analysis_types.Site.tap_of`), which read its outputs' cotangent."""
        outs = None
        for site in self.an.at(p):
            w, wf = env[site.base]
            assert not wf, "internal error: parameter view of an active site is batched"
            ext = []
            for v, b in zip(site.ext_vars, site.ext_batched):
                x, f = _read(env, v)
                if b and not f:
                    x = _bcast(x, self.B)
                ext.append(x)
            args = (self.kernels[site.path], w, tuple(ext), site.ext_batched, sinks[site.path])
            if outs is None:
                outs = tuple(self.site_fn(site, *args))
            else:
                outs = tuple(self.site_fn.tap(site, outs, *args))
        return [(o, True) for o in outs]

    def _sub_sinks(self, sinks, p):
        return {k: v for k, v in sinks.items() if k[: len(p)] == p and len(k) > len(p)}

    def _inherit_consts(self, outer_vars, inner_vars):
        """Inner variables bound to the outer jaxpr's constants are constants too
        (`constant_eqn`): a remat's or scan's body computes from them where the
        user's program does."""
        for vo, vi in zip(outer_vars, inner_vars):
            if isinstance(vo, compat.Literal) or vo in self.consts:
                self.consts.add(vi)

    def _outer(self, p, env):
        """``(var, (value, batched))`` of this scope's values that sites inside the
        equation at ``p`` read (`analysis_types.Analysis.forwards`)."""
        return [(v, env[v]) for v in self.an.forwards.get(p, ())]

    def call(self, eqn, view, ins, p, env, sinks):
        outs, ofl = self.evaluate(view.jaxpr, view.consts, [a for a, _ in ins],
                                  [b for _, b in ins], sinks, p, self._outer(p, env))
        return list(zip(outs, ofl))

    def remat(self, eqn, prm, ins, p, env, sinks):
        vals, flags = [a for a, _ in ins], [b for _, b in ins]
        outer = self._outer(p, env)
        sub_sinks = self._sub_sinks(sinks, p)
        out_flags = []
        self._inherit_consts(eqn.invars, prm.jaxpr.invars)
        outer_vars = [v for v, _ in outer]
        outer_flags = [f for _, (_, f) in outer]

        def f(vals, sub_sinks, outer_vals):
            inner = [(v, (x, fl)) for v, x, fl in zip(outer_vars, outer_vals, outer_flags)]
            outs, ofl = self.evaluate(prm.jaxpr, (), vals, flags, sub_sinks, p, inner)
            out_flags[:] = ofl
            return outs

        ck = jax.checkpoint(f, prevent_cse=prm.prevent_cse, policy=prm.policy)
        outs = ck(list(vals), sub_sinks, [x for _, (x, _) in outer])
        return list(zip(outs, out_flags))

    def scan(self, eqn, prm, ins, p, env, sinks):
        vals, flags = [a for a, _ in ins], [b for _, b in ins]
        outer = self._outer(p, env)
        nc, ncar, L = prm.num_consts, prm.num_carry, prm.length
        self._inherit_consts(eqn.invars[:nc], prm.jaxpr.invars[:nc])
        consts, cf = vals[:nc], flags[:nc]
        init = [
            x if f else _bcast(x, self.B)
            for x, f in zip(vals[nc : nc + ncar], flags[nc : nc + ncar])
        ]
        xs = [
            jnp.moveaxis(x, 0, 1) if f else x for x, f in zip(vals[nc + ncar :], flags[nc + ncar :])
        ]
        xf = flags[nc + ncar :]
        sub_sinks = self._sub_sinks(sinks, p)
        ys_flags = []

        def step(carry, x):
            x_vals, s = x
            outs, ofl = self.evaluate(
                prm.jaxpr,
                prm.consts,
                list(consts) + list(carry) + list(x_vals),
                list(cf) + [True] * ncar + list(xf),
                s,
                p,
                outer,
            )
            new_carry = [o if f else _bcast(o, self.B) for o, f in zip(outs[:ncar], ofl[:ncar])]
            new_carry = [c.astype(o.dtype) for c, o in zip(new_carry, carry)]
            ys_flags[:] = ofl[ncar:]
            return new_carry, outs[ncar:]

        carry, ys = jax.lax.scan(
            step, init, (xs, sub_sinks), length=L, reverse=prm.reverse, unroll=prm.unroll
        )
        ys = [jnp.moveaxis(y, 0, 1) if f else y for y, f in zip(ys, ys_flags)]
        return [(c, True) for c in carry] + list(zip(ys, ys_flags))

    ENTER = {walker.Nest.CALL: call, walker.Nest.REMAT: remat, walker.Nest.SCAN: scan}

"""Design E' measured with the package's own rules (issue 60, item 3): the package's
engine evaluating the batch loss's jaxpr (the one the independence proof traces) instead
of re-evaluating the per-example jaxpr under ``jax.vmap``.

A prototype, for measurement: `batch_engine` patches the package for the calls made
inside it so that

* the proof's trace of the batch loss (`independence.batch_loss_jaxpr`) is kept;
* the engine's one VJP (`engine._Chunk.backward`) walks the per-example jaxpr with the
  package's `interpreter.Evaluator` (its sites, kernels, sinks, blocks of repeated
  layers, scopes), but binds each ordinary equation's *matched equation of the batch
  loss* on the batch's values, as they are (`BatchEvaluator`): nothing is vmapped; a
  site gets its inputs with the examples leading (``x[:, None]``: one example's shape
  ``[1, ...]`` after them) and gives its outputs back in the batch's layout;
* the batch loss is seeded with ``B`` (``L = mean_b l_b``).

Its assumptions, asserted where they are used, not proved: the two jaxprs match equation
for equation once the per-example jaxpr's ``x[None]`` of each batch input is skipped
(`match`); every value that depends on the examples holds them on its leading axis where
one example's holds 1 (or has no such axis where one example's has none); the loss is a
mean over the examples; whole batches (no chunks), no residual leaf, no aux, no shard_map.
The design (docs/concepts.md, design E') replaces the assumptions by the proof's tags, a
checked match and its factor rho.

    python -m benchmarks.batch_engine [--quick] [--reps N] [--stats a,b] \
        [--out benchmarks/results/cpu_batch_engine.json]

``--quick`` checks the prototype's statistics against the package's (each statistic, a
tiny unrolled transformer), so that what it measures is a correct program.
"""

from __future__ import annotations

import contextlib
import statistics

import jax
import jax.numpy as jnp
from jax import lax

import jaxpr_surgery as js
from benchmarks import compile_time, one_trace, output
from jaxpr_surgery._src import compat, engine, independence, walker
from jaxpr_surgery._src.interpreter import Evaluator, _read

# --------------------------------------------------------------------------- #
# The match of the per-example jaxpr with the batch loss's
# --------------------------------------------------------------------------- #


class Mismatch(Exception):
    """The two jaxprs do not match equation for equation."""


def _expands(eqn, sources):
    """Whether ``eqn`` is the per-example function's ``x[None]`` of a batch input."""
    if (len(eqn.invars) != 1 or isinstance(eqn.invars[0], compat.Literal)
            or eqn.invars[0] not in sources):
        return False
    if eqn.primitive not in (lax.broadcast_in_dim_p, lax.reshape_p):
        return False
    ins, outs = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    return tuple(outs) == (1,) + tuple(ins)


def match(pe, batch, n_diff, n_ex):
    """``(eqns, alias)``: the batch loss's equation matched to each of the per-example
    jaxpr's (by id, also inside calls, checkpoints and scans), and the per-example
    variables that are a batch input itself (the ``x[None]`` skipped)."""
    eqns, alias = {}, {}
    sources = set(pe.invars[n_diff:n_diff + n_ex])
    rest = []
    for e in pe.eqns:
        if _expands(e, sources):
            alias[e.outvars[0]] = e.invars[0]
        else:
            rest.append(e)
    _pair(rest, batch.eqns, eqns)
    return eqns, alias


def _pair(pe_eqns, batch_eqns, out):
    if len(pe_eqns) != len(batch_eqns):
        raise Mismatch(f"{len(pe_eqns)} equations against {len(batch_eqns)}")
    for a, b in zip(pe_eqns, batch_eqns):
        if a.primitive is not b.primitive or len(a.outvars) != len(b.outvars):
            raise Mismatch(f"{a.primitive} against {b.primitive}")
        out[id(a)] = b
        ja, jb = walker.bodies(a), walker.bodies(b)
        if len(ja) != len(jb):
            raise Mismatch(f"bodies of {a.primitive}")
        for x, y in zip(ja, jb):
            _pair(x.eqns, y.eqns, out)


# --------------------------------------------------------------------------- #
# The evaluator
# --------------------------------------------------------------------------- #
def _to_examples(x, aval, B):
    """A batch value ``x`` of a per-example variable of ``aval``, with the examples
    leading (the package's evaluator's layout: ``[B, *one example's shape]``)."""
    shape = tuple(aval.shape)
    if tuple(x.shape) == (B,) + shape:
        return x
    assert shape and shape[0] == 1 and tuple(x.shape) == (B,) + shape[1:], (x.shape, shape)
    return x[:, None]


def _from_examples(o, aval, B):
    """The inverse of `_to_examples` for an output of one example's ``aval``."""
    shape = tuple(aval.shape)
    if shape and shape[0] == 1:
        return o[:, 0]
    return o


class BatchEvaluator(Evaluator):
    """The package's evaluator walking the per-example jaxpr, its ordinary equations
    bound as their matched equations of the batch loss on the batch's values (module
    docstring). Values are ``(value, depends on the examples)``, the value in the batch
    loss's layout."""

    def __init__(self, ev, eqns, alias):
        super().__init__(ev.an, ev.kernels, ev.site_fn, ev.B, ev.cache)
        self.eqns, self.alias = eqns, alias

    def _batch_eqn(self, eqn):
        b = self.eqns.get(id(eqn))
        if b is None:
            raise Mismatch(f"no match for {eqn.primitive}")
        return b

    def _bind(self, eqn, read):
        """The matched batch equation on the values of ``eqn``'s inputs (a literal as the
        batch loss's own: a mean's 1 is B there)."""
        b = self._batch_eqn(eqn)
        ins = [w.val if isinstance(w, compat.Literal) else read(v)[0]
               for v, w in zip(eqn.invars, b.invars)]
        return compat.bind_eqn(b, ins)

    def segment(self, eqns, env, read):
        for eqn in eqns:
            if eqn.outvars and eqn.outvars[0] in self.alias:
                env[eqn.outvars[0]] = read(self.alias[eqn.outvars[0]])
                continue
            flag = any(read(v)[1] for v in eqn.invars if not isinstance(v, compat.Literal))
            for v, o in zip(eqn.outvars, self._bind(eqn, read)):
                env[v] = (o, flag)

    def bind_constant(self, eqn, env):
        if all(v in env for v in eqn.outvars):
            return
        for v, o in zip(eqn.outvars, self._bind(eqn, lambda v: _read(env, v))):
            env[v] = (o, False)
        self.consts.update(eqn.outvars)

    def site(self, p, env, sinks):
        B = self.B
        saved = {}
        for site in self.an.at(p):
            for v in site.ext_vars:
                x, f = _read(env, v)
                if f and not isinstance(v, compat.Literal) and v not in saved:
                    saved[v] = env[v]
                    env[v] = (_to_examples(x, v.aval, B), True)
        try:
            outs = super().site(p, env, sinks)
        finally:
            env.update(saved)
        eqn = self.an.at(p)[0].eqn
        return [(_from_examples(o, v.aval, B), True) for (o, _), v in zip(outs, eqn.outvars)]

    def scan(self, eqn, prm, ins, p, env, sinks):
        vals, flags = [a for a, _ in ins], [b for _, b in ins]
        outer = self._outer(p, env)
        nc, ncar = prm.num_consts, prm.num_carry
        self._inherit_consts(eqn.invars[:nc], prm.jaxpr.invars[:nc])
        consts, cf = vals[:nc], flags[:nc]
        xf = flags[nc + ncar:]
        sub_sinks = self._sub_sinks(sinks, p)
        b = self._batch_eqn(eqn)

        def step(carry, x):
            x_vals, s = x
            outs, _ = self.evaluate(prm.jaxpr, prm.consts,
                                    list(consts) + list(carry) + list(x_vals),
                                    list(cf) + [True] * ncar + list(xf), s, p, outer)
            return [o.astype(c.dtype) for o, c in zip(outs[:ncar], carry)], outs[ncar:]

        carry, ys = lax.scan(step, list(vals[nc:nc + ncar]), (list(vals[nc + ncar:]), sub_sinks),
                             length=b.params["length"], reverse=prm.reverse, unroll=prm.unroll)
        return [(c, True) for c in carry] + [(y, True) for y in ys]

    ENTER = {**Evaluator.ENTER, walker.Nest.SCAN: scan}


# --------------------------------------------------------------------------- #
# The patch
# --------------------------------------------------------------------------- #
_KEPT: dict = {}
COUNTS = {"batch": 0}  # calls the batch engine served (``--quick`` checks it ran)


def _backward(self, plan, ev, sinks, copies):
    if copies:
        raise Mismatch("a residual leaf (per-example copies)")
    closed = _KEPT["closed"]
    n_diff, n_ex = len(self.diff), len(self.ex)
    eqns, alias = match(plan.closed.jaxpr, closed.jaxpr, n_diff, n_ex)
    bev = BatchEvaluator(ev, eqns, alias)
    B = self.B
    vals = list(self.diff) + list(self.ex) + list(self.other)
    flags = [False] * n_diff + [True] * n_ex + [False] * len(self.other)

    def forward(sinks):
        outs, _ = bev.evaluate(plan.closed.jaxpr, plan.closed.consts, vals, flags, sinks)
        loss = outs[0]
        return B * loss, jnp.broadcast_to(loss, (B,))

    total, pull, loss_b = jax.vjp(forward, sinks, has_aux=True)
    (sink_cts,) = pull(jnp.ones((), total.dtype))
    COUNTS["batch"] += 1
    return sink_cts, {}, loss_b, []


@contextlib.contextmanager
def batch_engine():
    """The package's calls traced inside run the prototype (module docstring)."""
    keep_loss, keep_backward = independence.batch_loss_jaxpr, engine._Chunk.backward

    def kept(prep):
        _KEPT["closed"] = keep_loss(prep)
        return _KEPT["closed"]

    independence.batch_loss_jaxpr = kept
    engine._Chunk.backward = _backward
    try:
        yield
    finally:
        independence.batch_loss_jaxpr = keep_loss
        engine._Chunk.backward = keep_backward
        _KEPT.clear()


# --------------------------------------------------------------------------- #
# Measurement
# --------------------------------------------------------------------------- #
STATS = ("second_moment", "variance", "sq_norms", "clipped_mean", "kurtosis")


def _stat(name):
    return getattr(js.stats, name)(*((1.0,) if name.startswith("clipped") else ()))


def _regimes(quick):
    """`benchmarks.one_trace`'s models (compile_check's s768 and GPT-2 small, and GPT-2
    small stacked under ``lax.scan`` + ``jax.checkpoint``), measured alike."""
    return one_trace._regimes(quick)


def _measure(fn, args, batched):
    """``compile_time._measure`` of ``fn``, lowered inside `batch_engine` if ``batched``."""
    if not batched:
        return compile_time._measure(fn, args)[0]
    with batch_engine():
        return compile_time._measure(fn, args)[0]


def check(model, stats=STATS, B=4):
    """The prototype's statistics against the package's: the largest relative error."""
    params, batch = model.params, model.make_batch(B)
    err = 0.0
    for s in stats:
        want = jax.jit(js.per_example_stat(model.loss, _stat(s), chunk_size=None))(params, batch)
        with batch_engine():
            got = jax.jit(js.per_example_stat(model.loss, _stat(s), chunk_size=None))(
                params, batch)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            err = max(err, float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)))
    return err


def run(quick=False, reps=None, stats=STATS, only=None):
    reps = reps or (1 if quick else 3)
    jax.jit(lambda x: x * 2).lower(1.0).compile()
    rows = []
    for name, build in _regimes(quick).items():
        if only is not None and name not in only:
            continue
        model = build()
        params, batch = model.params, model.make_batch(8)
        fns = {"grad": (jax.grad(model.loss), False)}
        for s in stats:
            fn = js.per_example_stat(model.loss, _stat(s), chunk_size=None)
            fns[f"{s} package"] = (fn, False)
            fns[f"{s} batch engine"] = (fn, True)
        samples = {m: [] for m in fns}
        for _ in range(reps):
            for m, (fn, batched) in fns.items():
                samples[m].append(_measure(fn, (params, batch), batched))
        g = samples["grad"]
        for m in fns:
            s = samples[m]
            row = {"regime": name, "B": 8, "method": m,
                   "lower_thread_s": min(x[4] for x in s),
                   "compile_cpu_s": statistics.median(x[3] for x in s)}
            if m != "grad":
                row["lower_thread_x_grad"] = row["lower_thread_s"] / min(x[4] for x in g)
                row["compile_cpu_x_grad"] = compile_time._paired([x[3] for x in s],
                                                                 [x[3] for x in g])
                print(f"{name:8s} {m:28s} lower {row['lower_thread_x_grad']:5.2f}x (its "
                      f"thread)  compile {row['compile_cpu_x_grad']:5.2f}x grad", flush=True)
            rows.append(row)
    return rows


def main(argv=None):
    ap = output.parser(__doc__)
    ap.add_argument("--stats", default=",".join(STATS))
    ap.add_argument("--models", default=None, help="comma-separated regimes (default all)")
    a = ap.parse_args(argv)
    stats = tuple(a.stats.split(","))
    checks = {}
    if a.quick:
        for name, build in _regimes(True).items():
            before = COUNTS["batch"]
            checks[name] = {"max_rel_error": check(build(), stats),
                            "served": COUNTS["batch"] - before}
            print(f"{name}: the prototype's statistics equal the package's to "
                  f"{checks[name]['max_rel_error']:.1e}", flush=True)
    rows = run(a.quick, a.reps, stats, None if a.models is None else a.models.split(","))
    if a.out:
        note = ("whole batches (chunk_size=None) for both; lower_thread: the "
                "lowering thread's CPU time, the least over rounds, over grad's "
                "least; compile: medians of the rounds' ratios of process CPU "
                "time; nothing runs")
        output.write_small(a.out, note, rows, checks=checks)
    return rows, checks


if __name__ == "__main__":
    main()

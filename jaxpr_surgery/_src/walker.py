"""The one jaxpr walker: how each structured primitive nests a jaxpr, and the walk that
the analysis, the batched interpreter and the independence proof each extend.

The three passes read the same jaxpr for different ends: the analysis tags each variable
with how it depends on the parameters and the data (`analysis`), the interpreter
evaluates it for the batch with the sites rewired (`interpreter`), the independence
proof tags each variable with how it depends on the examples (`independence`). What a
variable holds and how an ordinary equation is read differ; how a structured equation
nests a jaxpr does not, and is said here once:

* `Nest`, the kinds of nesting, and `NESTS`, the table from primitive objects to them
  (``jit``/``pjit``, ``closed_call`` and ``call``; ``checkpoint``; ``custom_vjp`` and
  ``custom_jvp`` calls; ``scan``; ``while``; ``cond``);
* `nested`: the typed view of an equation's nested jaxpr (`Once`, `compat.ScanParams`,
  `compat.WhileParams`, `Branches`), read through `compat` at both ends of jax's range;
* `Walker`: an environment per jaxpr run, the equations in order, each at its *path*
  (the positions of the equations that enclose it, then its own: the key the analysis
  gives sites and the interpreter finds them by), each structured equation handed to
  the walker's hook for its kind (`Walker.ENTER`, keyed by `Nest`), every other one,
  and a kind the walker has no hook for, to its `Walker.equation`;
* `bodies` and `equations`: the open jaxprs of any equation (also those no pass enters:
  a ``shard_map``'s, a custom rule's) and every equation at any depth, for read-only
  scans (dtypes, collectives, FLOPs).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from jaxpr_surgery._src import compat


class Nest(enum.Enum):
    """How a structured equation runs the jaxpr it holds."""

    CALL = "a call (jit, closed_call, call): its body once, on its operands"
    REMAT = "jax.checkpoint: its body once, recomputed for the backward pass"
    CUSTOM = "a custom_vjp / custom_jvp call: its primal body once, on its operands"
    SCAN = "lax.scan: its body once per step, over consts, carry and xs"
    WHILE = "lax.while_loop: its body while its condition holds, on consts and carry"
    COND = "lax.cond / lax.switch: one of its branches, on the operands after the index"


def _table(entries) -> dict:
    out = {}
    for prims, nest in entries:
        for p in prims:
            if p is not None:  # a primitive this jax does not have
                out[p] = nest
    return out


#: primitive object -> `Nest`
NESTS: dict = _table([
    ((compat.jit_p, compat.closed_call_p, compat.call_p), Nest.CALL),
    ((compat.remat_p,), Nest.REMAT),
    (tuple(compat.custom_prims), Nest.CUSTOM),
    ((compat.scan_p,), Nest.SCAN),
    ((compat.while_p,), Nest.WHILE),
    ((compat.cond_p,), Nest.COND),
])

#: the primitives of `Nest.CALL`
CALLS = tuple(p for p, n in NESTS.items() if n is Nest.CALL)


@dataclasses.dataclass(frozen=True)
class Once:
    """The body of an equation that runs it once (`Nest.CALL`, `Nest.REMAT`,
    `Nest.CUSTOM`): the equation's operand k binds ``jaxpr.invars[k]``, its output k is
    ``jaxpr.outvars[k]``. ``consts`` bind ``jaxpr.constvars``; ``prevent_cse`` and
    ``policy`` are a checkpoint's (defaults elsewhere)."""

    nest: Nest
    jaxpr: Any
    consts: tuple = ()
    prevent_cse: bool = True
    policy: Any = None


@dataclasses.dataclass(frozen=True)
class Branches:
    """A ``cond``'s branches (open jaxprs); the operands are the index, then each
    branch's inputs."""

    jaxprs: tuple


def _once_call(eqn):
    return Once(Nest.CALL, *compat.call_parts(eqn))


def _once_remat(eqn):
    prm = compat.remat_params(eqn)
    return Once(Nest.REMAT, prm.jaxpr, (), prm.prevent_cse, prm.policy)


def _once_custom(eqn):
    return Once(Nest.CUSTOM, *compat.custom_call_parts(eqn))


_VIEWS: dict = {
    Nest.CALL: _once_call,
    Nest.REMAT: _once_remat,
    Nest.CUSTOM: _once_custom,
    Nest.SCAN: compat.scan_params,
    Nest.WHILE: compat.while_params,
    Nest.COND: lambda eqn: Branches(tuple(compat.cond_branches(eqn))),
}


def nest_of(eqn) -> Nest | None:
    """The `Nest` of ``eqn``, or None (an ordinary equation, or one whose jaxprs no pass
    enters)."""
    return NESTS.get(eqn.primitive)


def nested(eqn):
    """The typed view of ``eqn``'s nested jaxpr by its `Nest` (`Once`,
    `compat.ScanParams`, `compat.WhileParams`, `Branches`); ``eqn`` must have one."""
    return _VIEWS[NESTS[eqn.primitive]](eqn)


def body(eqn):
    """The open body of an equation that runs one once (`Once`), else None."""
    nest = NESTS.get(eqn.primitive)
    if nest in (Nest.CALL, Nest.REMAT, Nest.CUSTOM):
        return _VIEWS[nest](eqn).jaxpr
    return None


def bodies(eqn) -> list:
    """The open jaxprs in ``eqn``'s params, of any primitive (also those no pass enters:
    a ``shard_map``'s, a custom derivative's rules)."""
    return [compat.closed_parts(j)[0] for j in compat.subjaxprs(eqn)]


def equations(jaxpr, enter: Callable[[Any], bool] | None = None) -> Iterator:
    """Every equation of the open ``jaxpr`` and, depth first, of the jaxprs inside them
    (`bodies`); ``enter(eqn)`` False keeps out of ``eqn``'s."""
    for eqn in jaxpr.eqns:
        yield eqn
        if enter is None or enter(eqn):
            for sub in bodies(eqn):
                yield from equations(sub, enter)


def path_to(jaxpr, target) -> list | None:
    """The equations from ``jaxpr``'s down to ``target`` (found by identity), or None."""
    for eqn in jaxpr.eqns:
        if eqn is target:
            return [eqn]
        for sub in bodies(eqn):
            inner = path_to(sub, target)
            if inner is not None:
                return [eqn, *inner]
    return None


class Walker(abc.ABC):
    """A walk of a jaxpr, one value per variable.

    `run` binds a jaxpr's inputs and walks its equations (`walk`); `step` gives each its
    outputs' values: a structured equation goes to the hook `ENTER` holds for its
    `Nest` (called ``hook(walker, eqn, view, ins, path, *ctx)``, ``view`` from
    `nested`), which runs the nested jaxpr by `run` as its kind requires; any other
    equation, and a kind without a hook, goes to `equation`. ``ctx`` is what a walker
    threads through a run besides the values (the analysis: the enclosing scans'
    lengths; the interpreter: the run's environment and sinks), passed through as given.
    A pass overrides `step` to look at every equation first, `read` for what a literal
    holds, `walk` to evaluate several equations at once (the interpreter's runs of
    ordinary equations)."""

    #: `Nest` -> hook; a kind absent is an ordinary equation to this walker
    ENTER: ClassVar[dict] = {}

    def read(self, env, v):
        """What ``v`` holds in ``env`` (a literal: None)."""
        return None if isinstance(v, compat.Literal) else env.get(v)

    def run(self, jaxpr, ins, path=(), *ctx):
        """The values of ``jaxpr``'s outputs from its inputs' ``ins``."""
        env = dict(zip(jaxpr.invars, ins))
        self.walk(jaxpr, env, path, 0, len(jaxpr.eqns), *ctx)
        return [self.read(env, v) for v in jaxpr.outvars]

    def walk(self, jaxpr, env, path, start, stop, *ctx):
        """``jaxpr.eqns[start:stop]`` into ``env``."""
        read = self.read
        for i in range(start, stop):
            eqn = jaxpr.eqns[i]
            outs = self.step(eqn, [read(env, v) for v in eqn.invars], path + (i,), *ctx)
            env.update(zip(eqn.outvars, outs))

    def enters(self, eqn) -> bool:
        """Whether this walker has a hook for ``eqn``'s kind of nesting."""
        nest = NESTS.get(eqn.primitive)
        return nest is not None and nest in self.ENTER

    def step(self, eqn, ins, path, *ctx):
        """The values of ``eqn``'s outputs from its inputs' ``ins``."""
        nest = NESTS.get(eqn.primitive)
        hook = self.ENTER.get(nest) if nest is not None else None
        if hook is None:
            return self.equation(eqn, ins, path, *ctx)
        return hook(self, eqn, _VIEWS[nest](eqn), ins, path, *ctx)

    @abc.abstractmethod
    def equation(self, eqn, ins, path, *ctx):
        """The values of an ordinary equation's outputs (or one whose kind of nesting
        this walker does not enter)."""

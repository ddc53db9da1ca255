"""Automatic chunking of the batch (``chunk_size="auto"``).

On CPU, running the model over the whole batch at once is slower than over
chunks of it once the program's temporaries outgrow about 32 MiB. Measured, the
cause is mostly the allocator, not the cache: glibc's malloc (a Linux process's
default) returns a freed block above its mmap threshold, which adapts up to
32 MiB, to the OS, so each call of a program with more temporary memory maps its
buffer afresh and page-faults every page of it (about 1 microsecond a page on the
benchmark machine; docs/benchmarks.md sets the suite under that allocator beside
one that keeps freed memory, where the whole batch is as fast or faster). So
``"auto"`` first asks whether this process's allocator does that
(`temporaries_refault`, measured once by allocating, writing and freeing 80 MiB
twice); where it keeps freed memory instead, the whole batch runs. Otherwise
it picks the chunk from an estimate of one example's activations, read
off the per-example jaxpr: the bytes of every intermediate value that depends on
the example's data (values computed from the parameters alone count once per
batch, not per example). Calls into jitted functions and custom-derivative
functions are looked into; loops and ``jax.checkpoint`` count their outputs only,
since their insides are not kept alive for the backward pass. Each chunk
continues the running statistics (api.py: its tile loops start from them; leaves
without one merge into them), which streams parameter-sized accumulators through
memory, so a chunk is also kept large against them (`MERGE_FACTOR`).

Elsewhere (GPU, TPU) the whole batch runs at once: there a chunk loop costs
parallelism and buys nothing unless the user bounds the memory with an explicit
``chunk_size``.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, cuts, tiling, walker
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.reductions import acc_dtype_for

# One chunk's estimated activations, CPU. The estimate counts every unfused
# intermediate, about twice what XLA keeps (its temp memory), so this keeps a
# chunk's temporaries near glibc's largest mmap threshold (32 MiB), above which
# every call page-faults its temporary buffer. Measured on the benchmark
# transformers (benchmarks/, 2-core AMD EPYC VM, default malloc): 0.5-0.8x the time
# of the unchunked call where the batch's estimate exceeds it, unchanged where it
# does not; with malloc keeping freed memory (benchmarks.run --allocator steady)
# the unchunked call was 0.75-1.0x the chunked one instead.
CPU_CHUNK_BYTES = 64 << 20
# A divisor of the batch is preferred (one traced chunk body, no remainder) if it
# is at least this fraction of the largest chunk that fits.
_DIVISOR_SLACK = 0.5
# A chunk's estimated activations are kept at least this many times the bytes of
# the statistics it merges into. Measured on the benchmark transformers (8 MiB of
# estimated activations per example): with 3.7M parameters, two chunks of 4 took
# 1.1x (E[g²]) to 1.8x (variance) the whole batch's time; with 2.1M, E[g²] in two
# chunks took 0.75x, the variance 1.3x.
MERGE_FACTOR = 3
# ... or the smallest divisor up to this factor above (a little over the budget).
_ABOVE_SLACK = 1.25

# Bytes `temporaries_refault` allocates: above glibc's largest mmap threshold
# (32 MiB) and above what one heap of a thread's own arena holds (64 MiB).
_PROBE_BYTES = 80 << 20

_LOOKED_INTO = (walker.Nest.CALL, walker.Nest.CUSTOM)


def _nbytes(v) -> int:
    aval = getattr(v, "aval", None)
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys, float0)
        return 0
    return tiling.bytes_of(shape, dtype)


def activation_bytes(jaxpr, data_in) -> int:
    """Bytes of the intermediates of ``jaxpr`` (open) that depend on an input flagged
    in ``data_in``."""
    data = {v for v, d in zip(jaxpr.invars, data_in) if d}
    total = 0
    for eqn in jaxpr.eqns:
        flags = [not isinstance(v, compat.Literal) and v in data for v in eqn.invars]
        if not any(flags):
            continue
        inner = walker.nested(eqn).jaxpr if walker.nest_of(eqn) in _LOOKED_INTO else None
        if inner is not None and len(inner.invars) == len(flags):
            total += activation_bytes(inner, flags)
        else:
            total += sum(_nbytes(v) for v in eqn.outvars)
        data.update(eqn.outvars)
    return total


def auto_chunk(
    B: int, per_example_bytes: int, budget: int | None = None, accumulator_bytes: int = 0
) -> int | None:
    """Examples per chunk so that a chunk's activations fit ``budget`` (default
    `CPU_CHUNK_BYTES`); None where the whole batch does (or where no chunk smaller
    than the batch pays for its merges).

    The chunks are balanced, and a divisor of ``B`` is taken when one is close (no
    remainder chunk to trace). Every chunk streams the running statistics
    (``accumulator_bytes``, parameter-sized per statistic) through memory, so a
    chunk's activations are kept at least `MERGE_FACTOR` times the accumulators,
    even beyond the budget.
    """
    budget = CPU_CHUNK_BYTES if budget is None else budget
    per_ex = max(int(per_example_bytes), 1)
    if B <= 1 or per_ex * B <= budget:
        return None
    fit = max(1, int(budget // per_ex))
    n = -(-B // fit)  # chunks needed
    size = -(-B // n)  # balanced chunk
    low = max(1, -(-int(MERGE_FACTOR * accumulator_bytes) // per_ex))
    divisors = [d for d in range(1, B + 1) if B % d == 0]
    if low <= size:  # the cache decides: the largest divisor close below, else above
        below = [d for d in divisors if max(low, _DIVISOR_SLACK * size) <= d <= size]
        above = [d for d in divisors if size < d <= _ABOVE_SLACK * size]
        size = max(below) if below else min(above) if above else size
    else:  # the merges decide: the smallest divisor close above
        near = [d for d in divisors if low <= d < low / _DIVISOR_SLACK]
        size = min(near) if near else low
    return None if size >= B else size


def accumulator_bytes(reductions, leaf_avals) -> int:
    """Bytes streamed through memory or between devices by every chunk: the running
    values it continues (per statistic, parameter-sized; per-example values are
    concatenated, not carried) and, under a batch split by XLA's partitioner
    (devices.py), the parameters, which FSDP gathers again for every chunk. (Which
    leaves are sharded over the batch's axes the trace cannot tell: Auto shardings are
    not in the types. Under FSDP on a 2-D mesh chunks of a scan stack's norms moved
    1.36x grad's collective bytes, the whole batch 1.19x.)"""
    merged = [r for r in reductions if not r.per_example]
    total = sum(tiling.bytes_of(a.shape, a.dtype) for a in leaf_avals) if (
        cuts.split_count() > 1) else 0
    if not merged or not leaf_avals:
        return total
    # leaves of one shape and dtype (a model's repeated layers) are sized once
    kinds = collections.Counter((tuple(a.shape), np.dtype(a.dtype)) for a in leaf_avals)
    for r in merged:
        for (shape, dtype), count in kinds.items():
            out = r.aval(shape, acc_dtype_for(dtype), 1)
            total += count * sum(tiling.bytes_of(x.shape, x.dtype) for x in jax.tree.leaves(out))
    return total


def validate(chunk_size, name: str) -> None:
    """Raises ``ValueError`` naming ``chunk_size`` unless it is a positive int, None or
    ``"auto"``."""
    cs = chunk_size
    if isinstance(cs, str) and cs == "auto" or cs is None:
        return
    if isinstance(cs, bool) or not isinstance(cs, (int, np.integer)) or cs <= 0:
        raise ValueError(
            f"{name}: chunk_size must be a positive int, None (the whole batch at once) or "
            f'"auto" (the default: chosen from the size of the activations), got {cs!r}.'
        )


def activation_bytes_of(jaxpr, n_params: int, n_examples: int, n_other: int) -> int:
    """`activation_bytes` of a per-example jaxpr whose inputs are the parameter leaves,
    the example leaves and the other arguments."""
    return activation_bytes(jaxpr, [False] * n_params + [True] * n_examples + [False] * n_other)


def _minor_faults(who):
    """Minor page faults so far of the calling thread (``who="RUSAGE_THREAD"``, Linux)
    or the process (``"RUSAGE_SELF"``, and where there is no per-thread count); None
    where the OS does not count them."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    try:
        return resource.getrusage(getattr(resource, who, resource.RUSAGE_SELF)).ru_minflt
    except (OSError, ValueError):
        return None


@functools.cache
def temporaries_refault() -> bool:
    """Whether this process's allocator page-faults a large buffer afresh each time it
    is allocated again, as XLA:CPU does with a program's temporaries on every call.

    Measured once: from a fresh thread (XLA's worker threads allocate from arenas of
    their own), the C library's ``malloc`` gives `_PROBE_BYTES`, which are written
    and freed, twice; True if the second buffer's writes page-fault at least half of
    its pages. True with glibc's default malloc, which returns a freed block above its
    mmap threshold (32 MiB at most) to the OS; False where the allocator keeps freed
    memory (glibc with ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0`` and a large
    ``MALLOC_TRIM_THRESHOLD_``, jemalloc, tcmalloc). Also True where the OS does not
    count faults or the probe cannot run, which keeps the chunks."""
    import ctypes
    import threading

    who = "RUSAGE_THREAD"  # Linux; elsewhere the whole process
    if _minor_faults(who) is None:
        return True
    out = []

    def probe():
        try:
            libc = ctypes.CDLL(None)
            malloc, free = libc.malloc, libc.free
            malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
            free.restype, free.argtypes = None, [ctypes.c_void_p]
            for _ in range(2):
                ptr = malloc(_PROBE_BYTES)
                if not ptr:
                    return
                before = _minor_faults(who)
                ctypes.memset(ptr, 1, _PROBE_BYTES)
                out.append(_minor_faults(who) - before)
                free(ptr)
        except Exception:  # noqa: BLE001 - any failure keeps the chunks
            out.clear()

    t = threading.Thread(target=probe, name="jaxpr_surgery-allocator-probe")
    t.start()
    t.join()
    if len(out) != 2:
        return True
    import resource

    return out[1] >= 0.5 * _PROBE_BYTES / resource.getpagesize()


def whole_for_the_allocator(chunk_size, B: int, per_example_bytes: int) -> bool:
    """Whether `resolve` runs the batch whole only because this process's allocator
    keeps freed memory (`temporaries_refault` is False): for explain's report."""
    return (
        isinstance(chunk_size, str)
        and tiling.prefer_per_example()
        and _past_budget(B, per_example_bytes)
        and not temporaries_refault()
    )


def _past_budget(B: int, per_example_bytes: int) -> bool:
    """Whether ``"auto"`` on CPU weighs chunks: the batch's estimated activations pass
    `CPU_CHUNK_BYTES` (as `auto_chunk`'s first test)."""
    return B > 1 and per_example_bytes * B > CPU_CHUNK_BYTES


def resolve(chunk_size, B: int, per_example_bytes, acc_bytes=0) -> int | None:
    """The examples per chunk a call runs with (None: the whole batch at once).
    ``per_example_bytes`` and ``acc_bytes`` (see `auto_chunk`): numbers, or functions
    giving them (only called for ``"auto"`` on CPU)."""
    if isinstance(chunk_size, str):  # "auto"
        if not tiling.prefer_per_example():
            return None
        nbytes = per_example_bytes() if callable(per_example_bytes) else per_example_bytes
        # (before the accumulators' shapes, an eval_shape only auto_chunk needs)
        if not _past_budget(B, nbytes) or not temporaries_refault():
            return None  # the batch fits, or memory is kept: whole is the fastest
        acc = acc_bytes() if callable(acc_bytes) else acc_bytes
        return auto_chunk(B, nbytes, accumulator_bytes=acc)
    if chunk_size is None or chunk_size >= B:
        return None
    return int(chunk_size)


# --------------------------------------------------------------------------- #
# The loop over chunks
# --------------------------------------------------------------------------- #
CHUNK_LOOP = "chunks"  # the name scope of the loops over chunks (tests find them by it)


@compat.implicit_rank_promotion
def run_chunks(run, prep, cs, zero, reductions, weights=None):
    """The batch in chunks of ``cs`` examples: ``(values, loss_b, aux)`` as one call.

    ``run(diff, ex, other, b, carry)`` evaluates one chunk of ``b`` examples (the
    engine), continuing ``carry``, a `stats.Carry` of the running accumulators of the
    chunks before it (keyed like ``zero``: ``Reduction.empty`` of every reduction that
    is not per example); ``prep`` holds the differentiated, per-example and other
    leaves. A chunk's computation is a jit per chunk size: one for the loop body,
    one for a remainder chunk. See `_chunk_loop`.

    ``weights``: the batch's ``example_weights`` ``[B]`` (or None): each chunk gets its
    own and the weight of the examples before it, ``run(..., carry, (w, W0))``; the
    running values are over weighted examples (`stats.Weighted`)."""
    fns = {}
    ex_leaves = list(prep.ex_leaves)
    if weights is not None:  # (with the weight before each example: sliced alike)
        before = jnp.concatenate([jnp.zeros((1,), weights.dtype), jnp.cumsum(weights)[:-1]])
        ex_leaves += [weights, before]
        reductions = [S.Weighted(r, weights) if S.weighs(r) else r for r in reductions]

    def call(d, e, o, b, c):
        if weights is None:
            return run(d, e, o, b, c)
        return run(d, e[:-2], o, b, c, (e[-2], e[-1][0]))

    def run_chunk(ex_leaves, b, carry):
        if b not in fns:
            fns[b] = jax.jit(lambda d, e, o, c: call(d, e, o, b, c))
        return fns[b](prep.diff_leaves, ex_leaves, prep.other_leaves, carry)

    return _chunk_loop(run_chunk, ex_leaves, prep.B, cs, zero, reductions)


def _chunk_loop(run_chunk, ex_leaves, B, cs, zero, reductions):
    """The full chunks in ``lax.scan`` loops (one, unless centred sums re-centre between
    them), the remainder after them.

    Each chunk continues the running accumulators of the chunks before it: its tile
    loops start from them, so no chunk merges its own values into them afterwards (a
    pass over every accumulator per chunk). A `Reduction.shift_bounded` accumulator
    (centred moments as `stats.Shifted` sums) runs against one shift: the mean of at
    least one example of the first chunk, so its rounding is amplified at most
    ``1 + m`` fold by the ``m`` examples after it; before that passes
    `stats.MAX_SHIFT_AMPLIFICATION` (past 32 examples) they re-centre (`recentre`) on
    the running mean, which then takes 31 times as many (so at most a few times a
    batch). The values come from the accumulators once, at the end
    (`Reduction.finish`). Per-example values are concatenated.

    Every full chunk runs in the loop, from the zero accumulators: the chunk's program
    is compiled once. (A first chunk peeled before the loop ran 5-20% faster on XLA:CPU
    but doubled the program XLA compiles, the whole model's forward and backward pass:
    the time to the first step, docs/benchmarks.md.) A loop after another, and the
    remainder, take the running values and their own examples through one
    optimization barrier, so that none starts before the previous one is done (two
    chunks' activations alive at once would be as many as the whole batch's).
    """
    nfull, rem = divmod(B, cs)
    head = [x[: nfull * cs].reshape((nfull, cs) + x.shape[1:]) for x in ex_leaves]
    bounded = [j for j in zero if reductions[j].shift_bounded]
    limit = S.MAX_SHIFT_AMPLIFICATION - 1

    def count(n):  # one type (no retrace of the chunk), with or without x64
        return jnp.asarray(n, jnp.int32)

    def recentre(carry, n):
        return {j: [reductions[j].recentre(v, n) for v in vals] if j in bounded else vals
                for j, vals in carry.items()}

    def split(vals):  # (the running values, the per-example ones)
        return ({j: v for j, v in vals.items() if j in zero},
                {j: v for j, v in vals.items() if j not in zero})

    def step(carry, xs):
        k, chunk = xs
        vals, loss_b, aux = run_chunk(chunk, cs, S.Carry(carry, count(k * cs)))
        new, per_ex = split(vals)
        return new, (per_ex, loss_b, aux)

    carry, pieces = zero, []
    # the shift is the mean of at least n_shift examples, `since` came after it (the
    # first chunk's first tile takes the shift: -1 before it)
    n_shift, since = 1, -1
    k = 0
    while k < nfull or rem:
        size = cs if k < nfull else rem
        if bounded and k and since + size > limit * n_shift:
            n_shift, since = k * cs, 0
            carry = recentre(carry, n_shift)
        todo = nfull - k if not bounded else (limit * n_shift - since) // cs
        todo = max(1, min(nfull - k, todo))
        if k < nfull:
            rest = [h[k : k + todo] for h in head]
            if k:
                carry, rest = compat.ordering_barrier((carry, rest))
            with jax.named_scope(CHUNK_LOOP):
                carry, (pev, loss_r, aux_r) = jax.lax.scan(
                    step, carry, (jnp.arange(k, k + todo), rest)
                )
            flat = lambda r: r.reshape((-1,) + r.shape[2:])  # noqa: E731
            pieces.append((jax.tree.map(flat, pev), flat(loss_r), [flat(a) for a in aux_r]))
            k += todo
            since += todo * cs
        else:
            tail = [x[nfull * cs :] for x in ex_leaves]
            carry, tail = compat.ordering_barrier((carry, tail))
            vals, loss_t, aux_t = run_chunk(tail, rem, S.Carry(carry, count(nfull * cs)))
            carry, per_ex = split(vals)
            pieces.append((per_ex, loss_t, aux_t))
            rem = 0
    values = {j: [reductions[j].finish(v, B) for v in vals] for j, vals in carry.items()}
    for j in pieces[0][0]:  # per-example values
        values[j] = [jnp.concatenate(v) for v in zip(*(p[0][j] for p in pieces))]
    loss_b = jnp.concatenate([p[1] for p in pieces])
    aux = [jnp.concatenate(a) for a in zip(*(p[2] for p in pieces))]
    return values, loss_b, aux

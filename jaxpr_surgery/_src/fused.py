"""A fused GPU kernel for the tile loop: ``sum_b phi(X_b^T DY_b)`` in one Pallas kernel.

`tiling.reduce_tiles` forms a tile of per-example gradients ``G_b = X_b^T DY_b``
(a batched matmul writing the tile to memory), then reads it back to apply every
``phi`` and accumulate. Here each program of the kernel owns one block of the
weight (``K`` index, ``bc`` rows of ``C``, ``bf`` columns of ``F``) and walks the
examples of its share of the batch: it accumulates ``G_b``'s block over the
tokens in registers (``bt`` tokens a step), applies every requested ``phi`` while
the block is hot, and adds it to its running sums. ``G`` never reaches memory;
the matmul work is the weight gradient's.

Scope: sums of the built-in elementwise statistics (the gradient itself, its
square, sign and absolute value: `stats.SUM`, `SQUARE`, `SIGN`, `ABS`, each with
``phi(0) == 0``, so zero-padded tokens, examples and features add nothing) and
one-pass centred moments (the variance: sums of ``G_b - K`` and its square
against a shift ``K``, the first example of each program's share of at most
`S.MAX_SHIFT_AMPLIFICATION` examples, padding masked out; the shares' moments
merged pairwise by Chan's update), in float32 or float64, outside ``shard_map``.
Everything else keeps the XLA tile loop. Derivatives of the statistic are taken
through the XLA form (a custom JVP), so differentiating a statistic never needs
the kernel's.

Selection: `mode` reads ``JAXPR_SURGERY_TILE_KERNEL``: ``xla`` (the default),
``pallas`` (the kernel, lowered by Triton, on a GPU; elsewhere the XLA loop) or
``interpret`` (the kernel run by Pallas's interpreter on any backend: how the
CPU tests check its numerics). The kernel is opt-in until it is measured on a GPU
against the XLA loop (docs/howto/memory.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat
from jaxpr_surgery._src import stats as S

ENV = "JAXPR_SURGERY_TILE_KERNEL"
MODES = ("xla", "pallas", "interpret")

# the statistics the kernel applies to a block of G_b, keyed by the reduction object
PHIS = {
    S.SUM: lambda g: g,
    S.SQUARE: lambda g: g * g,
    S.SIGN: jnp.sign,
    S.ABS: jnp.abs,
}
CENTRED = S.Centered()  # one-pass centred moments (no mean given), the kernel's other reduction

BLOCK = 64  # most rows of C and columns of F a program owns (a power of two)
MIN_BLOCK = 16  # Triton's smallest dot operand side
TOKEN_STEP = 32  # most tokens a step of the inner loop contracts
MIN_PROGRAMS = 264  # about two programs per streaming multiprocessor of an H100 (132)


def mode() -> str:
    """The kernel the tile loop takes (``JAXPR_SURGERY_TILE_KERNEL``; see the module
    docstring). Raises ``ValueError`` for an unknown value."""
    m = os.environ.get(ENV, "xla").strip().lower() or "xla"
    if m not in MODES:
        raise ValueError(
            f"{ENV}={os.environ.get(ENV)!r}: the tile kernel must be one of {MODES} "
            "('xla', the default: XLA's tile loop; 'pallas': the fused Pallas kernel on a "
            "GPU; 'interpret': the fused kernel interpreted, on any backend)."
        )
    return m


@contextlib.contextmanager
def selected(kernel: str):
    """``JAXPR_SURGERY_TILE_KERNEL`` set to ``kernel`` within the block (read when a
    call is traced: wrap the tracing, e.g. ``jax.jit(f).lower(...)``)."""
    old = os.environ.get(ENV)
    os.environ[ENV] = kernel
    try:
        mode()  # an unknown kernel fails here, naming the variable
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def applies(reductions, dtype, operands) -> bool:
    """Whether `phi_sums` takes ``reductions`` (all `builtin`) of ``G`` in ``dtype``
    from ``operands`` here."""
    m = mode()
    if m == "xla" or (m == "pallas" and jax.default_backend() != "gpu"):
        return False
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        return False
    if any(compat.vma_of(x) for x in operands):  # inside shard_map: the XLA loop
        return False
    return all(builtin(r) for r in reductions)


def builtin(reduction) -> bool:
    """``reduction`` is one the kernel computes: a sum of a built-in ``phi`` (`PHIS`)
    or one-pass centred moments (`stats.Centered`, no mean given)."""
    return reduction == CENTRED or reduction in PHIS


def _pow2(n: int, lo: int, hi: int) -> int:
    """The power of two at least ``n`` (clamped to ``[lo, hi]``)."""
    return int(min(hi, max(lo, 1 << max(0, int(n) - 1).bit_length())))


def _pad(a, axis, size):
    extra = size - a.shape[axis]
    if extra == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def blocks(B, K, N, C, F, max_per_split=None):
    """``(splits, examples per split, bc, bf, bt)``: the kernel's grid and blocks for
    ``X [B, K, N, C]``, ``DY [B, K, N, F]``. The batch is split across programs (each
    split's sums added afterwards) where the weight's blocks alone are too few to
    fill the GPU, and where a split would take more than ``max_per_split``."""
    bc, bf = _pow2(C, MIN_BLOCK, BLOCK), _pow2(F, MIN_BLOCK, BLOCK)
    bt = _pow2(N, MIN_BLOCK, TOKEN_STEP)
    programs = K * -(-C // bc) * -(-F // bf)
    per_split = -(-B // int(max(1, min(B, -(-MIN_PROGRAMS // programs)))))
    if max_per_split is not None:
        per_split = min(per_split, int(max_per_split))
    # a divisor of B a little above, where there is one: no padded examples
    hi = per_split * 3 // 2 if max_per_split is None else min(per_split * 3 // 2, max_per_split)
    per_split = next((d for d in range(per_split, hi + 1) if B % d == 0), per_split)
    return -(-B // per_split), per_split, bc, bf, bt  # no split of padding alone


def _kernel(x_ref, d_ref, *o_refs, terms, B, per_split, steps, bt, acc):
    """One block of the weight, the examples of one split: ``terms`` per output group,
    a ``phi`` (one output: its sum) or None (centred: the shift, ``S1``, ``S2``)."""
    bc, bf = o_refs[0].shape[-2:]
    P = _pallas()
    base = P.program_id(0) * per_split

    def G(b):
        def step(t, g):
            xs = x_ref[b, 0, P.ds(t * bt, bt), :]  # [bt, bc]
            ds = d_ref[b, 0, P.ds(t * bt, bt), :]  # [bt, bf]
            return g + jax.lax.dot_general(
                xs, ds, (((0,), (0,)), ((), ())), preferred_element_type=acc
            )

        return jax.lax.fori_loop(0, steps, step, jnp.zeros((bc, bf), acc))

    # centred sums against the split's first example (a shift: see tiling.py);
    # padded examples (past the batch) are masked out of them
    shift = G(0) if any(t is None for t in terms) else None

    def example(b, sums):
        g = G(b)
        out = []
        for t, s in zip(terms, sums):
            if t is not None:
                out.append(s + t(g))
            else:
                d = jnp.where(base + b < B, g - shift, jnp.zeros_like(g))
                out.append((s[0] + d, s[1] + d * d))
        return tuple(out)

    zero = jnp.zeros((bc, bf), acc)
    init = tuple(zero if t is not None else (zero, zero) for t in terms)
    sums = jax.lax.fori_loop(0, per_split, example, init)
    refs = iter(o_refs)
    for t, s in zip(terms, sums):
        for v in ((s,) if t is not None else (shift, *s)):
            next(refs)[0, 0] = v


def _pallas():
    from jax.experimental import pallas  # imported on first use: it loads Triton's bindings

    return pallas


def _compiler_params(interpret, n_phis):
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltr

    return pltr.CompilerParams(num_warps=8 if n_phis > 1 else 4, num_stages=2)


def _pallas_sums(x, dy, reductions, interpret):
    """The kernel's values of ``reductions`` (`builtin`) of ``G_b = X_b^T DY_b`` from
    canonical ``x [B, K, N, C]``, ``dy [B, K, N, F]``: ``sum_b phi(G_b)``, or
    `stats.Moments` for a centred one (no derivative rule: see `phi_sums`)."""
    B, K, N, C = x.shape
    F = dy.shape[-1]
    acc = x.dtype
    terms = tuple(None if r == CENTRED else PHIS[r] for r in reductions)
    # one-pass centred sums against one example: at most this many after it
    cap = S.MAX_SHIFT_AMPLIFICATION if None in terms else None
    splits, per_split, bc, bf, bt = blocks(B, K, N, C, F, max_per_split=cap)
    Np = -(-N // bt) * bt
    Cp, Fp = -(-C // bc) * bc, -(-F // bf) * bf
    x = _pad(_pad(_pad(x, 0, splits * per_split), 2, Np), 3, Cp)
    dy = _pad(_pad(_pad(dy, 0, splits * per_split), 2, Np), 3, Fp)
    n_out = sum(1 if t is not None else 3 for t in terms)
    P = _pallas()
    out = P.pallas_call(
        functools.partial(
            _kernel, terms=terms, B=B, per_split=per_split, steps=Np // bt, bt=bt, acc=acc
        ),
        out_shape=[jax.ShapeDtypeStruct((splits, K, Cp, Fp), acc) for _ in range(n_out)],
        grid=(splits, K, Cp // bc, Fp // bf),
        in_specs=[
            P.BlockSpec((per_split, 1, Np, bc), lambda s, k, i, j: (s, k, 0, i)),
            P.BlockSpec((per_split, 1, Np, bf), lambda s, k, i, j: (s, k, 0, j)),
        ],
        out_specs=[
            P.BlockSpec((1, 1, bc, bf), lambda s, k, i, j: (s, k, i, j)) for _ in range(n_out)
        ],
        interpret=interpret,
        compiler_params=_compiler_params(interpret, n_out),
        name="jaxpr_surgery_phi_sums",
    )(x, dy)
    out = iter([o[:, :, :C, :F] for o in out])
    counts = [min(per_split, B - s * per_split) for s in range(splits)]
    vals = []
    for t in terms:
        if t is not None:
            vals.append(jnp.sum(next(out), axis=0))
        else:
            vals.append(_merge_splits(next(out), next(out), next(out), counts))
    return vals


def _merge_splits(shift, s1, s2, counts):
    """`stats.Moments` of the whole batch from each split's sums against its shift
    (``[splits, ...]``; ``counts`` examples each), merged pairwise (Chan et al.)."""
    n = jnp.asarray(counts, shift.dtype).reshape((-1,) + (1,) * (shift.ndim - 1))
    mean, m2 = S.shifted_moments(S.Shifted(shift, s1, s2), n)
    while mean.shape[0] > 1:
        h = mean.shape[0] // 2
        m = S.merge_moments(
            S.Moments(mean[:h], m2[:h]), n[:h], S.Moments(mean[h : 2 * h], m2[h : 2 * h]),
            n[h : 2 * h],
        )
        mean = jnp.concatenate([m.mean, mean[2 * h :]])
        m2 = jnp.concatenate([m.m2, m2[2 * h :]])
        n = jnp.concatenate([n[:h] + n[h : 2 * h], n[2 * h :]])
    return S.Moments(mean[0], m2[0])


def _xla_sums(x, dy, reductions):
    """The same values by XLA, one example at a time, centred sums in two passes (the
    kernel's derivative rule: only programs that differentiate a statistic run it)."""
    B = x.shape[0]
    centred = [r == CENTRED for r in reductions]
    mean = jnp.einsum("bknc,bknf->kcf", x, dy) / B if any(centred) else None

    def one(b, sums):
        g = jax.lax.dot_general(x[b], dy[b], (((1,), (1,)), ((0,), (0,))))
        return [
            s + (jnp.square(g - mean) if c else PHIS[r](g))
            for s, r, c in zip(sums, reductions, centred)
        ]

    zero = jnp.zeros((x.shape[1], x.shape[3], dy.shape[3]), x.dtype)
    sums = jax.lax.fori_loop(0, B, one, [zero for _ in reductions])
    return [S.Moments(mean, v) if c else v for v, c in zip(sums, centred)]


@functools.cache
def check_on_device(interpret: bool = False) -> None:
    """Runs the kernel once on this process's device against a float64 reference, on
    a problem no block divides (padding everywhere, the batch split); raises
    ``RuntimeError`` if they differ. The kernel has been tested in Pallas's
    interpreter and by its Triton lowering, not on every GPU: a miscompilation
    must fail loudly, not give wrong statistics. It runs in a fresh thread, outside
    any trace it is called from."""
    failed = []
    t = threading.Thread(target=_check, args=(interpret, failed), name="jaxpr_surgery-fused-check")
    t.start()
    t.join()
    if failed:
        raise failed[0]


def _check(interpret, failed):
    try:
        r = np.random.default_rng(0)
        B, K, N, C, F = 5, 2, 37, 20, 70
        reductions = (*PHIS, CENTRED)
        x = r.standard_normal((B, K, N, C)).astype(np.float32)
        dy = (r.standard_normal((B, K, N, F)) + 0.5).astype(np.float32)
        run = jax.jit(lambda a, b: _pallas_sums(a, b, reductions, interpret))
        got = jax.tree.map(np.asarray, run(x, dy))
        G = np.einsum("bknc,bknf->bkcf", x.astype(np.float64), dy.astype(np.float64))
        mean = G.mean(0)
        ref = {S.SUM: lambda g: g, S.SQUARE: np.square, S.SIGN: np.sign, S.ABS: np.abs}
        # sign: an example's coordinate within float32 rounding of zero may flip
        near_zero = np.sum(np.abs(G) <= 1e-5 * np.max(np.abs(G)), axis=0)
        for r_, v in zip(reductions, got):
            if r_ == CENTRED:
                pairs = [("mean", v[0], mean), ("m2", v[1], np.sum(np.square(G - mean), 0))]
            else:
                pairs = [(r_.name, v, np.sum(ref[r_](G), axis=0))]
            for name, v_, want in pairs:
                tol = 2.0 * near_zero if r_ is S.SIGN else 1e-4 * float(np.max(np.abs(want)))
                if v_.shape != want.shape or not np.all(np.abs(v_ - want) <= tol):
                    raise RuntimeError(
                        f"{ENV}=pallas: the fused kernel's {name} disagrees with the "
                        f"reference on this device ({jax.devices()[0].device_kind}); its "
                        f"Triton compilation may be wrong here. Unset {ENV} (or set it to "
                        "'xla') to use XLA's tile loop, and please report the device and "
                        "jax version."
                    )
    except Exception as e:  # noqa: BLE001 - re-raised in the calling thread
        failed.append(e)


def phi_sums(x, dy, reductions):
    """The values of ``reductions`` (`builtin`: ``sum_b phi(X_b^T DY_b)``, ``[K, C, F]``,
    or centred `stats.Moments`) from canonical ``x [B, K, N, C]`` and
    ``dy [B, K, N, F]``, by the fused kernel (checked once on the device first,
    `check_on_device`)."""
    reductions = tuple(reductions)
    interpret = mode() == "interpret"
    if not interpret:
        check_on_device()

    @jax.custom_jvp
    def fused(x, dy):
        return _pallas_sums(x, dy, reductions, interpret)

    fused.defjvp(
        lambda primals, tangents: jax.jvp(
            lambda a, b: _xla_sums(a, b, reductions), primals, tangents
        )
    )
    return fused(x, dy)

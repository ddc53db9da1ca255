r"""Poisson batches of a fixed shape, for jit: the batch sampling DP-SGD's accounting assumes.

At every step each of the ``num_examples`` examples is in the batch independently with
probability \(q\). A batch's size is then random (binomial), so every batch is padded to
``max_batch_size`` slots and the padding slots are marked, for
``is_padding_example=``. How one step is drawn, from 96 random bits per example:

* example \(i\) is in the batch when its 64-bit uniform integer \(u_i\) is below
  \(\lfloor q\, 2^{64} \rfloor\) (a probability within \(2^{-64}\) of \(q\), never above
  it: a float32 comparison would be off by up to \(2^{-24}\), a large relative error at
  small \(q\));
* the slots hold the included examples in the order of 31 more random bits (``top_k``):
  a uniformly random order, so truncating to the first ``max_batch_size`` keeps a
  uniformly random subset of the included examples (the truncated Poisson sampling of
  ``dp_accounting.TruncatedSubsampledGaussianDpEvent``; ties of 31-bit priorities, of
  probability below \(k^2 / 2^{32}\) among \(k\) included examples, go to the lower index);
* the remaining slots are padding, holding the index 0 (a valid index, so gathers need no
  mask) and marked True in ``is_padding``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["poisson_batches", "min_max_batch_size", "OVERFLOW_PROBABILITY"]

#: The largest probability, over the whole run, that a Poisson batch holds more than
#: ``max_batch_size`` examples that `poisson_batches` accepts without ``truncate=True``.
OVERFLOW_PROBABILITY = 1e-9

_OWNER = "poisson_batches"


def _static_int(x, what, minimum):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(
            f"{_OWNER}({what}=...): expected a Python int (it fixes the shapes, so it is "
            f"static, not traced), got {x!r}.")
    if x < minimum:
        raise ValueError(f"{_OWNER}({what}=...): must be >= {minimum}, got {x}.")
    return int(x)


def _check_q(q):
    if isinstance(q, bool) or not isinstance(q, (int, float, np.integer, np.floating)):
        raise TypeError(f"{_OWNER}(sampling_probability=...): expected a Python float (static), "
                        f"got {q!r}.")
    q = float(q)
    if not 0 <= q <= 1:  # also NaN
        raise ValueError(f"{_OWNER}(sampling_probability=...): must be in [0, 1], got {q!r}.")
    return q


def _overflow_probability(n, q, k, steps):
    """P(some of ``steps`` Binomial(n, q) batch sizes exceeds ``k``), an upper bound."""
    if k >= n or q == 0:
        return 0.0
    from scipy.stats import binom  # (scipy: a dependency of jax)

    per_step = float(binom.sf(k, n, q))
    return min(1.0, steps * per_step)


def min_max_batch_size(*, num_examples: int, sampling_probability: float, steps: int) -> int:
    r"""The smallest ``max_batch_size`` that `poisson_batches` accepts without truncation:
    the probability that any of the ``steps`` Poisson batches holds more examples is at
    most ``OVERFLOW_PROBABILITY`` (\(10^{-9}\)).

    About the expected batch size \(qn\) plus 6 to 8 standard deviations
    \(\sqrt{nq(1-q)}\), depending on ``steps``.

    Examples:
      >>> import jaxpr_surgery as js
      >>> js.privacy.min_max_batch_size(num_examples=60_000, sampling_probability=256 / 60_000,
      ...                               steps=1_000)
      376
    """
    n = _static_int(num_examples, "num_examples", 1)
    q = _check_q(sampling_probability)
    steps = _static_int(steps, "steps", 1)
    if q == 0:
        return 1
    mean, sd = n * q, math.sqrt(n * q * (1 - q))
    lo, hi = max(0, int(mean) - 1), min(n, int(mean + 20 * sd) + 2)
    while lo < hi:  # the smallest k with overflow probability <= the tolerance
        mid = (lo + hi) // 2
        if _overflow_probability(n, q, mid, steps) <= OVERFLOW_PROBABILITY:
            hi = mid
        else:
            lo = mid + 1
    return max(1, hi)


def poisson_batches(
    key,
    *,
    num_examples: int,
    sampling_probability: float,
    max_batch_size: int,
    steps: int,
    truncate: bool = False,
):
    r"""Poisson-sampled batches of ``max_batch_size`` slots, padding marked.

    At each of the ``steps`` steps, every example ``0 .. num_examples - 1`` is in the batch
    independently with probability \(q\) = ``sampling_probability``, at most once; the
    batch's examples fill its first slots in a random order, and the other slots are
    padding (index 0, ``is_padding`` True). Pass ``is_padding`` as ``is_padding_example=``
    to the statistics' function (or `clipped_grad`): padded examples are removed exactly.
    Reproducible from ``key``; jittable (``key`` may be traced, the other arguments are
    static).

    **The size rule.** A Poisson batch holds \(\mathrm{Binomial}(n, q)\) examples, which is
    unbounded by any fixed size short of \(n\). Dropping the overflow silently would void
    the Poisson guarantee that the accounting assumes, so without ``truncate`` this
    raises unless the probability that any of the ``steps`` batches overflows is at most
    ``OVERFLOW_PROBABILITY`` (\(10^{-9}\); `min_max_batch_size` gives the smallest size
    accepted, about \(qn\) plus 6 to 8 standard deviations). Within it, the batches are
    Poisson batches except with that probability, which adds at most
    \((1 + e^\varepsilon) 10^{-9}\) to \(\delta\). With ``truncate=True`` any size is
    accepted: a batch of more examples keeps a uniformly random subset of
    ``max_batch_size`` of them, the number dropped is returned, and the accounting must
    know it: `epsilon` with ``truncated_batch_size=max_batch_size, num_examples=...``
    (truncated Poisson sampling, ``dp_accounting.TruncatedSubsampledGaussianDpEvent``).

    Args:
      key: a PRNG key.
      num_examples: the dataset size \(n\).
      sampling_probability: \(q \in [0, 1]\) (expected batch size / ``num_examples``).
      max_batch_size: the slots per batch.
      steps: the number of batches.
      truncate: accept a ``max_batch_size`` below the size rule, truncating.

    Returns:
      ``(indices, is_padding)``: an int32 ``[steps, max_batch_size]`` array of example
      indices and a bool one, True at padding slots. With ``truncate=True`` a third value,
      ``num_dropped``: int32 ``[steps]``, the examples sampled but dropped at each step.

    Raises:
      ValueError: ``max_batch_size`` below the size rule without ``truncate=True`` (the
        message gives the smallest size accepted), or bad arguments.

    Examples:
      >>> import jax, jaxpr_surgery as js
      >>> idx, pad = js.privacy.poisson_batches(
      ...     jax.random.key(0), num_examples=1_000, sampling_probability=0.02,
      ...     max_batch_size=64, steps=3)
      >>> idx.shape, pad.shape
      ((3, 64), (3, 64))
      >>> bool((idx[pad] == 0).all())
      True
    """
    n = _static_int(num_examples, "num_examples", 1)
    q = _check_q(sampling_probability)
    k = _static_int(max_batch_size, "max_batch_size", 1)
    steps = _static_int(steps, "steps", 1)
    if not isinstance(truncate, bool):
        raise TypeError(f"{_OWNER}(truncate=...): expected a bool, got {truncate!r}.")
    if not truncate:
        p = _overflow_probability(n, q, k, steps)
        if p > OVERFLOW_PROBABILITY:
            need = min_max_batch_size(num_examples=n, sampling_probability=q, steps=steps)
            mean, sd = n * q, math.sqrt(n * q * (1 - q))
            raise ValueError(
                f"{_OWNER}(max_batch_size={k}): too small for Poisson batches of "
                f"{mean:.1f} +- {sd:.1f} examples: over {steps} steps some batch holds more "
                f"than {k} examples with probability {p:.2g}, and dropping them would void "
                "the Poisson sampling that the privacy accounting assumes. Use "
                f"max_batch_size >= {need} (overflow probability <= {OVERFLOW_PROBABILITY:g}), "
                "or truncate=True: batches are then truncated to max_batch_size (the number "
                "dropped is returned) and epsilon(..., truncated_batch_size=max_batch_size, "
                "num_examples=...) accounts for it.")
    q_fixed = int(Fraction(q) * 2**64)  # floor(q 2^64): P(include) <= q, within 2^-64
    out = _sample(key, n, q_fixed, k, steps)
    if truncate:
        return out
    return out[0], out[1]


def _sample(key, n, q_fixed, k, steps):
    keys = jax.random.split(key, steps)
    return jax.lax.map(lambda kk: _one_step(kk, n, q_fixed, k), keys)


def _one_step(key, n, q_fixed, k):
    bits = jax.random.bits(key, (3, n), jnp.uint32)
    hi, lo, order = bits[0], bits[1], bits[2]
    if q_fixed >= 2**64:  # q = 1
        included = jnp.ones((n,), bool)
    else:
        t_hi = jnp.uint32(q_fixed >> 32)
        t_lo = jnp.uint32(q_fixed & 0xFFFFFFFF)
        included = (hi < t_hi) | ((hi == t_hi) & (lo < t_lo))
    top = jnp.uint32(0x80000000)
    priority = jnp.where(included, (order >> 1) | top, order >> 1)
    _, idx = jax.lax.top_k(priority, min(k, n))
    idx = idx.astype(jnp.int32)
    padding = ~included[idx]
    if k > n:
        idx = jnp.concatenate([idx, jnp.zeros((k - n,), jnp.int32)])
        padding = jnp.concatenate([padding, jnp.ones((k - n,), bool)])
    idx = jnp.where(padding, 0, idx)
    dropped = jnp.maximum(jnp.sum(included, dtype=jnp.int32) - k, 0)
    return idx, padding, dropped

"""Statistics a call inside an untyped mapped body cannot give: ``shard_map`` with
``check_vma=False``, or ``jax.pmap``, where no type says which values differ between
devices.

Inside a typed ``shard_map`` a parameter's type names the mesh axes it is split over:
the engine adds the shards' parts of a tensor-parallel leaf's per-example norms
(`Reduction.combine_shards`), and a DP step draws each shard of a weight its own noise
(``optim/dp.py``). Untyped, every leaf looks replicated. Elementwise statistics are
still each shard's own, and exact; but

* a loss with a collective over a mesh axis the examples are not split on (a ``psum``
  of a row-parallel layer over ``'model'``) may hold leaves split over that axis, whose
  per-example norms, clipping, inner products and Kronecker factors would count only
  each device's part;
* a clipped sum of a leaf gathered over the examples' axis (hand-written FSDP,
  gathers.py) comes back as the device's shard, which a DP step would noise with the
  same draw on every shard: the difference of two shards' updates would carry no
  noise.

Both are refused at trace time (`check`), naming the axis and the fix.
"""

from __future__ import annotations

from jaxpr_surgery._src import compat, devices, walker
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.weighting import unweighted


def of_whole_gradient(r) -> bool:
    """Whether reduction ``r``'s value for a leaf reads each example's whole gradient of
    it, not each element alone: norms, clipped sums (their clip factors), inner products,
    Kronecker factors."""
    inner = unweighted(r)
    return not isinstance(inner, S.ElementwiseReduction) or isinstance(inner, S.ClippedSum)


def model_axes(jaxpr, batch_axes) -> frozenset:
    """The named mesh axes a collective in ``jaxpr`` (or in a jaxpr inside it)
    communicates over, other than ``batch_axes``; not those inside a ``shard_map`` of
    the loss's own (its body is typed by its own ``check_vma``, over the axes it binds)."""
    eqns = walker.equations(jaxpr, lambda e: walker.nest_of(e) is not walker.Nest.SHARD_MAP)
    used = frozenset().union(*(compat.collective_axes(e) for e in eqns))
    return used - frozenset(batch_axes)


def check(jaxpr, reductions, gathered, batch_axes, paths, name):
    """Raises `NotImplementedError` for a call traced in an untyped body
    (`compat.vma_checked` False) whose ``reductions`` need what only types tell (module
    docstring). ``gathered``: the indices of the leaves gathered over the examples' axes
    (`gathers.lift`); ``batch_axes``: the axes the examples are split over."""
    whole = [r for r in reductions if of_whole_gradient(r)]
    if not whole or compat.vma_checked():
        return
    what = unweighted(whole[0]).describe()
    fix = ("Run it under shard_map with check_vma=True (the default), whose types say "
           "which parameters are split; elementwise statistics (mean, sum, moments, "
           "variance, sign_mean) are served untyped, each device's as jax.grad's "
           "gradients are there.")
    bound = compat.bound_axis_names()
    if bound is not None:  # (the package's own split of a batch sharded by XLA names none)
        bound = bound - {devices.AXIS}
    # (no named axis bound: no collective of fn can name one but inside a shard_map of
    # its own, which `model_axes` does not count; the walk is skipped, as on one device)
    axes = model_axes(jaxpr, batch_axes) if bound is None or bound else frozenset()
    if axes:
        ax = ", ".join(repr(a) for a in sorted(axes, key=str))
        raise NotImplementedError(
            f"{name}: {what} (of each example's whole gradient) inside shard_map with "
            "check_vma=False (or jax.pmap): fn "
            f"communicates over mesh axis {ax}, which the examples are not split on (not "
            "in axis_name), so parameters may be split over it (tensor parallelism), and "
            "without check_vma JAX does not type which are: their per-example norms (and "
            "clipping, inner products, Kronecker factors) would count only each device's "
            f"part of the gradient. {fix}")
    clipped = [r for r in whole if isinstance(unweighted(r), S.ClippedSum)]
    if clipped and gathered:
        leaves = ", ".join(paths[i] for i in sorted(gathered))
        raise NotImplementedError(
            f"{name}: {unweighted(clipped[0]).describe()} of parameter leaf/leaves "
            f"{leaves}, gathered over the examples' mesh axes (hand-written FSDP), inside "
            "shard_map with check_vma=False (or jax.pmap): each device gets its shard of "
            "the clipped sum, and without check_vma no type says it is a shard, so a DP "
            "step would add the same noise to every shard (the difference of two shards' "
            f"updates would carry none). {fix}")

"""A ``shard_map`` inside the loss (tensor parallelism written by hand in an otherwise
unsharded model): the independence proof enters its body (issue 60: one walker, shard_map
handled once). Blocks that keep the batch axis whole on every device, with typed bodies
(``check_vma``), are proved per-example: no warning, and every statistic equals the
vmap(grad) oracle (the leaf used inside falls back to exact per-example gradients).
What the proof does not follow stays undecided (a warning, as before), and examples
mixed inside the body are refused. One device suffices: a mesh of one device still
records the in_specs and the collectives.
"""

from __future__ import annotations

import contextlib
import warnings

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js

B, D, H, C = 6, 4, 8, 3


def _mesh():
    return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def _params(dtype):
    r = np.random.default_rng(0)
    return {"w1": jnp.asarray(r.normal(size=(D, H)), dtype),
            "w2": jnp.asarray(r.normal(size=(H, C)) / 3, dtype)}


def _batch(dtype):
    r = np.random.default_rng(1)
    return {"x": jnp.asarray(r.normal(size=(B, D)), dtype),
            "y": jnp.asarray(r.normal(size=(B, C)), dtype)}


ROW_PARALLEL = (P(None, "x"), P("x", None))  # (h's features, w2's rows over 'x')


def _loss(body, in_specs=ROW_PARALLEL, out_specs=None, check_vma=True):
    mesh, out_specs = _mesh(), P() if out_specs is None else out_specs

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"])
        f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                          check_vma=check_vma)
        return jnp.mean((f(h, p["w2"]) - b["y"]) ** 2)

    return loss


def _row_parallel(h, w):  # (each device's features, then the sum of the parts)
    return jax.lax.psum(h @ w, "x")


def _stats(loss, p, b, **kw):
    req = {"mean": js.stats.mean(), "second_moment": js.stats.second_moment(),
           "variance": js.stats.variance(), "sq_norms": js.stats.sq_norms()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", js.CrossExampleWarning)
        return js.per_example_stat(loss, req, **kw)(p, b)


def _oracle(loss, p, b):
    g = M.per_example_grads(loss, p, b)
    g = {k: np.asarray(v, np.float64) for k, v in g.items()}
    return {"mean": {k: v.mean(0) for k, v in g.items()},
            "second_moment": {k: (v ** 2).mean(0) for k, v in g.items()},
            "variance": {k: v.var(0, ddof=1) for k, v in g.items()},
            "sq_norms": sum((v.reshape(B, -1) ** 2).sum(1) for v in g.values())}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_tensor_parallel_block_is_proved_and_exact(dtype):
    """A row-parallel dense layer by hand (features split over 'x', a psum of the parts):
    no CrossExampleWarning (it warned: "shard_map has no rule here"), and the statistics
    equal the oracle's."""
    with M.x64() if dtype == "float64" else contextlib.nullcontext():
        dt = jnp.dtype(dtype)
        p, b = _params(dt), _batch(dt)
        loss = _loss(_row_parallel)
        got, want = _stats(loss, p, b), _oracle(loss, p, b)
        tol = 1e-10 if dtype == "float64" else 2e-5
        for k in want:
            M.assert_tree_close(got[k], want[k], rtol=tol, atol=tol, err_msg=k)


def test_examples_mixed_inside_the_block_are_refused():
    """The body centres each feature over the batch (batch norm written inside the
    shard_map): the examples interact, and the proof, inside the body, says so."""
    def centred(h, w):
        h = h - jnp.mean(h, axis=0, keepdims=True)
        return jax.lax.psum(h @ w, "x")

    loss = _loss(centred)
    with pytest.raises(js.CrossExampleError, match="per-example"):
        js.per_example_stat(loss, js.stats.mean())(_params(jnp.float32), _batch(jnp.float32))


@pytest.mark.parametrize("case", ["batch_split_in", "batch_split_out", "untyped"])
def test_what_the_proof_does_not_follow_stays_undecided(case):
    """Undecided, a warning naming the reason, where the body splits the examples over
    a mesh axis (in_specs), assembles an output along its batch axis (out_specs), or is
    untyped (check_vma=False: nothing says what a psum over 'x' adds up)."""
    if case == "batch_split_in":
        loss = _loss(lambda h, w: h @ w, in_specs=(P("x", None), P()), out_specs=P("x"))
        why = "splits the examples"
    elif case == "batch_split_out":
        loss = _loss(lambda h, w: h @ w, in_specs=(P(), P()), out_specs=P("x"))
        why = "assembles a shard_map's output along its batch axis"
    else:
        loss = _loss(_row_parallel, check_vma=False)
        why = "which the call does not know"
    with pytest.warns(js.CrossExampleWarning, match=why):
        js.per_example_stat(loss, js.stats.mean())(_params(jnp.float32), _batch(jnp.float32))



def test_megatron_mlp_block_is_proved_and_exact():
    """Megatron's MLP by hand: the first weight's columns and the second's rows over
    'x', one psum of the parts (both weights inside the body): proved and exact."""
    mesh = _mesh()

    def mlp(h, w1, w2):
        return jax.lax.psum(jnp.tanh(h @ w1) @ w2, "x")

    def loss(p, b):
        f = jax.shard_map(mlp, mesh=mesh, in_specs=(P(), P(None, "x"), P("x", None)),
                          out_specs=P())
        return jnp.mean((f(b["x"], p["w1"], p["w2"]) - b["y"]) ** 2)

    with M.x64():
        p, b = _params(jnp.float64), _batch(jnp.float64)
        got, want = _stats(loss, p, b), _oracle(loss, p, b)
        for k in want:
            M.assert_tree_close(got[k], want[k], rtol=1e-10, atol=1e-10, err_msg=k)


@pytest.mark.parametrize("case", ["along_batch", "untyped"])
def test_gathers_the_proof_does_not_follow_stay_undecided(case):
    """An all_gather in the body along the batch axis (each device's copy of every
    example side by side), or in an untyped body (nothing says what its axis holds):
    undecided, a warning naming the gather."""
    if case == "along_batch":
        loss = _loss(lambda h, w: jax.lax.all_gather(h @ w, "x", axis=0, tiled=True),
                     in_specs=(P(), P()), out_specs=P("x"))
        why = "gathers the devices' blocks along the batch axis"
    else:
        loss = _loss(lambda h, w: jax.lax.all_gather(h @ w, "x", axis=1, tiled=True),
                     in_specs=(P(), P(None, "x")), check_vma=False)
        why = "gathers over a mesh axis the call does not know"
    with pytest.warns(js.CrossExampleWarning, match=why):
        js.per_example_stat(loss, js.stats.mean())(_params(jnp.float32), _batch(jnp.float32))


def test_gathering_other_devices_examples_is_refused():
    """With the batch split over 'd' (axis_name='d'), a loss that all-gathers every
    device's examples (contrastive negatives from the whole global batch) makes the
    examples interact: refused at trace time, naming the gather."""
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def loss(p, b):
        z = jnp.tanh(b["x"] @ p["w1"])
        every = jax.lax.all_gather(z, "d", axis=0, tiled=True)
        return jnp.mean(jax.nn.logsumexp(z @ every.T, axis=1))

    f = jax.shard_map(js.per_example_stat(loss, js.stats.mean(), axis_name="d"), mesh=mesh,
                      in_specs=(P(), P("d")), out_specs=P())
    with pytest.raises(js.CrossExampleError, match="gathers across the devices"):
        f(_params(jnp.float32), _batch(jnp.float32))


def test_reduce_scattered_block_is_proved_and_exact():
    """A row-parallel layer that reduce-scatters its output over the features (as
    sequence parallelism does over the tokens): the devices' parts of the same examples
    added up, each keeping its block; proved and exact."""
    with M.x64():
        p, b = _params(jnp.float64), _batch(jnp.float64)
        loss = _loss(lambda h, w: jax.lax.psum_scatter(h @ w, "x", scatter_dimension=1,
                                                       tiled=True),
                     out_specs=P(None, "x"))
        got, want = _stats(loss, p, b), _oracle(loss, p, b)
        for k in want:
            M.assert_tree_close(got[k], want[k], rtol=1e-10, atol=1e-10, err_msg=k)


def test_reduce_scatter_of_the_batch_or_over_its_axis():
    """psum_scatter along the batch axis (each device keeps other examples): undecided;
    over the axis the batch is split over (axis_name): other devices' examples added
    up, refused."""
    loss = _loss(lambda h, w: jax.lax.psum_scatter(h @ w, "x", scatter_dimension=0,
                                                   tiled=True), out_specs=P("x"))
    with pytest.warns(js.CrossExampleWarning, match="reduce-scatters the devices' blocks"):
        js.per_example_stat(loss, js.stats.mean())(_params(jnp.float32), _batch(jnp.float32))
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def summed(p, b):
        z = jax.lax.psum_scatter(jnp.tanh(b["x"] @ p["w1"]), "d", scatter_dimension=1,
                                 tiled=True)
        return jnp.mean(z ** 2)

    f = jax.shard_map(js.per_example_stat(summed, js.stats.mean(), axis_name="d"), mesh=mesh,
                      in_specs=(P(), P("d")), out_specs=P())
    with pytest.raises(js.CrossExampleError, match="reduce-scatters across the devices"):
        f(_params(jnp.float32), _batch(jnp.float32))

"""The fused Pallas kernel of the tile loop (fused.py), on CPU.

CI has no GPU, so the kernel's numerics are checked under Pallas's interpreter
(``JAXPR_SURGERY_TILE_KERNEL=interpret``) against the vmap(grad) oracle on the
token models of the zoo, in float64 and float32, whole and in chunks (the
carried sums), under jax.grad and jax.vmap; its blocks against numpy on shapes
no block divides; and its Triton lowering for an H100 is produced on this
machine (cross-platform lowering), so a kernel Triton's lowering rejects fails
here rather than on a user's GPU.
"""

from __future__ import annotations

import contextlib

import conftest as C
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js
from jaxpr_surgery._src import fused
from jaxpr_surgery._src import stats as S

pytestmark = pytest.mark.slow

CASES = ["transformer", "transformer_rms_swiglu", "transformer_scan_remat"]
# fused: sums of built-in phi; the rest ride the XLA tile loop beside the kernel
STAT_IDS = ["mean", "second_moment", "sign_mean", "abs_mean", "variance", "elementwise_pow4"]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The fused kernel interpreted; returns the list of reductions of each call."""
    monkeypatch.setenv(fused.ENV, "interpret")
    calls = []
    inner = fused._pallas_sums

    def spy(x, dy, reductions, interpret):
        calls.append(tuple(getattr(r, "name", "centred") for r in reductions))
        return inner(x, dy, reductions, interpret)

    monkeypatch.setattr(fused, "_pallas_sums", spy)
    return calls


# each case and each dtype, pairwise (interpreting the kernel is slow): the kernel's
# arithmetic does not depend on the model, its blocks do
@pytest.mark.parametrize("case_name,dtype", [
    ("transformer", jnp.float64), ("transformer", jnp.float32),
    ("transformer_rms_swiglu", jnp.float32), ("transformer_scan_remat", jnp.float64),
], ids=["transformer-f64", "transformer-f32", "transformer_rms_swiglu-f32",
        "transformer_scan_remat-f64"])
def test_interpreted_kernel_matches_oracle(case_name, dtype, kernel_calls):
    ref = C.reference(case_name)
    case = zoo.get_case(case_name, dtype)
    out = C.run_stat(case, {sid: ref.stat(sid) for sid in STAT_IDS}, chunk_size=None)
    assert kernel_calls, "the fused kernel was not used"
    assert all(set(c) <= {"square", "sign", "abs", "identity", "centred"} for c in kernel_calls)
    assert any("centred" in c for c in kernel_calls)  # the variance
    for sid in STAT_IDS:
        C.check_against_reference(out[sid], case_name, sid, dtype)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case_name", CASES)
def test_compiled_kernel_on_gpu_matches_oracle(case_name, dtype, monkeypatch):
    """On a GPU: the Triton-compiled kernel (``pallas``), its device check included."""
    monkeypatch.setenv(fused.ENV, "pallas")
    ref = C.reference(case_name)
    case = zoo.get_case(case_name, dtype)
    out = C.run_stat(case, {sid: ref.stat(sid) for sid in STAT_IDS}, chunk_size=None)
    for sid in STAT_IDS:
        C.check_against_reference(out[sid], case_name, sid, dtype)


@pytest.mark.parametrize(
    "stat_ids", [("second_moment",), ("sign_mean",), ("mean", "abs_mean", "variance")]
)
def test_interpreted_kernel_in_chunks_matches_oracle(stat_ids, kernel_calls):
    """Chunks continue the running sums (the kernel's sums are added to them)."""
    case_name, dtype = "transformer", jnp.float64
    ref = C.reference(case_name)
    case = zoo.get_case(case_name, dtype)
    B = jax.tree.leaves(case.batch)[0].shape[0]
    out = C.run_stat(case, {s: ref.stat(s) for s in stat_ids}, chunk_size=B // 2 + 1)
    assert kernel_calls
    for sid in stat_ids:
        C.check_against_reference(out[sid], case_name, sid, dtype)


def _np_sums(x, dy):
    G = np.einsum("bknc,bknf->bkcf", x, dy)
    mean = G.mean(0)
    return [G.sum(0), np.square(G).sum(0), np.sign(G).sum(0), np.abs(G).sum(0),
            (mean, np.square(G - mean).sum(0))]


REDS = [S.SUM, S.SQUARE, S.SIGN, S.ABS, S.Centered()]


@pytest.mark.parametrize(
    "shape",
    [
        (7, 3, 37, 20, 70),  # nothing divides: tokens, features and splits padded
        (1, 1, 2, 1, 1),  # B = 1, one feature each
        (5, 1, 16, 128, 64),  # whole blocks
    ],
)
def test_kernel_blocks_with_remainders(shape, monkeypatch):
    monkeypatch.setenv(fused.ENV, "interpret")
    B, K, N, Cd, F = shape
    r = np.random.default_rng(0)
    x = r.standard_normal((B, K, N, Cd))
    dy = r.standard_normal((B, K, N, F)) + 0.3  # an offset: sums do not cancel to zero
    with zoo.x64():
        got = fused.phi_sums(jnp.asarray(x), jnp.asarray(dy), REDS)
    for g, e, r_ in zip(got, _np_sums(x, dy), REDS):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(e)):
            assert a.shape == (K, Cd, F) and a.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-12, atol=1e-12, err_msg=str(r_))


def test_kernel_splits_the_batch_when_blocks_are_few(monkeypatch):
    """A small weight is a few blocks: the batch is split across programs, each
    split's sums added afterwards; a divisor of the batch is preferred, else the
    last split is padded."""
    assert fused.blocks(B=11, K=1, N=8, C=16, F=16)[:2] == (11, 1)
    monkeypatch.setattr(fused, "MIN_PROGRAMS", 3)
    assert fused.blocks(B=10, K=1, N=8, C=16, F=16)[:2] == (2, 5)  # a divisor
    assert fused.blocks(B=11, K=1, N=8, C=16, F=16)[:2] == (3, 4)  # 12: one padded
    test_kernel_blocks_with_remainders((11, 1, 8, 16, 16), monkeypatch)


@pytest.mark.parametrize("B", [100, 33])
def test_kernel_centred_sums_keep_the_shift_bound(B, monkeypatch):
    """float32 variance where the mean dwarfs the spread (E[g^2] - E[g]^2 loses every
    digit): shares of at most 32 examples against their first keep it, merged exactly."""
    monkeypatch.setenv(fused.ENV, "interpret")
    K, N, Cd, F = 1, 4, 16, 16
    r = np.random.default_rng(1)
    x = (1 + 1e-3 * r.standard_normal((B, K, N, Cd))).astype(np.float32)
    dy = (1 + 1e-3 * r.standard_normal((B, K, N, F))).astype(np.float32)
    assert fused.blocks(B, K, N, Cd, F, max_per_split=32)[1] <= 32
    m = fused.phi_sums(jnp.asarray(x), jnp.asarray(dy), [S.Centered()])[0]
    G = np.einsum("bknc,bknf->bkcf", x.astype(np.float64), dy.astype(np.float64))
    want = np.square(G - G.mean(0)).sum(0)
    G32 = G.astype(np.float32)
    naive = np.square(G32).sum(0) - np.square(G32.sum(0)) / B
    assert np.max(np.abs(naive - want) / want) > 1e-2  # the naive form fails here
    np.testing.assert_allclose(np.asarray(m.m2), want, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(m.mean), G.mean(0), rtol=1e-6)


def test_grad_and_vmap_through_the_kernel(kernel_calls):
    """Derivatives of a fused statistic come from the XLA form (a custom JVP); vmap
    batches the kernel."""
    case = zoo.get_case("transformer", jnp.float64)
    stat = js.stats.second_moment()

    def total(params):
        out = js.per_example_stat(case.loss_fn, stat)(params, case.batch)
        return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(out))

    with zoo.x64():
        g_fused = jax.jit(jax.grad(total))(case.params)
        ens = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), case.params)
        v_fused = jax.jit(jax.vmap(js.per_example_stat(case.loss_fn, stat), (0, None)))(
            ens, case.batch
        )
    assert kernel_calls
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fused.ENV, "xla")
        with zoo.x64():
            g_xla = jax.jit(jax.grad(total))(case.params)
            v_xla = jax.jit(jax.vmap(js.per_example_stat(case.loss_fn, stat), (0, None)))(
                ens, case.batch
            )
    for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_xla)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
    for a, b in zip(jax.tree.leaves(v_fused), jax.tree.leaves(v_xla)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


def test_explain_names_the_kernel(monkeypatch):
    case = zoo.get_case("transformer", jnp.float32)
    stat = (js.stats.second_moment(), js.stats.elementwise(lambda g: g**4, name="p4"))
    monkeypatch.setenv(fused.ENV, "interpret")
    rep = str(js.explain(case.loss_fn, stat)(case.params, case.batch))
    assert "fused per-example products (Pallas kernel)" in rep
    # a user's phi keeps XLA's tile loop
    assert "elementwise(p4): streamed (tiled per-example products" in rep
    monkeypatch.setenv(fused.ENV, "xla")
    assert "Pallas" not in str(js.explain(case.loss_fn, stat)(case.params, case.batch))


def test_pallas_mode_off_gpu_keeps_the_xla_loop(monkeypatch, kernel_calls):
    monkeypatch.setenv(fused.ENV, "pallas")
    assert jax.default_backend() != "gpu"
    case = zoo.get_case("transformer", jnp.float32)
    C.run_stat(case, js.stats.second_moment())
    assert not kernel_calls
    assert not fused.applies([S.SQUARE], jnp.float32, ())


def test_unknown_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(fused.ENV, "triton")
    case = zoo.get_case("transformer", jnp.float32)
    with pytest.raises(ValueError, match="JAXPR_SURGERY_TILE_KERNEL='triton'.*'xla'"):
        C.run_stat(case, js.stats.second_moment())


def test_not_fused_where_it_does_not_apply(monkeypatch):
    monkeypatch.setenv(fused.ENV, "interpret")
    assert fused.applies([S.SQUARE, S.SIGN, S.Centered()], jnp.float32, ())
    assert not fused.applies([S.SQUARE, S.SqNorms()], jnp.float32, ())
    assert not fused.applies([S.SQUARE], jnp.bfloat16, ())
    user = S.PhiSum(jnp.square, multiplicative=True, name="square")  # not the built-in
    assert not fused.applies([user], jnp.float32, ())


def _lower_for_h100(f, *args):
    """``f`` lowered for CUDA on this machine, or skip where this jax cannot."""
    low = jax.jit(f).trace(*args)
    try:
        return low.lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:  # newer jax: name the GPU it is lowered for
        if "AbstractDevice" not in str(e):
            raise
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    dev = AbstractDevice("NVIDIA H100 80GB HBM3", None, "cuda")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((32, 1, 32, 256, 1024), jnp.float32),  # the short model's MLP
        ((8, 4, 256, 64, 256), jnp.float32),  # per-head weights, long sequences
        ((3, 2, 37, 20, 70), jnp.float32),  # padded everywhere
        ((4, 1, 40, 48, 24), jnp.float64),
    ],
)
def test_triton_lowering_for_h100(shape, dtype):
    pytest.importorskip("jax.experimental.pallas.triton")
    B, K, N, Cd, F = shape
    with zoo.x64() if dtype == jnp.float64 else contextlib.nullcontext():
        x = jax.ShapeDtypeStruct((B, K, N, Cd), dtype)
        dy = jax.ShapeDtypeStruct((B, K, N, F), dtype)
        text = _lower_for_h100(lambda a, b: fused._pallas_sums(a, b, tuple(REDS), False), x, dy)
    assert "triton" in text.lower()


def test_device_check_passes_and_catches_a_wrong_kernel(monkeypatch):
    """`check_on_device` (run once before the kernel's first use on a GPU) accepts the
    kernel and raises, naming the variable, where its sums are off."""
    fused.check_on_device.cache_clear()
    fused.check_on_device(interpret=True)
    inner = fused._pallas_sums

    def off(x, dy, reductions, interpret):
        out = inner(x, dy, reductions, interpret)
        return [o * (1 + 1e-3) if r is S.SQUARE else o for o, r in zip(out, reductions)]

    def flipped(x, dy, reductions, interpret):  # one example's sign lost
        out = inner(x, dy, reductions, interpret)
        return [o - 1.0 if r is S.SIGN else o for o, r in zip(out, reductions)]

    try:
        for wrong, name in [(off, "square"), (flipped, "sign")]:
            monkeypatch.setattr(fused, "_pallas_sums", wrong)
            fused.check_on_device.cache_clear()
            with pytest.raises(RuntimeError, match=f"JAXPR_SURGERY_TILE_KERNEL=pallas.*{name}"):
                fused.check_on_device(interpret=True)
    finally:
        fused.check_on_device.cache_clear()

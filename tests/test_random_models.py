"""Random models against the oracle: many ways of meeting a parameter, crossed with batch
sizes, chunks, tiny tile budgets, example weights and statistics (`_random_models`).

A model is drawn from its seed, so a failure names a model that can be rebuilt and
inspected (``_random_models.make_model(seed)``). Float64 at a tight tolerance; a few in
float32 at a loose one (the ratios, kurtosis and noise scales left out there: their
conditioning, not the package, sets float32's error); and some sharded on 8 devices by
XLA's partitioner (`_random_sharded`, in a subprocess) or split by ``jax.shard_map``.
Two families of blocks: the first (`_random_models.KINDS`), and both with the second
(`_random_models.MORE_KINDS`), whose seeds are their own (a first family's seed keeps
its model); and a third, stacks of transformer layers under ``lax.scan`` among a few
plain blocks (`_random_models.LAYER_KINDS`), whose clipped sums under a device split
recompute the layers' inner values.
"""

from __future__ import annotations

import functools

import _models as M
import jax.numpy as jnp
import pytest
import zoo
from _random_models import KINDS, LAYER_KINDS, MORE_KINDS, check, check_shard_map

pytestmark = pytest.mark.slow

DEFAULT = range(0, 6)
EXTENDED = range(6, 60)


@pytest.mark.parametrize(
    "seed", [*DEFAULT, *(pytest.param(s, marks=pytest.mark.extended) for s in EXTENDED)])
def test_random_model_matches_oracle_float64(seed):
    with zoo.x64():
        bad, desc = check(seed, jnp.float64)
    assert not bad, f"model {seed} ({', '.join(desc)}): " + "; ".join(bad)


@pytest.mark.parametrize(
    "seed", [60, *(pytest.param(s, marks=pytest.mark.extended) for s in range(61, 72))])
def test_random_model_matches_oracle_float32(seed):
    bad, desc = check(seed, jnp.float32)
    assert not bad, f"model {seed} ({', '.join(desc)}): " + "; ".join(bad)


# The second family of blocks (`_random_models.MORE_KINDS`: weights merged, masked,
# normalised, concatenated, indexed by the data, cast to a lower precision, used twice in
# one einsum, behind stop_gradient, custom_jvp, named_call, a remat policy or lax.map;
# jax.nn's attention). The default seeds take a third of its kinds (the default tier's
# time); with the extended ones (1002, 1020, 1024, 1025, 1026, 1042, 1059, 1101 among them)
# every kind.
MORE_DEFAULT = (1005, 1014, 1027, 1105)
MORE_EXTENDED = tuple(s for s in (*range(1000, 1060), 1101) if s not in MORE_DEFAULT)


@pytest.mark.parametrize(
    "seed", [*MORE_DEFAULT, *(pytest.param(s, marks=pytest.mark.extended) for s in MORE_EXTENDED)])
def test_random_model_of_more_kinds_matches_oracle(seed):
    with zoo.x64():
        bad, desc = check(seed, jnp.float64, kinds=KINDS + MORE_KINDS)
    assert not bad, f"model {seed} ({', '.join(desc)}): " + "; ".join(bad)


@pytest.mark.parametrize(
    "seed", [pytest.param(s, marks=pytest.mark.extended) for s in (1024, *range(1060, 1070))])
def test_random_model_of_more_kinds_matches_oracle_float32(seed):
    """(1024 computes a layer in bfloat16, at a tolerance of its rounding)"""
    bad, desc = check(seed, jnp.float32, kinds=KINDS + MORE_KINDS)
    assert not bad, f"model {seed} ({', '.join(desc)}): " + "; ".join(bad)


# The third family: stacks of transformer layers (`_random_models.LAYER_KINDS`).
LAYERS_DEFAULT = (2003, 2011)
LAYERS_EXTENDED = tuple(s for s in range(2000, 2030) if s not in LAYERS_DEFAULT)


@pytest.mark.parametrize(
    "seed", [*LAYERS_DEFAULT,
             *(pytest.param(s, marks=pytest.mark.extended) for s in LAYERS_EXTENDED)])
def test_random_layer_stack_matches_oracle(seed):
    with zoo.x64():
        bad, desc = check(seed, jnp.float64, kinds=LAYER_KINDS)
    assert not bad, f"model {seed} ({', '.join(desc)}): " + "; ".join(bad)


# ("layers<seed>": the third family, each call with a clipped sum; under the device
# split layers53 recomputes the inner values of its layers and the loss's tail: 4
# segments of 10 sites, one stack's inner value read after its scan; the extended ones
# 2 to 5 segments each, tied heads, closed-over stacks)
SHARDED_DEFAULT = ("0", "160029", "layers53")  # (160029: activations constrained)
SHARDED_EXTENDED = (tuple(str(s) for s in range(1, 26))
                    + tuple(f"more{s}" for s in (*MORE_DEFAULT, *range(1070, 1080)))
                    + tuple(f"layers{s}" for s in (46, 50, 54, 58, 64, 71, 72)))


@functools.cache
def _sharded(cases):
    return M.run_cases("_random_sharded.py", cases, timeout=1500)


@pytest.mark.parametrize(
    "seed", [*SHARDED_DEFAULT,
             *(pytest.param(s, marks=pytest.mark.extended) for s in SHARDED_EXTENDED)])
def test_random_sharded_model_matches_oracle(seed):
    """The same random models with their parameters and batch sharded by XLA's
    partitioner on 8 devices (`_random_sharded`: in a subprocess)."""
    r = _sharded(SHARDED_DEFAULT if seed in SHARDED_DEFAULT else SHARDED_EXTENDED)[seed]
    assert "crash" not in r, r.get("crash")
    assert not r["bad"], f"model {seed} ({', '.join(r['desc'])}): " + "; ".join(r["bad"])


# (1, 7, 16: raised a type error from jax before `api.replicated_leaves`)
SHARD_MAP_DEFAULT = (1, 7, 16)


@M.needs_devices
@pytest.mark.parametrize(
    "seed", [*SHARD_MAP_DEFAULT, *(pytest.param(s, marks=pytest.mark.extended)
                                   for s in range(17, 47) if s not in SHARD_MAP_DEFAULT)])
def test_random_model_under_shard_map(seed):
    """The batch split over the devices by ``jax.shard_map`` with ``axis_name``
    (`_random_models.check_shard_map`)."""
    with zoo.x64():
        bad, desc = check_shard_map(seed, M.NDEV)
    assert not bad, f"model {seed} ({', '.join(desc)}): " + "; ".join(bad)


@M.needs_devices
@pytest.mark.parametrize(
    "seed", [pytest.param(s, marks=pytest.mark.extended) for s in (1027, *range(1000, 1020))])
def test_random_model_of_more_kinds_under_shard_map(seed):
    with zoo.x64():
        bad, desc = check_shard_map(seed, M.NDEV, kinds=KINDS + MORE_KINDS)
    assert not bad, f"model {seed} ({', '.join(desc)}): " + "; ".join(bad)


@M.needs_devices
@pytest.mark.parametrize(
    "seed", [pytest.param(s, marks=pytest.mark.extended) for s in range(2030, 2040)])
def test_random_layer_stack_under_shard_map(seed):
    with zoo.x64():
        bad, desc = check_shard_map(seed, M.NDEV, kinds=LAYER_KINDS)
    assert not bad, f"model {seed} ({', '.join(desc)}): " + "; ".join(bad)


def test_fuzz_command_checks_the_seeds_it_is_given(capsys):
    """``python tests/_random_models.py START STOP``: a fuzz run (README, Contributing)."""
    import _random_models as R

    with pytest.raises(SystemExit) as e:
        R.main(["3", "5", "--minutes", "5"])
    assert e.value.code == 0
    assert "2 models from seed 3, 0 with mismatches or crashes" in capsys.readouterr().out

"""Every strategy on every mesh shape against a plain single-device Optax step, and the
report of each against its ZeRO / FSDP formula (docs/design.md section 3)."""

import functools

import chex
import numpy as np
import optax
import pytest
from conftest import ResBlock, ResMLP, assert_same_training, built, mlp_batches, mse_loss, reference_run, zshard_run
from flax import nnx

import zshard
from zshard import Strategy

STRATEGIES = [s.value for s in Strategy]


class BlocksOnly(nnx.Module):
    """All parameters inside block units: the root unit is empty."""

    def __init__(self, d, n, rngs):
        self.blocks = nnx.List([ResBlock(d, rngs=rngs) for _ in range(n)])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def uneven_mlp(seed=0):
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(seed))


@functools.cache
def adamw_reference():
    """Single-device AdamW, 10 steps: computed once for the module (read-only), not per case."""
    return reference_run(uneven_mlp, optax.adamw(1e-3), mse_loss, mlp_batches(10))


@functools.cache
def sgd_reference():
    """Single-device SGD, 3 steps, from seed 1: computed once for the module (read-only)."""
    return reference_run(lambda: uneven_mlp(1), optax.sgd(0.1), mse_loss, mlp_batches(3))


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_matches_single_device(strategy, mesh_shape):
    data = mlp_batches(10)
    want = adamw_reference()
    got = zshard_run(uneven_mlp, optax.adamw(1e-3), zshard.make_mesh(*mesh_shape), strategy, mse_loss, data)
    assert_same_training(got, want)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_sgd_exact_gradient_scale(strategy):
    # SGD is linear in the gradient: a gradient summed twice across replicas shows here,
    # where Adam's scale invariance would hide it.
    data = mlp_batches(3)
    want = sgd_reference()
    got = zshard_run(built(uneven_mlp, 1), optax.sgd(0.1), zshard.make_mesh(2, 4), strategy, mse_loss, data)
    chex.assert_trees_all_close(got.params, want.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage,name", [(0, "NO_SHARD"), (1, "SHARD_OPT"), (2, "SHARD_GRAD_OP"), (3, "FULL_SHARD")])
def test_zero_stage_aliases(stage, name):
    state = zshard.init(built(uneven_mlp), optax.sgd(0.1), zshard.make_mesh(1, 8), zero_stage=stage)
    assert state.plan.strategy is Strategy[name]
    assert Strategy.parse("_hybrid_shard_zero2") is Strategy.HYBRID_SHARD_ZERO2


def test_zero_stage_errors():
    with pytest.raises(ValueError, match="choose 0, 1, 2 or 3"):
        Strategy.parse(zero_stage=4)
    with pytest.raises(ValueError, match="contradicts"):
        Strategy.parse("FULL_SHARD", zero_stage=1)
    with pytest.raises(ValueError, match="NO_SHARD, SHARD_OPT, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2"):
        Strategy.parse("ZERO4")


@pytest.fixture(scope="module")
def reports():
    """Report of every strategy on 1x8 and 2x4 for a 2-block model (root unit empty); the report
    reads the compiled program, so the state is abstract (nothing built or placed). Two blocks, not
    the 8 of before: every check is a ratio or a sum over units, the same per unit (measured with 2: every model-state and
    communication ratio within 1.0005 of 1); the 14 unrolled steps compiled 2.5x
    faster (7.0 -> 2.8 CPU s for 6 of them)."""
    out = {}
    for shape in ((1, 8), (2, 4)):
        for strategy in STRATEGIES:
            state = zshard.init(lambda: BlocksOnly(100, 2, nnx.Rngs(0)), optax.adamw(1e-3), zshard.make_mesh(*shape), strategy=strategy,
                                abstract=True)
            batch = (np.ones((16, 100), np.float32), np.zeros((16, 100), np.float32))
            out[strategy, shape] = zshard.report(zshard.make_train_step(mse_loss), state, batch)
    return out


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_report_matches_formulas(reports, strategy, shape):
    rep = reports[strategy, shape]
    assert 1.0 <= rep.model_state_bytes["ratio"] <= 1.01
    for axis, v in rep.comm_bytes_per_step.items():
        assert abs(v["ratio"] - 1.0) <= 0.01, (axis, v)
    assert rep.per_device_bytes["argument"] >= rep.model_state_bytes["measured"]["total"]


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
def test_full_shard_moves_one_and_a_half_times_ddp(reports, shape):
    total = lambda r: sum(v["measured"] for v in r.comm_bytes_per_step.values())  # noqa: E731
    ratio = total(reports["FULL_SHARD", shape]) / total(reports["NO_SHARD", shape])
    assert abs(ratio - 1.5) <= 0.015
    ratio2 = total(reports["SHARD_GRAD_OP", shape]) / total(reports["NO_SHARD", shape])
    assert abs(ratio2 - 1.0) <= 0.01


def test_hybrid_sends_only_gradient_shards_across_replicas(reports):
    rep = reports["HYBRID_SHARD", (2, 4)]
    R, S = 2, 4
    grad_bytes = 4 * rep.num_params  # G: fp32 gradient of the whole model
    want = 2 * (grad_bytes / S) * (R - 1) / R
    assert abs(rep.comm_bytes_per_step["replica"]["measured"] / want - 1) <= 0.01
    kinds = {(c["kind"], c["axis"]) for c in rep.collectives}
    assert kinds == {("all-gather", "shard"), ("reduce-scatter", "shard"), ("all-reduce", "replica")}


def test_memory_per_strategy_orders_as_zero_paper(reports):
    ms = {s: reports[s, (2, 4)].model_state_bytes["measured"]["total"] for s in STRATEGIES}
    assert ms["NO_SHARD"] > ms["SHARD_OPT"] > ms["SHARD_GRAD_OP"] == ms["FULL_SHARD"]
    assert ms["HYBRID_SHARD"] == ms["HYBRID_SHARD_ZERO2"]
    assert ms["FULL_SHARD"] < ms["HYBRID_SHARD"] < ms["SHARD_OPT"]
    # parameters over shard (as HYBRID_SHARD), Adam moments over the world (as FULL_SHARD)
    assert ms["FULL_SHARD"] < ms["HYBRID_SHARD_OPT"] < ms["HYBRID_SHARD"]


def test_step_refuses_donated_state_and_ragged_batches():
    state = zshard.init(uneven_mlp(), optax.sgd(0.1), zshard.make_mesh(1, 8))
    step = zshard.make_train_step(mse_loss)
    x, y = mlp_batches(1)[0]
    new_state, _ = step(state, (x, y))
    with pytest.raises(ValueError, match="donated"):
        step(state, (x, y))  # the old state's buffers were donated to the first step
    with pytest.raises(ValueError, match="different leading"):
        step(new_state, (x, y[:8]))
    with pytest.raises(ValueError, match="must divide by the 8 devices"):
        step(new_state, (x[:0], y[:0]))

"""Gradient accumulation and global-norm clipping on shards, against the single-device step."""

import chex
import numpy as np
import optax
import pytest
from conftest import ResMLP, mlp_batches, mse_loss, reference_run, zshard_run
from flax import nnx

import zshard
from zshard.report import parse_collectives


def mlp():
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4)), ("NO_SHARD", (2, 4)), ("SHARD_OPT", (2, 4)), ("HYBRID_SHARD_ZERO2", (4, 2))])
def test_accumulated_step_equals_whole_batch_step(strategy, mesh):
    data = mlp_batches(3, batch=32)
    want = reference_run(mlp, optax.sgd(0.1), mse_loss, data)  # one step per whole batch of 32
    state = zshard.init(mlp, optax.sgd(0.1), zshard.make_mesh(*mesh), strategy=strategy)
    step = zshard.make_train_step(mse_loss, grad_accum=4)  # 32 = 8 devices x 4 micro-batches of 1
    for b, loss in zip(data, want.losses):
        state, metrics = step(state, b)
        assert abs(float(metrics["loss"]) - loss) <= 1e-6 * abs(loss)
    got = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    chex.assert_trees_all_close(got, nnx.state(want.model, nnx.Param).to_pure_dict(), rtol=1e-6, atol=1e-6)
    assert int(state.step) == 3  # the optimizer advanced once per step, not per micro-batch


def test_accumulation_all_reduces_across_replica_once_per_step():
    state = zshard.init(mlp, optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    k = 4
    step = zshard.make_train_step(mse_loss, grad_accum=k)
    colls = parse_collectives(step.lower(state, mlp_batches(1, batch=32)[0]).compile().as_text(), state.plan.mesh)
    replica = [c for c in colls if c.axis == "replica" and c.buffer_bytes > 64]
    assert replica and all(c.trips == 1 for c in replica), replica
    shard_bytes = sum(f.shard_size * 4 for u in state.plan.units for f in u.flats)
    assert sum(c.buffer_bytes for c in replica) == shard_bytes  # the accumulated shards, once
    scatters = [c for c in colls if c.kind == "reduce-scatter"]
    assert sum(c.trips for c in scatters) == k * len(state.plan.units)  # one per unit per micro-batch


def test_accumulation_adds_one_gradient_shard_not_a_full_gradient():
    def temp(k):
        state = zshard.init(lambda: ResMLP(64, 256, 64, n_blocks=8, rngs=nnx.Rngs(0)), optax.sgd(0.1), zshard.make_mesh(1, 8))
        step = zshard.make_train_step(mse_loss, grad_accum=k)
        return step.lower(state, mlp_batches(1, batch=32, d_in=64, d_out=64)[0]).compile().memory_analysis().temp_size_in_bytes

    full_grad_bytes = 4 * (8 * (256 * 256 + 256) + 64 * 256 + 256 + 256 * 64 + 64)
    assert temp(4) - temp(1) < full_grad_bytes / 2


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4))])
def test_clip_norm_equals_optax_clip_on_one_device(strategy, mesh):
    data = mlp_batches(4)
    tx_ref = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-3))
    want = reference_run(mlp, tx_ref, mse_loss, data)
    state = zshard.init(mlp, optax.adamw(1e-3), zshard.make_mesh(*mesh), strategy=strategy)
    step = zshard.make_train_step(mse_loss, clip_norm=0.05)
    norms = []
    for b in data:
        state, metrics = step(state, b)
        norms.append(float(metrics["grad_norm"]))
    np.testing.assert_allclose(norms, want.grad_norms, rtol=1e-5)  # the norm before clipping
    assert min(norms) > 0.05  # clipping was active on every step
    got = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    chex.assert_trees_all_close(got, nnx.state(want.model, nnx.Param).to_pure_dict(), rtol=1e-4, atol=1e-6)


def test_bad_accumulation_arguments():
    with pytest.raises(ValueError, match="grad_accum"):
        zshard.make_train_step(mse_loss, grad_accum=0)
    with pytest.raises(ValueError, match="clip_norm"):
        zshard.make_train_step(mse_loss, clip_norm=-1.0)
    state = zshard.init(mlp, optax.sgd(0.1), zshard.make_mesh(1, 8))
    step = zshard.make_train_step(mse_loss, grad_accum=4)
    with pytest.raises(ValueError, match="grad_accum=4 micro-batches; use a global batch that is a multiple of 32"):
        step(state, mlp_batches(1, batch=16)[0])

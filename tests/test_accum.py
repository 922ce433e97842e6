"""Gradient accumulation and global-norm clipping on shards, against the single-device step."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ResMLP, built, mlp_batches, mse_loss, reference_run
from flax import nnx

import zshard
from zshard.report import parse_collectives


def mlp():
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))


@functools.cache
def whole_batch_reference():
    """3 SGD steps on whole batches of 32 on one device, computed once: the cases differ only on the zshard side."""
    return reference_run(mlp, optax.sgd(0.1), mse_loss, mlp_batches(3, batch=32))


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4)), ("NO_SHARD", (2, 4)), ("SHARD_OPT", (2, 4)), ("HYBRID_SHARD_ZERO2", (4, 2))])
def test_accumulated_step_equals_whole_batch_step(strategy, mesh):
    data = mlp_batches(3, batch=32)
    want = whole_batch_reference()  # one step per whole batch of 32
    state = zshard.init(built(mlp), optax.sgd(0.1), zshard.make_mesh(*mesh), strategy=strategy)
    step = zshard.make_train_step(mse_loss, grad_accum=4)  # 32 = 8 devices x 4 micro-batches of 1
    for b, loss in zip(data, want.losses):
        state, metrics = step(state, b)
        assert abs(float(metrics["loss"]) - loss) <= 1e-6 * abs(loss)
    got = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    chex.assert_trees_all_close(got, nnx.state(want.model, nnx.Param).to_pure_dict(), rtol=1e-6, atol=1e-6)
    assert int(state.step) == 3  # the optimizer advanced once per step, not per micro-batch


def test_accumulation_all_reduces_across_replica_once_per_step():
    state = zshard.init(built(mlp), optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    k = 4
    step = zshard.make_train_step(mse_loss, grad_accum=k)
    colls = parse_collectives(step.lower(state, mlp_batches(1, batch=32)[0]).compile().as_text(), state.plan.mesh)
    replica = [c for c in colls if c.axis == "replica" and c.buffer_bytes > 64]
    assert replica and all(c.trips == 1 for c in replica), replica
    shard_bytes = sum(f.shard_size * 4 for u in state.plan.units for f in u.flats)
    assert sum(c.buffer_bytes for c in replica) == shard_bytes  # the accumulated shards, once
    scatters = [c for c in colls if c.kind == "reduce-scatter"]
    params = sum(len(f.slots) for u in state.plan.units for f in u.flats)
    assert sum(c.trips for c in scatters) == k * params  # one per parameter (collectives._gather_all) per micro-batch


def test_accumulation_adds_one_gradient_shard_not_a_full_gradient():
    big = ResMLP(64, 256, 64, n_blocks=8, rngs=nnx.Rngs(0))  # built once, eagerly: not compiled

    def temp(k):
        state = zshard.init(big, optax.sgd(0.1), zshard.make_mesh(1, 8))
        step = zshard.make_train_step(mse_loss, grad_accum=k)
        return step.lower(state, mlp_batches(1, batch=32, d_in=64, d_out=64)[0]).compile().memory_analysis().temp_size_in_bytes

    full_grad_bytes = 4 * (8 * (256 * 256 + 256) + 64 * 256 + 256 + 256 * 64 + 64)
    assert temp(4) - temp(1) < full_grad_bytes / 2


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4))])
def test_clip_norm_equals_optax_clip_on_one_device(strategy, mesh):
    data = mlp_batches(4)
    tx_ref = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-3))
    want = reference_run(mlp, tx_ref, mse_loss, data)
    state = zshard.init(built(mlp), optax.adamw(1e-3), zshard.make_mesh(*mesh), strategy=strategy)
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
    state = zshard.init(built(mlp), optax.sgd(0.1), zshard.make_mesh(1, 8))
    step = zshard.make_train_step(mse_loss, grad_accum=4)
    with pytest.raises(ValueError, match="grad_accum=4 micro-batches; use a global batch that is a multiple of 32"):
        step(state, mlp_batches(1, batch=16)[0])


def masked_sum_count(model, batch):
    """Token-weighted loss: (sum of squared errors over valid rows, number of valid rows)."""
    x, y, mask = batch
    err = jnp.sum(jnp.square(model(x) - y), axis=-1) * mask
    return zshard.TokenMean(jnp.sum(err), jnp.sum(mask))


def masked_mean(model, batch):
    loss = masked_sum_count(model, batch)
    return loss.total / loss.count


@pytest.mark.parametrize("strategy,mesh,k", [("FULL_SHARD", (1, 8), 1), ("HYBRID_SHARD", (2, 4), 2), ("NO_SHARD", (2, 4), 4)])
def test_sum_count_loss_is_the_global_token_mean(strategy, mesh, k):
    rng = np.random.default_rng(3)
    data = []
    for x, y in mlp_batches(3, batch=32):
        mask = (rng.random(32) < 0.3).astype(np.float32)  # uneven: some devices see no valid row
        mask[0] = 1.0
        data.append((x, y, mask))
    want = reference_run(mlp, optax.sgd(0.1), masked_mean, data)
    state = zshard.init(built(mlp), optax.sgd(0.1), zshard.make_mesh(*mesh), strategy=strategy)
    step = zshard.make_train_step(masked_sum_count, grad_accum=k)
    for b, loss in zip(data, want.losses):
        state, metrics = step(state, b)
        assert abs(float(metrics["loss"]) - loss) <= 1e-5 * abs(loss)
        assert float(metrics["tokens"]) == b[2].sum()
    got = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    chex.assert_trees_all_close(got, nnx.state(want.model, nnx.Param).to_pure_dict(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("skip", [True, False])
def test_nan_on_one_device_is_seen_by_all(skip):
    state = zshard.init(built(mlp), optax.adamw(1e-3), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    step = zshard.make_train_step(mse_loss, skip_nonfinite=skip)
    good, bad = mlp_batches(2)
    state, metrics = step(state, good)
    assert int(metrics["nonfinite"]) == 0
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    x, y = bad
    x = x.copy()
    x[5, 3] = np.nan  # row 5 lives on device 2 (2 rows per device): one device only
    state, metrics = step(state, (x, y))
    assert int(metrics["nonfinite"]) == 1
    after = jax.tree.map(np.asarray, (state.params, state.opt_state))
    if skip:  # every device kept its shards, bitwise
        chex.assert_trees_all_equal(after, before)
        state, metrics = step(state, good)
        assert int(metrics["nonfinite"]) == 0 and np.isfinite(float(metrics["loss"]))
    else:  # the update went through with NaN everywhere: all devices agree on it
        assert all(np.isnan(leaf).any() for leaf in jax.tree.leaves(after[0]))


def no_decay_on_vectors(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4)), ("SHARD_OPT", (2, 4))])
def test_optax_masks_and_labels_see_the_logical_tree(strategy, mesh):
    # weight decay only on matrices (p.ndim > 1), and multi_transform labels by path
    def label(params):  # works on zshard's nested dict and on nnx.State alike
        return jax.tree_util.tree_map_with_path(lambda path, _: "frozen_lr" if "head" in str(path[0]) else "main", params)

    def make_tx():
        return optax.multi_transform(
            {"main": optax.adamw(1e-2, weight_decay=0.5, mask=no_decay_on_vectors), "frozen_lr": optax.sgd(0.0)},
            label,
        )

    data = mlp_batches(4)
    want = reference_run(mlp, make_tx(), mse_loss, data)
    state = zshard.init(built(mlp), make_tx(), zshard.make_mesh(*mesh), strategy=strategy)
    head0 = np.asarray(nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()["head"]["kernel"])
    step = zshard.make_train_step(mse_loss)
    for b in data:
        state, _ = step(state, b)
    got = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    ref = nnx.state(want.model, nnx.Param).to_pure_dict()
    np.testing.assert_array_equal(got["head"]["kernel"], head0)  # lr 0: untouched
    # a builder's init runs under jit: on jax 0.12 one element of head.kernel differed from eager init by 1 ulp
    np.testing.assert_allclose(got["head"]["kernel"], ref["head"]["kernel"], rtol=1e-6)
    for path in [("inp", "bias"), ("inp", "kernel"), ("blocks", 0, "lin", "bias"), ("blocks", 1, "lin", "kernel")]:
        a, r = got, ref
        for k in path:
            a, r = a[k], r[k]
        assert np.linalg.norm(np.asarray(a) - np.asarray(r)) <= 1e-5 * np.linalg.norm(np.asarray(r)), path

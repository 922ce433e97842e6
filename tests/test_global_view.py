"""Optax transformations that need a global view of the gradient are refused on shards."""

import chex
import jax
import optax
import pytest
from conftest import ResMLP, mlp_batches, mse_loss, reference_run
from flax import nnx

import zshard


def mlp():
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "tx,name",
    [
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), "clip_by_global_norm"),
        (optax.apply_if_finite(optax.adam(1e-3), 3), "apply_if_finite"),
        (optax.lamb(1e-3), "scale_by_trust_ratio"),
        (optax.adafactor(1e-3), "clip_by_block_rms"),
    ],
)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD", "SHARD_OPT"])
def test_a_transformation_that_reduces_over_parameters_is_refused_by_name(tx, name, strategy):
    with pytest.raises(ValueError, match=rf"optax transformation '{name}' needs a global view.*clip_norm="):
        zshard.init(mlp, tx, zshard.make_mesh(2, 4), strategy=strategy, abstract=True)


@pytest.mark.parametrize(
    "tx",
    [
        optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        optax.chain(optax.clip(0.5), optax.lion(1e-4)),
        optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10), momentum=0.9, nesterov=True),
        optax.multi_transform({"a": optax.adam(1e-3), "b": optax.set_to_zero()}, lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "b", p)),
    ],
    ids=["adamw-mask", "clip-lion", "sgd-schedule", "multi_transform"],
)
def test_elementwise_transformations_are_accepted(tx):
    state = zshard.init(mlp, tx, zshard.make_mesh(1, 8), abstract=True)
    assert jax.tree.leaves(state.opt_state)


def test_no_shard_holds_whole_parameters_so_a_global_norm_in_the_chain_is_exact():
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-3))
    data = mlp_batches(3)
    want = reference_run(mlp, tx, mse_loss, data)
    state = zshard.init(mlp, tx, zshard.make_mesh(2, 4), strategy="NO_SHARD")
    step = zshard.make_train_step(mse_loss)
    for b, loss in zip(data, want.losses):
        state, metrics = step(state, b)
        assert abs(float(metrics["loss"]) - loss) <= 1e-5 * abs(loss)
    chex.assert_trees_all_close(
        nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict(),
        nnx.state(want.model, nnx.Param).to_pure_dict(),
        rtol=1e-5,
        atol=1e-6,
    )

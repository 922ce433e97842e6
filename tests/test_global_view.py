"""Which Optax transformations run on the local slices as they are, and which through the
global view (zshard.optim.optim_global); how the optimizer state of each is laid out."""

import chex
import jax
import optax
import optax.contrib
import pytest
from conftest import ResMLP, mlp_batches, mse_loss, reference_run
from flax import nnx
from jax.sharding import PartitionSpec as P

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
        (optax.contrib.muon(1e-3), "scale_by_muon"),
        (optax.chain(optax.add_noise(0.1, 0.55, key=0), optax.sgd(1e-3)), "add_noise"),
    ],
)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD", "SHARD_OPT", "NO_SHARD"])
def test_a_transformation_that_needs_more_than_a_slice_runs_on_the_global_view(tx, name, strategy):
    state = zshard.init(mlp, tx, zshard.make_mesh(2, 4), strategy=strategy, abstract=True)
    assert state.plan.opt_view is not None and state.plan.opt_view.why == name


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
def test_elementwise_transformations_keep_the_slice_path(tx):
    state = zshard.init(mlp, tx, zshard.make_mesh(1, 8), abstract=True)
    assert state.plan.opt_view is None
    assert jax.tree.leaves(state.opt_state)


def test_state_shaped_like_a_parameter_stays_sharded_the_rest_is_replicated():
    # Adafactor: v_row [19] / v_col [19] of a factored [19, 19] kernel are replicated (replicated),
    # the unfactored v of a bias [19] is sharded like the bias.
    state = zshard.init(mlp, optax.adafactor(1e-3, min_dim_size_to_factor=4), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    factored = state.opt_state[0]  # scale_by_factored_rms's state
    kernel = ("blocks", 0, "lin", "kernel")
    get = lambda tree, path: tree[path[0]][path[1]][path[2]][path[3]]  # noqa: E731
    assert get(factored.v_row, kernel).shape == (19,) and get(factored.v_row, kernel).sharding.is_fully_replicated
    assert get(factored.v_col, kernel).shape == (19,) and get(factored.v_col, kernel).sharding.is_fully_replicated
    bias = ("blocks", 0, "lin", "bias")
    assert get(factored.v, bias).sharding.spec == P("shard")
    assert get(factored.v, bias).addressable_shards[0].data.shape == (5,)  # 19 -> padded 20 / 4


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


def test_report_counts_a_prng_key_in_the_optimizer_state():
    tx = optax.chain(optax.add_noise(0.1, 0.55, key=0), optax.sgd(1e-3))
    state = zshard.init(mlp, tx, zshard.make_mesh(1, 8))
    rep = zshard.report(zshard.make_train_step(mse_loss), state, mlp_batches(1)[0])
    # the key (8 bytes of threefry data) and the count are replicated and counted whole on both sides;
    # the rest of the excess is the padding of the uneven 13/19/3 sizes
    assert 1.0 <= rep.model_state_bytes["ratio"] <= 1.06
    assert rep.optimizer["path"] == "global view (add_noise)" and rep.optimizer["measured"] == rep.optimizer["formula"] == 0

"""Frozen parameters (`trainable=` filter): no gradient, no optimizer state, no
reduce-scatter, bitwise unchanged; a unit with nothing to train costs no gradient traffic."""

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import ResMLP, mlp_batches, mse_loss
from flax import nnx, traverse_util

import zshard
from zshard.report import parse_collectives

# freeze the input layer (root unit, partly) and the whole first block unit
TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.Any(nnx.PathContains("inp"), nnx.PathContains(0))))


def mlp():
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))


def reference(data, tx):
    model = mlp()
    opt = nnx.Optimizer(model, tx, wrt=TRAINABLE)

    @nnx.jit
    def step(m, o, b):
        loss, grads = nnx.value_and_grad(mse_loss, argnums=nnx.DiffState(0, TRAINABLE))(m, b)
        o.update(m, grads)
        return loss, optax.global_norm(grads)

    out = [tuple(map(float, step(model, opt, b))) for b in data]
    return out, nnx.state(model, nnx.Param).to_pure_dict()


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4)), ("SHARD_OPT", (2, 4)), ("NO_SHARD", (2, 4))])
def test_frozen_parameters_stay_bitwise_and_the_rest_trains_like_the_reference(strategy, mesh):
    data = mlp_batches(4)
    want, ref_params = reference(data, optax.adamw(1e-2))
    state = zshard.init(mlp, optax.adamw(1e-2), zshard.make_mesh(*mesh), strategy=strategy, trainable=TRAINABLE)
    before = traverse_util.flatten_dict(jax.tree.map(np.asarray, state.params))
    step = zshard.make_train_step(mse_loss)
    for b, (loss, gnorm) in zip(data, want):
        state, metrics = step(state, b)
        assert abs(float(metrics["loss"]) - loss) <= 1e-5 * abs(loss)
        assert abs(float(metrics["grad_norm"]) - gnorm) <= 1e-5 * gnorm  # frozen ones not in the norm
    after = traverse_util.flatten_dict(jax.tree.map(np.asarray, state.params))
    frozen = [p for p in after if p[0] == "inp" or p[:2] == ("blocks", 0)]
    assert len(frozen) == 4
    for p in frozen:
        np.testing.assert_array_equal(after[p], before[p])  # bitwise
    got = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    chex.assert_trees_all_close(got, ref_params, rtol=1e-4, atol=1e-6)
    # no optimizer state for frozen parameters
    opt_paths = {p for tree in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, dict)) if isinstance(tree, dict)
                 for p in traverse_util.flatten_dict(tree)}
    assert opt_paths and not any(p in opt_paths for p in frozen)


def test_a_unit_with_nothing_to_train_costs_no_gradient_communication():
    # Freeze block 0 only: its input gradient is still needed (inp trains), so its backward
    # re-gathers it; with TRAINABLE above XLA drops block 0's whole backward, a smaller program.
    only_block0 = nnx.All(nnx.Param, nnx.Not(nnx.PathContains(0)))
    state = zshard.init(mlp, optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD", trainable=only_block0)
    step = zshard.make_train_step(mse_loss)
    colls = parse_collectives(step.lower(state, mlp_batches(1)[0]).compile().as_text(), state.plan.mesh)
    trainable_units = [u for u in state.plan.units if any(f.trainable for f in u.flats)]
    assert [u.name for u in trainable_units] == ["root", "blocks.1"]
    # one reduce-scatter per trainable parameter (collectives._gather_all gathers and
    # reduce-scatters per parameter), none for block 0's
    trainable_params = [s for u in trainable_units for f in u.flats if f.trainable for s in f.slots]
    assert len([c for c in colls if c.kind == "reduce-scatter"]) == len(trainable_params)
    rep = zshard.report(step, state, mlp_batches(1)[0])
    for axis, v in rep.comm_bytes_per_step.items():  # measured includes padding: 19-wide layers pad to /4
        assert abs(v["ratio"] - 1) <= 0.02, (axis, v)
    assert abs(rep.model_state_bytes["ratio"] - 1) <= 0.02


def test_trainable_filter_errors():
    with pytest.raises(ValueError, match="selects no parameter"):
        zshard.init(mlp, optax.sgd(0.1), zshard.make_mesh(1, 8), trainable=nnx.Nothing)

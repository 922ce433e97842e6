"""A block unit's raw shard used as a value in ``loss_fn`` is refused before compiling.

``jax.tree.leaves(nnx.state(model, nnx.Param))`` inside ``loss_fn`` walks the raw values, which
for a block unit are this device's padded shards (zshard/inspection/checks.py). The same penalty
read through the variables (``v[...]``) is gathered and exact; root parameters are gathered
logical values, so walking them is exact too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import ResBlock, ResMLP, assert_same_training, mlp_batches, mse_loss, reference_run, zshard_run
from flax import nnx

import zshard
import zshard.programs.program

D = 19
PENALTY = 1e-2


class StackedMLP(nnx.Module):
    """``inp -> 2 ResBlocks stacked with nnx.vmap, run with nnx.scan -> head``."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(13, D, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs):
            return ResBlock(D, rngs=rngs)

        self.blocks = stacked(rngs)
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, block):
            return block(h)

        return self.head(body(self.inp(x), self.blocks))


class RematMLP(ResMLP):
    """:class:`ResMLP` with each block under the user's own ``nnx.remat``."""

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = nnx.remat(lambda blk, h: blk(h))(block, x)
        return self.head(x)


MODELS = {
    "plain": (lambda: ResMLP(rngs=nnx.Rngs(0)), r"blocks\.0\.lin\.bias"),
    "stacked": (lambda: StackedMLP(rngs=nnx.Rngs(0)), r"blocks\.lin\.bias"),
    "remat": (lambda: RematMLP(rngs=nnx.Rngs(0)), r"blocks\.0\.lin\.bias"),
}
MESHES = {"FULL_SHARD": (1, 8), "HYBRID_SHARD": (2, 4)}
# Modules are built eagerly and passed to zshard (copied to the shards, not compiled): a builder's
# initialisers would compile again for every mesh and strategy. The builder path: test_strategies.


def leaves_l2(model, batch):
    """The pattern that walks raw values: inside the step, a block's padded shards."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return mse_loss(model, batch) + PENALTY * sum(jnp.sum(p**2) for p in leaves)


def variables_l2(model, batch):
    """The fix: the same penalty read through each variable (``v[...]`` gathers a block's)."""
    variables = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
    return mse_loss(model, batch) + PENALTY * sum(jnp.sum(v[...] ** 2) for v in variables)


def root_leaves_l2(model, batch):
    """Raw leaves of the root unit's modules only: gathered logical values inside the step."""
    leaves = jax.tree.leaves(nnx.state(model.inp, nnx.Param)) + jax.tree.leaves(nnx.state(model.head, nnx.Param))
    return mse_loss(model, batch) + PENALTY * sum(jnp.sum(p**2) for p in leaves)


@pytest.mark.parametrize("strategy", list(MESHES))
@pytest.mark.parametrize("model", list(MODELS))
def test_leaves_penalty_is_refused_before_compiling(model, strategy):
    make, path = MODELS[model]
    state = zshard.init(make(), optax.sgd(0.1), zshard.make_mesh(*MESHES[strategy]), strategy=strategy)  # built eagerly: not compiled
    step = zshard.make_train_step(leaves_l2, prefetch=1)
    with pytest.raises(ValueError, match=rf"parameter '{path}' of block unit 'blocks(\.0)?': the raw padded shard") as err:
        step(state, mlp_batches(1)[0])
    msg = str(err.value)
    assert "`integer_pow` in loss_fn" in msg and "test_leaves.py" in msg  # the primitive and the user's line
    assert "variable[...]" in msg and "optax.add_decayed_weights" in msg  # the fixes
    assert step._jitted._cache_size() == 0  # nothing was compiled
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # nor donated


@pytest.mark.parametrize("strategy", [s.value for s in zshard.Strategy])
@pytest.mark.parametrize("accum", [1, 2])
def test_refused_under_every_strategy_and_accumulation(strategy, accum):
    shape = (2, 4) if "HYBRID" in strategy else (1, 8)
    state = zshard.init(lambda: StackedMLP(rngs=nnx.Rngs(0)), optax.adamw(1e-3), zshard.make_mesh(*shape), strategy=strategy,
                        abstract=True)  # refused while tracing: nothing needs to be built
    step = zshard.make_train_step(leaves_l2, grad_accum=accum, prefetch=1)
    with pytest.raises(ValueError, match=r"parameter 'blocks\.lin\.bias' of block unit 'blocks'"):
        step.lower(state, mlp_batches(1, batch=16)[0])


def test_without_the_check_the_number_is_silently_wrong(monkeypatch):
    """Why the refusal exists: with the walk switched off the step runs and its loss is not
    the single-device one (the test of the check above can fail)."""
    data = mlp_batches(1)
    want = reference_run(lambda: ResMLP(rngs=nnx.Rngs(0)), optax.sgd(0.1), leaves_l2, data)
    monkeypatch.setattr(zshard.programs.program, "check_traced", lambda *a, **k: None)
    got = zshard_run(ResMLP(rngs=nnx.Rngs(0)), optax.sgd(0.1), zshard.make_mesh(2, 4), "FULL_SHARD", leaves_l2, data)
    assert abs(got.losses[0] - want.losses[0]) > 1e-3 * abs(want.losses[0]), (got.losses, want.losses)


@pytest.mark.parametrize("strategy", list(MESHES))
@pytest.mark.parametrize("model", list(MODELS))
def test_penalty_read_through_variables_is_exact(model, strategy):
    make, _ = MODELS[model]
    data = mlp_batches(2)
    want = reference_run(make, optax.adamw(1e-2), variables_l2, data)
    got = zshard_run(make(), optax.adamw(1e-2), zshard.make_mesh(*MESHES[strategy]), strategy, variables_l2, data)
    assert_same_training(got, want)


@pytest.mark.parametrize("strategy", list(MESHES))
def test_root_parameters_walked_as_leaves_are_exact(strategy):
    make = lambda: ResMLP(rngs=nnx.Rngs(0))  # noqa: E731
    data = mlp_batches(2)
    want = reference_run(make, optax.adamw(1e-2), root_leaves_l2, data)
    got = zshard_run(make(), optax.adamw(1e-2), zshard.make_mesh(*MESHES[strategy]), strategy, root_leaves_l2, data)
    assert_same_training(got, want)


def test_eval_step_refuses_it_too():
    state = zshard.init(ResMLP(rngs=nnx.Rngs(0)), optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="FULL_SHARD")
    ev = zshard.make_eval_step(leaves_l2)
    with pytest.raises(ValueError, match=r"parameter 'blocks\.0\.lin\.bias' of block unit 'blocks\.0'"):
        ev(state, mlp_batches(1)[0])
    assert float(zshard.make_eval_step(variables_l2)(state, mlp_batches(1)[0])["loss"]) > 0


def test_other_raw_walks_are_refused_too():
    """``optax.global_norm`` of the raw leaves, and leaves concatenated first."""
    state = zshard.init(RematMLP(rngs=nnx.Rngs(0)), optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    norm = lambda m, b: mse_loss(m, b) + optax.global_norm(nnx.state(m.blocks, nnx.Param))  # noqa: E731
    flat = lambda m, b: mse_loss(m, b) + jnp.linalg.norm(jnp.concatenate([p.ravel() for p in jax.tree.leaves(nnx.state(m.blocks))]))  # noqa: E731
    for fn in (norm, flat):
        with pytest.raises(ValueError, match=r"parameter 'blocks\.0\.lin\.bias' of block unit 'blocks\.0'"):
            zshard.make_train_step(fn).lower(state, mlp_batches(1)[0])

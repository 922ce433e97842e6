"""Weights tied across units, and integer parameters inside a unit, against the plain step."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import built, mlp_batches, mse_loss, reference_run
from flax import nnx

import zshard
from zshard.report import parse_collectives


class TiedBlock(nnx.Module):
    """``x + tanh(own(x)) @ shared``: ``shared`` is one Linear used by every block."""

    def __init__(self, d: int, shared: nnx.Linear, *, rngs: nnx.Rngs):
        self.own = nnx.Linear(d, d, rngs=rngs)
        self.shared = shared

    def __call__(self, x):
        return x + self.shared(jnp.tanh(self.own(x)))


class TiedMLP(nnx.Module):
    def __init__(self, d: int = 19, n_blocks: int = 3, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(13, d, rngs=rngs)
        shared = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.blocks = nnx.List([TiedBlock(d, shared, rngs=rngs) for _ in range(n_blocks)])
        self.head = nnx.Linear(d, 3, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tied():
    return TiedMLP(rngs=nnx.Rngs(0))


@functools.cache
def reference():
    """5 AdamW steps of ``TiedMLP`` on one device, computed once: the cases differ only on the zshard side."""
    return reference_run(tied, optax.adamw(1e-2), mse_loss, mlp_batches(5))


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4)), ("SHARD_GRAD_OP", (4, 2)), ("HYBRID_SHARD_OPT", (2, 4))])
def test_a_weight_tied_across_units_trains_like_the_reference(strategy, mesh):
    data = mlp_batches(5)
    want = reference()
    state = zshard.init(built(tied), optax.adamw(1e-2), zshard.make_mesh(*mesh), strategy=strategy)
    # one parameter, owned by the root unit (the blocks' common parent), read by every block
    root = state.plan.units[0]
    assert ("blocks", 0, "shared", "kernel") in [s.path for s in root.slots]
    assert [u.name for u in state.plan.units] == ["root", "blocks.0", "blocks.1", "blocks.2"]
    assert all(u.shared == ((("shared", "kernel"), ("blocks", 0, "shared", "kernel")),) for u in state.plan.units[1:])
    step = zshard.make_train_step(mse_loss)
    for b, loss, norm in zip(data, want.losses, want.grad_norms):
        state, metrics = step(state, b)
        assert abs(float(metrics["loss"]) - loss) <= 1e-5 * abs(loss)
        assert abs(float(metrics["grad_norm"]) - norm) <= 1e-5 * norm  # counted once, sum of all uses
    chex.assert_trees_all_close(
        nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict(),
        nnx.state(want.model, nnx.Param).to_pure_dict(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_the_tied_weight_is_gathered_and_reduce_scattered_once_per_step():
    state = zshard.init(built(tied), optax.sgd(0.1), zshard.make_mesh(1, 8))
    colls = parse_collectives(zshard.make_train_step(mse_loss).lower(state, mlp_batches(1)[0]).compile().as_text(), state.plan.mesh)
    count = lambda kind: sum(c.trips for c in colls if c.kind == kind and c.buffer_bytes > 64)  # noqa: E731
    # one collective per parameter (collectives._gather_all): the root's (tied weight
    # included) gathered once, the blocks' twice; every one reduce-scattered once
    big = [(u, sl) for u in state.plan.units for f in u.flats for sl in f.slots if sl.padded * 4 > 64]
    assert count("all-gather") == sum(1 if u.name == "root" else 2 for u, _ in big)
    assert count("reduce-scatter") == len(big)


class PermBlock(nnx.Module):
    """An fp32 Linear and an int32 permutation in one unit (bf16 beside fp32: test_shapes.py)."""

    def __init__(self, d: int, seed: int, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.perm = nnx.Param(jnp.asarray(np.random.default_rng(seed).permutation(d), jnp.int32))

    def __call__(self, x):
        y = jnp.tanh(self.lin(x))
        return x + y[:, self.perm[...]]


class PermMLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(13, 19, rngs=rngs)
        self.blocks = nnx.List([PermBlock(19, i, rngs=rngs) for i in range(2)])
        self.head = nnx.Linear(19, 3, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


FLOATS = nnx.All(nnx.Param, lambda path, x: jnp.issubdtype(x.get_value().dtype, jnp.inexact))


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4))])
def test_integer_parameters_in_a_unit_are_gathered_frozen_and_keep_their_dtype(strategy, mesh):
    data = mlp_batches(4)
    ref = PermMLP(rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=FLOATS)

    @nnx.jit
    def ref_step(m, o, b):
        loss, grads = nnx.value_and_grad(mse_loss, argnums=nnx.DiffState(0, FLOATS))(m, b)
        o.update(m, grads)
        return loss

    state = zshard.init(PermMLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), zshard.make_mesh(*mesh), strategy=strategy)
    assert {f.dtype for f in state.plan.units[1].flats} == {np.dtype("float32"), np.dtype("int32")}
    step = zshard.make_train_step(mse_loss)
    for b in data:
        want = float(ref_step(ref, opt, jax.tree.map(jnp.asarray, b)))
        state, metrics = step(state, b)
        assert abs(float(metrics["loss"]) - want) <= 1e-5 * abs(want)
    got = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    for i in range(2):
        perm = got["blocks"][i]["perm"]
        assert perm.dtype == jnp.int32 and perm.shape == (19,)
        np.testing.assert_array_equal(perm, np.random.default_rng(i).permutation(19))
    want = nnx.state(ref, nnx.Param).to_pure_dict()
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)

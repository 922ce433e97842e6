"""Every parameter shape: scalars, size-1, size-0, a dimension smaller than the shard count,
and two dtypes in one unit, against the single-device step; padding never leaks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import reference_run, zshard_run
from flax import nnx, traverse_util

import zshard


class Odd(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (5, 3)))  # 15: uneven, dims < 8
        self.scale = nnx.Param(jnp.array(1.5))  # scalar
        self.one = nnx.Param(jnp.ones((1,)))  # size 1
        self.empty = nnx.Param(jnp.zeros((0, 4)))  # size 0
        self.half = nnx.Param((0.3 * jax.random.normal(rngs.params(), (3, 3))).astype(jnp.bfloat16))  # 2nd dtype

    def __call__(self, x):
        y = x @ self.w * self.scale + self.one[0] + jnp.sum(self.empty)
        return y + (y.astype(jnp.bfloat16) @ self.half).astype(jnp.float32)


class OddNet(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Odd(rngs) for _ in range(2)])
        self.bias = nnx.Param(jnp.zeros((3,)))

    def __call__(self, x):
        x = self.blocks[0](x[:, :5])
        x = jnp.concatenate([x, x[:, :2]], -1)
        return self.blocks[1](x) + self.bias


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def data(n=3):
    r = np.random.default_rng(0)
    return [(r.standard_normal((8, 5)).astype(np.float32), r.standard_normal((8, 3)).astype(np.float32)) for _ in range(n)]


def make():
    return OddNet(nnx.Rngs(0))


@functools.cache
def reference():
    """3 Adam steps of ``OddNet`` on one device, computed once: the cases differ only on the zshard side."""
    return reference_run(make, optax.adam(1e-3), loss_fn, data())


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4)), ("SHARD_OPT", (2, 4)), ("NO_SHARD", (1, 8))])
def test_odd_shapes_and_dtypes_train_like_the_reference(strategy, mesh):
    want = reference()
    got = zshard_run(make, optax.adam(1e-3), zshard.make_mesh(*mesh), strategy, loss_fn, data())
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    # the bf16 parameter's gradient is summed across devices in bf16 (its own dtype) and
    # optax.global_norm squares bf16 in bf16 on the reference side: bf16-level agreement
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=5e-3)
    for path, ref in want.params.items():
        out = got.params[path]
        assert out.shape == ref.shape and out.dtype == ref.dtype, path
        tol = 1e-2 if ref.dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol, err_msg=str(path))


def test_two_dtypes_in_one_unit_make_two_flat_parameters_and_padding_stays_zero():
    state = zshard.init(lambda: OddNet(nnx.Rngs(0)), optax.adamw(1e-2, weight_decay=0.1), zshard.make_mesh(1, 8))
    unit = state.plan.units[1]
    assert [str(f.dtype) for f in unit.flats] == ["float32", "bfloat16"]
    assert {s.path[-1]: s.padded for f in unit.flats for s in f.slots} == {"w": 16, "scale": 8, "one": 8, "empty": 0, "half": 16}
    step = zshard.make_train_step(loss_fn)
    for b in data(4):
        state, _ = step(state, b)
    sizes = {p: int(np.prod(v.get_value().shape)) for p, v in state.plan.template}
    for tree in (state.params, *jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, dict))):
        if not isinstance(tree, dict):
            continue
        for path, leaf in traverse_util.flatten_dict(tree).items():
            if path in sizes:
                np.testing.assert_array_equal(np.asarray(leaf, np.float32).reshape(-1)[sizes[path]:], 0.0, err_msg=str(path))


@pytest.mark.parametrize("strategy,mesh", [("HYBRID_SHARD", (2, 4)), ("SHARD_OPT", (2, 4))])
def test_each_parameter_is_stored_as_its_record_says(strategy, mesh):
    """Plan.layouts (one ParamLayout per parameter) is what init placed and unshard reads:
    stored shape, PartitionSpec and dtype of every leaf; from_storage gives the model's value."""
    model = OddNet(nnx.Rngs(0))
    state = zshard.init(model, optax.adam(1e-3), zshard.make_mesh(*mesh), strategy=strategy)
    plan = state.plan
    logical = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    stored = traverse_util.flatten_dict(state.params)
    assert list(plan.layouts) == [p for p, _ in plan.template] and set(plan.layouts) == set(stored) == set(logical)
    for path, rec in plan.layouts.items():
        leaf = stored[path]
        assert leaf.shape == rec.storage_shape and leaf.dtype == rec.dtype and leaf.sharding.spec == rec.spec, path
        assert rec.padded % plan.opt_shards == 0 and rec.logical_shape == logical[path].get_value().shape
        host = np.asarray(leaf)
        np.testing.assert_array_equal(rec.from_storage(host), np.asarray(logical[path].get_value()), err_msg=str(path))
        np.testing.assert_array_equal(rec.to_storage(rec.from_storage(host)), host, err_msg=str(path))
    assert plan.trainable == frozenset(p for p, r in plan.layouts.items() if r.trainable) == frozenset(logical)


def test_a_weakly_typed_parameter_is_stored_strongly_so_the_step_keeps_its_signature():
    """``nnx.Param(jnp.array(1.5))`` is weakly typed (a Python scalar). The step returns the state
    strongly typed; a weak leaf in the state ``zshard.init`` gave would change the step's input
    signature after the first step, and the second step would trace and compile it again."""
    assert jax.typeof(make().blocks[0].scale.get_value()).weak_type  # the premise
    for model in (make, make()):  # the callable path (under jit) and the module path (host copies)
        state = zshard.init(model, optax.adam(1e-3), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
        assert not [p for p, x in jax.tree_util.tree_leaves_with_path(state) if jax.typeof(x).weak_type]
    before = jax.tree.map(jax.typeof, state)
    state, _ = zshard.make_train_step(loss_fn)(state, data(1)[0])
    assert jax.tree.map(jax.typeof, state) == before  # the second step hits the first one's program

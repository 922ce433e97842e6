"""Model code as users write it: transforms around blocks, other methods, nested containers,
parameters read outside their unit, device-dependent control flow, aux outputs.

Each model runs with ``prefetch=1`` (the GPU / TPU default) and ``remat="block"`` and is compared
with the plain single-device step (``conftest.reference_run``) within 1e-5.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ResBlock, mlp_batches, mse_loss, reference_run, rel_l2, zshard_run
from flax import nnx

import zshard

D = 5


class Net(nnx.Module):
    """``inp -> two ResBlock units run as `mode` says -> head``."""

    def __init__(self, mode: str, *, rngs: nnx.Rngs):
        self.mode = mode
        self.inp = nnx.Linear(13, D, rngs=rngs)
        self.blocks = nnx.List([ResBlock(D, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        a, b = self.blocks
        m = self.mode
        if m == "jax.checkpoint":
            x = jax.checkpoint(lambda h: b(a(h)))(x)
        elif m == "nnx.remat":
            x = nnx.remat(lambda blk, h: blk(h))(a, x)
            x = nnx.remat(lambda blk, h: blk(h))(b, x)
        elif m == "lax.scan":
            x, _ = jax.lax.scan(lambda h, _: (b(a(h)), None), x, None, length=2)
        elif m == "lax.fori_loop":
            x = jax.lax.fori_loop(0, 2, lambda i, h: b(a(h)), x)
        elif m == "jax.vmap":
            x = jax.vmap(lambda h: b(a(h)))(x)  # per example: blocks see [D]
        elif m == "nnx.vmap":
            x = nnx.vmap(lambda blk, h: blk(h), in_axes=(None, 0))(a, x)
            x = nnx.vmap(lambda blk, h: blk(h), in_axes=(None, 0))(b, x)
        elif m == "twice":
            x = a(a(b(x)))
        elif m == "loop":
            for _ in range(3):
                for blk in self.blocks:
                    x = blk(x)
        return self.head(x)


MODES = ["jax.checkpoint", "nnx.remat", "lax.scan", "lax.fori_loop", "jax.vmap", "nnx.vmap", "twice", "loop"]
MESHES = [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4)), ("SHARD_GRAD_OP", (4, 2)), ("HYBRID_SHARD_ZERO2", (2, 4))]


# zshard_run(make(), ...): a module built eagerly is copied to the shards without compiling, where a
# builder's initialisers compile again for every mesh and strategy (about 1 s each); the builder path:
# test_strategies, test_verify, and the abstract=True plans here.


@functools.cache
def sgd_loop_state():
    """One ``Net("loop")`` state on 1x8 with SGD for the tests that only trace a step (and raise
    before running it: nothing donated)."""
    return zshard.init(Net("loop", rngs=nnx.Rngs(0)), optax.sgd(0.1), zshard.make_mesh(1, 8))


def assert_same(z, ref, tol=1e-5):
    for a, b in zip(z.losses, ref.losses):
        assert abs(a - b) <= tol * abs(b), (z.losses, ref.losses)
    for p, v in ref.params.items():
        assert rel_l2(z.params[p], v) <= tol, p


@functools.cache
def net_reference(mode):
    """The single-device run of ``Net(mode)`` (Adam 1e-2, 2 steps of ``mlp_batches(2)``), computed once per mode
    (read-only): ``loop``'s serves test_transforms_around_units_train_exactly and test_has_aux_is_exact_and_reduced."""
    return reference_run(lambda: Net(mode, rngs=nnx.Rngs(0)), optax.adam(1e-2), mse_loss, mlp_batches(2))


@pytest.mark.parametrize("i,mode", list(enumerate(MODES)), ids=MODES)
def test_transforms_around_units_train_exactly(i, mode):
    strategy, shape = MESHES[i % len(MESHES)]
    batches = mlp_batches(2)
    z = zshard_run(Net(mode, rngs=nnx.Rngs(0)), optax.adam(1e-2), zshard.make_mesh(*shape), strategy, mse_loss, batches)
    assert_same(z, net_reference(mode))


# --- other methods, parameters read outside their unit, nested containers ---------------------------------


class Tied(nnx.Module):
    """Embedding used twice: ``embed(tokens)`` in, ``embed.attend(h)`` out; a block's bias
    also read by the root; a helper method of a block called from the root."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(11, D, rngs=rngs)
        self.blocks = nnx.List([ResBlock(D, rngs=rngs) for _ in range(2)])

    def __call__(self, tokens):
        h = self.embed(tokens)
        for blk in self.blocks:
            h = blk(h)
        h = h + self.blocks[0].lin.bias[...]  # read outside its unit
        return self.embed.attend(h)


def token_loss(model, batch):
    tokens, targets = batch
    logp = jax.nn.log_softmax(model(tokens))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def token_batches(n):
    rng = np.random.default_rng(1)
    return [(rng.integers(0, 11, (16, 4), dtype=np.int32), rng.integers(0, 11, (16, 4), dtype=np.int32)) for _ in range(n)]


def make_tied():
    return Tied(rngs=nnx.Rngs(0))


@functools.cache
def tied_reference():
    """The single-device run of ``Tied`` (Adam 1e-2, 2 steps): the same for the three cases below, computed once
    (read-only); the cases differ only on the zshard side (units, strategy, mesh)."""
    return reference_run(make_tied, optax.adam(1e-2), token_loss, token_batches(2))


@pytest.mark.parametrize("unit,strategy,shape", [(nnx.Embed, "FULL_SHARD", (1, 8)), (None, "HYBRID_SHARD", (2, 4)), (None, "HYBRID_SHARD_OPT", (4, 2))])
def test_other_methods_and_reads_outside_the_unit(unit, strategy, shape):
    batches = token_batches(2)
    tx = optax.adam(1e-2)
    z = zshard_run(make_tied(), tx, zshard.make_mesh(*shape), strategy, token_loss, batches, unit=unit)
    assert_same(z, tied_reference())


def test_tied_gpt_with_size_based_units():
    from train.model import GPT, GPTConfig, cross_entropy_loss  # noqa: PLC0415
    from conftest import gpt_batches  # noqa: PLC0415

    cfg = GPTConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, tie_embeddings=True)
    make = lambda: GPT(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    batches = gpt_batches(2, batch=8, seq_len=8)
    tx = optax.adam(1e-3)
    z = zshard_run(make(), tx, zshard.make_mesh(1, 8), "FULL_SHARD", cross_entropy_loss, batches, unit=3000)
    assert len(zshard.init(make, tx, zshard.make_mesh(1, 8), unit=3000, abstract=True).plan.units) > 2
    assert_same(z, reference_run(make, tx, cross_entropy_loss, batches))


class Nested(nnx.Module):
    def __init__(self, kind: str, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(13, D, rngs=rngs)
        if kind == "list":
            self.groups = nnx.List([nnx.List([ResBlock(D, rngs=rngs)]), nnx.List([ResBlock(D, rngs=rngs)])])
        else:
            self.groups = nnx.Dict({"a": ResBlock(D, rngs=rngs), "b": ResBlock(D, rngs=rngs)})
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        members = [g[0] for g in self.groups] if isinstance(self.groups, nnx.List) else [self.groups["a"], self.groups["b"]]
        for blk in members:
            x = blk(x)
        return self.head(x)


@pytest.mark.parametrize("kind,expected", [("list", ["groups.0.0", "groups.1.0"]), ("dict", ["groups.a", "groups.b"])])
def test_nested_containers_default_policy_picks_called_modules(kind, expected):
    make = lambda: Nested(kind, rngs=nnx.Rngs(0))  # noqa: E731
    tx = optax.sgd(0.1)
    mesh = zshard.make_mesh(2, 4)
    plan = zshard.init(make, tx, mesh, abstract=True).plan
    assert [u.name for u in plan.units[1:]] == expected
    batches = mlp_batches(2)
    assert_same(zshard_run(make(), tx, mesh, "HYBRID_SHARD", mse_loss, batches), reference_run(make, tx, mse_loss, batches))


# --- control flow whose predicate differs between devices ------------------------------------------------


class Gated(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(13, D, rngs=rngs)
        self.blocks = nnx.List([ResBlock(D, rngs=rngs) for _ in range(2)])

    def __call__(self, x, flag):
        h = self.inp(x)
        h = jax.lax.cond(flag[0] > 0, lambda v: self.blocks[0](v), lambda v: v, h)
        return self.blocks[1](h)


def test_device_dependent_cond_around_a_unit_is_refused_before_compiling():
    state = zshard.init(Gated(rngs=nnx.Rngs(0)), optax.sgd(0.1), zshard.make_mesh(1, 4, devices=jax.devices()[:4]))

    def loss(model, batch):
        x, flag = batch
        return jnp.mean(model(x, flag) ** 2)

    step = zshard.make_train_step(loss)
    x = np.ones((8, 13), np.float32)
    flag = np.array([1, 1, 0, 0, 1, 1, 0, 0], np.int32)
    with pytest.raises(ValueError, match=r"unit 'blocks\.0'.*cond.*differs between devices"):
        step(state, (x, flag))


# --- what loss_fn returns -------------------------------------------------------------------------------


def test_has_aux_is_exact_and_reduced():
    make = lambda: Net("loop", rngs=nnx.Rngs(0))  # noqa: E731
    batches = mlp_batches(2)
    ref = net_reference("loop")  # Adam 1e-2 on these batches, as test_transforms_around_units_train_exactly[loop]

    def loss_aux(model, batch):
        x, y = batch
        out = model(x)
        return jnp.mean((out - y) ** 2), {"scale": jnp.float32(0.25), "mean_out": jnp.mean(out), "rows": jnp.int32(x.shape[0])}

    state = zshard.init(make(), optax.adam(1e-2), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    step = zshard.make_train_step(loss_aux, has_aux=True)
    for b, want in zip(batches, ref.losses):
        state, metrics = step(state, b)
        assert abs(float(metrics["loss"]) - want) <= 1e-5 * abs(want)  # not 4x: aux is never a count
        assert float(metrics["aux"]["scale"]) == 0.25  # floating aux: mean over devices
        assert int(metrics["aux"]["rows"]) == 16  # integer aux: summed over devices
    for p, v in ref.params.items():
        from conftest import flat_params  # noqa: PLC0415

        assert rel_l2(flat_params(zshard.unshard(state))[p], v) <= 1e-5


def test_ambiguous_tuple_and_vector_loss_are_refused():
    state = sgd_loop_state()
    b = mlp_batches(1)[0]
    pair = zshard.make_train_step(lambda m, b: (mse_loss(m, b), jnp.float32(0.25)))
    with pytest.raises(TypeError, match="has_aux=True.*TokenMean"):
        pair(state, b)
    vector = zshard.make_train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2, axis=0))
    with pytest.raises(ValueError, match=r"loss of shape \(3,\); it must be a scalar"):
        vector(state, b)


def test_skipped_step_is_not_counted():
    state = zshard.init(Net("loop", rngs=nnx.Rngs(0)), optax.adam(1e-2), zshard.make_mesh(1, 8))
    step = zshard.make_train_step(mse_loss, skip_nonfinite=True)
    x, y = mlp_batches(1)[0]
    state, _ = step(state, (x, y))
    bad = x.copy()
    bad[0, 0] = np.nan
    state, metrics = step(state, (bad, y))
    assert int(metrics["nonfinite"]) == 1
    assert int(state.step) == 1
    assert int(state.opt_state[0].count) == 1
    chex.assert_trees_all_equal(int(state.step), int(state.opt_state[0].count))


def test_array_methods_on_a_parameter_read_outside_its_unit_are_gathered():
    """``kernel.sum()`` / ``kernel.T`` on the Variable (Flax reads array attributes from the raw
    value, which inside the step is this device's shard) are exact, like ``kernel[...]``."""

    def loss(model, batch):
        k = model.blocks[0].lin.kernel
        return mse_loss(model, batch) + 0.1 * k.sum() ** 2 + 0.01 * jnp.sum(k.T[0]) + 0.0 * k.shape[0]

    make = lambda: Net("loop", rngs=nnx.Rngs(0))  # noqa: E731
    batches = mlp_batches(2)
    z = zshard_run(make(), optax.sgd(0.05), zshard.make_mesh(1, 8), "FULL_SHARD", loss, batches)
    assert_same(z, reference_run(make, optax.sgd(0.05), loss, batches))


def test_unshard_runs_a_model_with_state(tmp_path):
    from test_model_state import BNDropNet  # noqa: PLC0415

    state = zshard.init(BNDropNet(rngs=nnx.Rngs(0, dropout=1)), optax.sgd(0.1), zshard.make_mesh(1, 8))
    state, _ = zshard.make_train_step(mse_loss)(state, mlp_batches(1)[0])
    model = zshard.unshard(state)
    x = jnp.ones((4, 13))
    assert model(x).shape == (4, 3)
    assert nnx.jit(lambda m, v: m(v))(model, x).shape == (4, 3)


def test_bad_returns_and_batches_are_named():
    state = sgd_loop_state()
    x, y = mlp_batches(1)[0]
    with pytest.raises(TypeError, match=r"array of shape \(\); with has_aux=True"):
        zshard.make_train_step(mse_loss, has_aux=True)(state, (x, y))
    with pytest.raises(TypeError, match="dtype int32; it must be floating"):
        zshard.make_train_step(lambda m, b: jnp.sum(b[0] > 0).astype(jnp.int32))(state, (x, y))
    with pytest.raises(ValueError, match=r"batch\[2\] is a scalar"):
        zshard.make_train_step(mse_loss)(state, (x, y, 2.0))

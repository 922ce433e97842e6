"""Models with state besides parameters: dropout RNG streams, BatchNorm statistics,
counters, sow-ed intermediates; Linen through ``nnx.bridge``; sharding annotations.

The reference for a model whose forward depends on the device (its own dropout stream,
its own slice's batch statistics) is :func:`dp_reference`: the same data-parallel step
emulated on one device, device by device, with the documented rules (device ``d`` draws
from ``fold_in(key, d)``; floating statistics are averaged over devices, counts agree).
"""

from __future__ import annotations

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import flat_params, mlp_batches, mse_loss, reference_run, rel_l2
from flax import nnx

import zshard

D = 6
AXES = ("replica", "shard")


def _others(model):
    return {p: v for p, v in nnx.to_flat_state(nnx.state(model)) if not isinstance(v, nnx.Param)}


def dp_reference(make_model, tx, loss_fn, batches, world: int, grad_accum: int = 1):
    """One device, emulating ``world`` data-parallel devices: per step, device ``d`` runs
    forward and backward on its rows (``grad_accum`` micro-batches in turn, carrying the
    non-parameter variables) with RNG keys ``fold_in(key, d)``, from the non-parameter
    variables of the step's start; gradients and losses are averaged, floating variables
    averaged, integer ones take the largest value."""
    model = make_model()
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def device_step(model, batch):
        return nnx.value_and_grad(loss_fn)(model, batch)

    # The arithmetic between the device steps, jitted too: op by op, each operation compiled its own
    # program per shape (the zoo's Llama reference: 110 compiles, 13 s; the numbers are the same).
    @jax.jit
    def fold(key, d):
        return jax.vmap(lambda k: jax.random.fold_in(k, d))(key.reshape(-1)).reshape(key.shape)

    add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))

    @nnx.jit(static_argnums=3)
    def update(opt, model, grads, n):
        opt.update(model, jax.tree.map(lambda g: g / n, grads))

    losses = []
    for batch in batches:
        start = {p: v.get_raw_value() for p, v in _others(model).items()}
        grads, loss, after = None, 0.0, []
        n = len(jax.tree.leaves(batch)[0]) // (world * grad_accum)
        for d in range(world):
            for p, v in _others(model).items():
                v.set_raw_value(fold(start[p], d) if isinstance(v, nnx.RngKey) else start[p])
            for j in range(grad_accum):
                lo = (d * grad_accum + j) * n
                l, g = device_step(model, jax.tree.map(lambda x: jnp.asarray(x)[lo : lo + n], batch))
                loss += float(l) / (world * grad_accum)
                grads = g if grads is None else add(grads, g)
            after.append({p: v.get_raw_value() for p, v in _others(model).items()})
        for p, v in _others(model).items():
            if isinstance(v, nnx.RngKey):
                v.set_raw_value(start[p])
            elif jnp.issubdtype(start[p].dtype, jnp.inexact):
                v.set_raw_value(sum(a[p] for a in after) / world)
            else:
                v.set_raw_value(max((a[p] for a in after), key=lambda x: int(jnp.max(x))))
        update(opt, model, grads, world * grad_accum)
        losses.append(loss)
    return losses, model


def run(make_model, tx, loss_fn, batches, strategy, shape, grad_accum=1, step=None, **kw):
    """``make_model``: a callable (built under jit) or a module built once (copied, not compiled;
    left as it was, so a cached one serves several runs). ``step``: a train step to reuse."""
    state = zshard.init(make_model, tx, zshard.make_mesh(*shape), strategy=strategy, **kw)
    step = step or zshard.make_train_step(loss_fn, grad_accum=grad_accum)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses, state


def close(got, want, tol, name):
    """Relative L2 within ``tol`` (the suite's criterion), or every element within 1e-6: a
    bias just before a BatchNorm has a zero gradient, so its value is float noise."""
    assert rel_l2(got, want) <= tol or np.max(np.abs(np.asarray(got) - np.asarray(want))) <= 1e-6, (name, rel_l2(got, want))


def assert_close(losses, ref_losses, model, ref_model, tol=1e-5):
    np.testing.assert_allclose(losses, ref_losses, rtol=tol)
    got, want = flat_params(model), flat_params(ref_model)
    for p, v in want.items():
        close(got[p], v, tol, p)
    for (p, v), (_, w) in zip(_others(model).items(), _others(ref_model).items()):
        if isinstance(v, nnx.RngKey):
            chex.assert_trees_all_equal(jax.random.key_data(v.get_raw_value()), jax.random.key_data(w.get_raw_value()))
        else:
            np.testing.assert_allclose(np.asarray(v.get_raw_value()), np.asarray(w.get_raw_value()), rtol=tol, atol=1e-6, err_msg=str(p))


# --- dropout: every device its own stream ----------------------------------------------------------------


class DropBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.4, rngs=rngs)  # the usual NNX pattern: the stream lives in the module

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.lin(x)))


class DropNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(13, D, rngs=rngs)
        self.blocks = nnx.List([DropBlock(rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_dropnet():
    return DropNet(rngs=nnx.Rngs(0, dropout=1))


@functools.cache
def single_device_masks_first_loss():
    """The first loss of the dropout cases' data-parallel step with one device's masks on every device
    (``dp_reference`` with ``world=1``): the same for both cases, computed once; the first step only,
    the one whose loss they compare (a step's loss comes before its update)."""
    return dp_reference(make_dropnet, optax.adam(1e-2), mse_loss, mlp_batches(3)[:1], 1)[0][0]


@pytest.mark.parametrize("strategy,shape,k", [("FULL_SHARD", (1, 8), 1), ("HYBRID_SHARD", (2, 4), 2)])
def test_dropout_streams_per_device(strategy, shape, k):
    make = make_dropnet
    tx = optax.adam(1e-2)
    batches = mlp_batches(3)
    module, step = make(), zshard.make_train_step(mse_loss, grad_accum=k)  # built eagerly, one compiled step for both runs
    losses, state = run(module, tx, mse_loss, batches, strategy, shape, step=step)
    ref_losses, ref_model = dp_reference(make, tx, mse_loss, batches, 8, grad_accum=k)
    assert_close(losses, ref_losses, zshard.unshard(state), ref_model)
    # the same seed and mesh: the same run
    again, _ = run(module, tx, mse_loss, batches, strategy, shape, step=step)
    assert again == losses
    # and not the single-device masks copied to every device
    assert abs(single_device_masks_first_loss() - losses[0]) > 1e-4


def test_device_key_differs_per_device():
    mesh = zshard.make_mesh(2, 4)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(), out_specs=jax.sharding.PartitionSpec(AXES))
    def draws():
        return jax.random.uniform(zshard.device_key(jax.random.key(0)), (1,))

    values = np.asarray(draws())
    assert len(set(values.tolist())) == 8


class KeyDrop(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(13, D, rngs=rngs)
        self.drop = nnx.Dropout(0.5)  # no stream of its own: loss_fn passes one

    def __call__(self, x, rngs):
        return self.drop(self.lin(x), rngs=rngs)


@functools.cache
def _keydrop_state():
    """The 1x8 ``KeyDrop`` state of :func:`_key_warnings`, shapes and shardings only (``abstract=True``: its
    steps are only lowered), made once for its five calls."""
    return zshard.init(lambda: KeyDrop(rngs=nnx.Rngs(0)), optax.sgd(0.1), zshard.make_mesh(1, 8), abstract=True)


def _key_warnings(loss_fn, batch):
    """What a 1x8 step on 8 rows (one per device) warns before compiling (traced and lowered only)."""
    state = _keydrop_state()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        zshard.make_train_step(loss_fn).lower(state, batch)
    return [str(w.message) for w in got if "same on every device" in str(w.message) or "same key" in str(w.message)]


def test_a_key_that_is_the_same_on_every_device_is_warned_naming_the_call_site_and_device_key():
    x = mlp_batches(1, batch=8)[0][0]

    def made_in_loss_fn(model, x):  # the case: every device's row gets the same mask
        return jnp.mean(model(x, nnx.Rngs(dropout=0)) ** 2)

    (line,) = _key_warnings(made_in_loss_fn, x)
    assert "test_model_state.py:" in line and "(KeyDrop.__call__)" in line, line
    assert "key = zshard.device_key(key)" in line and "the same dropout mask" in line

    def folded(model, x):  # the fix: one mask per device, not warned
        return jnp.mean(model(x, nnx.Rngs(dropout=zshard.device_key(jax.random.key(0)))) ** 2)

    assert _key_warnings(folded, x) == []

    def weight(model, x):  # the same everywhere by design (a random projection), met through a matmul: not warned
        return jnp.mean((model.lin(x) @ jax.random.normal(jax.random.key(1), (D, D))) ** 2)

    assert _key_warnings(weight, x) == []

    def from_batch(model, batch):  # one key copied into every row of the batch
        return jnp.mean(model(batch["x"], nnx.Rngs(dropout=batch["key"][0])) ** 2)

    (line,) = _key_warnings(from_batch, {"x": x, "key": jax.random.wrap_key_data(jnp.tile(jax.random.key_data(jax.random.key(0)), (8, 1)))})
    assert "batch leaf [0] (8 copies of one key) is the same key on every device" in line, line
    assert _key_warnings(from_batch, {"x": x, "key": jax.random.split(jax.random.key(0), 8)}) == []


# --- BatchNorm ---------------------------------------------------------------------------------------------


class BNBlock(nnx.Module):
    def __init__(self, axis_name, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.bn = nnx.BatchNorm(D, axis_name=axis_name, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.relu(self.bn(self.lin(x)))


class BNNet(nnx.Module):
    def __init__(self, axis_name=None, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(13, D, rngs=rngs)
        self.bn = nnx.BatchNorm(D, axis_name=axis_name, rngs=rngs)
        self.blocks = nnx.List([BNBlock(axis_name, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        x = self.bn(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@functools.cache
def sync_batchnorm_reference():
    """The single-device run of the sync BatchNorm cases (the same for both, computed once; read-only)."""
    return reference_run(lambda: BNNet(None, rngs=nnx.Rngs(0)), optax.sgd(0.05), mse_loss, mlp_batches(3))


@pytest.mark.parametrize("strategy,shape", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD_ZERO2", (2, 4))])
def test_sync_batchnorm_equals_single_device_global_batch(strategy, shape):
    tx = optax.sgd(0.05)  # not Adam: the bias before a BatchNorm has a zero gradient, which Adam scales to noise
    batches = mlp_batches(3)
    losses, state = run(BNNet(AXES, rngs=nnx.Rngs(0)), tx, mse_loss, batches, strategy, shape)  # built eagerly: not compiled
    ref = sync_batchnorm_reference()
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)
    model = zshard.unshard(state)
    for p, v in ref.params.items():
        close(flat_params(model)[p], v, 1e-5, p)
    for a, b in [(model.bn.mean, ref.model.bn.mean), (model.blocks[1].bn.var, ref.model.blocks[1].bn.var)]:
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-5, atol=1e-7)


def make_local_bnnet():
    return BNNet(None, rngs=nnx.Rngs(0))


@functools.cache
def local_batchnorm_reference():
    """The emulated 8-device run of the local BatchNorm cases (the same for both, computed once; read-only).
    8 rows per device: with 2 (batch 16) a feature's variance is near zero, and rounding differences
    reached 5.5e-05 relative on inp/kernel (SHARD_GRAD_OP, 2026-12-01)."""
    return dp_reference(make_local_bnnet, optax.sgd(0.05), mse_loss, mlp_batches(2, batch=64), 8)


@pytest.mark.parametrize("strategy,shape", [("SHARD_GRAD_OP", (1, 8)), ("HYBRID_SHARD", (2, 4))])
def test_local_batchnorm_statistics_are_averaged_and_replicated(strategy, shape):
    make = make_local_bnnet
    tx = optax.sgd(0.05)
    batches = mlp_batches(2, batch=64)  # 8 rows per device (local_batchnorm_reference)
    losses, state = run(make(), tx, mse_loss, batches, strategy, shape)
    ref_losses, ref_model = local_batchnorm_reference()
    assert_close(losses, ref_losses, zshard.unshard(state), ref_model)
    mean = state.variables["bn"]["mean"]
    assert mean.sharding.is_fully_replicated
    shards = [np.asarray(s.data) for s in mean.addressable_shards]
    assert all((s == shards[0]).all() for s in shards)


# --- counters and sow ---------------------------------------------------------------------------------------


class Calls(nnx.Variable):
    """A counter: how often the block ran."""


class CountBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.calls = Calls(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        y = jnp.tanh(self.lin(x))
        self.sow(nnx.Intermediate, "act", jnp.mean(y))
        return x + y


class CountNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(13, D, rngs=rngs)
        self.blocks = nnx.List([CountBlock(rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for b in list(self.blocks) + [self.blocks[0]]:
            x = b(x)
        return self.head(x)


def test_counters_and_sow_intermediates():
    make = lambda: CountNet(rngs=nnx.Rngs(0))  # noqa: E731

    def loss_aux(model, batch):
        loss = mse_loss(model, batch)
        acts = nnx.pop(model, nnx.Intermediate)
        return loss, {"act0": acts["blocks"][0]["act"][0], "act0_again": acts["blocks"][0]["act"][1]}

    batches = mlp_batches(2)
    state = zshard.init(make, optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    step = zshard.make_train_step(loss_aux, has_aux=True, grad_accum=2)
    ref = make()

    @nnx.jit  # the reference forward in one program, not op by op
    def ref_forward(ref, b):
        return mse_loss(ref, b), nnx.pop(ref, nnx.Intermediate)

    for b in batches:
        state, m = step(state, b)
        ref_loss, acts = ref_forward(ref, jax.tree.map(jnp.asarray, b))
        np.testing.assert_allclose(float(m["aux"]["act0"]), float(acts["blocks"][0]["act"][0]), rtol=1e-5)
        np.testing.assert_allclose(float(m["loss"]), float(ref_loss), rtol=1e-5)
        nnx.update(ref, nnx.state(zshard.unshard(state), nnx.Param))  # follow the trained parameters
    # block 0 runs twice per forward, block 1 once; 2 micro-batches x 2 steps
    assert int(state.variables["blocks"][0]["calls"]) == 8
    assert int(state.variables["blocks"][1]["calls"]) == 4
    assert "act" not in state.variables["blocks"][0]  # intermediates are never carried


class PmapBlock(nnx.Module):  # code written for pmap: reduces over its axis name itself
    def __init__(self, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return x + jax.lax.pmean(self.lin(x), "data")


def _pmap_error(make, needles):
    state = zshard.init(make(), optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="FULL_SHARD")
    step = zshard.make_train_step(mse_loss)
    with pytest.raises(ValueError) as info:  # not jax's bare AssertionError from inside pmean
        step(state, mlp_batches(1)[0])
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    with pytest.raises(ValueError, match="does not exist here"):  # lower() explains it too
        step.lower(state, mlp_batches(1)[0])


def test_pmap_axis_names_are_refused_before_compiling_naming_the_module_and_the_fix():
    fix = "axis_name=('replica', 'shard')"
    _pmap_error(lambda: BNNet("batch", rngs=nnx.Rngs(0)),
                ["module 'bn' (nnx.BatchNorm) calls jax.lax.pmean over the axis name 'batch'", fix, "SyncBatchNorm"])

    def blocks():
        m = BNNet(None, rngs=nnx.Rngs(0))
        m.blocks[1] = PmapBlock(rngs=nnx.Rngs(1))
        return m

    _pmap_error(blocks, ["module 'blocks.1' (test_model_state.PmapBlock) calls jax.lax.pmean over the axis name 'data' at ",
                         "test_model_state.py:", fix])

    import flax.linen as nn  # noqa: PLC0415
    from flax.nnx import bridge  # noqa: PLC0415

    class LNet(nn.Module):  # flax's ImageNet ResNet: nn.BatchNorm(..., axis_name='batch')
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=False, axis_name="batch", name="bn_init")(nn.Dense(D)(x))
            return nn.Dense(3)(x)

    def linen():
        model = bridge.ToNNX(LNet(), rngs=nnx.Rngs(0))
        bridge.lazy_init(model, jnp.ones((1, 13)))
        return model

    _pmap_error(linen, ["Linen module 'bn_init' (linen.BatchNorm inside the nnx.bridge model) calls jax.lax.pmean over the axis name 'batch'", fix])


# --- Linen through nnx.bridge; sharding annotations --------------------------------------------------------


def test_linen_model_with_scan_and_remat_trains_exactly():
    import flax.linen as nn  # noqa: PLC0415
    from flax.nnx import bridge  # noqa: PLC0415

    class LBlock(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + jnp.tanh(nn.Dense(x.shape[-1])(x)), None

    class LNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(D)(x)
            scanned = nn.scan(nn.remat(LBlock), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            x, _ = scanned()(x, None)
            return nn.Dense(3)(x)

    def make():
        model = bridge.ToNNX(LNet(), rngs=nnx.Rngs(0))
        bridge.lazy_init(model, jnp.ones((1, 13)))
        return model

    tx = optax.adam(1e-2)
    batches = mlp_batches(2)
    losses, state = run(make, tx, mse_loss, batches, "HYBRID_SHARD", (2, 4))
    ref = reference_run(make, tx, mse_loss, batches)
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)
    for p, v in ref.params.items():
        assert rel_l2(flat_params(zshard.unshard(state))[p], v) <= 1e-5, p


class Annotated(nnx.Module):
    """MaxText / flax-guide style: logical sharding annotations on every kernel."""

    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(13, 8, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(8, 3, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def test_sharding_annotations_build_and_train_without_a_mesh_of_ones_own():
    tx = optax.adam(1e-2)
    batches = mlp_batches(2)
    losses, state = run(lambda: Annotated(rngs=nnx.Rngs(0)), tx, mse_loss, batches, "FULL_SHARD", (1, 8))
    with nnx.use_eager_sharding(False):  # the reference needs it on one device; zshard does not
        ref = reference_run(lambda: Annotated(rngs=nnx.Rngs(0)), tx, mse_loss, batches)
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)
    model = zshard.unshard(state)
    assert model.up.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")  # kept as metadata


# --- checkpoints carry the variables --------------------------------------------------------------------


class BNDropNet(DropNet):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.bn = nnx.BatchNorm(D, rngs=rngs)

    def __call__(self, x):
        return super().__call__(x) + self.bn(self.inp(x)).sum(-1, keepdims=True)


def test_checkpoint_resume_continues_streams_and_statistics_on_another_mesh(tmp_path):
    make = lambda: BNDropNet(rngs=nnx.Rngs(0, dropout=3))  # noqa: E731
    tx = optax.adam(1e-2)
    batches = mlp_batches(4)
    module = make()  # built once, eagerly (copied, not compiled); the callable path: restore below
    step = zshard.make_train_step(mse_loss)  # one compiled step for the straight run and the first half
    straight, _ = run(module, tx, mse_loss, batches, "FULL_SHARD", (1, 8), step=step)

    state = zshard.init(module, tx, zshard.make_mesh(1, 8))
    for b in batches[:2]:
        state, _ = step(state, b)
    zshard.save(state, tmp_path / "ckpt")
    restored, _ = zshard.restore(tmp_path / "ckpt", zshard.make_mesh(2, 4), model=make, tx=tx, strategy="HYBRID_SHARD")
    chex.assert_trees_all_equal(
        jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x),
                     restored.variables),
        jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x),
                     state.variables),
    )
    step2 = zshard.make_train_step(mse_loss)
    resumed = []
    for b in batches[2:]:
        restored, m = step2(restored, b)
        resumed.append(float(m["loss"]))
    np.testing.assert_allclose(resumed, straight[2:], rtol=1e-5)  # same masks, same statistics
    # export keeps what inference needs (statistics), not the RNG state; load_params reads it back
    zshard.export(restored, tmp_path / "model.safetensors")
    loaded = zshard.load_params(tmp_path / "model.safetensors", make())
    np.testing.assert_array_equal(np.asarray(loaded.bn.mean[...]), np.asarray(zshard.unshard(restored).bn.mean[...]))
    zshard.export(tmp_path / "ckpt", tmp_path / "from_ckpt.safetensors")
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(tmp_path / "from_ckpt.safetensors", framework="numpy") as f:
        names = set(f.keys())
    assert "bn.mean" in names and not any("rngs" in n for n in names)

"""The sharded train step: equivalence with a single-device Optax step, layout, API, bad input."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zshard
from conftest import (
    ResMLP,
    built,
    gpt_batches,
    mlp_batches,
    mse_loss,
    Trajectory,
    flat_params,
    reference_run,
    rel_l2,
    run_steps,
    zshard_run,
)
from train.model import GPT, GPTConfig, cross_entropy_loss

GPT_CFG = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2)

# (strategy, replica, shard)
CONFIGS = [("FULL_SHARD", 1, 8), ("HYBRID_SHARD", 2, 4), ("HYBRID_SHARD", 4, 2)]
CONFIG_IDS = [f"{s}-{r}x{n}" for s, r, n in CONFIGS]


def configs(models):
    """``models x CONFIGS`` as pytest params ``(model_name, init_with, strategy, r, s)``; HYBRID_SHARD 4x2
    -m exhaustive except for the mlp under SGD: 4x2 takes 2x4's code path (gathers and reduce-scatters
    over shard, the all-reduce over replica) with the sizes swapped. The default run keeps it where a
    gradient-scale error shows most (SGD, elementwise) and in the layout tests below."""
    return [pytest.param(m, i, *c, id=f"{m}-{i}-{cid}",
                         marks=pytest.mark.exhaustive if (c[1], c[2]) == (4, 2) and (m, i) != ("mlp", "callable") else ())
            for m, i in models for c, cid in zip(CONFIGS, CONFIG_IDS)]


def make_gpt():
    return GPT(GPT_CFG, rngs=nnx.Rngs(0))


def make_mlp():
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))


MODELS = {
    # name: (builder, loss, batches(steps))
    "gpt": (make_gpt, cross_entropy_loss, lambda steps: gpt_batches(steps, batch=8, seq_len=GPT_CFG.seq_len)),
    "mlp": (make_mlp, mse_loss, lambda steps: mlp_batches(steps, batch=16)),
}

ADAM_STEPS, SGD_STEPS = 10, 3
OPTIMIZERS = {
    "adamw": (lambda: optax.adamw(1e-3), ADAM_STEPS),
    "sgd": (lambda: optax.sgd(0.1), SGD_STEPS),
}


@functools.cache
def reference(model_name: str, opt_name: str):
    """Single-device ground truth, computed once per (model, optimizer)."""
    build, loss_fn, batches = MODELS[model_name]
    make_tx, steps = OPTIMIZERS[opt_name]
    return reference_run(build, make_tx(), loss_fn, batches(steps))


def run_zshard(model_name, opt_name, strategy, r, s, init_with: str):
    build, loss_fn, batches = MODELS[model_name]
    make_tx, steps = OPTIMIZERS[opt_name]
    if model_name == "gpt" and init_with == "callable":
        # the GPT from its builder: first compared with the same GPT built once, eagerly, and copied
        # (assert_module_and_callable_inits_agree; test_init_module_and_callable_agree's check on this mesh),
        # then trained, as zshard_run trains: its init program compiled once for both checks
        tx, mesh = make_tx(), zshard.make_mesh(r, s)
        state = zshard.init(build, tx, mesh, strategy=strategy)
        assert_module_and_callable_inits_agree(zshard.init(built(build), tx, mesh, strategy=strategy), state)
        state, losses, norms = run_steps(zshard.make_train_step(loss_fn, prefetch=1), state, batches(steps))
        model = zshard.unshard(state)
        return Trajectory(losses, norms, flat_params(model), model)
    # a built module (copied to the shards from host; built once, conftest.built) or a zero-arg callable (built under jit)
    init_arg = built(build) if init_with == "module" else build
    return zshard_run(init_arg, make_tx(), zshard.make_mesh(r, s), strategy, loss_fn, batches(steps))


def check_structure(got, ref):
    """unshard() gives back exactly the logical parameters: same paths, shapes, dtypes, class."""
    assert type(got.model) is type(ref.model)
    assert set(got.params) == set(ref.params)
    for path, b in ref.params.items():
        a = got.params[path]
        assert a.shape == b.shape, (path, a.shape, b.shape)
        assert a.dtype == b.dtype, (path, a.dtype, b.dtype)


def check_metrics(got, ref):
    assert len(got.losses) == len(ref.losses)
    for i, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: loss {a} vs reference {b}"
    for i, (a, b) in enumerate(zip(got.grad_norms, ref.grad_norms)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: grad_norm {a} vs reference optax.global_norm {b}"


# --------------------------------------------------------------------------------------
# Equivalence with a plain single-device step
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name,init_with,strategy,r,s", configs([("gpt", "callable"), ("mlp", "module")]))
def test_adamw_matches_reference(model_name, init_with, strategy, r, s):
    ref = reference(model_name, "adamw")
    got = run_zshard(model_name, "adamw", strategy, r, s, init_with)
    check_structure(got, ref)
    check_metrics(got, ref)
    # Per-parameter relative L2 error, not elementwise: Adam divides each element's update by
    # sqrt(nu), so it amplifies fp32 reduction-order noise where the true gradient is a
    # cancelling sum near zero (e.g. zero-initialised biases, whose gradient is a sum over
    # the batch of terms of both signs). Summing in a different order on 8 devices then
    # flips the sign of a ~1e-9 gradient and moves that one element by a whole lr; the
    # parameter as a whole still agrees to ~1e-7.
    errors = {p: rel_l2(got.params[p], b) for p, b in ref.params.items()}
    bad = {p: e for p, e in errors.items() if not e <= 1e-5}
    assert not bad, f"parameters off the reference by more than 1e-5 (relative L2): {bad}"


@pytest.mark.parametrize("model_name,init_with,strategy,r,s", configs([("gpt", "module"), ("mlp", "callable")]))
def test_sgd_matches_reference_elementwise(model_name, init_with, strategy, r, s):
    # SGD's update is proportional to the gradient: a gradient scale bug (summed twice over
    # replica, divided by the wrong device count) shows here, while Adam is scale-invariant.
    ref = reference(model_name, "sgd")
    got = run_zshard(model_name, "sgd", strategy, r, s, init_with)
    check_structure(got, ref)
    check_metrics(got, ref)
    chex.assert_trees_all_close(got.params, ref.params, rtol=1e-5, atol=1e-6)


def test_full_shard_on_2x4_matches_reference():
    # FULL_SHARD also over a 2-D mesh: parameters split over all 8 devices of both axes
    ref = reference("mlp", "sgd")
    got = run_zshard("mlp", "sgd", "FULL_SHARD", 2, 4, "module")
    check_metrics(got, ref)
    chex.assert_trees_all_close(got.params, ref.params, rtol=1e-5, atol=1e-6)


def assert_module_and_callable_inits_agree(a, b):
    """``a`` from the GPT built once, eagerly (``built(make_gpt)``), ``b`` from its builder ``make_gpt``
    (initialised under jit), on the same mesh and strategy: the same parameters, shardings and model."""
    chex.assert_trees_all_equal_shapes_and_dtypes(a.params, b.params)
    chex.assert_trees_all_close(a.params, b.params, rtol=1e-6, atol=1e-7)
    assert jax.tree.map(lambda x: x.sharding, a.params) == jax.tree.map(lambda x: x.sharding, b.params)
    # and both unshard to the model they came from (the built one: init leaves it as it was, test_init_does_not_touch_the_model)
    ref = built(make_gpt)
    for state in (a, b):
        model = zshard.unshard(state)
        chex.assert_trees_all_close(
            nnx.to_pure_dict(nnx.state(model, nnx.Param)),
            nnx.to_pure_dict(nnx.state(ref, nnx.Param)),
            rtol=1e-6,
            atol=1e-7,
        )


# FULL_SHARD 1x8 and HYBRID_SHARD 2x4: test_adamw_matches_reference[gpt-callable-*] runs this check on the
# state it then trains (run_zshard), one init program compiled for both; 4x2, whose gpt-callable AdamW case is
# -m exhaustive, here
@pytest.mark.parametrize("strategy,r,s", [c for c in CONFIGS if (c[1], c[2]) == (4, 2)],
                         ids=[i for c, i in zip(CONFIGS, CONFIG_IDS) if (c[1], c[2]) == (4, 2)])
def test_init_module_and_callable_agree(strategy, r, s):
    mesh = zshard.make_mesh(r, s)
    tx = optax.adamw(1e-3)
    a = zshard.init(built(make_gpt), tx, mesh, strategy=strategy)  # built once, eagerly
    b = zshard.init(make_gpt, tx, mesh, strategy=strategy)
    assert_module_and_callable_inits_agree(a, b)


def test_init_does_not_touch_the_model():
    model = make_mlp()
    before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model)))
    zshard.init(model, optax.adamw(1e-3), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model)), before)


# --------------------------------------------------------------------------------------
# The README's API in ten lines, as written, with a user's own model
# --------------------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, d, *, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
        self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.fc2(jax.nn.gelu(self.fc1(self.norm(x))))


class UserModel(nnx.Module):
    def __init__(self, d=24, n=3, *, rngs):
        self.embed = nnx.Linear(10, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs=rngs) for _ in range(n)])
        self.out = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        for blk in self.blocks:
            h = blk(h)
        return self.out(h)[..., 0]


def test_design_section_1_api():
    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((32, 10)).astype(np.float32), "y": rng.standard_normal(32).astype(np.float32)}
    model = UserModel(rngs=nnx.Rngs(0))
    # the test's own loss evaluations (before and after training) in one jitted program: run eagerly, each
    # of their ~40 operations compiled a program of its own (the step below takes loss_fn itself, unjitted)
    plain_loss = nnx.jit(loss_fn)
    initial_loss = float(plain_loss(model, batch))

    mesh = zshard.make_mesh(replica=2, shard=4)
    assert isinstance(mesh, jax.sharding.Mesh) and tuple(mesh.axis_names) == ("replica", "shard")
    state = zshard.init(model, optax.adamw(3e-4), mesh, strategy="HYBRID_SHARD", unit=Block)
    assert isinstance(state, zshard.ShardedState)
    assert [u.name for u in state.plan.units] == ["root", "blocks.0", "blocks.1", "blocks.2"]
    step = zshard.make_train_step(loss_fn)
    losses = []
    for i in range(5):
        # numpy the first time, jax arrays after: both are accepted
        b = batch if i == 0 else jax.tree.map(jnp.asarray, batch)
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    assert abs(losses[0] - initial_loss) <= 1e-5 * initial_loss
    assert losses[-1] < losses[0]
    assert int(state.step) == 5

    trained = zshard.unshard(state)
    assert isinstance(trained, nnx.Module) and isinstance(trained, UserModel)
    assert isinstance(trained.blocks[0], Block) and type(trained.blocks[0]) is Block
    # the plain model runs anywhere, and has learned what the sharded step did
    assert float(plain_loss(trained, batch)) < initial_loss


# --------------------------------------------------------------------------------------
# Layout of the sharded state
# --------------------------------------------------------------------------------------


LAYOUTS = [("FULL_SHARD", 1, 8, P(("replica", "shard"))), ("FULL_SHARD", 2, 4, P(("replica", "shard"))),
           ("HYBRID_SHARD", 2, 4, P("shard")), ("HYBRID_SHARD", 4, 2, P("shard"))]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"{s}-{r}x{n}" for s, r, n, _ in LAYOUTS])
def trained(request):
    strategy, r, s, spec = request.param
    mesh = zshard.make_mesh(r, s)
    state = zshard.init(make_mlp(), optax.adamw(1e-2, weight_decay=0.1), mesh, strategy=strategy)
    step = zshard.make_train_step(mse_loss)
    for b in mlp_batches(4):
        state, _ = step(state, b)
    return state, strategy, r, s, spec


def _logical_sizes():
    return {p: int(np.prod(v.shape)) for p, v in nnx.to_flat_state(nnx.state(make_mlp()))}


def test_param_layout(trained):
    state, strategy, r, s, spec = trained
    n_shards = r * s if strategy == "FULL_SHARD" else s
    sizes = _logical_sizes()
    flat = traverse_util.flatten_dict(state.params)
    assert set(flat) == set(sizes)
    for path, leaf in flat.items():
        n = sizes[path]
        n_pad = -(-n // n_shards) * n_shards
        assert leaf.shape == (n_pad,), (path, leaf.shape, n_pad)
        assert leaf.dtype == jnp.float32
        assert isinstance(leaf.sharding, NamedSharding)
        assert leaf.sharding.spec == spec, (path, leaf.sharding.spec)
        assert leaf.sharding.mesh.shape == state.plan.mesh.shape
        shards = leaf.addressable_shards
        assert len(shards) == 8
        for sh in shards:
            assert sh.data.shape == (n_pad // n_shards,), (path, sh.data.shape)
        # row k of the padded parameter lives on shard position k
        host = np.asarray(leaf)
        for sh in shards:
            np.testing.assert_array_equal(np.asarray(sh.data), host[sh.index])
        if strategy == "HYBRID_SHARD":
            # replicated over replica: the same bytes on (i, j) and (i', j)
            by_pos = {}
            for sh in shards:
                by_pos.setdefault(tuple((i.start, i.stop) for i in sh.index), []).append(np.asarray(sh.data))
            assert len(by_pos) == n_shards
            for copies in by_pos.values():
                assert len(copies) == r
                for c in copies[1:]:
                    np.testing.assert_array_equal(c, copies[0])
        # padding is exactly zero after several AdamW steps with weight decay
        np.testing.assert_array_equal(host[n:], 0.0, err_msg=f"padding of {path} is not zero")
        assert np.all(np.isfinite(host)) and np.any(host[:n] != 0)


def test_opt_state_layout(trained):
    state, strategy, r, s, spec = trained
    mu = optax.tree_utils.tree_get(state.opt_state, "mu")
    nu = optax.tree_utils.tree_get(state.opt_state, "nu")
    count = optax.tree_utils.tree_get(state.opt_state, "count")
    for moment in (mu, nu):
        # The optimizer sees each shard with the parameter's logical rank: [1, .., 1, n_pad]
        # (so masks like p.ndim > 1 keep their meaning); the elements are the parameter's.
        flat_moment = jax.tree.map(lambda x: x.reshape(-1), moment)
        chex.assert_trees_all_equal_shapes_and_dtypes(flat_moment, state.params)
        for leaf in jax.tree.leaves(moment):
            assert leaf.shape[:-1] == (1,) * (leaf.ndim - 1)
            assert leaf.sharding.spec[-1] == spec[0] and all(a is None for a in leaf.sharding.spec[:-1])
            assert leaf.addressable_shards[0].data.size == leaf.size // (r * s if strategy == "FULL_SHARD" else s)
    assert count.shape == ()
    assert count.sharding.spec == P() or count.sharding.is_fully_replicated
    assert int(count) == 4
    assert state.step.shape == () and state.step.sharding.is_fully_replicated and int(state.step) == 4
    # padding of the moments is zero too (zero gradient, zero parameter)
    sizes = _logical_sizes()
    for moment in (mu, nu):
        for path, leaf in traverse_util.flatten_dict(moment).items():
            np.testing.assert_array_equal(np.asarray(leaf).reshape(-1)[sizes[path]:], 0.0)


def test_plan_padded_sizes(trained):
    state, strategy, r, s, _ = trained
    plan = state.plan
    n_shards = r * s if strategy == "FULL_SHARD" else s
    assert plan.num_shards == n_shards and plan.world == 8
    assert plan.num_params() == sum(_logical_sizes().values())
    assert [u.name for u in plan.units] == ["root", "blocks.0", "blocks.1"]
    for u in plan.units:
        for f in u.flats:
            assert f.num_shards == n_shards
            for slot in f.slots:
                assert slot.padded % n_shards == 0 and slot.padded >= slot.size


# --------------------------------------------------------------------------------------
# Bad input: clear errors before anything compiles
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh24():
    return zshard.make_mesh(2, 4)


def test_unknown_strategy(mesh24):
    with pytest.raises(ValueError) as e:
        zshard.init(make_mlp(), optax.sgd(0.1), mesh24, strategy="ZERO_INFINITY")
    msg = str(e.value)
    assert "ZERO_INFINITY" in msg and "FULL_SHARD" in msg and "HYBRID_SHARD" in msg


def test_strategy_enum_and_lowercase(mesh24):
    a = zshard.init(make_mlp(), optax.sgd(0.1), mesh24, strategy=zshard.Strategy.HYBRID_SHARD)
    b = zshard.init(make_mlp(), optax.sgd(0.1), mesh24, strategy="hybrid_shard")
    assert a.plan.strategy is b.plan.strategy is zshard.Strategy.HYBRID_SHARD


def test_wrong_mesh_axes():
    devices = np.asarray(jax.devices()).reshape(2, 4)
    bad = jax.sharding.Mesh(devices, ("data", "model"))
    with pytest.raises(ValueError) as e:
        zshard.init(make_mlp(), optax.sgd(0.1), bad)
    msg = str(e.value)
    assert "replica" in msg and "shard" in msg and "data" in msg


def test_not_a_mesh():
    with pytest.raises((ValueError, TypeError)) as e:
        zshard.init(make_mlp(), optax.sgd(0.1), "2x4")
    assert "mesh" in str(e.value)


def test_model_not_module_or_callable(mesh24):
    with pytest.raises(TypeError) as e:
        zshard.init(42, optax.sgd(0.1), mesh24)
    assert "int" in str(e.value)
    with pytest.raises(TypeError, match="callable must return an nnx.Module, it returned an array"):
        zshard.init(lambda: 3, optax.sgd(0.1), mesh24)


def test_tx_not_an_optax_transformation(mesh24):
    with pytest.raises(TypeError, match="tx must be an optax.GradientTransformation.*got str"):
        zshard.init(make_mlp, "adam", mesh24)


def test_unit_class_not_in_model(mesh24):
    class Missing(nnx.Module):
        pass

    with pytest.raises(ValueError) as e:
        zshard.init(make_mlp(), optax.sgd(0.1), mesh24, unit=Missing)
    msg = str(e.value)
    assert "Missing" in msg and "ResBlock" in msg and "Linear" in msg


def test_leftover_intermediate_is_refused(mesh24):
    class Sows(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            y = self.lin(x)
            self.sow(nnx.Intermediate, "act", y)
            return y

    model = Sows(nnx.Rngs(0))
    model(jnp.ones((2, 4)))  # leaves model.act behind
    with pytest.raises(ValueError, match=r"sow-ed intermediate 'act'.*nnx.pop"):
        zshard.init(model, optax.sgd(0.1), mesh24)


@pytest.mark.parametrize(
    "batch,where",
    [
        ((np.zeros((12, 13), np.float32), np.zeros((12, 3), np.float32)), "batch[0]"),
        ({"x": np.zeros((16, 13), np.float32), "y": np.zeros((20, 3), np.float32)}, "batch['y']"),
    ],
    ids=["tuple-12", "dict-y-20"],
)
def test_batch_not_divisible(mesh24, batch, where):
    traced = []

    def loss_fn(model, b):
        traced.append(True)
        return mse_loss(model, b if isinstance(b, tuple) else (b["x"], b["y"]))

    state = zshard.init(make_mlp(), optax.sgd(0.1), mesh24, strategy="HYBRID_SHARD")
    step = zshard.make_train_step(loss_fn)
    with pytest.raises(ValueError) as e:
        step(state, batch)
    msg = str(e.value)
    assert where in msg, msg
    assert "8" in msg
    bad_dim = str(jax.tree.leaves(batch)[0].shape[0] if where == "batch[0]" else 20)
    assert bad_dim in msg
    assert not traced, "the error must come before tracing / compiling the step"
    # the state was not donated by the failed call: it still trains
    state, metrics = step(state, (np.zeros((16, 13), np.float32), np.zeros((16, 3), np.float32)))
    assert np.isfinite(float(metrics["loss"]))

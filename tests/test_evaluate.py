"""``zshard.make_eval_step``: forward only, on the sharded state (zshard/programs/evaluate.py).

1. The loss equals a plain single-device forward on the same weights (fp32, 1e-5 relative),
   for every strategy and mesh shape, token-weighted ``zshard.TokenMean`` losses included.
2. HLO: one all-gather per parameter of each unit per call, no reduce-scatter, only scalar all-reduces.
3. Memory: the compiled eval step's temporary bytes stay at about two blocks, far below the
   whole model; the unsharded forward needs the whole model as arguments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zshard
from conftest import ResMLP, mlp_batches, mse_loss, rel_l2
from test_structure import count, groups_of, parse_collectives

CASES = [("FULL_SHARD", 1, 8), ("HYBRID_SHARD", 2, 4), ("SHARD_GRAD_OP", 1, 8), ("NO_SHARD", 2, 4)]


def _model():
    return ResMLP(13, 19, 3, n_blocks=3, rngs=nnx.Rngs(0))


@functools.cache
def _state(strategy, r, s):
    """``_model()`` built eagerly (copied to the shards, not compiled: a builder's initialisers
    compile per mesh and strategy; the builder path: test_strategies) and placed once per mesh:
    an eval step leaves its state as it was (checked below), so the tests share it."""
    return zshard.init(_model(), optax.adamw(1e-3), zshard.make_mesh(r, s), strategy=strategy)


_loss_one_device = nnx.jit(mse_loss)  # the reference in one program, not op by op


@pytest.mark.parametrize("strategy,r,s", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
def test_eval_loss_matches_single_device(strategy, r, s):
    state = _state(strategy, r, s)
    ev = zshard.make_eval_step(mse_loss)
    ref = _model()
    for batch in mlp_batches(2, batch=16):
        got = ev(state, batch)
        want = _loss_one_device(ref, jax.tree.map(jnp.asarray, batch))
        assert set(got) == {"loss"}
        assert rel_l2(got["loss"], want) < 1e-5, (float(got["loss"]), float(want))


def test_eval_token_weighted_and_state_unchanged():
    state = _state("FULL_SHARD", 2, 4)
    before = jax.tree.map(np.asarray, state.params)
    x, y = mlp_batches(1, batch=16)[0]
    mask = np.zeros((16,), np.float32)
    mask[:3] = 1  # valid rows on device 0 only: a mean of per-device means would be wrong
    mask[9] = 1

    def masked(model, batch):
        x, y, m = batch
        err = jnp.sum(jnp.square(model(x) - y), axis=-1)  # [b]
        return zshard.TokenMean(jnp.sum(err * m), jnp.sum(m))

    got = zshard.make_eval_step(masked)(state, (x, y, mask))
    err = np.sum(np.square(np.asarray(_model()(jnp.asarray(x))) - y), axis=-1)
    want = np.sum(err * mask) / mask.sum()
    assert rel_l2(got["loss"], want) < 1e-5 and float(got["tokens"]) == 4.0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)


def test_eval_bad_batch_names_sizes():
    state = _state("FULL_SHARD", 1, 8)
    x, y = mlp_batches(1, batch=12)[0]
    with pytest.raises(ValueError, match=r"batch\[0\] has shape \(12, 13\).*multiple of 8"):
        zshard.make_eval_step(mse_loss)(state, (x, y))


L, D = 4, 512  # a block: 512*512 + 512 fp32 = 1.05 MB


@functools.cache
def _compiled(strategy, r, s, n_blocks=L, prefetch=1):
    state = zshard.init(ResMLP(64, D, 64, n_blocks=n_blocks, rngs=nnx.Rngs(0)), optax.sgd(1e-3),
                        zshard.make_mesh(r, s), strategy=strategy)
    compiled = zshard.make_eval_step(mse_loss, prefetch=prefetch).lower(state, mlp_batches(1, 16, 64, 64)[0]).compile()
    return state, compiled


def test_the_lowered_program_returns_what_the_step_returns():
    """``lower()`` is the program ``__call__`` runs (zshard.programs.program.ShardedProgram): compiled, it
    returns the metrics alone (what a trace found, its TraceInfo, comes from ``trace()``)."""
    state, compiled = _compiled("FULL_SHARD", 1, 8)
    ev = zshard.make_eval_step(mse_loss, prefetch=1)
    out = compiled(state, ev.put_batch(state, mlp_batches(1, 16, 64, 64)[0]))
    assert isinstance(out, dict) and set(out) == {"loss"} and np.isfinite(float(out["loss"]))
    _, info = ev.trace(state, mlp_batches(1, 16, 64, 64)[0])
    assert info.split is None and info.calls == ()  # no sequence split, no zshard.attention


@pytest.mark.parametrize("strategy,r,s", [("FULL_SHARD", 1, 8), ("HYBRID_SHARD", 2, 4)])
def test_eval_hlo_one_gather_per_unit_no_reduce_scatter(strategy, r, s):
    state, compiled = _compiled(strategy, r, s)
    ops = parse_collectives(compiled.as_text())
    plan = state.plan
    ags = [o for o in ops if o.kind == "all-gather"]
    # one all-gather per parameter (collectives._gather_all), every unit once
    slots = [sl for u in plan.units for f in u.flats for sl in f.slots]
    assert len(plan.units) == L + 1 and count(ops, "all-gather") == len(slots), [(o.op, o.sizes) for o in ags]
    assert sorted(n for o in ags for n in o.sizes) == sorted(sl.padded for sl in slots)
    assert all(o.groups == groups_of(plan.mesh, plan.shard_axes) for o in ags)
    assert count(ops, "reduce-scatter") == 0
    assert all(max(o.sizes) <= 1 for o in ops if o.kind == "all-reduce"), "only the scalar loss is all-reduced"


def test_eval_memory_two_blocks_not_the_model():
    state8, c8 = _compiled("FULL_SHARD", 1, 8, n_blocks=8)
    _, c4 = _compiled("FULL_SHARD", 1, 8, n_blocks=4)
    mem8, mem4 = c8.memory_analysis(), c4.memory_analysis()
    model_bytes = 4 * state8.plan.num_params()
    block_bytes = 4 * (D * D + D)
    info = f"temp {mem8.temp_size_in_bytes / 1e6:.2f} MB (4 blocks {mem4.temp_size_in_bytes / 1e6:.2f}), model {model_bytes / 1e6:.2f} MB"
    # two gathered units (this one, as its all-gather outputs [n_pad] per parameter and its
    # parameters, and the prefetched next one, as its all-gather outputs only until its input
    # exists), plus activations: measured 3.39 blocks (4.4 before the prefetched gather waited to
    # be sliced, collectives.gather_params(ready=...)). Without the forced schedule
    # (zshard/programs/evaluate.py) it was 17.3 MB, twice the model.
    assert mem8.temp_size_in_bytes <= 3.6 * block_bytes, info
    assert mem8.temp_size_in_bytes < 0.6 * model_bytes, info
    assert mem8.temp_size_in_bytes - mem4.temp_size_in_bytes <= 0.1 * block_bytes, info  # depth adds no temp
    assert mem8.argument_size_in_bytes < model_bytes / 8 + 0.1 * block_bytes, info  # the shards only

    # the unsharded forward on one device takes the whole model as its argument
    # without prefetch: about one unit at a time (measured 2.4 blocks)
    mem0 = _compiled("FULL_SHARD", 1, 8, n_blocks=8, prefetch=0)[1].memory_analysis()
    assert mem0.temp_size_in_bytes <= 2.5 * block_bytes, f"prefetch=0: temp {mem0.temp_size_in_bytes / 1e6:.2f} MB"

    ref = ResMLP(64, D, 64, n_blocks=8, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(ref)
    full = jax.jit(lambda p, b: mse_loss(nnx.merge(graphdef, p), b)).lower(params, mlp_batches(1, 16, 64, 64)[0]).compile()
    assert full.memory_analysis().argument_size_in_bytes >= model_bytes


class _DropNormBlock(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.fc = nnx.Linear(d, d, rngs=rngs)
        self.norm = nnx.BatchNorm(d, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jax.nn.relu(self.norm(self.fc(x))))


class _DropNormNet(nnx.Module):
    """Dropout and BatchNorm inside each block unit and in the root."""

    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(13, 16, rngs=rngs)
        self.blocks = nnx.List([_DropNormBlock(16, rngs=rngs) for _ in range(2)])
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x))


@pytest.mark.parametrize("strategy,r,s", [("FULL_SHARD", 1, 8), ("HYBRID_SHARD", 2, 4)])
def test_eval_runs_the_model_in_evaluation_mode(strategy, r, s):
    """Dropout off and BatchNorm on its running averages, as ``model.eval()`` on one device:
    the loss equals the single-device evaluation-mode loss and is not the training-mode one
    (the eval step used to run dropout, the same mask on every call)."""
    make = lambda: _DropNormNet(nnx.Rngs(0))  # noqa: E731
    state = zshard.init(make(), optax.sgd(0.1), zshard.make_mesh(r, s), strategy=strategy)
    got = zshard.make_eval_step(mse_loss)(state, next(iter(mlp_batches(1, batch=16))))
    ref = make()
    batch = jax.tree.map(jnp.asarray, next(iter(mlp_batches(1, batch=16))))
    ref.eval()
    want = _loss_one_device(ref, batch)
    assert rel_l2(got["loss"], want) < 1e-5, (float(got["loss"]), float(want))
    ref.train()
    assert rel_l2(got["loss"], _loss_one_device(ref, batch)) > 1e-2  # training mode really differs here

    def train_mode(model, batch):
        model.train()
        return mse_loss(model, batch)

    # the escape hatch: fn may switch back; it then sees dropout and the batch's statistics
    again = zshard.make_eval_step(train_mode)(state, next(iter(mlp_batches(1, batch=16))))
    assert rel_l2(again["loss"], got["loss"]) > 1e-2

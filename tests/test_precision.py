"""Mixed precision with FSDP's meaning: fp32 masters in the shards, gathers and compute in
param_dtype, gradient reduction in reduce_dtype."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import built, gpt_batches, reference_run
from flax import nnx

import zshard
from train.model import GPT, GPTConfig, cross_entropy_loss
from zshard.report import parse_collectives


def gpt():
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2), rngs=nnx.Rngs(0))


BF16 = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")


@functools.cache
def fp32_reference():
    """20 fp32 AdamW steps on one device, computed once: the cases differ only on the zshard side."""
    return reference_run(gpt, optax.adamw(3e-3), cross_entropy_loss, gpt_batches(20))


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4))])
def test_bf16_compute_tracks_fp32_reference(strategy, mesh):
    # Stated tolerance: bf16 keeps 8 mantissa bits (relative spacing 2^-8 = 0.4%); over 20
    # AdamW steps the loss stays within 2% of the fp32 run.
    data = gpt_batches(20)
    want = fp32_reference()
    state = zshard.init(built(gpt), optax.adamw(3e-3), zshard.make_mesh(*mesh), strategy=strategy, mixed_precision=BF16)
    step = zshard.make_train_step(cross_entropy_loss)
    losses = []
    for b in data:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want.losses, rtol=2e-2)
    assert losses[-1] < losses[0] - 0.3  # it trains
    # masters and optimizer state stay fp32 in the shards
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
    assert jnp.dtype("float32") in {x.dtype for x in jax.tree.leaves(state.opt_state)}


@functools.cache  # BF16 on HYBRID_SHARD 2x4: read by two tests, emitted once
def _program(mp, strategy="FULL_SHARD", mesh=(1, 8)):
    """The step as zshard emits it (HLO before XLA's optimisation passes) and its collectives.

    XLA:CPU's float normalisation upcasts bf16 collectives to f32 in the *compiled* program
    (the CPU runtime has no bf16 all-gather); GPU backends keep them. The emitted program is
    what carries zshard's choice of dtype, so the dtype and byte checks read it.
    """
    state = zshard.init(built(gpt), optax.sgd(0.1), zshard.make_mesh(*mesh), strategy=strategy, mixed_precision=mp)
    step = zshard.make_train_step(cross_entropy_loss)
    hlo = step.lower(state, gpt_batches(1)[0]).as_text(dialect="hlo")
    return hlo, parse_collectives(hlo, state.plan.mesh)


def _result_types(hlo, op):
    return [line.split("=", 1)[1].split(op)[0] for line in hlo.splitlines() if f" {op}(" in line]


def test_gathers_move_param_dtype_and_reduce_in_reduce_dtype():
    hlo, _ = _program(BF16)
    gathers, scatters = _result_types(hlo, "all-gather"), _result_types(hlo, "reduce-scatter")
    assert gathers and all(t.strip().startswith("bf16[") for t in gathers), gathers
    assert scatters and all(t.strip().startswith("f32[") for t in scatters), scatters
    hlo2, _ = _program(zshard.MixedPrecision(param_dtype="bfloat16"))  # reduce_dtype defaults to param_dtype
    assert all(t.strip().startswith("bf16[") for t in _result_types(hlo2, "reduce-scatter"))
    hlo3, _ = _program(BF16, "HYBRID_SHARD", (2, 4))  # the cross-replica all-reduce is in reduce_dtype too
    assert any(t.strip().startswith("f32[") and "[]" not in t for t in _result_types(hlo3, "all-reduce"))


def test_bf16_halves_the_gather_bytes():
    def gather_bytes(mp):
        _, colls = _program(mp, "HYBRID_SHARD", (2, 4))
        return sum(c.sent_bytes * c.trips for c in colls if c.kind == "all-gather")

    assert gather_bytes(BF16) == pytest.approx(gather_bytes(None) / 2, rel=1e-6)


def test_report_formula_counts_gathers_in_param_dtype():
    state = zshard.init(built(gpt), optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD", mixed_precision=BF16)
    fp32 = zshard.init(built(gpt), optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    step = zshard.make_train_step(cross_entropy_loss)
    r16, r32 = (zshard.report(step, s, gpt_batches(1)[0]) for s in (state, fp32))
    # gathers halve, the fp32 reduce-scatter and replica all-reduce do not
    assert r16.comm_bytes_per_step["replica"]["formula"] == r32.comm_bytes_per_step["replica"]["formula"]
    assert r16.comm_bytes_per_step["shard"]["formula"] < r32.comm_bytes_per_step["shard"]["formula"]
    assert r32.comm_bytes_per_step["shard"]["ratio"] == pytest.approx(1.0, abs=0.01)


def test_fp32_masters_keep_updates_below_bf16_resolution():
    state = zshard.init(built(gpt), optax.sgd(1e-6), zshard.make_mesh(1, 8), mixed_precision=BF16)
    before = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    step = zshard.make_train_step(cross_entropy_loss)
    for b in gpt_batches(3):
        state, _ = step(state, b)
    after = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    w0 = np.asarray(before["head"]["kernel"], np.float32)
    w1 = np.asarray(after["head"]["kernel"], np.float32)
    moved = w1 != w0
    assert moved.any()  # the fp32 master moved ...
    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # noqa: E731
    # ... by less than bf16 can represent: a bf16 master would not have changed at all
    assert np.mean(bf16(w1)[moved] == bf16(w0)[moved]) > 0.9


def test_bad_mixed_precision():
    with pytest.raises(ValueError, match="floating dtype"):
        zshard.MixedPrecision(param_dtype="int32")
    with pytest.raises(ValueError, match="not a dtype"):
        zshard.MixedPrecision(reduce_dtype="fp42")
    with pytest.raises(TypeError, match="MixedPrecision"):
        zshard.init(gpt, optax.sgd(0.1), zshard.make_mesh(1, 8), mixed_precision="bf16")

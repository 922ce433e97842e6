"""Stacked blocks (built with nnx.vmap, run with nnx.scan) as units: the layer axis is never
sharded and each scan iteration gathers only its own layer."""

import functools

import jax
import numpy as np
import optax
import pytest
from conftest import REPEATED_MODEL_PATH, built, gpt_batches, reference_run, zshard_run
from flax import nnx
from jax.sharding import PartitionSpec as P

import zshard
from train.model import GPT, GPTConfig, Llama, LlamaConfig, cross_entropy_loss
from zshard.report import parse_collectives
from zshard.params.units import stacked_layers

L = 3


def gpt(scan):
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layers=L, n_heads=2, scan=scan), rngs=nnx.Rngs(0))


def llama(scan):
    cfg = LlamaConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=L, n_heads=4, n_kv_heads=2, d_ff=48, scan=scan)
    return Llama(cfg, rngs=nnx.Rngs(0))


def test_stacked_units_are_detected_and_laid_out_per_layer():
    # built once, eagerly, and copied to the shards: the builder's path of the same layout is
    # test_scanned_equals_unrolled_equals_reference[gpt-HYBRID_SHARD]'s
    state = zshard.init(built(gpt, True), optax.adamw(1e-3), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    units = {u.name: u.layers for u in state.plan.units}
    assert units == {"root": None, "blocks": L}
    kernel = state.params["blocks"]["mlp"]["fc"]["kernel"]  # [L, 32*128] -> per layer padded to /4
    assert kernel.shape == (L, 32 * 128) and kernel.sharding.spec == P(None, "shard")
    assert kernel.addressable_shards[0].data.shape == (L, 32 * 128 // 4)
    assert stacked_layers(gpt(False).blocks[0]) is None  # an ordinary block is not "stacked"


def unrolled_copy(make):
    """The unrolled (nnx.List) model holding exactly the scanned model's initial weights."""
    scanned, unrolled = make(True), make(False)
    stacked = nnx.state(scanned, nnx.Param).to_pure_dict()
    target = nnx.state(unrolled, nnx.Param).to_pure_dict()
    target["blocks"] = {i: jax.tree.map(lambda x: x[i], stacked["blocks"]) for i in range(L)}
    for key in stacked:
        if key != "blocks":
            target[key] = stacked[key]
    nnx.update(unrolled, nnx.State(target))
    return unrolled


@functools.cache
def unrolled_reference(make):
    """The single-device reference of the unrolled copy of ``make``'s model, 4 steps of AdamW;
    computed once per model (read-only), not once per strategy."""
    return reference_run(lambda: unrolled_copy(make), optax.adamw(1e-3), cross_entropy_loss, gpt_batches(4))


# Every strategy on the scanned GPT but the two whose model path another strategy takes (a model's own
# scan: conftest.REPEATED_MODEL_PATH, SHARD_OPT is NO_SHARD's, HYBRID_SHARD_ZERO2 SHARD_GRAD_OP's within a
# shard group with HYBRID_SHARD's reduction), those -m exhaustive; the scanned Llama (rotary positions,
# grouped-query attention in the loop body) on one strategy per replica handling, the others -m exhaustive
CASES = [pytest.param(gpt, s.value, id=f"gpt-{s.value}", marks=pytest.mark.exhaustive if s.value in REPEATED_MODEL_PATH else ())
         for s in zshard.Strategy] + [
    pytest.param(llama, s.value, id=f"llama-{s.value}",
                 marks=() if s.value in ("FULL_SHARD", "HYBRID_SHARD") else pytest.mark.exhaustive)
    for s in zshard.Strategy
]


# The stacked model from its builder (vmapped initialisers compiled under jit, per layout) where the layout is one
# of its own: NO_SHARD (replicated), FULL_SHARD (over all 8 devices), HYBRID_SHARD (over shard, replicated over
# replica); built once, eagerly, and copied where another case's builder made the same parameter layout:
# SHARD_GRAD_OP's is FULL_SHARD's, HYBRID_SHARD_OPT's HYBRID_SHARD's (its optimizer state aside), the Llama on
# HYBRID_SHARD after its FULL_SHARD.
BUILT = {("gpt", "SHARD_GRAD_OP"), ("gpt", "HYBRID_SHARD_OPT"), ("llama", "HYBRID_SHARD")}


@pytest.mark.parametrize("make,strategy", CASES)
def test_scanned_equals_unrolled_equals_reference(make, strategy):
    data = gpt_batches(4)
    want = unrolled_reference(make)
    init_arg = built(make, True) if (make.__name__, strategy) in BUILT else (lambda: make(True))
    scanned = zshard_run(init_arg, optax.adamw(1e-3), zshard.make_mesh(2, 4), strategy, cross_entropy_loss, data)
    np.testing.assert_allclose(scanned.losses, want.losses, rtol=1e-5)
    np.testing.assert_allclose(scanned.grad_norms, want.grad_norms, rtol=1e-5)
    # the scanned model's parameters are the unrolled ones stacked on a leading layer axis
    for path, ref in want.params.items():
        if path[0] == "blocks":
            got = scanned.params[("blocks",) + path[2:]][path[1]]
        else:
            got = scanned.params[path]
        assert got.shape == ref.shape, path
        assert np.linalg.norm(got - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-30), path


@pytest.mark.parametrize("strategy,mesh,gathers,scatters", [
    ("FULL_SHARD", (1, 8), 2 * L, L),      # forward and backward loop bodies each gather one layer
    ("HYBRID_SHARD", (2, 4), 2 * L, L),
    ("SHARD_GRAD_OP", (1, 8), L, L),       # gathered once, kept for backward
])
def test_gather_happens_inside_the_loop_once_per_layer(strategy, mesh, gathers, scatters):
    state = zshard.init(lambda: gpt(True), optax.sgd(0.1), zshard.make_mesh(*mesh), strategy=strategy, abstract=True)  # compiled only
    step = zshard.make_train_step(cross_entropy_loss)
    colls = parse_collectives(step.lower(state, gpt_batches(1)[0]).compile().as_text(), state.plan.mesh)
    block = state.plan.units[1]
    layer_bytes = sum(f.padded_size * f.dtype.itemsize for f in block.flats)  # one layer, not the stack
    in_loop = [c for c in colls if c.trips == L]
    # one collective per parameter of the layer (collectives._gather_all), together one layer
    params = [sl for f in block.flats for sl in f.slots]
    slot_bytes = {sl.padded * sl.dtype.itemsize for sl in params}
    ag = [c for c in in_loop if c.kind == "all-gather"]
    rs = [c for c in in_loop if c.kind == "reduce-scatter"]
    # XLA drops a backward re-gather the recomputation does not read (seen: one bias of the
    # block's last projection), so the backward loop gathers at most one layer
    per_layer = gathers // L
    dropped = per_layer * len(params) - len(ag)
    assert 0 <= dropped < (len(params) if per_layer > 1 else 1), (len(ag), len(params))
    assert (per_layer - 1) * layer_bytes < sum(c.buffer_bytes for c in ag) <= per_layer * layer_bytes
    assert len(rs) * L == scatters * len(params) and sum(c.buffer_bytes for c in rs) * L == scatters * layer_bytes
    assert all(c.buffer_bytes in slot_bytes for c in ag + rs)
    assert not any(c.buffer_bytes >= L * layer_bytes for c in colls), "a whole-stack collective"
    if strategy == "HYBRID_SHARD":  # per layer, the gradient shard crosses replicas
        ar = [c for c in in_loop if c.kind == "all-reduce"]
        assert len(ar) == 1 and ar[0].axis == "replica" and ar[0].buffer_bytes == layer_bytes // 4


def test_scanned_blocks_under_bf16_mixed_precision_keep_the_carry_dtype():
    mp = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")
    data = gpt_batches(4)
    want = unrolled_reference(gpt)  # the fp32 cases' reference (AdamW 1e-3, 4 steps): no reference run of its own
    # built once, eagerly, and copied (its init program not compiled again: the builder's path of this layout is
    # test_scanned_equals_unrolled_equals_reference[gpt-HYBRID_SHARD]'s)
    got = zshard_run(built(gpt, True), optax.adamw(1e-3), zshard.make_mesh(2, 4), "HYBRID_SHARD", cross_entropy_loss, data,
                     mixed_precision=mp)
    np.testing.assert_allclose(got.losses, want.losses, rtol=2e-2)  # bf16 tolerance, as in test_precision


def test_single_kernel_layers_are_not_mistaken_for_stacks():
    conv = nnx.Conv(4, 4, kernel_size=(3, 3), use_bias=False, rngs=nnx.Rngs(0))  # kernel [3, 3, 4, 4]
    general = nnx.LinearGeneral(13, (4, 8), use_bias=False, rngs=nnx.Rngs(0))  # kernel [13, 4, 8]
    assert stacked_layers(conv) is None and stacked_layers(general) is None
    assert stacked_layers(built(gpt, True).blocks) == L  # the file's scanned GPT, built once (read only)

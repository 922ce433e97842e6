"""Prefetch: the next unit's all-gather may be issued before the current unit computes."""

import functools
import re

import optax
import pytest
from conftest import ResMLP, built, mlp_batches, mse_loss, reference_run
from flax import nnx

import zshard
from zshard.programs.step import default_prefetch

D = 256


def deep(n_blocks):
    return lambda: ResMLP(64, D, 64, n_blocks=n_blocks, rngs=nnx.Rngs(0))


@functools.cache  # 8 blocks with and without prefetch: read by both tests below, compiled once
def _compiled(n_blocks, prefetch):
    state = zshard.init(built(deep(n_blocks)), optax.sgd(0.1), zshard.make_mesh(1, 8), strategy="FULL_SHARD")
    step = zshard.make_train_step(mse_loss, prefetch=prefetch)
    return state, step.lower(state, mlp_batches(1, batch=32, d_in=64, d_out=64)[0]).compile()


def _schedule(state, compiled) -> str:
    """The scheduled entry computation as letters: G block all-gather, R block reduce-scatter,
    c matmul (a dot or a custom fusion around one), in execution order. A unit call gathers
    and reduce-scatters per parameter: a block's are told by its kernel's ``[n_pad]`` (gathered)
    and ``[n_pad/8]`` (reduce-scattered), sizes no root parameter has."""
    n_pad = max(s.padded for s in state.plan.units[1].flats[0].slots)  # the block kernel, [D*D]
    assert n_pad == D * D and all(s.padded != n_pad for s in state.plan.units[0].flats[0].slots)
    text = compiled.as_text()
    seq = ""
    for line in text[text.index("ENTRY") :].splitlines():
        m = re.search(r"= (\S+) (all-gather|reduce-scatter|dot|fusion)\(", line)
        if not m:
            continue
        if m.group(2) == "all-gather" and m.group(1).startswith(f"f32[{n_pad}]"):
            seq += "G"
        elif m.group(2) == "reduce-scatter" and m.group(1).startswith(f"f32[{n_pad // 8}]"):
            seq += "R"
        elif m.group(2) == "dot" or "kind=kCustom" in line:
            seq += "c"
    return seq


def test_prefetch_issues_the_next_gather_before_the_current_unit_computes():
    blocks = 8
    state, off = _compiled(blocks, 0)
    _, on = _compiled(blocks, 1)
    seq_off, seq_on = _schedule(state, off), _schedule(state, on)
    # every block gathers twice (forward, backward) and reduce-scatters once, either way
    for seq in (seq_off, seq_on):
        assert seq.count("G") == 2 * blocks and seq.count("R") == blocks, seq
    # prefetch=0: each gather waits for its own unit's input, so gathers never queue up
    assert "GG" not in seq_off, seq_off
    # prefetch=1: forward starts with blocks 0 and 1 gathered before block 0 computes,
    # backward with the last two blocks re-gathered before the last one's backward; never 3
    cut = [i for i, x in enumerate(seq_on) if x == "G"][blocks - 1] + 1  # after the forward gathers
    forward, backward = seq_on[:cut], seq_on[cut:]
    assert forward.lstrip("c").startswith("GG"), seq_on
    assert backward.lstrip("c").startswith("GG"), seq_on
    assert "GGG" not in seq_on, seq_on


def test_prefetch_memory_is_bounded_by_units_not_by_depth():
    unit_bytes = (D * D + D) * 4  # one gathered block, fp32
    grad_shard_bytes = unit_bytes // 8  # the block's gradient shard, kept until the update
    temp = {(n, pf): _compiled(n, pf)[1].memory_analysis().temp_size_in_bytes for n in (8, 16) for pf in (0, 1)}
    # the prefetched unit costs one gathered unit, plus a little (seen: 1.19; 2.0 before the
    # prefetched unit was sliced only once its own input / cotangent exists) ...
    assert temp[8, 1] - temp[8, 0] <= 1.5 * unit_bytes, temp
    # ... and twice the depth adds only the new blocks' gradient shards (ZeRO: 1/N of the
    # gradient) and activations, less than half a gathered unit beyond them (seen: 0.25)
    assert temp[16, 1] - temp[8, 1] < 8 * grad_shard_bytes + unit_bytes / 2, temp


def four_blocks():
    return ResMLP(13, 19, 3, n_blocks=4, rngs=nnx.Rngs(0))


@functools.cache
def reference():
    """4 AdamW steps of the 4-block ``ResMLP`` on one device, computed once: the cases differ only on the zshard side."""
    return reference_run(four_blocks, optax.adamw(1e-2), mse_loss, mlp_batches(4))


@pytest.mark.parametrize("strategy,mesh,prefetch", [("HYBRID_SHARD", (2, 4), 1), ("FULL_SHARD", (1, 8), 2), ("SHARD_GRAD_OP", (2, 4), 1)])
def test_prefetch_gives_the_reference_numbers(strategy, mesh, prefetch):
    make = four_blocks
    data = mlp_batches(4)
    want = reference()
    state = zshard.init(built(make), optax.adamw(1e-2), zshard.make_mesh(*mesh), strategy=strategy)
    step = zshard.make_train_step(mse_loss, prefetch=prefetch)
    for b, loss in zip(data, want.losses):
        state, metrics = step(state, b)
        assert abs(float(metrics["loss"]) - loss) <= 1e-5 * abs(loss)


def test_default_prefetch_is_chosen_per_backend():
    # CPU runs collectives synchronously: a prefetched gather overlaps nothing and only costs a unit
    assert default_prefetch("cpu") == 0 and default_prefetch("gpu") == 1 and default_prefetch("tpu") == 1
    assert zshard.make_train_step(mse_loss).prefetch == default_prefetch()  # prefetch=None: the backend's
    assert zshard.make_train_step(mse_loss, prefetch=2).prefetch == 2  # an explicit value is kept


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_prefetch_is_refused(bad):
    with pytest.raises(ValueError, match="prefetch=.*non-negative integer"):
        zshard.make_train_step(mse_loss, prefetch=bad)

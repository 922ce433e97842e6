"""ZeRO++ hpZ (``make_train_step(hpz=True)``, zshard/wire/hpz.py; arXiv 2306.10209 section 3.2): the same
numbers bitwise as without it, the backward re-gathers over ``shard`` only in the compiled HLO,
the secondary slices in temp memory, and the refusals before compiling."""

import functools

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import ResMLP, Trajectory, assert_same_training, built, flat_params, mlp_batches, mse_loss, reference_run, run_steps
from flax import nnx
from optim_cases import Net

import zshard
from zshard.inspection.hlo import parse_collectives
from zshard.wire.quant import Quant

# hpZ is bitwise the step without it under XLA:CPU's default fusion (tests/conftest.py, _FAST_COMPILE)
pytestmark = pytest.mark.usefixtures("xla_default_cpu_fusion")


MESH = (2, 4)  # replica (nodes) x shard (devices in a node)
R, S = MESH
STEPS = 3
MLP_DATA = mlp_batches(STEPS, batch=16)
INT8 = zshard.MixedPrecision(gather_format=Quant("int8", 16))  # the ResMLP kernels have >= 16 elements per device


def mlp():
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))  # 19x19 kernels: 361 elements, padded


def mlp_tp():
    return ResMLP(13, 32, 3, n_blocks=2, rngs=nnx.Rngs(0))


TP_PLAN = {"blocks.*.lin.kernel": -1, "blocks.*.lin.bias": 0}  # column-parallel blocks: [32, 16] pieces


def mlp_scan():
    """Two blocks stacked (``nnx.vmap``) and run by ``nnx.scan``, 19 wide (padded): one stacked unit."""
    return Net(13, 19, 3, layers=2, rngs=nnx.Rngs(0))


CASES = {  # name -> (model, loss, data, mixed precision, make_train_step options)
    "block_prefetch1": (mlp, mse_loss, MLP_DATA, None, dict(remat="block", prefetch=1)),
    "int8_gather": (mlp, mse_loss, MLP_DATA, INT8, dict(remat="block", prefetch=1)),
    # a stacked unit run by nnx.scan: the secondary slices [L, n_pad/S] gathered over shard once in the backward
    # loop's body. (This was the scanned GPT, d 32, 2 layers: the same stacked-unit path, 10 s of its two step
    # compiles at XLA:CPU's default fusion and its reference; the scanned MLP's take 4.6 s.)
    "scan": (mlp_scan, mse_loss, MLP_DATA, None, dict(remat="block")),
    # a context axis: the secondary partition is over (shard, context), the data axes inside a node; with
    # remat="none" (the saved activations spliced back), prefetch 0 and 2 micro-batches
    "context_none_accum2": (mlp, mse_loss, MLP_DATA, None,
                            dict(remat="none", prefetch=0, grad_accum=2, mesh=(2, 2, 1), context=2,
                                 sequence_axis=(None, None))),  # rows over context too, on purpose
    # a tensor axis: each piece's secondary slice [T, n_pad/S] kept and gathered over shard in its own shard_map
    "tensor": (mlp_tp, mse_loss, MLP_DATA, None, dict(remat="block", prefetch=1, mesh=(2, 2, 2), tensor_parallel=TP_PLAN)),
}
SAME_REFERENCE = {"int8_gather": "block_prefetch1", "context_none_accum2": "block_prefetch1"}


@functools.cache
def _run(case: str, hpz: bool):
    """``STEPS`` steps of ``case`` on FULL_SHARD 2x4: ``(params and opt state on the host, trajectory,
    all-gathers per axis in the emitted program)``."""
    make, loss_fn, data, mp, options = CASES[case]
    kw = {} if mp is None else dict(mixed_precision=mp)
    options = dict(options)
    if "tensor_parallel" in options:
        kw["tensor_parallel"] = options.pop("tensor_parallel")
    mesh = zshard.make_mesh(*options.pop("mesh", MESH), context=options.pop("context", 1))
    state = zshard.init(built(make), optax.adam(1e-2), mesh, strategy="FULL_SHARD", **kw)  # one eager model, hpZ or not
    step = zshard.make_train_step(loss_fn, hpz=hpz, **options)
    colls = parse_collectives(step.lower(state, data[0]).as_text(dialect="hlo"), state.plan.mesh)
    inside = "shard+context" if "context" in mesh.axis_names else "shard"
    gathers = {axis: sum(c.kind == "all-gather" and c.axis == axis for c in colls) for axis in ("world", inside)}
    gathers["shard"] = gathers.pop(inside)
    gathers["block params"] = len(_block_params(state.plan))
    state, losses, norms = run_steps(step, state, data)
    model = zshard.unshard(state)
    return jax.device_get((state.params, state.opt_state)), Trajectory(losses, norms, flat_params(model), model), gathers


@functools.cache
def _reference(case: str):
    case = SAME_REFERENCE.get(case, case)  # the same model, optimizer and global batches
    make, loss_fn, data, _, _ = CASES[case]
    return reference_run(make, optax.adam(1e-2), loss_fn, data)


@pytest.mark.parametrize("case", list(CASES))
def test_hpz_is_bitwise_the_step_without_it(case):
    (with_hpz, got, gathers), (without, plain, plain_gathers) = _run(case, True), _run(case, False)
    # hpZ is on: each block parameter's backward gather is over shard (scan, accumulation: once, in the loop
    # body), and its world gather is gone (int8: the u8 payload's and the f32 scales' both). Only what the
    # pullback reads is re-gathered, with or without hpZ: the ResMLP kernels only under remat="none" (a
    # scanned GPT under remat="block": all but its block's last bias, mlp.proj.bias).
    assert plain_gathers["shard"] == 0 < gathers["shard"] <= gathers["block params"]
    assert gathers["shard"] == gathers["block params"] or case == "context_none_accum2"
    dropped = plain_gathers["world"] - gathers["world"]
    assert dropped == gathers["shard"] if CASES[case][3] is None else dropped > gathers["shard"]
    chex.assert_trees_all_equal(with_hpz, without)  # params and optimizer state after 3 steps, every bit
    assert got.losses == plain.losses and got.grad_norms == plain.grad_norms
    if CASES[case][3] is None:  # unquantized: the one-device Optax run, as every strategy
        assert_same_training(got, _reference(case), tol=1e-5)
    else:  # int8 weights: close to it, not equal (the quantization is real)
        np.testing.assert_allclose(got.losses, _reference(case).losses, rtol=1e-2)
        assert got.losses != _reference(case).losses


# --- the compiled program: collectives and memory ----------------------------------------------------

D = 128  # 128x128 kernels: the secondary slices are large enough to see in temp memory


def _program(hpz: bool, blocks: int = 4):
    return _compiled(hpz, blocks)  # _program(True) and _program(True, 4): one cache entry, one compile


# The tests that read _program take the fast_compile fixture (tests/conftest.py): they compare no two
# programs bit for bit, and what they read is the same under both fusions (temp 135,056 -> 135,568 B with 4
# blocks and 155,216 -> 217,616 B with 8, without / with hpZ, and the same collectives; jax 0.10.2, measured
# 2026-12-07). The 4 programs compile in 4.2 s of user CPU instead of 5.4 s (a script, imports included).
@functools.cache
def _compiled(hpz: bool, blocks: int):
    make = lambda: ResMLP(13, D, 3, n_blocks=blocks, rngs=nnx.Rngs(0))  # noqa: E731
    state = zshard.init(make, optax.sgd(0.1), zshard.make_mesh(*MESH), strategy="FULL_SHARD", abstract=True)
    step = zshard.make_train_step(mse_loss, hpz=hpz, remat="block", prefetch=0)
    compiled = step.lower(state, mlp_batches(1, batch=16)[0]).compile()
    return state.plan, parse_collectives(compiled.as_text(), state.plan.mesh), compiled.memory_analysis(), (step, state)


def _block_params(plan):
    """``n_pad`` of every block-unit parameter (the re-gathered ones; the root is gathered once)."""
    return [s.padded for u in plan.units if u.name != "root" for f in u.flats for s in f.slots]


def _gathers(colls, axis):
    """``(buffer bytes, group size)`` of the all-gathers over ``axis``, sorted."""
    return sorted((c.buffer_bytes, c.group_size) for c in colls if c.kind == "all-gather" and c.axis == axis)


def test_backward_regathers_the_secondary_slices_over_shard_only(fast_compile):
    plan, plain, _, _ = _program(False)
    _, hpz, _, _ = _program(True)
    blocks = _block_params(plan)
    # without hpZ every gather is over the world (replica x shard): the root once, each block parameter twice
    assert not _gathers(plain, "shard")
    world = _gathers(plain, "world")
    assert len(world) == len(_root_params(plan)) + 2 * len(blocks)
    # with hpZ: the forward gathers exactly as before, one world gather fewer per re-gather ...
    regathers = _gathers(hpz, "shard")
    assert len(regathers) == len(blocks) == len(world) - len(_gathers(hpz, "world"))
    # ... and each re-gather takes this device's f32 [n_pad/S] and returns the f32 [n_pad]: operand n_pad/S elements
    assert regathers == sorted((4 * n, S) for n in blocks)
    assert all(buf // (4 * S) == n // S for (buf, _), n in zip(regathers, sorted(blocks)))
    assert sorted(_gathers(hpz, "world")) == sorted([(4 * n, R * S) for n in _root_params(plan) + blocks])
    # bytes one device receives in backward over the slow link: 0 with hpZ (all of them inside the node)
    cross = lambda cs: sum(c.sent_bytes for c in cs if c.kind == "all-gather" and c.axis != "shard")  # noqa: E731
    assert cross(plain) - cross(hpz) == pytest.approx(sum(4 * n * (R * S - 1) / (R * S) for n in blocks))
    # the gradient path is unchanged: the same reduce-scatters (and the loss all-reduce)
    others = lambda cs: sorted((c.kind, c.axis, c.buffer_bytes) for c in cs if c.kind != "all-gather")  # noqa: E731
    assert others(hpz) == others(plain)


def test_report_counts_the_regathers_on_shard_against_the_formula(fast_compile):
    step, state = _program(True)[3]
    comm = zshard.report(step, state, mlp_batches(1, batch=16)[0]).comm_bytes_per_step
    # per step: the world keeps the forward gathers and the reduce-scatters (fp32, ring 7/8); shard
    # moves the blocks' re-gathers, 4 B x 66,048 elements x 3/4 = 198,144 B (as parse_collectives counts)
    assert comm["shard"]["measured"] == pytest.approx(198_144) and comm["shard"]["ratio"] == pytest.approx(1.0, rel=1e-3)
    assert comm["world"]["ratio"] == pytest.approx(1.0, rel=1e-3) and comm["replica"]["measured"] == 0


def _root_params(plan):
    return [s.padded for u in plan.units if u.name == "root" for f in u.flats for s in f.slots]


def test_secondary_slices_cost_their_bytes_in_temp_memory(fast_compile):
    # The slices of every block unit are alive from its forward to its backward: each block more holds
    # its f32 [n_pad/S] slices more. Measured as the growth from 4 to 8 blocks, so that what the peak
    # holds besides them (the gathered unit, its gradient) cancels out.
    temp = {(h, n): _program(h, n)[2].temp_size_in_bytes for h in (False, True) for n in (4, 8)}
    plan = _program(False, 4)[0]
    per_block = sum(4 * n // S for n in _block_params(plan)) // 4  # 4 B x (16,384 + 128) / 4 = 16,512 B
    grown, base = temp[True, 8] - temp[True, 4], temp[False, 8] - temp[False, 4]
    # measured, temp 4 -> 8 blocks without / with hpZ: jax 0.10.2 135,056 -> 135,568 / 155,216 -> 217,616 B;
    # jax 0.12.0.1 159,696 -> 192,720 / 167,952 -> 230,736 B. 4 blocks more cost 62,400 (0.10) and 62,784 B
    # (0.12) with hpZ, for 66,048 B of slices: at least the slices (95%), at most the slices and what the 4
    # blocks cost without hpZ (0.12 keeps 33,024 B more per 4 blocks there; 0.10 512 B). Keeping the whole
    # gathered weights instead (a slice fused into its reader) costs up to S = 4 times the slices.
    assert 0.85 * 4 * per_block <= grown <= 1.1 * 4 * per_block + base, (temp, per_block)
    assert temp[True, 4] > temp[False, 4]
    # the state (arguments) is untouched
    assert _program(True, 4)[2].argument_size_in_bytes == _program(False, 4)[2].argument_size_in_bytes


# --- refusals, before anything compiles -------------------------------------------------------------


@pytest.mark.parametrize("strategy,mesh,match", [
    ("HYBRID_SHARD", (2, 4), "HYBRID_SHARD already gathers over shard only"),
    ("HYBRID_SHARD_OPT", (2, 4), "HYBRID_SHARD_OPT already gathers over shard only"),
    ("SHARD_GRAD_OP", (2, 4), "SHARD_GRAD_OP keeps the gathered weights from forward to backward"),
    ("HYBRID_SHARD_ZERO2", (2, 4), "HYBRID_SHARD_ZERO2 keeps the gathered weights"),
    ("NO_SHARD", (2, 4), "NO_SHARD keeps every parameter whole"),
    ("SHARD_OPT", (2, 4), "SHARD_OPT keeps every parameter whole"),
    ("FULL_SHARD", (1, 8), "replica=1: the world all-gather is already inside one node"),
    ("FULL_SHARD", (8, 1), "shard=1: the secondary partition over shard would be the whole weights.*SHARD_GRAD_OP"),
])
def test_hpz_is_refused_where_it_makes_no_sense(strategy, mesh, match):
    state = zshard.init(mlp, optax.sgd(0.1), zshard.make_mesh(*mesh), strategy=strategy, abstract=True)
    step = zshard.make_train_step(mse_loss, hpz=True)
    with pytest.raises(ValueError, match=f"hpz=True .ZeRO\\+\\+ hierarchical partitioning.*{match}"):
        step.lower(state, MLP_DATA[0])
    with pytest.raises(TypeError, match="hpz='yes': must be True or False"):
        zshard.make_train_step(mse_loss, hpz="yes")


def test_python_m_train_carries_hpz_and_refuses_it_by_key():
    from train import config as C
    from train.cli import build_parser

    run = build_parser().parse_args(["--training.hpz", "--mesh", "2x4"]).run
    assert run.training.hpz is True and run.validate(8).training.hpz
    for raw, needle in [({"mesh": {"shape": "1x8"}}, "replica = 1"), ({"mesh": {"shape": "8x1"}}, "shard = 1"),
                        ({"mesh": {"shape": "2x4", "strategy": "HYBRID_SHARD"}}, "mesh.strategy is HYBRID_SHARD")]:
        with pytest.raises(C.ConfigError, match=f"training.hpz.*{needle}.*or unset training.hpz"):
            C.Config.from_dict({**raw, "training": {"hpz": True}}).validate(8)

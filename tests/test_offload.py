"""Host offload (issue 27, docs/offload.md): ``zshard.init(..., offload="optimizer" | "optimizer+master")``.

What a CPU can show, and each is asserted here: the numbers (bit for bit those of the same run
without offload, every strategy, on 1x8 and 2x4, with gradient accumulation, clipping and a
skipped non-finite step), where every array lives (``sharding.memory_kind`` after init, step and
restore), the GPU program's transfers (``jax.export`` for ``cuda`` runs on a CPU-only machine:
one ``annotate_device_placement`` each way per offloaded leaf, none without offload), the
report's device / host bytes against their formulas, the plan tool, and the refusals. What it
cannot: XLA:CPU runs a transfer inside a program as a no-op and reports no host bytes, so the
HBM saved and the transfer time are ``python -m train.bench --offload`` on a GPU.
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ResMLP, built, mlp_batches, mse_loss
from flax import nnx, traverse_util
from optim_cases import Net

import zshard
import zshard.optim.offload as offload

# offload is bitwise the run without it under XLA:CPU's default fusion (tests/conftest.py, _FAST_COMPILE)
pytestmark = pytest.mark.usefixtures("xla_default_cpu_fusion")

BF16 = zshard.MixedPrecision(param_dtype="bfloat16")
MESHES = {"1x8": (1, 8), "2x4": (2, 4)}
STRATEGIES = [s.value for s in zshard.Strategy]


def model():
    """13 -> 19 -> one residual block -> 3 (every size padded): the root unit and one block unit."""
    return ResMLP(n_blocks=1, rngs=nnx.Rngs(0))


def batches():
    """Three steps; the second is non-finite (a NaN input), so skip_nonfinite keeps the state."""
    data = mlp_batches(3)
    x, y = data[1]
    x = x.copy()
    x[0, 0] = np.nan
    return [data[0], (x, y), data[2]]


def tx_for(mesh: str):
    """1x8: a chain with a global norm (the global-view optimizer, zshard.optim.optim_global); 2x4: AdamW."""
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)) if mesh == "1x8" else optax.adamw(1e-2)


def host_leaves(state) -> list:
    return [x for x in jax.tree.leaves((state.params, state.opt_state, state.device_params)) if x.sharding.memory_kind == "pinned_host"]


def local_bytes(x) -> int:
    return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


@functools.cache
def trained(mesh: str, strategy: str, mode: str | None, mp: bool):
    """``(init state, final state, the state the last step donated, losses, nonfinite flags, step)``:
    three steps with grad_accum=2, clip_norm and skip_nonfinite (step 2 is skipped).

    FULL_SHARD's runs (the placement, export, checkpoint and report tests') start from the builder
    ``model``, so ``zshard.init`` of a callable with offload stays tested; the other strategies'
    from one eagerly built model (conftest.built: no initialiser compiled per mesh and strategy,
    about 0.45 s each), the same for the run with offload and the one without."""
    state = zshard.init(model if strategy == "FULL_SHARD" else built(model), tx_for(mesh), zshard.make_mesh(*MESHES[mesh]), strategy=strategy, offload=mode,
                        mixed_precision=BF16 if mp else None)
    init_kinds = [x.sharding.memory_kind for x in jax.tree.leaves(state)]
    step = zshard.make_train_step(mse_loss, grad_accum=2, clip_norm=0.5, skip_nonfinite=True)
    losses, flags, donated = [], [], None
    for b in batches():
        donated = state
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        flags.append(int(metrics["nonfinite"]))
    return init_kinds, state, donated, losses, flags, step


def assert_bitwise(a, b):
    la, lb = jax.tree.leaves((a.params, a.opt_state, a.step)), jax.tree.leaves((b.params, b.opt_state, b.step))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- exactness: every strategy, both meshes ---------------------------------------------------------
# 1x8: offload="optimizer" against no offload (fp32, a global-view chain); 2x4: "optimizer+master"
# against the same MixedPrecision(bfloat16) without offload (AdamW, elementwise). Each strategy runs
# both modes, each mode on one mesh.


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offload_is_bitwise_the_run_without_it(mesh, strategy):
    mode, mp = ("optimizer", False) if mesh == "1x8" else ("optimizer+master", True)
    _, want, _, want_losses, want_flags, _ = trained(mesh, strategy, None, mp)
    _, got, _, got_losses, got_flags, _ = trained(mesh, strategy, mode, mp)
    assert got_flags == want_flags == [0, 1, 0]  # the NaN step was skipped, in both
    assert int(got.step) == 2
    assert got_losses[0] == want_losses[0] and got_losses[2] == want_losses[2]
    assert_bitwise(got, want)
    if mp:  # the device copies are the masters in param_dtype
        masters = traverse_util.flatten_dict(got.params)
        for path, copy in traverse_util.flatten_dict(got.device_params).items():
            np.testing.assert_array_equal(np.asarray(copy), np.asarray(masters[path]).astype(jnp.bfloat16))


def test_stacked_units_offload_bitwise_with_accumulation_and_clipping():
    """Scanned blocks ([L, n_pad/N] leaves, one leaf for all layers, moved whole): the gathers read
    the bf16 copies and the gradient arrives in fp32 with reduce_dtype float32 ([Note: master
    cotangents]); two steps with grad_accum=2 and clip_norm are bitwise the run without offload,
    and the GPU program moves each host leaf once each way.

    The model is two 19-wide blocks stacked (``nnx.vmap``) and run by ``nnx.scan`` (tests/optim_cases.py's
    ``Net``: [2, 19, 19] kernels, padded, and a scalar parameter): one stacked unit, the same path as the
    scanned GPT (d 32, 2 layers) this test ran before (this test alone at -n 0, cold cache: 7.0 s of user
    CPU against 13.6 s with the GPT, the process's start included; most of it the two step compiles at
    XLA:CPU's default fusion). A GPT trains with offload in test_python_m_train_with_offload_runs."""
    mp = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")
    data = mlp_batches(2, batch=16)
    states, built = [], Net(13, 19, 3, layers=2, rngs=nnx.Rngs(0))  # built once, eagerly: both runs start from it
    for mode in (None, "optimizer+master"):
        state = zshard.init(built, optax.adamw(1e-2), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD", mixed_precision=mp, offload=mode)
        step = zshard.make_train_step(mse_loss, grad_accum=2, clip_norm=0.5)
        for b in data:
            state, _ = step(state, b)
        states.append(state)
    got, want = states[1], states[0]
    assert any(rec.layers for rec in got.plan.layouts.values())  # stacked parameters, [L, n_pad]
    assert_placed(got, "optimizer+master")
    counts = offload.exported_placements(step.export(got, data[0]))
    assert counts["device"]["count"] == counts["pinned_host"]["count"] == len(host_leaves(got))
    assert counts["device"]["bytes"] == sum(local_bytes(x) for x in host_leaves(got))
    assert_bitwise(got, want)


def test_tensor_axis_split_parameters_offload_bitwise():
    """Parameters split over ``tensor`` (PartitionSpec("tensor", shard axes)): the memory kind composes."""
    tp = {"blocks.*.lin.kernel": -1, "blocks.*.lin.bias": 0}
    mp = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")
    mesh = zshard.make_mesh(1, 4, tensor=2)
    states, built = [], ResMLP(d=16, rngs=nnx.Rngs(0))  # built once, eagerly, for both runs
    for mode in (None, "optimizer+master"):
        state = zshard.init(built, optax.adamw(1e-2), mesh, tensor_parallel=tp, mixed_precision=mp, offload=mode)
        step = zshard.make_train_step(mse_loss, skip_nonfinite=True)
        for b in batches():
            state, _ = step(state, b)
        states.append(state)
    got = states[1]
    kernel_mu = got.opt_state[0].mu["blocks"][0]["lin"]["kernel"]
    assert "tensor" in kernel_mu.sharding.spec and kernel_mu.sharding.memory_kind == "pinned_host"
    master = got.params["blocks"][0]["lin"]["kernel"]
    assert "tensor" in master.sharding.spec and master.sharding.memory_kind == "pinned_host"
    assert got.device_params["blocks"][0]["lin"]["kernel"].sharding.memory_kind == "device"
    assert_bitwise(got, states[0])


# --- placement --------------------------------------------------------------------------------------


def assert_placed(state, mode):
    masters = offload.master_paths(state.plan)
    for path, x in traverse_util.flatten_dict(state.params).items():
        assert x.sharding.memory_kind == ("pinned_host" if path in masters else "device"), path
    for x in jax.tree.leaves(state.opt_state):
        want = "pinned_host" if mode is not None and x.ndim else "device"  # counts stay on the device
        assert x.sharding.memory_kind == want, x.shape
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.device_params)} <= {"device"}
    assert bool(masters) == (mode == "optimizer+master") and len(jax.tree.leaves(state.device_params)) == len(masters)
    assert state.step.sharding.memory_kind == "device"


@pytest.mark.parametrize("mode", [None, "optimizer", "optimizer+master"])
def test_placement_after_init_and_every_step_and_the_donated_input_is_deleted(mode):
    mesh, mp = ("1x8", False) if mode == "optimizer" else ("2x4", True)
    init_kinds, state, donated, _, _, _ = trained(mesh, "FULL_SHARD", mode, mp)
    assert ("pinned_host" in init_kinds) == (mode is not None)
    assert init_kinds == [x.sharding.memory_kind for x in jax.tree.leaves(state)]  # after init = after each step
    assert_placed(state, mode)
    assert all(x.is_deleted() for x in jax.tree.leaves(donated))


@pytest.mark.parametrize("mode", [None, "optimizer", "optimizer+master"])
def test_exported_gpu_program_moves_each_offloaded_leaf_once_each_way(mode):
    """``annotate_device_placement`` in the CUDA program: one "device" per offloaded leaf and one
    "pinned_host" per updated leaf, with their bytes; without offload, none at all."""
    mesh, mp = ("1x8", False) if mode == "optimizer" else ("2x4", True)
    _, state, _, _, _, step = trained(mesh, "FULL_SHARD", mode, mp)
    exported = step.export(state, mlp_batches(1)[0])
    counts = offload.exported_placements(exported)
    host = host_leaves(state)
    nbytes = sum(local_bytes(x) for x in host)
    assert counts["device"]["count"] == counts["pinned_host"]["count"] == len(host)
    assert counts["device"]["bytes"] == counts["pinned_host"]["bytes"] == nbytes
    if mode is None:
        assert "annotate_device_placement" not in exported.mlir_module()
    else:
        n_train = len(state.plan.trainable)
        assert len(host) == n_train * (2 + (mode == "optimizer+master"))  # Adam's mu and nu (+ the master) per parameter
        assert_copies_wait_for_the_gradients(exported.mlir_module(), len(host))


def assert_copies_wait_for_the_gradients(text: str, n_host: int):
    """Every host -> device copy reads an ``optimization_barrier`` result, and that barrier also takes
    values computed in the step (the gradients), so XLA:GPU cannot start the copy before the
    backward ([Note: copies after the backward] in zshard/optim/offload.py; on one H200 the copies were
    issued early and the offloaded step's peak HBM was above the run without offload)."""
    barriers, copies, returned, func = {}, [], set(), None  # barrier -> its operands; (func, result, operand) of each copy
    for line in text.splitlines():
        if line.lstrip().startswith("func.func"):
            func = re.search(r"@([\w.$-]+)\(", line).group(1)
        if m := re.match(r"\s*(%[\w#]+)(?::\d+)? = stablehlo.optimization_barrier (.*?) :", line):
            barriers[m.group(1)] = re.findall(r"%[\w#]+", m.group(2))
        if m := re.match(r'\s*(%[\w#]+) = stablehlo.custom_call @annotate_device_placement\((%[\w#]+)\).*"device"', line):
            copies.append((func, m.group(1), m.group(2)))
        if func == "main" and line.lstrip().startswith("return "):
            returned |= set(re.findall(r"%[\w#]+", line.split(":", 1)[0]))
    copies = [operand for f, result, operand in copies if not (f == "main" and result in returned)]  # not main's outputs
    assert len(copies) == n_host, copies
    for operand in copies:
        barrier = operand.split("#")[0]
        assert barrier in barriers, f"{operand} is copied to the device without waiting for the gradients"
        assert any(not v.startswith("%arg") for v in barriers[barrier]), barriers[barrier]


# --- checkpoints ------------------------------------------------------------------------------------


def test_checkpoint_from_and_into_offloaded_state_on_other_meshes_strategies_and_settings(tmp_path):
    _, source, _, _, _, _ = trained("2x4", "FULL_SHARD", "optimizer+master", True)
    zshard.save(source, tmp_path / "a")
    restored = {}
    for mode in (None, "optimizer", "optimizer+master"):
        state, _ = zshard.restore(tmp_path / "a", zshard.make_mesh(1, 8), model=model, tx=tx_for("2x4"), strategy="HYBRID_SHARD",
                                  mixed_precision=BF16, offload=mode)
        assert_placed(state, mode)
        restored[mode] = state
    for mode in ("optimizer", "optimizer+master"):
        assert_bitwise(restored[mode], restored[None])
    for path, copy in traverse_util.flatten_dict(restored["optimizer+master"].device_params).items():
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(traverse_util.flatten_dict(source.device_params)[path]))
    # the exported weights of the offloaded state (its fp32 masters fetched from host memory) are the parameters
    # of the state restored without offload (jax 0.12 refused to device_put a host leaf a program wrote: an error
    # in export, zshard/plan/weights.py's _to_device)
    loaded = zshard.load_params(zshard.export(source, tmp_path / "m.safetensors"), model())
    want = nnx.to_flat_state(nnx.state(zshard.unshard(restored[None]), nnx.Param))
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    assert len(got) == len(want)
    for path, v in want:
        np.testing.assert_array_equal(np.asarray(got[path].get_value()), np.asarray(v.get_value()))
    # ... and back: saved without offload, restored into the first layout with offload, bit for bit
    zshard.save(restored[None], tmp_path / "b")
    back, _ = zshard.restore(tmp_path / "b", zshard.make_mesh(2, 4), model=model, tx=tx_for("2x4"), strategy="FULL_SHARD",
                             mixed_precision=BF16, offload="optimizer+master")
    assert_placed(back, "optimizer+master")
    assert_bitwise(back, source)


# --- the report and the plan tool -------------------------------------------------------------------


def test_report_splits_device_and_host_bytes_against_the_formulas():
    """ResMLP: Psi = 706 parameters over N = 8; Adam fp32 with bf16 copies: host 4 + 8 bytes per
    parameter / N, device 2 / N (+ the count); transfers 2 x host per step (ZeRO-Offload, sec. 4.2)."""
    _, state, _, _, _, step = trained("2x4", "FULL_SHARD", "optimizer+master", True)
    rep = zshard.report(step, state, mlp_batches(1)[0])
    o = rep.offload
    psi, n = 13 * 19 + 19 + 19 * 19 + 19 + 19 * 3 + 3, 8
    assert o["mode"] == "optimizer+master"
    assert o["formula"]["host"] == 12 * psi / n
    assert o["formula"]["device"] == pytest.approx(2 * psi / n, abs=1)
    host = host_leaves(state)
    assert o["measured"]["host"] == sum(local_bytes(x) for x in host)  # padded shards: a few bytes over the formula
    device = [x for x in jax.tree.leaves((state.params, state.opt_state, state.device_params)) if x.sharding.memory_kind == "device"]
    assert o["measured"]["device"] == sum(local_bytes(x) for x in device)
    assert o["transfer"]["measured"] == 2 * o["measured"]["host"] and o["transfer"]["formula"] == 2 * o["formula"]["host"]
    assert o["transfer"]["calls"] == {"device": len(host), "pinned_host": len(host)}
    assert "model state in host memory (pinned_host)" in rep.table()


# fast_compile (tests/conftest.py) here and in test_python_m_train_with_offload_runs: neither compares two programs
# bit for bit nor reads a cached run (trained); memory kinds, transfer counts and formulas are the same under both
def test_plan_tool_prints_device_and_host_bytes(fast_compile):
    from test_plan import planned  # noqa: PLC0415  (python -m train.plan's main in this process)

    out = planned(["--model", "gpt2-124m", "--mesh", "1x8", "--seq-len", "64", "--offload", "optimizer"])
    n = 124_439_808 - 12 * 2304 - (1024 - 64) * 768  # as tests/test_plan.py counts GPT-2 small here
    assert "| offload=optimizer | measured MiB | formula MiB |" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("model state per device:"))
    assert f"(formula {4 * n / 8 / 1e9:.2f} / {8 * n / 8 / 1e9:.2f} GB)" in line, line  # device 4 Psi / N, host 8 Psi / N
    assert "device peak (argument + output - alias + temp - host state + one parameter's update)" in out


# --- refused before compiling, named ---------------------------------------------------------------


def test_bad_modes_and_master_without_a_lower_param_dtype_are_refused():
    mesh = zshard.make_mesh(1, 8)
    with pytest.raises(ValueError, match="offload='cpu': choose None"):
        zshard.init(model, optax.adam(1e-2), mesh, offload="cpu")
    for mp in (None, zshard.MixedPrecision(param_dtype="float32")):
        with pytest.raises(ValueError, match=r"needs MixedPrecision\(param_dtype=...\) lower than the trainable parameters' dtype"):
            zshard.init(model, optax.adam(1e-2), mesh, offload="optimizer+master", mixed_precision=mp, abstract=True)


def test_a_device_without_pinned_host_memory_is_refused():
    memories = [types.SimpleNamespace(kind="device")]
    fake = types.SimpleNamespace(process_index=jax.process_index(), platform="fakeaccel", addressable_memories=lambda: memories)
    with pytest.raises(ValueError, match=r"has no 'pinned_host' memory \(its memory kinds: \['device'\]\).*offload=None"):
        offload.check_backend(types.SimpleNamespace(devices=np.array([fake], dtype=object)), "optimizer")
    offload.check_backend(zshard.make_mesh(1, 8), "optimizer")  # CPU devices have pinned_host memory


def test_a_host_leaf_in_arithmetic_is_named():
    """A leaf moved to the host by hand (the plan keeps it on the device), a leaf moved back, and a
    program that uses a host leaf in arithmetic: each named by its path."""
    mesh = zshard.make_mesh(1, 8)
    step = zshard.make_train_step(mse_loss)
    batch = mlp_batches(1)[0]
    state = zshard.init(built(model), optax.adam(1e-2), mesh)  # eager: no initialiser compiled (the builder: trained's FULL_SHARD)
    mu = state.opt_state[0].mu["blocks"][0]["lin"]["kernel"]
    state.opt_state[0].mu["blocks"][0]["lin"]["kernel"] = jax.device_put(mu, mu.sharding.with_memory_kind("pinned_host"))
    with pytest.raises(ValueError, match=r"optimizer state leaf opt_state\[0\]\.mu\['blocks'\]\[0\]\['lin'\]\['kernel'\] is in "
                                         r"'pinned_host' memory, but this state's plan \(offload=None\) keeps it in 'device'"):
        step(state, batch)
    state = zshard.init(model, optax.adam(1e-2), mesh, offload="optimizer", abstract=True)
    nu = state.opt_state[0].nu["head"]["kernel"]
    state.opt_state[0].nu["head"]["kernel"] = jax.ShapeDtypeStruct(nu.shape, nu.dtype, sharding=nu.sharding.with_memory_kind("device"))
    with pytest.raises(ValueError, match=r"opt_state\[0\]\.nu\['head'\]\['kernel'\] is in 'device' memory, but .*'pinned_host'"):
        step.lower(state, batch)


def test_a_host_leaf_used_in_arithmetic_inside_the_program_is_named(monkeypatch):
    """Should an update path forget to move a leaf (here: the blocks' kernels' moments), JAX's
    "memory_space of all inputs ... must be the same" comes back naming the leaf."""
    state = zshard.init(model, optax.adam(1e-2), zshard.make_mesh(1, 8), offload="optimizer", abstract=True)
    kernel = state.opt_state[0].mu["blocks"][0]["lin"]["kernel"].sharding.shard_shape(state.opt_state[0].mu["blocks"][0]["lin"]["kernel"].shape)
    moved = offload.to_device
    monkeypatch.setattr(offload, "to_device", lambda x: x if x.shape == kernel else moved(x))
    with pytest.raises(ValueError, match=r"zshard: opt_state\[0\]\.(mu|nu)\['blocks'\]\[0\]\['lin'\]\['kernel'\] is in pinned_host "
                                         r"memory and the program uses it in arithmetic with device data"):
        zshard.make_train_step(mse_loss).lower(state, mlp_batches(1)[0])


def test_jax_keeps_a_wider_cotangent_of_a_custom_vjp():
    """[Note: master cotangents] relies on it: a custom_vjp of a bfloat16 primal whose backward
    returns float32 gives a float32 gradient, unrounded, also through a scan. If a JAX release
    refuses or rounds it, this test says so (and the master-offload step would fail loudly)."""

    @jax.custom_vjp
    def f(x):
        return x.astype(jnp.float32) * 2

    f.defvjp(lambda x: (f(x), None), lambda _, g: ((g * (1 + 2**-20)).astype(jnp.float32),))

    def loss(xs):
        return jax.lax.scan(lambda c, x: (c + f(x).sum(), None), 0.0, xs)[0]

    g = jax.grad(loss)(jnp.ones((3, 4), jnp.bfloat16))
    assert g.dtype == jnp.float32 and float(g[0, 0]) == 1 + 2**-20  # bf16 would round it to 1.0


def test_train_cli_offload_flag_and_config():
    from train.config import Config, ConfigError

    run = Config.from_dict({"mesh": {"offload": "optimizer+master"}, "training": {"param_dtype": "bfloat16"}}).validate(8)
    assert run.mesh.offload == "optimizer+master"
    with pytest.raises(ConfigError, match=r"mesh.offload \(--offload\).*training.param_dtype \(--param-dtype\) to bfloat16"):
        Config.from_dict({"mesh": {"offload": "optimizer+master"}}).validate(8)
    with pytest.raises(ConfigError, match="mesh.offload"):
        Config.from_dict({"mesh": {"offload": "gpu"}}).validate(8)


def test_python_m_train_with_offload_runs(tmp_path, corpus, fast_compile):
    """``python -m train --offload optimizer+master`` (its ``main`` in this process: tests/runs.py's ``train_main``)."""
    import json

    from runs import train_main  # noqa: PLC0415

    out = tmp_path / "run"
    assert train_main(["--model", "nano", "--steps", "3", "--seq-len", "32", "--batch-size", "16", "--data", corpus, "--eval-every", "0",
                       "--offload", "optimizer+master", "--param-dtype", "bfloat16", "--report", "--sample-tokens", "4", "--out", out]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["report"]["offload"]["mode"] == "optimizer+master"
    assert summary["report"]["offload"]["transfer"]["calls"]["device"] > 0
    assert (out / "model.safetensors").exists()

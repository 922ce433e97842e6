"""Shared setup for the zshard test suite: 8 emulated CPU devices, small models, a reference step.

``XLA_FLAGS`` must hold ``--xla_force_host_platform_device_count=8`` before jax is imported
anywhere (docs/design.md section 7); pytest imports this file before any test module, so it is
set here, at the very top, before the first ``import jax``. The suite runs on 2 pytest-xdist
workers (``-n 2 --dist loadfile`` in pyproject.toml): each worker is its own process that
imports this file first, so each has 8 emulated devices; a test file runs whole in one worker,
so its module-scoped fixtures are built once. ``-n 0`` runs everything in one process.

Test modules import the helpers below with ``from conftest import ...``.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count=8"
# XLA:CPU's code generation at its cheapest: LLVM's optimization level 0, none of its expensive
# passes, XLA:CPU's older fusion pipeline instead of its fusion emitters, and one LLVM module per
# program. They change only how XLA:CPU compiles. The byte and memory tests read the compiled HLO's
# collectives and memory_analysis(); on the reference GPT's FULL_SHARD 2x4 step the collectives
# (47 all-gathers, 27 reduce-scatters), argument and output bytes are those of XLA's defaults. Its
# temp size is too under each of the first two flags alone and under the fourth (32 parts or one,
# the other three on); the fusion flag makes it 161888 bytes against 161616 (+0.17%, the older
# pipeline's fusions; measured 2026-12-07). Compiling is about three quarters
# of the suite's time; measured at -n 0 with no compilation cache, tests/test_strategies.py took
# 137 s wall with the first two flags and 75 s with the first three. The fourth: XLA:CPU splits a
# program's LLVM module into 32 parts by default, to compile them on its thread pool, which a
# 2-core machine running two workers has no core free for; tests/test_strategies.py with
# tests/test_step.py took 56.0 and 57.1 s of user CPU with 32 parts, 48.6 and 49.0 s with one
# (-n 0, no compilation cache, back to back). Elementwise results may differ by an ulp from the
# defaults' (a jit-initialised parameter against an eager one, tests/test_verify.py), and the
# older fusion pipeline fuses two programs that compute the same numbers differently where one of
# them moves leaves to host memory or gathers inside a scan: the tests that compare such programs
# bit for bit (tests/test_offload.py, tests/test_hpz.py) use the ``xla_default_cpu_fusion``
# fixture below, which compiles zshard's programs with XLA:CPU's default fusion, as a user's run
# does. Two comparisons that were within their tolerance by a margin smaller than an ulp's
# consequences now start from one eagerly built model (tests/test_hybrid_opt.py, bf16) or use SGD
# with momentum instead of Adam (tests/test_expert_parallel.py, whose hybrid-zero2 case already
# failed with Adam). Subprocesses the tests start inherit these flags.
# The fusion flag exists in jaxlib 0.10 only: jaxlib 0.12.1's XLA aborts on it ("Unknown flag in
# XLA_FLAGS"), so scripts/compat.sh's newest jax runs with XLA:CPU's fusion emitters, its default.
_OLD_FUSION_PIPELINE = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11)
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 *(("--xla_cpu_use_fusion_emitters=false",) if _OLD_FUSION_PIPELINE else ()),
                 "--xla_cpu_parallel_codegen_split_count=1")
for _f in (_FLAG, *_FAST_COMPILE):
    if (_f if _f == _FLAG else _f.split("=")[0]) not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _f).strip()
# The suite is about emulated CPU devices, also on a machine that has an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation per distinct program for the whole run: JAX's persistent compilation cache
# (keyed by the program's HLO, the compile options, XLA_FLAGS and the jax version) is shared by
# both xdist workers and by the ``python -m train`` subprocesses the tests start (they inherit
# these variables). The suite compiles the same programs many times over: each reference run
# builds a new ``nnx.jit``, and every main-job test compiles the same nano train step. A hit
# returns the executable XLA compiled, with the same ``as_text()``, ``memory_analysis()`` and
# ``cost_analysis()`` that the byte and memory tests read. ``ZSHARD_TEST_NO_CACHE=1`` turns it off.
# The subprocesses cache every program (threshold 0, set in the environment they inherit): a
# ``python -m train`` run compiles about 70 programs, most under 0.1 s each and the same in the
# next run (a nano run: 7.6 s -> 5.9 s warm); the main-job files took 160 s -> 136 s (measured back
# to back, cold cache). This process keeps 0.25 s (set after the import below): it holds its own
# programs in memory, and writing each small one to disk (about 0.07 s) costs more than it saves.
_SUBPROCESS_MIN_COMPILE_S, _MIN_COMPILE_S = "0", 0.25
if not os.environ.get("ZSHARD_TEST_NO_CACHE"):
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", _SUBPROCESS_MIN_COMPILE_S)

import collections  # noqa: E402
import functools  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx, traverse_util  # noqa: E402

from zshard.verify import reference_step, rel_l2  # noqa: E402, F401  (rel_l2: the tests import it from here)
import zshard.gpu  # noqa: E402
import zshard.programs.program  # noqa: E402

_SUITE_COMPILER_OPTIONS = zshard.gpu.compiler_options  # before any fixture below patches it: the suite's fast flags

pytest_plugins = ["compile_log"]  # pytest --compile-log DIR: every XLA compile by test and program
NUM_DEVICES = 8
ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"

if os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS") == _SUBPROCESS_MIN_COMPILE_S:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_S)

# Python's cyclic garbage collector at thresholds (20000, 10, 10), not the default (700, 10, 10):
# tracing and compiling allocate millions of small objects (jaxprs, tracers, lowered modules)
# and the module-cached steps stay alive, so each full collection walks a large heap. One process
# running test_tensor_parallel.py and test_optim.py (-n 0, warm compilation cache, back to back):
# 7101 young and 30 full collections, 14.7 s of 106.7 s, at the default; 150 and 1, 4.4 s of
# 92.3 s, here. Peak RSS 1.35 GB -> 1.68 GB. Garbage in reference cycles is still collected, later.
gc.set_threshold(20_000, 10, 10)

if len(jax.devices()) != NUM_DEVICES:  # pragma: no cover - environment check
    raise RuntimeError(
        f"the zshard tests need {NUM_DEVICES} emulated CPU devices, got {jax.devices()}: "
        f"jax was imported before tests/conftest.py could set XLA_FLAGS={_FLAG}"
    )


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


class ResBlock(nnx.Module):
    """``x + tanh(Linear(x))``: one repeated block (one zshard unit)."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class ResMLP(nnx.Module):
    """``d_in -> d -> (n_blocks residual blocks) -> d_out``, biases everywhere.

    The default 13 -> 19 -> 3 has no size divisible by 2, 4 or 8: every parameter is padded.
    ``inp`` and ``head`` form the root unit; each element of ``blocks`` is a block unit.
    """

    def __init__(self, d_in: int = 13, d: int = 19, d_out: int = 3, n_blocks: int = 2, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(d_in, d, rngs=rngs)
        self.blocks = nnx.List([ResBlock(d, rngs=rngs) for _ in range(n_blocks)])
        self.head = nnx.Linear(d, d_out, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mse_loss(model, batch):
    """Mean squared error; ``batch = (x, y)``."""
    x, y = batch
    return jnp.mean(jnp.square(model(x) - y))


def mlp_batches(steps: int, batch: int = 16, d_in: int = 13, d_out: int = 3, seed: int = 0):
    """``steps`` different ``(x, y)`` numpy batches."""
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((batch, d_in)).astype(np.float32), rng.standard_normal((batch, d_out)).astype(np.float32))
        for _ in range(steps)
    ]


def gpt_batches(steps: int, batch: int = 8, seq_len: int = 16, vocab: int = 256, seed: int = 0):
    """``steps`` different ``(inputs, targets)`` int32 batches of shape (batch, seq_len)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tok = rng.integers(0, vocab, size=(batch, seq_len + 1), dtype=np.int32)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


# --------------------------------------------------------------------------------------
# Reference: a plain single-device NNX + Optax step
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Trajectory:
    losses: list[float]
    grad_norms: list[float]
    params: dict  # flat dict path -> np.ndarray (final parameters)
    model: nnx.Module


def flat_params(model: nnx.Module) -> dict:
    """``{path: np.ndarray}`` of every ``nnx.Param`` of ``model``."""
    state = nnx.state(model, nnx.Param)
    return {p: np.asarray(v) for p, v in traverse_util.flatten_dict(nnx.to_pure_dict(state)).items()}


# Strategies whose model path another strategy of the default run already takes: SHARD_OPT is
# NO_SHARD's (parameters replicated; only the optimizer state is split), HYBRID_SHARD_ZERO2 is
# SHARD_GRAD_OP's within a shard group with HYBRID_SHARD's cross-replica reduction. A test of a
# model feature (MoE routing, a model's own scan / remat / dropout, batch statistics) on every
# strategy marks these two -m exhaustive.
REPEATED_MODEL_PATH = ("SHARD_OPT", "HYBRID_SHARD_ZERO2")


def strong(x):
    """``x`` without JAX's weak type (keys and non-arrays as they are)."""
    if not isinstance(x, jax.Array) or jnp.issubdtype(x.dtype, jax.dtypes.prng_key) or not x.weak_type:
        return x
    return jax.lax.convert_element_type(x, x.dtype)


@functools.cache
def built(make: Callable[..., nnx.Module], *args) -> nnx.Module:
    """``make(*args)`` built once per test process, eagerly, and shared read-only by the tests that
    pass it to ``zshard.init`` (which copies a built module to its shards, without compiling, and
    leaves it as it was). A builder callable instead compiles the model's initialisers under
    ``jit`` for every mesh and strategy (about 1 s each for a 2-layer GPT, most of it threefry);
    the builder path stays tested in tests/test_strategies.py, tests/test_scan.py and
    tests/test_verify.py."""
    return make(*args)


def reference_run(make_model: Callable[[], nnx.Module], tx, loss_fn, batches) -> Trajectory:
    """Train ``make_model()`` on one device with ``nnx.Optimizer``: the ground truth.

    Its variables are made strongly typed first, as ``zshard.init`` stores them (a weakly typed
    ``nnx.Param(jnp.full((), 1.5))`` would make the second step compile again; same values)."""
    ref = make_model()
    graphdef, variables = nnx.split(ref)
    ref = nnx.merge(graphdef, jax.tree.map(strong, variables))
    opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    step = reference_step(loss_fn)  # the one reference, python -m zshard.verify's too

    losses, norms = [], []
    for b in batches:
        loss, gn, _ = step(ref, opt, jax.tree.map(jnp.asarray, b))
        losses.append(float(loss))
        norms.append(float(gn))
    return Trajectory(losses, norms, flat_params(ref), ref)


def zshard_run(init_arg, tx, mesh, strategy, loss_fn, batches, **init_kw) -> Trajectory:
    """The same training with zshard; ``init_arg`` is a module or a zero-arg callable."""
    import zshard

    state = zshard.init(init_arg, tx, mesh, strategy=strategy, **init_kw)
    # prefetch=1 (the GPU / TPU default): CPU's default, 0, would leave the prefetch chain untested
    state, losses, norms = run_steps(zshard.make_train_step(loss_fn, prefetch=1), state, batches)
    model = zshard.unshard(state)
    return Trajectory(losses, norms, flat_params(model), model)


def state_copy(state):
    """``state`` (a :class:`zshard.ShardedState`) on new buffers: the same shardings and plan, nothing compiled.
    A test keeps one placed state per plan (a plan is hashed by identity: each ``zshard.init`` traces and
    compiles the step anew) and steps copies of it, since a step donates its input."""
    return jax.device_put(state, may_alias=False)


def run_steps(step, state, batches):
    """``step`` over ``batches``: ``(final state, losses, grad norms)``, the metrics as floats."""
    losses, norms = [], []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return state, losses, norms


def assert_same_training(got: Trajectory, want: Trajectory, tol: float = 1e-5) -> None:
    """Losses and gradient norms within ``tol`` (relative) of the reference, and every
    parameter within ``tol`` relative L2. Relative L2 per parameter, not elementwise: Adam
    turns fp32 reduction-order noise of cancelling gradient sums into elementwise
    differences, so an elementwise rtol would test noise."""
    np.testing.assert_allclose(got.losses, want.losses, rtol=tol)
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=tol)
    for path, ref in want.params.items():
        assert got.params[path].shape == ref.shape, path
        assert rel_l2(got.params[path], ref) <= tol, path




# XLA:CPU's default fusion for the programs zshard compiles (the ``--xla_cpu_use_fusion_emitters``
# flag above undone per jit, through ``jax.jit(compiler_options=...)``, the way zshard.gpu adds
# XLA:GPU's options); a CUDA mesh keeps its own options.
DEFAULT_CPU_FUSION = {"xla_cpu_use_fusion_emitters": True} if _OLD_FUSION_PIPELINE else {}  # else: the default already


@pytest.fixture(scope="module")
def xla_default_cpu_fusion():
    """Compile zshard's programs in this module (its steps' jits, :func:`zshard.gpu.mesh_jit`) with
    XLA:CPU's default fusion, for tests that compare two programs bit for bit (the comment on
    ``_FAST_COMPILE``). Module-scoped: a module's cached runs are all compiled the same way."""
    import zshard.gpu
    import zshard.programs.program as program

    cpu_default = zshard.gpu.compiler_options

    def options(mesh):
        return cpu_default(mesh) or dict(DEFAULT_CPU_FUSION)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zshard.gpu, "compiler_options", options)
        mp.setattr(program, "compiler_options", options)
        yield


@pytest.fixture
def fast_compile(monkeypatch):
    """The suite's fast XLA:CPU flags (``_FAST_COMPILE``) again for one test of a module that uses
    ``xla_default_cpu_fusion``: for a test that compares no two programs bit for bit and reads what
    the flags leave as they are (memory kinds, transfer counts, collectives, ``memory_analysis()``;
    each test file says what it measured). Its programs compile about twice as fast."""
    monkeypatch.setattr(zshard.gpu, "compiler_options", _SUITE_COMPILER_OPTIONS)
    monkeypatch.setattr(zshard.programs.program, "compiler_options", _SUITE_COMPILER_OPTIONS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small real text file for ``python -m train --data``: the first 200 kB of
    tinyshakespeare when it lies beside the checkout, else this repo's Python sources."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    if SHAKESPEARE.exists():
        path.write_bytes(SHAKESPEARE.read_bytes()[:200_000])
    else:
        path.write_bytes(b"".join(p.read_bytes() for p in sorted((ROOT / "zshard").glob("*.py"))))
    return path


# The files that take longest, first (longest processing time first, the classic rule for 2
# machines): ``--dist loadfile`` hands each worker the next whole file in queue order, so a long
# file handed out last leaves the other worker idle at the end. pyproject.toml passes
# ``--no-loadscope-reorder`` (pytest-xdist 3.8): without it pytest-xdist re-sorts the files by their
# number of tests, which put test_preempt_mp.py (1 test, 95 s) and test_readme.py (1 test, 62 s)
# last. Seconds: every file's wall time (setup, call and teardown of its tests) in one run of e025efd on the idle
# 2-core machine (2026-12-07, cold compilation cache, 1209 tests, 1132 s over both workers, pytest 582 s); a new
# file not listed counts 0.94 s per test, the mean of these. (Earlier: a2f45b8, 1216 tests, 1576 s, 1.19 s per
# test; 12-03: 947 tests, 2617 s, 2.76 s per test.)
FILE_SECONDS = {
    "test_tensor_parallel.py": 90, "test_preempt_mp.py": 81, "test_context.py": 62, "test_readme.py": 48,
    "test_offload.py": 40, "test_checkpoint.py": 36, "test_multiprocess.py": 35, "test_preempt.py": 35,
    "test_cli.py": 26, "test_hf_finetune.py": 25, "test_bench.py": 24, "test_optim.py": 24, "test_plan.py": 24,
    "test_main_job.py": 23, "test_verify.py": 23, "test_memory.py": 21, "test_user_models.py": 20,
    "test_expert_parallel.py": 19, "test_scan.py": 19, "test_step.py": 19, "test_strategies.py": 19,
    "test_data.py": 18, "test_attention.py": 17, "test_hpz.py": 17, "test_main_eval.py": 17,
    "test_plan_search.py": 17, "test_remat.py": 17, "test_feedback.py": 16, "test_hybrid_opt.py": 16,
    "test_moe.py": 16, "test_plan_search_formats.py": 16, "test_quant.py": 16, "test_hf.py": 15,
    "test_model_state.py": 15, "test_zoo.py": 15, "test_generate.py": 14, "test_precision.py": 14,
    "test_sample.py": 14, "test_accum.py": 12, "test_gpu.py": 12, "test_train.py": 11, "test_train_auto.py": 11,
    "test_leaves.py": 9, "test_plan_search_expert.py": 8, "test_train_presets.py": 7, "test_units.py": 7,
    "test_bench_moe.py": 6, "test_global_view.py": 6, "test_shapes.py": 6, "test_evaluate.py": 5, "test_mesh.py": 5,
    "test_moe_op.py": 5, "test_prefetch.py": 5, "test_tied.py": 5, "test_flat.py": 4, "test_frozen.py": 4,
    "test_router_metrics.py": 3, "test_scale.py": 3, "test_collectives.py": 2, "test_cost_model.py": 2,
    "test_install.py": 2, "test_structure.py": 2, "test_expert_plan.py": 1, "test_forward.py": 1,
    "test_launch.py": 1, "test_layout.py": 1, "test_mixtral.py": 1, "test_quant_context.py": 1, "test_wire.py": 1,
    "test_aliases.py": 0, "test_config.py": 0, "test_docs_numbers.py": 0, "test_expert_cli.py": 0,
    "test_expert_formulas.py": 0, "test_report.py": 0,
}  # fmt: skip
MEAN_TEST_SECONDS = 0.94


def pytest_collection_modifyitems(config, items):
    per_file = collections.Counter(item.path.name for item in items)

    def seconds(name: str) -> float:
        return FILE_SECONDS.get(name, MEAN_TEST_SECONDS * per_file[name])

    items.sort(key=lambda item: (-seconds(item.path.name), item.path.name))  # stable: the order inside a file is kept

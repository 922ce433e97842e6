"""The GPU program on a machine without a GPU: every backend choice follows the mesh's devices.

A 2-layer Llama (d 256, 4 heads of 64, 2 key/value heads, sequence 512) compiled for 8 x H100
(``zshard.gpu_devices("h100")``) in this CPU process: cuDNN attention forward and backward, the
GPU compiler options (``zshard.gpu.GPU_COMPILER_OPTIONS``) changing the collectives, the overlap
view of ``zshard.report``, prefetch 1; and on the CPU mesh of the same process none of it (the
attention numbers bitwise those of ``jax.nn.dot_product_attention``'s XLA path). The GPU cases need
JAX's CUDA plugin (``pip install "zshard[cuda12]"``, CI installs it) and skip without it.
"""

import dataclasses
import importlib
import importlib.util
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zshard
from train.model import LlamaConfig, build_model, cross_entropy_loss, tensor_plan
from zshard import gpu
from zshard.attention import _bias
from zshard.gpu import cudnn_refusal
from zshard.programs.step_config import default_prefetch


# compile-only GPU executables cannot be read back from JAX's persistent cache (tests/conftest.py sets one)
pytestmark = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
CUDA = gpu.cuda_plugin()
needs_cuda = pytest.mark.skipif(not CUDA, reason='JAX\'s CUDA plugin is not installed (pip install "zshard[cuda12]")')
CFG = LlamaConfig(vocab_size=512, seq_len=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, scan=True)
MP = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")


def _state(mesh):
    return zshard.init(lambda: build_model(CFG, nnx.Rngs(0)), optax.adamw(1e-3), mesh, abstract=True, mixed_precision=MP)


def _batch():
    tokens = jax.ShapeDtypeStruct((8, CFG.seq_len), jnp.int32)
    return tokens, tokens


@pytest.fixture(scope="module")
def h100():
    return zshard.make_mesh(1, 8, devices=zshard.gpu_devices("h100", 8))


@pytest.fixture(scope="module")
def gpu_report(h100):
    return zshard.report(zshard.make_train_step(cross_entropy_loss), _state(h100), _batch())


def test_target_errors_name_the_choices_and_the_fix():
    with pytest.raises(ValueError, match="choose one of 'h100', 'h200', 'a100'"):
        zshard.gpu_devices("v100")
    with pytest.raises(ValueError, match="multiple of 8"):
        zshard.gpu_devices("h100", 12)
    for name in gpu.TARGETS:  # each spec names its source and its adjustment
        head = gpu.target_spec(name)[:1200]
        assert "Source: openxla/xla" in head and "Adjusted for jaxlib 0.10.2" in head


def _no_jax_plugins(name):  # find_spec of a dotted name when the parent package is absent (the README's install)
    raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")


@pytest.mark.parametrize("absent", [lambda name: None, _no_jax_plugins], ids=["other-plugins", "no-jax_plugins"])
def test_missing_cuda_plugin_names_the_extra(monkeypatch, absent):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: absent(name) if name == "jax_plugins.xla_cuda12" else real(name, *a))
    assert gpu.cuda_plugin() is False
    with pytest.raises(ImportError, match=r'pip install "zshard\[cuda12\]"'):
        zshard.gpu_devices("h100")


@needs_cuda
@pytest.mark.parametrize("target,kind", [("h100", "H100"), ("h200", "H200"), ("a100", "A100")])
def test_targets_make_meshes_of_their_gpus(target, kind):
    devices = zshard.gpu_devices(target, 16)
    assert len(devices) == 16 and kind in devices[0].device_kind and devices == zshard.gpu_devices(target, 16)
    assert [d.process_index for d in devices] == [i // 8 for i in range(16)]  # one host per 8
    mesh = zshard.make_mesh(2, 8, devices=devices)
    assert gpu.platform(mesh) == "cuda" and mesh.devices[1, 0].process_index == 1
    assert gpu.compile_only(mesh) and gpu.compiler_options(mesh) == {**gpu.GPU_COMPILER_OPTIONS, **gpu.COMPILE_ONLY_OPTIONS}


@needs_cuda
def test_prefetch_default_follows_the_mesh(h100):
    assert default_prefetch(mesh=h100) == 1
    assert default_prefetch(mesh=zshard.make_mesh(1, 8)) == 0  # this process's CPU devices
    assert gpu.platform(zshard.make_mesh(1, 8)) == "cpu" and gpu.compiler_options(zshard.make_mesh(1, 8)) is None


@needs_cuda
def test_gpu_step_uses_cudnn_and_reports_overlap(gpu_report):
    att = gpu_report.attention
    assert att["kernel"] == "cudnn" and att["forward_calls"] >= 1 and att["backward_calls"] >= 1
    assert {o["op"] for o in gpu_report.overlap} >= {"all-gather", "reduce-scatter"}
    for o in gpu_report.overlap:
        assert set(o) >= {"op", "axis", "bytes", "async", "compute_between"} and o["bytes"] > 0 and o["axis"] == "shard"
        assert o["compute_between"] >= 0 and (o["async"] or o["compute_between"] == 0)
    started = [o for o in gpu_report.overlap if o["async"] and o["op"] in ("all-gather", "reduce-scatter")]
    assert started and sum(o["compute_between"] > 0 for o in started) >= 0.9 * len(started)
    assert "with compute between start and done" in gpu_report.table() and gpu_report.prefetch == 1


@needs_cuda
def test_gpu_compiler_options_reach_xla_through_zshards_jit(h100, monkeypatch):
    def grad(ws, x):  # 4 layers, each weight all-gathered: its transpose a reduce-scatter
        def loss(ws, x):
            for w in ws:
                x = jnp.tanh(x @ jax.lax.all_gather(w, "shard", axis=0, tiled=True))  # [256/8, 256] --all_gather--> [256, 256]
            return x.astype(jnp.float32).mean()
        return jax.grad(loss)(ws, x)

    spec = P(("replica", "shard"))
    f = jax.shard_map(grad, mesh=h100, in_specs=([spec] * 4, spec), out_specs=[spec] * 4)
    shard = jax.sharding.NamedSharding(h100, spec)
    args = ([jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=shard)] * 4, jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=shard))

    def collectives(options):
        monkeypatch.setattr(gpu, "GPU_COMPILER_OPTIONS", options)
        return len(zshard.parse_overlap(gpu.mesh_jit({}, f, h100).lower(*args).compile().as_text(), h100))

    split = {"xla_gpu_all_gather_combine_threshold_bytes": 1, "xla_gpu_reduce_scatter_combine_threshold_bytes": 1}
    assert collectives(split) > collectives({})  # uncombined: one per layer and direction
    monkeypatch.undo()
    step = zshard.make_train_step(cross_entropy_loss)  # the step's jit on a CUDA mesh is the one with the profile
    profile = {**gpu.GPU_COMPILER_OPTIONS, **gpu.COMPILE_ONLY_OPTIONS}  # h100's devices compile only
    assert step._jit_for(_state(h100)) is step._jits[tuple(sorted(profile.items()))]
    assert step._jit_for(_state(zshard.make_mesh(1, 8))) is step._jitted  # CPU: XLA's defaults, as before


@needs_cuda
def test_a_large_sort_compiles_without_a_gpu():
    # the MoE router's token sort (zshard/moe.py) on a compile-only GPU: with XLA's defaults a sort of more than
    # about 20,000 keys becomes CUB's radix sort, whose scratch-size query needs a device; COMPILE_ONLY_OPTIONS turn it off
    mesh = jax.sharding.Mesh(zshard.gpu_devices("h100", 1), ("x",))
    assert gpu.compile_only(mesh) and not gpu.compile_only(zshard.make_mesh(1, 8)) and not gpu.compile_only(jax.devices())
    keys = jax.ShapeDtypeStruct((65536,), jnp.int32, sharding=jax.sharding.NamedSharding(mesh, P()))
    with pytest.raises(jax.errors.JaxRuntimeError, match="invalid device ordinal"):  # why the option is there
        jax.jit(jnp.argsort).lower(keys).compile()
    assert gpu.compiler_options(mesh)["xla_gpu_enable_cub_radix_sort"] is False
    compiled = jax.jit(jnp.argsort, compiler_options=gpu.compiler_options(mesh)).lower(keys).compile()
    assert "sort(" in compiled.as_text() and "cub" not in compiled.as_text().lower()


@needs_cuda
def test_cudnn_on_a_tensor_axis_splits_the_heads_by_hand():
    mesh = zshard.make_mesh(1, 4, tensor=2, devices=zshard.gpu_devices("h100", 8))
    state = zshard.init(lambda: build_model(CFG, nnx.Rngs(0)), optax.adamw(1e-3), mesh, abstract=True, mixed_precision=MP,
                        tensor_parallel=tensor_plan(CFG, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: the heads (4 query, 2 key/value) divide over tensor 2
        text = zshard.make_train_step(cross_entropy_loss).lower(state, (jax.ShapeDtypeStruct((4, CFG.seq_len), jnp.int32),) * 2).as_text()
    assert re.search(r"__cudnn\$fmhaSoftmax\b(?!Backward)", text) and "__cudnn$fmhaSoftmaxBackward" in text


@needs_cuda
def test_eval_step_on_a_gpu_mesh_runs_cudnn_forward_only(h100):
    text = zshard.make_eval_step(cross_entropy_loss).lower(_state(h100), _batch()).as_text()
    assert "@__cudnn$fmhaSoftmax(" in text and "Backward" not in text


@needs_cuda
def test_packed_segments_reach_cudnn_as_a_mask(h100):
    spec = P(("replica", "shard"))
    f = jax.shard_map(lambda q, k, v, seg: zshard.attention(q, k, v, segment_ids=seg), mesh=h100, in_specs=(spec,) * 4,
                      out_specs=spec)
    shard = jax.sharding.NamedSharding(h100, spec)
    q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard) for x in _qkv(jnp.bfloat16))
    text = jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))).lower(
        q, k, v, jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=shard)).as_text()
    assert "@__cudnn$fmhaScaleBiasSoftmax(" in text and "@__cudnn$fmhaScaleBiasSoftmaxBackward(" in text


@needs_cuda
def test_gpu_step_exports_with_cudnn_calls(h100):  # zshard.report's offload view exports the GPU program
    text = zshard.make_train_step(cross_entropy_loss).export(_state(h100), _batch()).mlir_module()
    assert "@__cudnn$fmhaSoftmaxBackward(" in text


def _attention_on(mesh, q, k, v, **kw):
    spec = P(("replica", "shard"))
    f = jax.shard_map(lambda q, k, v: zshard.attention(q, k, v, **kw), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    return jax.jit(f)


def _qkv(dtype, head_dim=64, n=16):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (8, n, 4, head_dim), dtype)
    k, v = (jax.random.normal(x, (8, n, 2, head_dim), dtype) for x in ks[1:])
    return q, k, v


def test_cpu_mesh_attention_is_the_xla_path_bitwise():
    q, k, v = _qkv(jnp.float32)
    seg = jnp.asarray(np.repeat([[0] * 10 + [1] * 6], 8, axis=0), jnp.int32)
    mesh = zshard.make_mesh(1, 8)
    placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, P(("replica", "shard")))) for x in (q, k, v)]
    got = _attention_on(mesh, q, k, v, sliding_window=5)(*placed)
    spec = P(("replica", "shard"))  # the same program by hand: GQA repeated, the mask an additive bias

    def xla_path(q, k, v):
        return jax.nn.dot_product_attention(q, jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2), bias=_bias(16, 16, True, 5, None))

    want = jax.jit(jax.shard_map(xla_path, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(*placed)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    one = zshard.attention(q, k, v, segment_ids=seg)  # outside any mesh: the process's backend, CPU
    ref = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2), bias=_bias(16, 16, True, None, seg))
    np.testing.assert_array_equal(np.asarray(one), np.asarray(ref))
    assert "cudnn" not in _attention_on(mesh, q, k, v).lower(*placed).as_text()


@needs_cuda
def test_cuda_mesh_attention_kernel_and_its_named_fallbacks(h100, monkeypatch):
    monkeypatch.setattr(gpu, "_WARNED", set())  # each fallback warns once per process
    def lowered(q, k, v, **kw):
        shard = jax.sharding.NamedSharding(h100, P(("replica", "shard")))
        args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard) for x in (q, k, v)]
        return _attention_on(h100, q, k, v, **kw).lower(*args).as_text()

    q, k, v = _qkv(jnp.bfloat16)
    assert "__cudnn$fmhaSoftmax" in lowered(q, k, v, sliding_window=4)  # GQA k, v [.., 2, 64] as they are
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        assert "__cudnn$fmha" in lowered(q, k, v)
    assert cudnn_refusal(q, k, v, softcap=30.0).startswith("a soft-cap")
    assert "float32" in cudnn_refusal(*_qkv(jnp.float32))
    assert "two-sided" in cudnn_refusal(q, k, v, causal=False, sliding_window=4)
    with pytest.warns(UserWarning, match="head dim must be <= 128"):  # AOT on a CPU host: JAX cannot read the GPU
        text = lowered(*_qkv(jnp.bfloat16, head_dim=256))
    assert "__cudnn" not in text
    with pytest.warns(UserWarning, match="soft-cap"):
        assert "__cudnn" not in lowered(q, k, v, softcap=30.0)


@needs_cuda
def test_compiler_partitioned_batch_gets_cudnn_like_zshard(h100, monkeypatch):
    # a plain jax.jit over a batch sharded on the mesh (the compiler-FSDP peer of train.plan --peer): cuDNN
    # through a shard_map over the batch, forward and backward, no fallback; a batch the axes do not divide falls back
    monkeypatch.setattr(gpu, "_WARNED", set())
    q, k, v = _qkv(jnp.bfloat16)
    rows = jax.sharding.NamedSharding(h100, P(("replica", "shard")))

    def lowered(q, k, v):
        loss = lambda q, k, v: zshard.attention(q, k, v).astype(jnp.float32).sum()  # noqa: E731
        args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows if x.shape[0] % 8 == 0 else None) for x in (q, k, v)]
        with jax.set_mesh(h100):
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        text = lowered(q, k, v)
    assert not [w for w in seen if "zshard.attention" in str(w.message)]  # no fallback
    assert re.search(r'custom_call_target="__cudnn\$fmhaSoftmax"', text) and "__cudnn$fmhaSoftmaxBackward" in text
    with pytest.warns(UserWarning, match="data axes that divide the batch"):
        assert "__cudnn" not in lowered(*(x[:4] for x in (q, k, v)))


def test_embed_returns_the_tables_dtype_so_the_residual_stream_is_the_compute_dtype():
    from train.models.core import Embed
    from train.models.loss import loss_chunk

    emb = Embed(16, 4, rngs=nnx.Rngs(0))
    ids = jnp.arange(3)
    assert emb(ids).dtype == jnp.float32  # fp32 tables: float32, as before
    emb.embedding.value = emb.embedding.value.astype(jnp.bfloat16)  # as zshard's bf16 gather hands it over
    assert emb(ids).dtype == jnp.bfloat16
    fixed = Embed(16, 4, dtype=jnp.float32, rngs=nnx.Rngs(0))
    fixed.embedding.value = fixed.embedding.value.astype(jnp.bfloat16)
    assert fixed(ids).dtype == jnp.float32  # an explicit dtype wins
    # the loss chunks are balanced: no padded rows for Llama 3's vocabulary at 8192 tokens (64 x 128, not 64 x 130)
    assert loss_chunk(8192, 128256) == 128 and loss_chunk(8191, 128256) == 128 and loss_chunk(130, 128256) == 130


def test_gradients_leave_the_scanned_units_in_the_reduce_dtype():
    # [Note: reduce-dtype cotangents] (zshard/wire/grad_exit.py): with a bf16 gradient reduction the backward scan
    # over the layers stacks bf16 [L, n_pad/N] cotangents, not fp32 upcasts (the GPU temp, docs/performance.md);
    # the step casts them to the fp32 masters' dtype afterwards (the values: tests/test_precision.py)
    mesh = zshard.make_mesh(1, 8)
    mp = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="bfloat16")
    state = zshard.init(lambda: build_model(CFG, nnx.Rngs(0)), optax.adamw(1e-3), mesh, abstract=True, mixed_precision=mp)
    stacked = state.params["blocks"]["mlp"]["w_down"]["kernel"]  # [L, n_pad] f32, split over the world on n_pad
    per_device = f"{CFG.n_layers},{stacked.shape[-1] // 8}]"
    hlo = zshard.make_train_step(cross_entropy_loss).lower(state, _batch()).as_text(dialect="hlo")
    assert stacked.dtype == jnp.float32 and f"bf16[{per_device}" in hlo

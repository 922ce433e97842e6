"""The GPU side of zshard, decided by a mesh's devices, never by the process's default backend.

- :func:`gpu_devices`: the devices of a compile-only NVIDIA GPU topology (``"h100"``, ``"h200"``,
  ``"a100"``) built from XLA's target spec kept in ``zshard/targets/*.txtpb`` (each file names its
  source and how it was adjusted for jaxlib 0.10.2). ``zshard.make_mesh(1, 8, devices=...)`` over
  them compiles the real XLA:GPU program on a machine without a GPU (``step.lower(...).compile()``:
  ``memory_analysis()`` and ``as_text()`` are XLA:GPU's; nothing can run).
- :func:`platform`: ``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"`` of a mesh, a device, or the
  code being traced (:func:`traced_platform`: the mesh of the enclosing ``shard_map``). The
  attention kernel (:mod:`zshard.attention`), the prefetch default
  (:func:`zshard.programs.step_config.default_prefetch`) and the compiler options below follow it.
- :data:`GPU_COMPILER_OPTIONS` / :func:`compiler_options`: the XLA:GPU options zshard's own
  ``jax.jit`` passes (``compiler_options=``) when the mesh is on CUDA; not ``XLA_FLAGS``. On a
  compile-only mesh (:func:`compile_only`) also :data:`COMPILE_ONLY_OPTIONS`.
- :func:`cuda_attention`: ``zshard.attention``'s kernel on a CUDA mesh, cuDNN's flash attention,
  with the fallbacks :func:`cudnn_refusal` names.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zshard.context.flash import TILE, one_device
from zshard.mesh.mesh import TENSOR

__all__ = [
    "COMPILE_ONLY_OPTIONS", "CUDA_EXTRA", "CUDNN_CALLS", "CUDNN_DTYPES", "GPU_COMPILER_OPTIONS", "TARGETS", "compile_only",
    "compiler_options", "cuda_attention",
    "cudnn_refusal", "export_checks", "gpu_devices", "mesh_jit", "platform", "target_spec", "traced_platform",
]  # fmt: skip

TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "a100": "a100_sxm_80.txtpb"}  # target -> zshard/targets/ file
CUDA_EXTRA = 'pip install "zshard[cuda12]"'  # JAX's CUDA plugin (jax[cuda12]): needed to compile for a GPU target

# [Note: GPU compiler options] XLA:GPU DebugOptions given to jax.jit(compiler_options=...) on a CUDA
# mesh. What each changed was read in the program compiled ahead of time for 8 x H100 (llama-3-8b
# plan preset, FULL_SHARD 1x8, bf16 compute, fp32 masters and reduce, 8 x 8192 tokens; measured
# 2026-12-05 with python scripts/gpu_aot_check.py and zshard.inspection.hlo.parse_overlap; a scanned loop's
# body counts once). XLA's defaults: 18 all-gathers (all async), 9 reduce-scatters (6 async: the
# collective pipeliner peels the last layer's 3 out of the backward loop, where they run
# synchronously), temp 19.44 GB (10.65 GB with the chunked loss and the bf16 residual stream).
# - xla_gpu_reduce_scatter_combine_threshold_bytes = 1 GiB: a block's float32 gradients (872 MB
#   for Llama-3 8B) leave in one reduce-scatter, not 3: 3 reduce-scatters in the text, all async,
#   each with compute between start and done (the loop's: 14 fusions / GEMMs / cuDNN calls), and
#   temp 18.98 GB (-0.46 GB; now 10.26 GB, -0.39). The all-gathers stay per parameter (their
#   threshold is left at XLA's): combined, a block's one gather would overlap only its RMSNorm, where split each
#   parameter's gather overlaps the previous one's GEMM.
# - xla_gpu_enable_latency_hiding_scheduler = True: XLA's default in jaxlib 0.10.2 (the program
#   is the same without it); named so the profile does not depend on that default.
# Measured and left out: xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce} = True
# (the same program: the reduce-scatter pipeliner is already on, nothing else is pipelined),
# xla_gpu_enable_while_loop_double_buffering (unrolls the layer loops in two, the same overlap in
# each half, temp +0.03 GB), xla_gpu_enable_pipelined_reduce_scatter = False (temp 17.78 GB, now
# 9.68 GB, but each block's reduce-scatter must finish inside its own iteration: 1-6 ops between
# instead of the next block's backward, 14; docs/performance.md).
GPU_COMPILER_OPTIONS: dict = {
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 30,
    "xla_gpu_enable_latency_hiding_scheduler": True,
}
# What a compile-only topology (gpu_devices: no GPU, no driver) cannot compile with XLA's defaults:
# a sort of more than about 20,000 keys (measured 2026-12-06, argsort of int32 on one H100: 20,000
# compiles, 24,576 fails; the MoE router's token sort, zshard/moe.py) becomes CUB's radix sort, whose
# scratch-size query runs on a device: "CUDA Runtime error: cudaErrorInvalidDevice: invalid device
# ordinal". Off, XLA sorts with its own kernel: the compile-only program differs from a GPU's there
# (tests/test_gpu.py::test_a_large_sort_compiles_without_a_gpu).
COMPILE_ONLY_OPTIONS: dict = {"xla_gpu_enable_cub_radix_sort": False}


def target_spec(target: str) -> str:
    """The text of XLA's GPU target spec of ``target`` (``zshard/targets/<file>.txtpb``: a
    ``stream_executor.GpuTargetConfigProto``; its header names the source).

    Raises:
      ValueError: ``target`` is not one of :data:`TARGETS` (the message lists them).
    """
    if target not in TARGETS:
        raise ValueError(f"GPU target {target!r} is unknown; choose one of {', '.join(map(repr, TARGETS))}")
    try:
        folder = importlib.resources.files("zshard.targets")
    except ModuleNotFoundError:  # a checkout run without installing: the folder beside this file
        folder = Path(__file__).resolve().parent / "targets"
    return folder.joinpath(TARGETS[target]).read_text()


@functools.lru_cache(maxsize=None)
def _topology_devices(target: str, count: int, devices_per_host: int) -> tuple:
    from jax.experimental import topologies  # noqa: PLC0415  (imports the plugin machinery only when asked)

    hosts, per_host = (1, count) if count <= devices_per_host else (count // devices_per_host, devices_per_host)
    # "<partitions>x<hosts>x<devices per host>"; device d of host h has process_index h
    topology = f"1x{hosts}x{per_host}"
    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=target_spec(target), topology=topology)
    except Exception as e:  # the plugin's own message (a field it does not know, a driver it wanted)
        raise RuntimeError(f"gpu_devices({target!r}, {count}): JAX's CUDA plugin refused the target spec "
                           f"zshard/targets/{TARGETS[target]} for topology {topology}: {e}") from e
    return tuple(desc.devices)


def gpu_devices(target: str, count: int = 8, devices_per_host: int = 8) -> list:
    """The devices of a compile-only topology of ``count`` GPUs of ``target``, for ahead-of-time
    compiles on any machine (no GPU, no driver: JAX's CUDA plugin compiles, nothing runs).

    ``zshard.make_mesh(1, 8, devices=zshard.gpu_devices("h100"))`` is a mesh of 8 H100; a step
    lowered on it (``step.lower(state, batch).compile()``, ``zshard.report``) is XLA:GPU's program
    with cuDNN attention, the GPU prefetch default and :data:`GPU_COMPILER_OPTIONS`.

    Args:
      target: ``"h100"`` (H100 SXM 80 GB), ``"h200"`` (141 GB) or ``"a100"`` (A100 SXM 80 GB).
      count: GPUs in all; more than ``devices_per_host`` must be a multiple of it.
      devices_per_host: GPUs of one host (NVLink domain): device ``d`` is on host
        ``d // devices_per_host`` (its ``process_index``), so ``make_mesh`` keeps a host's
        devices adjacent on ``shard``.

    Returns:
      ``count`` ``jax.Device`` of platform ``"gpu"`` (``device_kind`` e.g. ``"NVIDIA H100 80GB
      HBM3"``), the same objects for the same arguments (so meshes over them compare equal).

    Raises:
      ValueError: an unknown ``target`` (the choices listed), or counts that are not positive or
        do not divide into hosts.
      ImportError: JAX's CUDA plugin is not installed (``pip install "zshard[cuda12]"``).
      RuntimeError: the plugin refused the target spec (its message, the file named).
    """
    target_spec(target)  # an unknown target: named before anything else
    for name, n in (("count", count), ("devices_per_host", devices_per_host)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"gpu_devices: {name}={n!r} must be a positive int")
    if count > devices_per_host and count % devices_per_host:
        raise ValueError(f"gpu_devices: count={count} GPUs do not fill hosts of devices_per_host={devices_per_host}; "
                         f"give a multiple of {devices_per_host} (or count <= {devices_per_host}: one host)")
    if not cuda_plugin():
        raise ImportError(f"gpu_devices({target!r}): compiling for a GPU target needs JAX's CUDA plugin, which is not "
                          f"installed: {CUDA_EXTRA} (jax[cuda12]: about 4.4 GB of wheels; no GPU or driver needed)")
    return list(_topology_devices(target, count, devices_per_host))


def cuda_plugin() -> bool:
    """Whether JAX's CUDA plugin (the ``cuda12`` extra, ``jax[cuda12]``) is installed. ``find_spec`` of
    ``jax_plugins.xla_cuda12`` returns ``None`` when other plugins are installed and raises
    ``ModuleNotFoundError`` when none is (no ``jax_plugins`` package: ``pip install ".[train]"``)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def _kind(platform_name: str, device_kind: str) -> str:
    """``"cuda"`` / ``"rocm"`` for JAX's platform ``"gpu"`` (by the device kind: AMD's are
    ``"AMD Instinct ..."``), else the platform itself (``"cpu"``, ``"tpu"``)."""
    if platform_name == "gpu":
        return "rocm" if re.search(r"\bAMD\b|Instinct|Radeon|gfx\d", device_kind) else "cuda"
    return platform_name


def platform(where) -> str:
    """The platform of a mesh (concrete or abstract), a device, or a sequence of devices:
    ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``; ``None``: the process's default backend's.

    Raises:
      ValueError: a mesh or list without devices (an abstract mesh made without one).
    """
    if where is None:
        where = jax.devices()[0]
    if isinstance(where, jax.sharding.AbstractMesh):
        dev = where.abstract_device
        if dev is None:
            raise ValueError(f"zshard.gpu.platform: the abstract mesh {where} carries no device (make it from a mesh of devices)")
        return _kind(dev.platform, dev.device_kind)
    if isinstance(where, jax.sharding.Mesh):
        where = where.devices.flat[0]
    elif not hasattr(where, "platform"):
        where = list(where)
        if not where:
            raise ValueError("zshard.gpu.platform: no devices")
        where = where[0]
    return _kind(where.platform, where.device_kind)


def traced_platform(x=None) -> str:
    """The platform the code being traced compiles for: the devices of the enclosing mesh
    (inside ``shard_map``: zshard's steps), else of ``x``'s mesh (an array with a
    ``NamedSharding``), else the process's default backend (plain ``jax.jit`` on one device)."""
    for mesh in (jax.sharding.get_abstract_mesh(), None if x is None else getattr(jax.typeof(x).sharding, "mesh", None)):
        if isinstance(mesh, jax.sharding.AbstractMesh) and mesh.abstract_device is not None:
            return platform(mesh)
    return platform(None)


def compile_only(where) -> bool:
    """Whether a mesh (concrete), a device or a sequence of devices is compile-only: a
    topology's (:func:`gpu_devices`, ``jax.experimental.topologies``), whose programs compile
    but never run. ``False`` for an abstract mesh (no device to ask) and for real devices."""
    if isinstance(where, jax.sharding.AbstractMesh):
        return False
    if isinstance(where, jax.sharding.Mesh):
        where = where.devices.flat[0]
    elif not hasattr(where, "platform"):
        where = next(iter(where), None)
    return "CompileOnly" in type(getattr(where, "client", None)).__name__  # jaxlib's CompileOnlyPyClient


def compiler_options(mesh) -> dict | None:
    """``jax.jit(compiler_options=...)`` for a program on ``mesh``: :data:`GPU_COMPILER_OPTIONS`
    (a copy) on a CUDA mesh, with :data:`COMPILE_ONLY_OPTIONS` on a compile-only one
    (:func:`compile_only`); ``None`` elsewhere (XLA's defaults: CPU programs unchanged)."""
    if platform(mesh) != "cuda":
        return None
    return {**GPU_COMPILER_OPTIONS, **(COMPILE_ONLY_OPTIONS if compile_only(mesh) else {})}


def mesh_jit(cache: dict, fn, mesh, **jit_kw):
    """``jax.jit(fn, compiler_options=compiler_options(mesh), **jit_kw)``, made once per set of
    options and kept in ``cache`` (the steps' jits: one for XLA's defaults, one for the GPU profile)."""
    options = compiler_options(mesh)
    key = None if options is None else tuple(sorted(options.items()))
    if key not in cache:
        cache[key] = jax.jit(fn, compiler_options=options, **jit_kw)
    return cache[key]


# ------------------------------------------------------------------------------------------------
# cuDNN attention: zshard.attention's kernel on a CUDA mesh

CUDNN_DTYPES = ("bfloat16", "float16")
# the custom calls cuDNN's attention lowers to (jax.nn.dot_product_attention; a mask makes it a bias)
CUDNN_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward", "__cudnn$fmhaScaleBiasSoftmax",
               "__cudnn$fmhaScaleBiasSoftmaxBackward")


def export_checks() -> list:
    """``jax.export.export(..., disabled_checks=...)`` for a program with cuDNN attention: its
    custom calls are not among jax.export's stable ones (their ABI may change between jaxlib
    versions), so an exported GPU program is for reading (``mlir_module()``), not for keeping."""
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in CUDNN_CALLS]
_WARNED: set = set()  # the fallback reasons already warned of (once each per process)


def cudnn_refusal(q, k, v, *, causal: bool = True, sliding_window=None, softcap=None) -> str | None:
    """Why ``jax.nn.dot_product_attention(..., implementation="cudnn")`` cannot take this call,
    known before calling it, or ``None``: a soft-cap (jax.nn has none), a dtype other than
    bfloat16 / float16 or q, k, v of different dtypes, a window that is not causal (cuDNN's window
    is left-sided only). Shapes cuDNN refuses (e.g. ``head_dim > 128`` in an ahead-of-time compile
    on a host without a GPU, where JAX cannot read the GPU's compute capability) are found by the
    call itself (:func:`cuda_attention`)."""
    if softcap is not None:
        return "a soft-cap (jax.nn.dot_product_attention has no soft-cap option)"
    dtypes = {jnp.dtype(x.dtype).name for x in (q, k, v)}
    if len(dtypes) > 1 or not dtypes <= set(CUDNN_DTYPES):
        return f"q, k, v of dtype {'/'.join(sorted(dtypes))} (cuDNN's flash attention takes one of {', '.join(CUDNN_DTYPES)})"
    if sliding_window is not None and not causal:
        return "a two-sided sliding window (cuDNN's window is left-sided, under a causal mask)"
    return None


def cuda_attention(q, k, v, *, causal=True, segment_ids=None, sliding_window=None, scale=None, softcap=None, tile=TILE):
    """One device's attention on CUDA: cuDNN's flash attention (``jax.nn.dot_product_attention(...,
    implementation="cudnn")``: the ``__cudnn$fmhaSoftmax`` forward and ``__cudnn$fmhaSoftmaxBackward``
    custom calls), else the tiled block (:func:`zshard.context.flash.one_device`) with a warning, once per
    reason, naming it.

    Grouped-query keys and values ``[B, L, n_kv, D]`` go to cuDNN as they are (no repeat to the query
    heads); ``causal`` is cuDNN's causal mask; ``sliding_window`` ``W`` its left window (``W - 1``
    keys before the query's own); ``segment_ids`` a boolean ``[B, 1, L, L]`` mask of equal ids, which
    jax.nn passes to cuDNN as an additive bias in ``q``'s dtype (a ``[B, 1, L, L]`` buffer forward,
    and cuDNN writes its gradient backward). Refused (:func:`cudnn_refusal`, or the call raising):
    the tiled block, exact in float32 (zshard/context/flash.py). ``q [B, L, H, D]`` -> ``[B, L, H, Dv]``."""
    reason = cudnn_refusal(q, k, v, causal=causal, sliding_window=sliding_window, softcap=softcap)
    mesh = jax.sharding.get_abstract_mesh()
    auto = [a for a, kind in zip(mesh.axis_names, mesh.axis_types) if kind != jax.sharding.AxisType.Manual and mesh.shape[a] > 1]
    tensor = mesh.shape[TENSOR] if auto == [TENSOR] else 0
    data = int(np.prod([mesh.shape[a] for a in auto])) if auto and TENSOR not in auto else 0
    if reason is None and auto and not (tensor and q.shape[2] % tensor == 0 and k.shape[2] % tensor == 0) \
            and not (data and q.shape[0] % data == 0):
        # JAX 0.10.2's cuDNN call cannot be partitioned by the compiler ("'GSPMDSharding' object has no attribute 'spec'")
        reason = (f"the mesh axes {auto} are partitioned by the compiler around q {tuple(q.shape)}, k {tuple(k.shape)} (JAX's "
                  "cuDNN call cannot be; a tensor axis that divides the query and key/value heads, or data axes that "
                  "divide the batch, are split by hand)")
    if reason is None:
        mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, L, L]
        window = None if sliding_window is None else (sliding_window - 1, 0)  # keys p' in [p - (W-1), p]

        def cudnn(q, k, v, mask):
            return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal, local_window_size=window,
                                                implementation="cudnn")

        try:
            if data:
                free = tuple(a for a, kind in zip(mesh.axis_names, mesh.axis_types) if kind != jax.sharding.AxisType.Manual)
                return _over_batch(cudnn, mesh, free)(q, k, v, mask)  # every free axis manual: none left to partition
            return (_over_tensor(cudnn, mesh) if auto else cudnn)(q, k, v, mask)
        except (NotImplementedError, ValueError, RuntimeError) as e:  # cuDNN's (JAX's) refusal of this shape
            reason = f"cuDNN refused q {tuple(q.shape)}, k {tuple(k.shape)}: {e}"
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"zshard.attention on CUDA: {reason}; running zshard's tiled attention (zshard/context/flash.py) instead "
                      "of cuDNN's", stacklevel=3)
    return one_device(q, k, v, causal, segment_ids, sliding_window, scale, softcap, tile)


def _over_tensor(cudnn, mesh):
    """``cudnn(q, k, v, mask)`` with the heads split over the (compiler-partitioned) ``tensor`` axis
    by hand: a ``shard_map`` over ``tensor`` (Megatron's layout: each device holds whole key/value
    groups with their query heads, ``q [B, L, H/T, D]``, ``k, v [B, L, n_kv/T, D]``), under a custom
    VJP whose backward runs cuDNN's forward again and its backward in a second ``shard_map``: JAX
    0.10.2 cannot lower a differentiated ``shard_map`` over ``tensor`` inside zshard's (its residuals'
    sharding puts ``tensor`` after ``shard``). One more cuDNN forward per call in the backward."""
    heads = P(None, None, TENSOR, None)
    fwd = jax.shard_map(cudnn, mesh=mesh, in_specs=(heads, heads, heads, P()), out_specs=heads, axis_names={TENSOR})

    def grads(q, k, v, mask, do):
        return jax.vjp(lambda q, k, v: cudnn(q, k, v, mask), q, k, v)[1](do)

    bwd = jax.shard_map(grads, mesh=mesh, in_specs=(heads, heads, heads, P(), heads), out_specs=(heads,) * 3,
                        axis_names={TENSOR})
    run = jax.custom_vjp(fwd)
    run.defvjp(lambda q, k, v, mask: (fwd(q, k, v, mask), (q, k, v, mask)), lambda res, do: (*bwd(*res, do), None))
    return run


def _over_batch(cudnn, mesh, axes: tuple):
    """``cudnn(q, k, v, mask)`` with the batch split over the compiler-partitioned data ``axes`` by
    hand (a plain ``jax.jit`` with FSDP shardings, e.g. the compiler-FSDP peer of ``train.plan
    --peer``): a ``shard_map`` over ``axes``, each device's sequences ``q [B/N, L, H, D]``, ``k, v
    [B/N, L, n_kv, D]``, mask ``[B/N, 1, L, L]``; differentiated by ``jax.vjp`` through it (cuDNN's
    backward call inside the same ``shard_map``, no extra forward)."""
    rows = P(axes)
    return jax.shard_map(cudnn, mesh=mesh, in_specs=(rows, rows, rows, rows), out_specs=rows, axis_names=set(axes))

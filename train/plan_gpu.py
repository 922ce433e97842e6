"""The compiled program of ``python -m train.plan``, read for a GPU: target devices, attention
kernel, overlap of each collective, FLOPs, the compiler-sharded peer and the JSON summary.

- :func:`target_devices`: compile-only devices of a GPU (``--target h100``) from XLA's target
  specs (:func:`zshard.gpu_devices`), on any machine with the ``cuda12`` extra;
- :func:`program_summary`: what the compiled step holds per device: ``memory`` (bytes of
  ``memory_analysis()``), ``attention`` (the kernel: ``cudnn`` when the program calls cuDNN's
  fused attention, and how often), ``collectives`` (each with whether it is asynchronous and
  how many compute instructions run between its start and its done), ``flops``;
- :func:`compile_peer`: the same model and batch as ``jax.jit`` with FSDP ``NamedSharding``s
  (train/compiler_fsdp.py, the benchmark's FSDP-compiler peer), same remat and precision;
- :func:`side_by_side`, :func:`write_json`: the table and the file.

FLOPs are counted in the compiled program's text: ``2 * prod(output) * prod(contracting)`` of
every ``dot`` (inside fusions too), times the trip count of the loop it runs in. XLA:GPU's
``cost_analysis()`` answers ``None`` for a program compiled without a GPU, and counts nothing
inside a cuDNN call: cuDNN's attention is added by formula (:func:`attention_flops`).
"""

from __future__ import annotations

import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zshard
from train.compiler_fsdp import fsdp_jit
from train.models.core import head_size
from zshard.gpu import cuda_plugin  # noqa: F401  (train.plan's check; in __all__)

__all__ = ["TARGETS", "TARGET_MEMORY_GB", "attention_calls", "attention_flops", "compile_peer", "cuda_plugin",
           "dot_flops", "overlap", "program_summary", "reduce_dtypes", "side_by_side", "target_devices", "write_json"]

TARGETS = ("cpu", "h100", "h200", "a100")
TARGET_MEMORY_GB = {"h100": 80.0, "h200": 141.0, "a100": 80.0}  # HBM of one GPU, vendor sheets (GB = 10^9 bytes)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z\-]*)\((.*)$")


def target_devices(target: str, count: int) -> list:
    """``count`` compile-only devices of GPU ``target`` (``h100``, ``h200``, ``a100``), 8 per host.

    Raises:
      ValueError: a target with no XLA target spec, or ``count`` not a multiple of 8 above 8
        (also for JAX's CUDA plugin refusing the spec: its message).
    """
    try:
        return zshard.gpu_devices(target, count)
    except (ImportError, RuntimeError) as e:
        raise ValueError(f"--target {target}: {e}") from e


def _compiler_options(mesh) -> dict | None:
    """The XLA options zshard's own jit compiles a step on ``mesh`` with (its GPU profile on a CUDA
    mesh, ``None`` elsewhere), so a peer compiled beside it gets the same."""
    return zshard.gpu.compiler_options(mesh)


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """``{computation: [(name, shape, op, rest), ...]}`` in program (= schedule) order."""
    comps, current = {}, None
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)", line)
            current = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            comps[current] = []
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None and (m := _INSTR.match(line)):
            comps[current].append(m.groups())
    return comps


def _trips(comps) -> dict[str, int]:
    """Executions per step of each computation reached from ENTRY (a ``while`` body: its
    ``known_trip_count`` times its caller's)."""
    trips, todo = {"ENTRY": 1}, ["ENTRY"]
    while todo:
        name = todo.pop()
        for _, _, op, rest in comps.get(name, []):
            k = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest) if op == "while" else None
            for callee in re.findall(r"(?:body|calls|condition|branch_computations)=\{?%?([\w.\-]+)", rest):
                if callee in comps and callee not in trips:
                    trips[callee] = trips[name] * (int(k.group(1)) if k and op == "while" else 1)
                    todo.append(callee)
    return trips


def _dims(shape: str) -> list[int]:
    m = re.search(r"\[([0-9,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def dot_flops(hlo: str) -> float:
    """FLOPs of one device's step: ``2 * prod(output dims) * prod(lhs contracting dims)`` of every
    ``dot`` of the compiled program, times the executions of its computation (cuDNN's and other
    custom calls are not counted; neither are elementwise operations)."""
    comps = _computations(hlo)
    trips = _trips(comps)
    total = 0.0
    for comp, instrs in comps.items():
        shapes = {name: shape for name, shape, _, _ in instrs}
        for name, shape, op, rest in instrs:
            if op != "dot":
                continue
            lhs = re.match(r"\s*%?([\w.\-]+)", rest).group(1)
            contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
            lhs_dims = _dims(shapes.get(lhs, ""))
            k = 1
            for d in (int(x) for x in contract.group(1).split(",") if x) if contract else ():
                k *= lhs_dims[d] if d < len(lhs_dims) else 1
            out = 1
            for d in _dims(shape):
                out *= d
            total += 2.0 * out * k * trips.get(comp, 0)
    return total


def reduce_dtypes(hlo: str) -> dict[str, int]:
    """Bytes of the gradient reduce-scatters of a compiled program by element type (``{"f32": ...,
    "bf16": ...}``: each reduce-scatter of the text once, its outputs' bytes): the precision the
    gradients are summed in. zshard's follows ``MixedPrecision.reduce_dtype``; a ``jax.jit`` peer
    computing in bf16 sums the bf16 outputs of its weight-gradient dots (the partitioner puts the
    reduce-scatter there), whatever dtype its masters have."""
    out: dict[str, int] = {}
    for instrs in _computations(hlo).values():
        for _, shape, op, _ in instrs:
            if op in ("reduce-scatter", "reduce-scatter-done"):  # sync, or the async pair's result
                for dtype, dims in re.findall(r"\b([a-z]+\d+)\[([0-9,]*)\]", shape):
                    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
                    out[dtype] = out.get(dtype, 0) + n * np.dtype(_NP.get(dtype, dtype)).itemsize
    return out


_NP = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s8": "int8", "u8": "uint8", "s32": "int32"}


def attention_calls(hlo: str) -> dict:
    """The attention kernel of a compiled program: ``kernel`` (``"cudnn"`` when it calls cuDNN's
    fused attention, ``__cudnn$fmha*``; else ``"xla"``: the attention's own ops),
    ``forward_calls`` / ``backward_calls`` (cuDNN calls in the program text: a scanned loop body
    counts once) and ``forward_runs`` / ``backward_runs`` (per step, loop trips included)."""
    comps = _computations(hlo)
    trips = _trips(comps)
    out = {"forward_calls": 0, "backward_calls": 0, "forward_runs": 0, "backward_runs": 0}
    for comp, instrs in comps.items():
        for _, _, op, rest in instrs:
            target = re.search(r'custom_call_target="(__cudnn\$fmha[^"]*)"', rest) if op == "custom-call" else None
            if target:
                way = "backward" if "Backward" in target.group(1) else "forward"
                out[f"{way}_calls"] += 1
                out[f"{way}_runs"] += trips.get(comp, 0)
    return {"kernel": "cudnn" if out["forward_calls"] else "xla", **out}


def attention_flops(cfg, batch_per_device: int, seq: int, tensor: int, calls: dict) -> float:
    """FLOPs of the cuDNN attention calls of one device's step, which ``dot_flops`` cannot see.

    One causal forward call: ``4 * b * T^2 * h * d / 2`` (``b`` sequences of ``T`` tokens, ``h``
    query heads of width ``d`` on this device; two matmuls ``QK^T``, ``PV`` of ``2 b T^2 h d``
    each, half of the scores masked); a backward call: 2.5 times that (five matmuls, ``QK^T``
    recomputed). FlashAttention-2 (Dao 2023, arXiv 2307.08691) section 4.1, the FLOP count of
    its benchmarks.
    """
    fwd = 4.0 * batch_per_device * seq * seq * (cfg.n_heads // tensor) * head_size(cfg) / 2
    return fwd * (calls["forward_runs"] + 2.5 * calls["backward_runs"])


def overlap(hlo: str, mesh) -> list[dict]:
    """Each collective of a compiled program: ``op``, ``axis``, ``bytes`` (``X``, the full buffer),
    ``trips``, ``async`` and ``compute_between`` (fusions, dots, custom calls and loops scheduled
    between its start and its done, 0 for a synchronous one), in program order."""
    return [{k: c[k] for k in ("op", "axis", "bytes", "trips", "async", "compute_between")}
            for c in zshard.parse_overlap(hlo, mesh)]


def program_summary(compiled, mesh, *, target: str, cfg, batch_per_device: int, seq: int, tensor: int) -> dict:
    """The JSON summary of one compiled step (one device; bytes; FLOPs of one step).

    Keys: ``target``, ``device_kind``, ``memory`` (``argument``, ``output``, ``alias``,
    ``temp``, ``peak = argument + output - alias + temp``), ``attention``
    (:func:`attention_calls`), ``collectives`` (:func:`overlap`), ``overlapped`` (async
    all-gather / reduce-scatter starts of the text with compute between, of all of them),
    ``comm_bytes`` (bytes one device sends per step, ring algorithm), ``flops`` (:func:`dot_flops`
    plus :func:`attention_flops`), ``flops_attention``.
    """
    hlo = compiled.as_text()
    ma = compiled.memory_analysis()
    mem = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    mem["peak"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    calls = attention_calls(hlo)
    colls = overlap(hlo, mesh)
    gathers = [c for c in colls if c["op"] in ("all-gather", "reduce-scatter") and c["async"]]
    att = attention_flops(cfg, batch_per_device, seq, tensor, calls) if calls["kernel"] == "cudnn" else 0.0
    sent = sum(c.sent_bytes * c.trips for c in zshard.parse_collectives(hlo, mesh) if c.axis != "none")
    return {"target": target, "device_kind": mesh.devices.flat[0].device_kind, "memory": mem, "attention": calls,
            "collectives": colls, "overlapped": [sum(c["compute_between"] > 0 for c in gathers), len(gathers)],
            "comm_bytes": sent, "flops": dot_flops(hlo) + att, "flops_attention": att, "reduce_dtypes": reduce_dtypes(hlo)}


def compile_peer(cfg, devices, mesh_shape: dict, batch: int, seq: int, tx, *, remat: str, compute_dtype, build):
    """Compile the benchmark's FSDP-compiler step (:func:`train.compiler_fsdp.fsdp_jit`: ``jax.jit``,
    every parameter and Adam moment sharded on its largest dimension divisible by the device
    count) for ``batch`` x ``seq`` tokens on ``devices``, abstractly (nothing allocated), traced
    under the mesh (``jax.set_mesh``: the attention kernel follows its devices, as in zshard's
    step) and compiled with the XLA options zshard's step gets on that mesh.

    Returns:
      ``(compiled, mesh, seconds)``.
    """
    mesh = jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(tuple(mesh_shape.values())), tuple(mesh_shape))
    graphdef, params = nnx.split(nnx.eval_shape(build))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    jitted, (p_sh, o_sh, b_sh), abs_opt = fsdp_jit(graphdef, params, tx, mesh, "fsdp", remat, compute_dtype,
                                                   compiler_options=_compiler_options(mesh))
    placed = lambda tree, sh: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)  # noqa: E731
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=b_sh)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # traced under the mesh: zshard.attention picks its kernel from these devices, as in zshard's step
        lowered = jitted.lower(placed(params, p_sh), placed(abs_opt, o_sh), (tokens, tokens))
    compiled = lowered.compile()
    return compiled, mesh, time.perf_counter() - t0


def side_by_side(z: dict, p: dict) -> str:
    """A Markdown table of two :func:`program_summary` results: zshard, the peer, zshard / peer."""
    GB = 1e9
    rows = [(f"{k} GB per GPU", z["memory"][k] / GB, p["memory"][k] / GB) for k in ("argument", "temp", "peak")]
    rows += [("TFLOPs per GPU per step", z["flops"] / 1e12, p["flops"] / 1e12),
             ("collective GB sent per GPU per step", z["comm_bytes"] / GB, p["comm_bytes"] / GB),
             ("async all-gather/reduce-scatter overlapped", z["overlapped"][0], p["overlapped"][0]),
             ("  of async all-gather/reduce-scatter", z["overlapped"][1], p["overlapped"][1]),
             ("gradient reduce-scatter dtype (by bytes)", _main_dtype(z), _main_dtype(p)),
             ("cuDNN attention calls fwd+bwd", z["attention"]["forward_calls"] + z["attention"]["backward_calls"],
              p["attention"]["forward_calls"] + p["attention"]["backward_calls"])]
    lines = ["| per GPU | zshard | FSDP-compiler peer | zshard / peer |", "|---|---:|---:|---:|"]
    for name, a, b in rows:
        ratio = f"{a / b:.3f}" if b and not isinstance(a, str) else "-"
        fmt = (lambda v: f"{v:.2f}") if isinstance(a, float) else str
        lines.append(f"| {name} | {fmt(a)} | {fmt(b)} | {ratio} |")
    return "\n".join(lines)


def _main_dtype(summary: dict) -> str:
    """The element type most gradient reduce-scatter bytes are in, with its share: ``"f32 (100%)"``."""
    by = summary.get("reduce_dtypes") or {}
    if not by:
        return "none"
    top = max(by, key=by.get)
    return f"{top} ({by[top] / sum(by.values()):.0%})"


def write_json(path: str, summary: dict) -> None:
    """Write the plan's summary (:func:`program_summary`, with ``peer`` and the run's settings)."""
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")

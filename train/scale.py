"""Scale by simulation: per-device memory of zshard at 64 and 512 devices, against the formula.

    python -m train.scale                                   # every model and strategy, 64 and 512 devices
    python -m train.scale --devices 64 --models llama-7b    # one slice of the table
    python -m train.scale --devices 512 --models llama-70b --tensor 8   # 8x8x8: TP inside each host
    python -m train.scale --devices 64 --models llama-7b --context 4 --seq-len 32768   # 8x2x4: 32k tokens over C = 4
    python -m train.bench                                   # runs this as its section 3
    python -m train.scale --moe                             # MoE shapes with / without the expert axis, closed form

GPT-2 1.5B, Llama 7B and 70B shapes (``train.model.PLAN_PRESETS``), seq 2048, one sequence per
device, AdamW, fp32, FULL_SHARD / HYBRID_SHARD / HYBRID_SHARD_OPT on meshes of ``N/8 x 8`` (8
devices per host), compiled ahead of time with abstract inputs on ``N`` emulated CPU devices
(one subprocess per ``N``, each asking for its own device count; nothing is allocated). Per-device
peak (``argument + output - alias + temp``) and the live set at the fullest instant
(:func:`live_peak`) against :func:`expected_peak` (:func:`memory_formula`,
:func:`moment_bytes`); fits on 80 GB and on 141 GB devices.
docs/memory.md ("The scale table") has the measured table and the buffer-level analysis.

``python -m train.bench`` runs it as its section 3. The formulas are zshard's
(:mod:`zshard.formulas`: :func:`memory_formula`, :func:`moment_bytes`, :func:`expected_peak`,
:func:`activation_bytes`), re-exported here under the names they had.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import zshard
from train.devices import emulate_devices
from train.model import PLAN_PRESETS, GPTConfig, build_model, cross_entropy_loss, tensor_plan
from train.plan import peak_bytes
from zshard.formulas import activation_bytes, expected_peak, memory_formula, moment_bytes  # noqa: F401  (train.scale's names, as before)
from zshard.formulas import dropless_capacity, expert_all_to_all_per_step, expert_gather_bytes, gathered_block_bytes

__all__ = ["MOE_PLANS", "MOE_SHAPES", "MoEShape", "SCALE_TENSOR", "activation_bytes", "expected_peak", "live_peak", "memory_formula", "moe_plan", "moe_plan_table", "moment_bytes", "run_scale", "scale_table", "scale_worker"]

GB = 10**9
DEVICE_GB = (80, 141)  # H100 80 GB, H200 141 GB
SCALE_MODELS = ("gpt2-1.5b", "llama-7b", "llama-70b")
SCALE_DEVICES = (64, 512)
SCALE_STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_OPT")
SCALE_TENSOR = (("llama-70b", 512, 8),)  # (model, devices, T): the tensor-parallel rows, FSDP across hosts and TP inside
SCALE_SEQ = 2048
HOST_DEVICES = 8  # devices per host: the shard axis of the simulated meshes


# --------------------------------------------------------------------------------------
# The live set: what the compiled program holds at once, read from XLA's buffer assignment
# --------------------------------------------------------------------------------------

# XLA debug options for one compile: its buffer assignment and live ranges as text
DUMP_OPTIONS = {"xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "jit__step"}


def live_peak(dump_dir: str | Path) -> dict:
    """The most bytes a compiled step holds at one instant, from the files XLA writes with
    ``xla_dump_to`` (``DUMP_OPTIONS``): ``*-buffer-assignment.txt`` (every value's allocation,
    offset and size) and ``*-live-range.txt`` (every value's first and last instant in the
    flattened schedule, loop bodies included).

    At each instant the live values' byte ranges are united per allocation, so values that
    share memory (a loop's carry and its body's parameter, an in-place update) count once.
    XLA's own "Live ranges at N (peak)" listing sums values without that and picks a
    different instant; the heap it allocates (``memory_analysis()``: ``temp``, plus the
    arguments) is at least this live set, and the difference is its packing.

    Returns:
      ``{"bytes": int, "instant": int, "op": str}``: the live bytes at the fullest instant
      (arguments included), that instant and the ``op_name`` of the instruction scheduled there.
    Raises:
      FileNotFoundError: no step module in ``dump_dir``.
    """
    def read(suffix):
        found = sorted(Path(dump_dir).glob(f"*jit__step*{suffix}"))
        if not found:
            raise FileNotFoundError(f"{dump_dir}: no *jit__step*{suffix} (compiled with DUMP_OPTIONS and xla_dump_to?)")
        return found[-1].read_text()

    where, allocation = {}, None
    for line in read("cpu_after_optimizations-buffer-assignment.txt").splitlines():
        if m := re.match(r"allocation (\d+): size", line):
            allocation = int(m.group(1))
        elif m := re.match(r" value: <\d+ (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)", line):
            where[m.group(1)] = (allocation, int(m.group(3)), int(m.group(2)))  # value -> (allocation, offset, size)
    ranges_text = read("cpu_after_optimizations-live-range.txt")
    sequence, _, rest = ranges_text.partition("BufferLiveRange:")
    ranges = []
    for name, start, end in re.findall(r"^\s+(\S+?\{[^}]*\}):(\d+)-(\d+)$", rest.split("Live ranges at")[0], re.M):
        key = name if name in where else name.removesuffix("{}")
        if key in where:
            ranges.append((int(start), int(end), *where[key]))
    events = sorted({t for r in ranges for t in r[:2]})
    best, instant = -1, 0
    for t in events:  # the live set changes only where a range starts or ends
        spans = {}
        for start, end, alloc, offset, size in ranges:
            if start <= t <= end:
                spans.setdefault(alloc, []).append((offset, offset + size))
        held = 0
        for parts in spans.values():  # union of byte ranges within one allocation
            reach = -1
            for lo, hi in sorted(parts):
                if hi > reach:
                    held += hi - max(lo, reach)
                    reach = hi
        if held > best:
            best, instant = held, t
    names = dict(re.findall(r"^\s+(\d+):(\S+)$", sequence, re.M))
    hlo = read("cpu_after_optimizations.txt")
    m = re.search(rf"^\s*(?:ROOT )?%?{re.escape(names.get(str(instant), '?'))} = .*?op_name=\"([^\"]*)\"", hlo, re.M)
    return {"bytes": best, "instant": instant, "op": m.group(1) if m else names.get(str(instant), "?")}


# --------------------------------------------------------------------------------------
# The worker, the runner, the table
# --------------------------------------------------------------------------------------


def _tp_local(state, slots) -> int:
    """Parameters of ``slots`` one device holds, counting a tensor-split one's piece (``1/T``)."""
    return sum(s.param.piece_size for s in slots)


def scale_worker(n_devices: int, models, strategies, tensor: int = 1, context: int = 1, seq: int = SCALE_SEQ) -> list[dict]:
    """In a process of ``n_devices`` emulated CPU devices (:func:`train.devices.emulate_devices`):
    compile every (model, strategy) on a ``n/(8T) x 8 x T`` mesh (``8 x T`` without the unit
    axis: ``n/8 x 8``) with abstract inputs, one sequence per data device, and measure it.
    With ``context = C > 1`` (tensor 1): a ``n/8 x 8/C x C`` mesh (each host's 8 devices ``8/C``
    shards of ``C`` context devices), one sequence of ``seq`` tokens per ``(replica, shard)``, split
    over ``context`` (docs/long-sequences.md)."""
    data = n_devices // tensor
    if context > 1:
        mesh = zshard.make_mesh(n_devices // HOST_DEVICES, HOST_DEVICES // context, context=context,
                                devices=jax.devices()[:n_devices])
        data //= context
    else:
        mesh = zshard.make_mesh(data // HOST_DEVICES, HOST_DEVICES, tensor=tensor, devices=jax.devices()[:n_devices])
    tokens = jax.ShapeDtypeStruct((data, seq), jnp.int32)
    step = zshard.make_train_step(cross_entropy_loss, sequence_axis=1 if context > 1 else None)
    out = []
    for name in models:
        cfg = dataclasses.replace(PLAN_PRESETS[name], seq_len=seq)
        plan = tensor_plan(cfg, tensor)
        for strategy in strategies:
            state = zshard.init(lambda cfg=cfg: build_model(cfg, nnx.Rngs(0)), optax.adamw(1e-4), mesh, strategy=strategy,
                                abstract=True, tensor_parallel=plan or None)
            with tempfile.TemporaryDirectory() as dump:
                t0 = time.perf_counter()
                step.lower(state, (tokens, tokens)).compile({**DUMP_OPTIONS, "xla_dump_to": dump})
                compile_s = time.perf_counter() - t0
                live = live_peak(dump)
            rep = zshard.report(step, state, (tokens, tokens))
            psi = rep.num_params
            block = next(u for u in state.plan.units if u.layers)
            psi_local = sum((u.layers or 1) * _tp_local(state, u.slots) for u in state.plan.units)  # Psi, split ones / T
            psi_layer = _tp_local(state, block.slots)
            gpt = isinstance(cfg, GPTConfig)
            d_ff = 4 * cfg.d_model if gpt else cfg.d_ff
            # the MLP output projection, row-parallel (split over T) under a TP plan; GPT's has an unsplit bias
            psi_mlp_out = d_ff * cfg.d_model // tensor + (cfg.d_model if gpt else 0)
            form = memory_formula(psi_local, state.plan.num_shards, opt_shards=state.plan.opt_shards)
            moments = moment_bytes(cfg.d_model, cfg.n_layers, cfg.n_heads, d_ff, cfg.vocab_size, seq, 1, glu=not gpt,
                                   psi_layer=psi_layer, psi_mlp_out=psi_mlp_out, tied=cfg.tie_embeddings, tensor=tensor,
                                   vocab_split=any(k.endswith("embedding") for k in plan), context=context,
                                   kv_heads=getattr(cfg, "n_kv_heads", None))
            expected, moment = expected_peak(form, moments)
            peak = peak_bytes(rep.per_device_bytes)
            out.append({
                "model": name, "devices": n_devices, "mesh": "x".join(str(n) for n in mesh.shape.values()),
                "strategy": strategy, "tensor": tensor, "context": context, "seq": seq, "params": psi, "compile_s": compile_s, "per_device_bytes": rep.per_device_bytes,
                "peak": peak, "live": live["bytes"], "live_op": live["op"], "formula": form, "moments": moments,
                "moment": moment, "expected": expected,
                "ratio": peak / expected, "live_ratio": live["bytes"] / expected,
                "state_ratio": rep.model_state_bytes["ratio"],
                "fits": {str(g): peak <= g * GB for g in DEVICE_GB},
            })
            print(json.dumps(out[-1]), flush=True)
    return out


def run_scale(devices, models, strategies, progress, timeout: float, tensor: int = 1, context: int = 1,
              seq: int = SCALE_SEQ) -> list[dict]:
    """One :func:`scale_worker` subprocess per device count; its rows (a failed worker's are missing)."""
    rows = []
    for n in devices:
        progress.set_description(f"scale: {n} devices" + (f", tensor {tensor}" if tensor > 1 else ""))
        env = dict(os.environ, JAX_PLATFORMS="cpu")  # the worker asks for its n devices itself
        cmd = [sys.executable, "-m", "train.scale", "--worker", str(n), "--models", ",".join(models),
               "--strategies", ",".join(strategies), "--tensor", str(tensor), "--context", str(context), "--seq-len", str(seq)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parent.parent)
        try:
            stdout, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, err = proc.communicate()
            err += f"\nkilled after --scale-timeout {timeout:g} s"
        got = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        rows += got
        progress.update(len(got))
        if proc.returncode != 0:
            progress.write(f"scale worker for {n} devices failed (exit {proc.returncode}):\n{err[-3000:]}", file=sys.stderr)
    return rows


def scale_table(rows) -> str:
    """The measured rows as a Markdown table: peak (what the device must hold: XLA's heap), the
    live set at the fullest instant (:func:`live_peak`), and the formula (:func:`expected_peak`)."""
    r0 = rows[0] if rows else {}
    split = (f"seq {r0.get('seq', SCALE_SEQ)} split over context {r0['context']}, one sequence per (replica, shard)"
             if r0.get("context", 1) > 1 else f"seq {r0.get('seq', SCALE_SEQ)}, one sequence per device")
    lines = [f"### Scale by simulation: {split}, AdamW fp32, remat (recomputed blocks), "
             "8 devices per host", "",
             "Expected = state + gradient shards + the largest moment (`train.scale.expected_peak`, `moment_bytes`). "
             "Peak = argument + output - alias + temp (`memory_analysis()`); live = the most bytes live at one instant "
             "(`train.scale.live_peak`, XLA's buffer live ranges); peak / live = the heap's packing.", "",
             "| model | devices | mesh | strategy | params | compile s | state / formula | peak GB | live GB "
             "| state + grad GB | moment | + moment GB | expected GB | live / expected | peak / expected | peak / live "
             "| 80 GB | 141 GB |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        base = r["formula"]["state"] + r["formula"]["grad_shard"]
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['mesh']} | {r['strategy']} | {r['params'] / 1e9:.2f} B | {r['compile_s']:.1f} | "
            f"{r['state_ratio']:.4f} | {r['peak'] / GB:.2f} | {r['live'] / GB:.2f} | {base / GB:.2f} | {r['moment']} | "
            f"{(r['expected'] - base) / GB:.2f} | {r['expected'] / GB:.2f} | {r['live_ratio']:.3f} | {r['ratio']:.3f} | "
            f"{r['peak'] / r['live']:.3f} | {'fits' if r['fits']['80'] else 'no'} | {'fits' if r['fits']['141'] else 'no'} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# MoE shapes with and without expert parallelism, in closed form (docs/expert-parallel.md)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's parameter counts, for planning without building it.

    Attributes:
      layers: blocks; dense_layers: of them, blocks whose MLP is dense (``d_ff`` wide, no experts).
      d_model: residual width ``D``; attn: parameters of one block's attention (norms included).
      experts: routed experts per MoE block ``E``; top_k: experts per token ``k``; d_expert: each
        expert's SwiGLU width ``F`` (``3 D F`` parameters); shared: shared experts per MoE block (as wide).
      d_ff: the dense blocks' SwiGLU width; vocab: tokens (untied embedding and head).
    """

    name: str
    layers: int
    dense_layers: int
    d_model: int
    attn: int
    experts: int
    top_k: int
    d_expert: int
    shared: int
    d_ff: int
    vocab: int

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def block(self) -> tuple[int, int]:
        """``(Psi_layer_dense, Psi_layer_expert)`` of one MoE block: attention, norms, router and shared
        experts dense; the ``E`` routed experts' ``3 D F`` each."""
        D, F = self.d_model, self.d_expert
        return self.attn + 2 * D + D * self.experts + self.shared * 3 * D * F, self.experts * 3 * D * F

    def params(self) -> tuple[int, int]:
        """``(Psi_dense, Psi_expert)`` of the whole model."""
        dense, expert = self.block()
        rest = self.dense_layers * (self.attn + 2 * self.d_model + 3 * self.d_model * self.d_ff)
        return self.moe_layers * dense + rest + 2 * self.vocab * self.d_model + self.d_model, self.moe_layers * expert


# The published shapes (Hugging Face config.json of Qwen/Qwen3-30B-A3B and deepseek-ai/DeepSeek-V3). Attention counted
# as the models compute it: Qwen3's GQA (32 query heads, 4 key/value heads of 128, q/k norms of 128); DeepSeek-V3's
# MLA (q rank 1536, kv rank 512, 128 heads, 128 + 64 rope query/key dims, 128 value dims, its two low-rank norms).
MOE_SHAPES = {
    "qwen3-30b-a3b": MoEShape("qwen3-30b-a3b", layers=48, dense_layers=0, d_model=2048,
                              attn=2048 * 128 * (32 + 4 + 4) + 32 * 128 * 2048 + 2 * 128, experts=128, top_k=8,
                              d_expert=768, shared=0, d_ff=0, vocab=151936),
    "deepseek-v3": MoEShape("deepseek-v3", layers=61, dense_layers=3, d_model=7168,
                            attn=7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168,
                            experts=256, top_k=8, d_expert=2048, shared=1, d_ff=18432, vocab=129280),
}
MOE_PLANS = (("qwen3-30b-a3b", 8, (1, 8)), ("qwen3-30b-a3b", 16, (1, 8)), ("deepseek-v3", 256, (1, 8)),
             ("deepseek-v3", 512, (1, 8)))  # (shape, H100s, the expert sizes X): 8 GPUs per node, X inside one node


def moe_plan(shape: MoEShape, devices: int, expert: int, seq: int = 4096, batch: int = 1, gather_itemsize: int = 2,
             master_itemsize: int = 4) -> dict:
    """Per-device bytes of a FULL_SHARD MoE step on ``devices`` (``N``; expert groups of ``X`` inside one
    node) in closed form (:mod:`zshard.expert_formulas`): mixed precision (``gather_itemsize`` gathered
    parameters and activations, ``master_itemsize`` masters, Adam moments and gradients).

    ``state`` + ``grad_shard`` (:func:`memory_formula`), ``block``: one MoE block gathered and its
    gradient before the reduce-scatter (:func:`gathered_block_bytes` in both dtypes), ``inputs``: the
    layer inputs kept for the recompute ``L s b D``, ``dispatch``: the padded dropless buffers sent and
    received by one all-to-all, ``2 X cap D`` with ``cap = s b k``; ``floor`` their sum (no attention
    or expert activations: a lower estimate; ``python -m train.plan`` compiles the step). Per step:
    ``gathers`` (:func:`expert_gather_bytes`, forward and backward), ``a2a`` and ``a2a_padded``
    (:func:`expert_all_to_all_per_step`, 6 per MoE block with the block recomputed).
    """
    psi_d, psi_x = shape.params()
    blk_d, blk_x = shape.block()
    n = seq * batch  # tokens per device
    state = memory_formula(psi_d + psi_x, devices, itemsize=master_itemsize)
    block = gathered_block_bytes(blk_d, blk_x, expert, gather_itemsize) + gathered_block_bytes(blk_d, blk_x, expert, master_itemsize)
    cap = dropless_capacity(n, shape.top_k)
    a2a = dict(moe_layers=shape.moe_layers, tokens=n, top_k=shape.top_k, d_model=shape.d_model, itemsize=gather_itemsize,
               expert=expert)
    out = {"model": shape.name, "devices": devices, "expert": expert, "params": psi_d + psi_x, "expert_params": psi_x,
           "state": state["state"], "grad_shard": state["grad_shard"], "block": block,
           "inputs": float(shape.layers * n * shape.d_model * gather_itemsize),
           "dispatch": float(2 * expert * cap * shape.d_model * gather_itemsize) if expert > 1 else 0.0,
           "gathers": expert_gather_bytes(psi_d, psi_x, devices, expert, gather_itemsize),
           "a2a": expert_all_to_all_per_step(**a2a), "a2a_padded": expert_all_to_all_per_step(**a2a, capacity=cap)}
    out["floor"] = out["state"] + out["grad_shard"] + block + out["inputs"] + out["dispatch"]
    return out


def moe_plan_table(rows) -> str:
    """The :func:`moe_plan` rows as a Markdown table, GB (10^9 bytes) per device and per step."""
    lines = ["| model | params | H100s | X | state + grad GB | block GB | floor GB | 80 GB | expert gathers GB/step "
             "| dense gathers GB/step | all-to-all GB/step (exact) | padded dropless GB/step |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e9:.1f} B | {r['devices']} | {r['expert']} | "
                     f"{(r['state'] + r['grad_shard']) / GB:.1f} | {r['block'] / GB:.2f} | {r['floor'] / GB:.1f} | "
                     f"{'fits' if r['floor'] <= 80 * GB else 'no'} | {r['gathers']['expert'] / GB:.1f} | "
                     f"{r['gathers']['dense'] / GB:.1f} | {r['a2a'] / GB:.1f} | {r['a2a_padded'] / GB:.1f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Command line: the worker (one device count, in its own process) and a standalone run
# --------------------------------------------------------------------------------------


class _Progress:
    """The slice of ``tqdm``'s interface :func:`run_scale` uses, printing to stderr."""

    def set_description(self, text):
        print(text, file=sys.stderr, flush=True)

    def update(self, n):
        pass

    def write(self, text, file=sys.stderr):
        print(text, file=file, flush=True)


def _csv(value: str, allowed, flag: str, parser) -> list:
    items = [x.strip() for x in value.split(",") if x.strip()]
    for x in items:
        if x not in allowed:
            parser.error(f"{flag}: unknown {x!r}; choose from {', '.join(map(str, allowed))}")
    return items


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.scale", allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default=",".join(map(str, SCALE_DEVICES)), metavar="N,...",
                   help=f"emulated device counts, comma-separated, multiples of {HOST_DEVICES} (default: %(default)s)")
    p.add_argument("--models", default=",".join(SCALE_MODELS), metavar="NAME,...",
                   help=f"model shapes, comma-separated, from: {', '.join(SCALE_MODELS)} (default: all)")
    p.add_argument("--strategies", default=",".join(SCALE_STRATEGIES), metavar="NAME,...",
                   help=f"strategies, comma-separated, from: {', '.join(SCALE_STRATEGIES)} (default: all)")
    p.add_argument("--tensor", type=int, default=1, metavar="T",
                   help="tensor-parallel size: meshes n/(8T) x 8 x T, the models' TP plans (train.models.tensor_plan)")
    p.add_argument("--context", type=int, default=1, metavar="C",
                   help="context parallelism (tensor 1): meshes n/8 x 8/C x C, each sequence split over C devices")
    p.add_argument("--seq-len", type=int, default=SCALE_SEQ, metavar="T", help="tokens per sequence (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S", help="seconds allowed to each device count's subprocess")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows (every measured and formula term) as JSON")
    p.add_argument("--moe", action="store_true", help="only the MoE shapes with and without expert parallelism, in closed "
                   "form (Qwen3-30B-A3B and DeepSeek-V3 on H100 nodes; docs/expert-parallel.md); compiles nothing")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # one device count, in this process
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.moe:
        print(moe_plan_table([moe_plan(MOE_SHAPES[m], n, x) for m, n, xs in MOE_PLANS for x in xs]))
        return 0
    models = _csv(args.models, SCALE_MODELS, "--models", p)
    strategies = _csv(args.strategies, SCALE_STRATEGIES, "--strategies", p)
    if args.worker is not None:
        emulate_devices(args.worker, cpu_only=True)
        scale_worker(args.worker, models, strategies, args.tensor, args.context, args.seq_len)
        return 0
    try:
        devices = [int(d) for d in args.devices.split(",") if d.strip()]
    except ValueError:
        p.error(f"--devices {args.devices!r}: expected comma-separated integers, e.g. 64,512")
    for d in devices:
        if d < HOST_DEVICES or d % HOST_DEVICES:
            p.error(f"--devices: {d} is not a positive multiple of {HOST_DEVICES} (devices per host)")
        if args.tensor < 1 or d % (HOST_DEVICES * args.tensor):
            p.error(f"--tensor {args.tensor}: {d} devices do not form an n/(8T) x 8 x T mesh; use a T that divides {d // HOST_DEVICES}")
    for name in models:
        try:
            tensor_plan(PLAN_PRESETS[name], args.tensor)
        except ValueError as e:
            p.error(f"--tensor {args.tensor}, model {name}: {e}")
    if args.context > 1 and (args.tensor > 1 or HOST_DEVICES % args.context or args.seq_len % (2 * args.context)):
        p.error(f"--context {args.context}: needs --tensor 1, a C dividing {HOST_DEVICES} and --seq-len dividing by 2C")
    rows = run_scale(devices, models, strategies, _Progress(), args.timeout, args.tensor, args.context, args.seq_len)
    print(scale_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if len(rows) == len(devices) * len(models) * len(strategies) else 1


if __name__ == "__main__":
    sys.exit(main())

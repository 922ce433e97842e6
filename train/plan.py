"""Plan a run before renting the hardware: ``python -m train.plan``.

Builds a preset model abstractly (nothing allocated: ``zshard.init(..., abstract=True)``),
compiles one train step ahead of time on as many emulated CPU devices as the mesh needs,
and prints :func:`zshard.report` plus a verdict: does the step fit in the device memory?

    python -m train.plan --model llama-7b --mesh 8x8 --strategy HYBRID_SHARD --batch-size 64
    python -m train.plan --model llama-70b --mesh 1x8x8 --seq-len 8192   # FSDP over 8, TP inside each 8
    python -m train.plan --model llama-7b --mesh 1x4 --context 2 --seq-len 32768 --batch-size 4

A mesh ``RxSxT`` (or ``--tensor T``) adds the tensor axis: the preset declares its TP plan
(:func:`train.models.tensor_plan`: fused QKV and gate|up column-parallel, the output
projections row-parallel, the vocabulary split when ``T`` divides it), the batch splits over
the ``R*S`` data devices and the ``T`` devices of a tensor group share their sequences.

With ``--expert X`` (an MoE preset: ``qwen3-30b-a3b``, ``deepseek-v3``) the mesh gains the expert
axis (``zshard.make_mesh(R, S, expert=X)``, R*S*X emulated devices): each MoE layer's experts are
split over it (:func:`train.models.expert_plan`), the batch over ``R x S x X``.

    python -m train.plan --model qwen3-30b-a3b --mesh 1x4 --expert 2 --batch-size 8 --seq-len 4096

With ``--context C`` the mesh is ``R x S x C (x T)`` (``zshard.make_mesh(R, S, T, context=C)``,
R*S*C*T emulated devices): each sequence is split over ``context`` in the head-tail order
(``make_train_step(..., sequence_axis=1)``, docs/long-sequences.md) and the batch over ``R x S``.

Peak bytes per device are estimated as ``argument + output - alias + temp`` of the
compiled step's ``memory_analysis()`` (donated outputs reuse their inputs' buffers).
Block units recompute their forward pass in backward (FULL_SHARD / HYBRID_SHARD), so the
activations held are about one block's plus each block's input.

With ``--target h100`` (``h200``, ``a100``) the step is compiled by XLA:GPU for that many GPUs of
that kind, on any machine with the ``cuda12`` extra (no GPU needed; :mod:`train.plan_gpu`), in
bf16 compute with fp32 masters and fp32 gradient reduction unless ``--compute-dtype`` /
``--reduce-dtype`` say otherwise; the plan then also names the attention kernel (cuDNN's fused
attention or XLA's ops) and, for each collective, whether it is asynchronous and how much
compute the schedule puts between its start and its done. ``--hlo FILE`` writes the optimized
program, ``--json FILE`` a summary (:func:`train.plan_gpu.program_summary`), and ``--peer`` compiles
the same model and batch as ``jax.jit`` with FSDP shardings (the benchmark's FSDP-compiler peer)
and prints the two side by side (docs/performance.md):

    python -m train.plan --model llama-3-8b --mesh 1x8 --seq-len 8192 --target h100 --peer --json plan.json

With ``--search --devices N`` (no ``--mesh``) it searches the meshes, strategies, remat policies and
accumulation for the fastest configuration that fits, compiling only a few finalists
(:mod:`train.planning.search`; docs/planning.md, "The search"):

    python -m train.plan --model llama-70b --devices 64 --target h100 --seq-len 4096 --global-batch-tokens 1048576 --search

The model presets (``train/model.py``, ``PLAN_PRESETS``) are GPT-2 and Llama shapes from
their papers, and two mixtures of experts (Qwen3-30B-A3B; DeepSeek-V3, approximated as its
docstring says). The planner lives with the application (zshard does not import ``train``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import optax
from flax import nnx

import zshard
from train.devices import emulate_devices
from train.model import PLAN_PRESETS, build_model, expert_plan, loss_for, tensor_plan, units_with_ends
from train.planning.profiles import load_profile
from train.planning.single import plan_prediction
from train.plan_gpu import (TARGET_MEMORY_GB, TARGETS, compile_peer, cuda_plugin, program_summary, side_by_side,
                            target_devices, write_json)

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["main", "peak_bytes"]

GB = 10**9  # device memory is quoted in GB (10^9 bytes)


def peak_bytes(per_device: dict) -> int:
    """``argument + output - alias + temp`` bytes of one device (``Report.per_device_bytes``)."""
    return per_device["argument"] + per_device["output"] - per_device["alias"] + per_device["temp"]


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m train.plan",
        allow_abbrev=False,
        description="Compile one zshard train step of a preset model ahead of time on emulated "
        "devices and report per-device memory and communication against the ZeRO/FSDP formulas.",
    )
    p.add_argument("--model", required=True, help="preset: " + ", ".join(PLAN_PRESETS))
    p.add_argument("--mesh", default=None, metavar="RxS[xT]", help="mesh shape, e.g. 8x8 (R*S emulated devices) or 1x8x8 (R*S*T, "
                   "tensor axis T); required without --search")
    p.add_argument("--search", action="store_true",
                   help="search the meshes, strategies, remat policies and accumulation of --devices devices for the fastest "
                   "configuration that fits (train/planning/search.py): formulas first, then --finalists compiled")
    p.add_argument("--devices", type=int, default=None, metavar="N", help="with --search: devices of the run")
    p.add_argument("--global-batch-tokens", type=int, default=None, metavar="B",
                   help="with --search: tokens per optimizer step (a multiple of --seq-len); default one sequence per device")
    p.add_argument("--finalists", type=int, default=4, metavar="K", help="with --search: candidates compiled (default 4)")
    p.add_argument("--formats", default=None, metavar="LIST",
                   help="with --search: wire formats to search for the gathers and the gradient reductions over the shard axes, "
                   "a comma list of none, int8, int4, float8_e4m3fn, float8_e5m2 (every gather x reduce pair zshard takes; "
                   "--error-feedback: each quantized reduction with it; --quant-block: the block); default none,int8")
    p.add_argument("--tensor", type=int, default=None, metavar="T", help="tensor-parallel size (the same as a mesh RxSxT)")
    p.add_argument("--expert", type=int, default=1, metavar="X",
                   help="expert parallelism: each MoE layer's experts split over X devices (R*S*X emulated devices, the batch "
                   "over all of them, tokens sent to their experts by all-to-all; an MoE preset whose expert count X "
                   "divides: qwen3-30b-a3b, deepseek-v3; default 1: none)")
    p.add_argument("--context", type=int, default=1, metavar="C",
                   help="context parallelism: each sequence split over C devices (R*S*C emulated devices; the sequence "
                   "length must divide by 2C; default 1: none)")
    p.add_argument("--strategy", default="FULL_SHARD", help="NO_SHARD, SHARD_OPT, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, HYBRID_SHARD_OPT")
    p.add_argument("--unit", default="blocks", choices=["blocks", "ends"],
                   help="wrap policy: blocks = zshard's default (the blocks are units; embedding, final norm and head "
                   "form the root, gathered for the whole step), as python -m train runs; ends = the token embedding "
                   "and the output head are units too (train.model.units_with_ends)")
    p.add_argument("--batch-size", type=int, default=None, metavar="B", help="global batch in sequences (default: one per device)")
    p.add_argument("--seq-len", type=int, default=None, metavar="T", help="tokens per sequence (default: the preset's)")
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype the parameters (and so the Adam moments) are stored in; not mixed precision "
                   "(there, masters stay float32): this asks what pure-bf16 training would need")
    p.add_argument("--offload", default=None, choices=["optimizer", "optimizer+master"],
                   help="host offload (docs/offload.md): optimizer = the AdamW moments in pinned host memory; optimizer+master "
                   "= the fp32 masters too, with mixed precision (a bf16 copy on the device for the gathers)")
    for what, help_ in (("gather", "the parameter all-gathers over the shard axes"), ("reduce", "the gradient reduction over "
                        "the shard axes (an all-to-all of quantized blocks)"), ("replica", "the gradient reduction over replica")):
        p.add_argument(f"--{what}-format", default=None, choices=["int8", "int4", "float8_e4m3fn", "float8_e5m2"],
                       help=f"quantized wire format of {help_} (zshard.Quant, docs/quantized.md); default: unquantized")
    p.add_argument("--error-feedback", action="store_true",
                   help="with --reduce-format: keep every device's fp32 residual of its quantized gradient (4 bytes per "
                   "quantized parameter element on each device, in the model state)")
    p.add_argument("--quant-block", type=int, default=256, metavar="B",
                   help="elements per float32 scale of the formats (0: one scale per tensor); default 256")
    p.add_argument("--device-memory-gb", type=float, default=None, metavar="GB",
                   help="memory of one device, GB (10^9 bytes); default: the --target GPU's (H100 80, H200 141, A100 80), else 80")
    p.add_argument("--target", default="cpu", choices=TARGETS,
                   help="compile for: cpu = emulated CPU devices (default); h100, h200, a100 = that GPU's XLA:GPU program, "
                   "compiled without one (needs the cuda12 extra)")
    p.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16"],
                   help="dtype of the gathered parameters and the compute (zshard.MixedPrecision param_dtype, masters "
                   "stay in --param-dtype); default: bfloat16 with a GPU --target, else none (the parameters' dtype)")
    p.add_argument("--reduce-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the gradient reduce-scatter with --compute-dtype (default float32)")
    p.add_argument("--remat", default=None, help="activation checkpointing of each block (make_train_step(remat=...)): "
                   "none, block (default), dots, offload; with --search a comma list of those to consider (default none,block,dots)")
    p.add_argument("--hlo", default=None, metavar="FILE", help="write the compiled (optimized) program's HLO text")
    p.add_argument("--json", default=None, metavar="FILE", help="write a JSON summary: target, memory, attention, collectives, flops")
    p.add_argument("--peer", action="store_true",
                   help="also compile the same model and batch as jax.jit with FSDP shardings (the benchmark's FSDP-compiler "
                   "peer, same remat and precision) and print both side by side")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also compile every strategy and plot per-device memory side by side")
    p.add_argument("--profile", default=None, metavar="NAME|FILE.toml",
                   help="hardware profile of the predicted step time (train/planning/profiles: a100, cpu, h100, h200, or a "
                   "TOML file such as python -m train.planning.calibrate --out writes); default: the --target's")
    p.add_argument("--devices-per-node", type=int, default=None, metavar="N",
                   help="devices per node for the predicted step time (which mesh axes cross nodes); default: the "
                   "--target profile's (8 GPUs; the CPU: all emulated devices)")
    return p, p.parse_args(argv)


def main(argv=None) -> int:
    parser, args = _parse(sys.argv[1:] if argv is None else argv)
    if args.search:
        from train.planning.search_cli import search_main  # noqa: PLC0415
        return search_main(parser, args)
    if args.mesh is None:
        parser.error("--mesh is required (or --search with --devices to search the meshes)")
    for flag in ("devices", "global_batch_tokens", "formats"):
        if getattr(args, flag) is not None:
            parser.error(f"--{flag.replace('_', '-')} is for --search; give --mesh and --batch-size for one plan")
    args.remat = args.remat or "block"
    try:
        replica, shard, *rest = zshard.parse_mesh(args.mesh)
    except ValueError as e:
        parser.error(f"--mesh: {e}")
    tensor = rest[0] if rest else 1
    if args.tensor is not None:
        if args.tensor < 1 or (rest and args.tensor != tensor):
            parser.error(f"--tensor {args.tensor}: must be positive and agree with --mesh {args.mesh}")
        tensor = args.tensor
    if args.context < 1:
        parser.error(f"--context {args.context}: must be a positive number of devices")
    if args.expert < 1:
        parser.error(f"--expert {args.expert}: must be a positive number of devices (1: no expert parallelism)")
    context, expert = args.context, args.expert
    data = replica * shard * expert  # the batch's rows split over replica x shard x expert; each sequence over context, shared by tensor
    world = data * context * tensor
    mesh_name = (f"{replica}x{shard}" + (f"x{tensor}" if tensor > 1 else "") + (f", expert {expert}" if expert > 1 else "")
                 + (f", context {context}" if context > 1 else ""))
    gpu = args.target != "cpu"
    fallback = gpu and not cuda_plugin()  # no CUDA plugin: plan on emulated CPU devices, say so
    emulate_devices(None if gpu and not fallback else world, cpu_only=True)  # before jax starts its backend

    if args.model not in PLAN_PRESETS:
        parser.error(f"--model {args.model!r}: choose one of {', '.join(PLAN_PRESETS)}")
    try:
        zshard.Strategy.parse(args.strategy)
    except ValueError as e:
        parser.error(f"--strategy: {e}")
    if (not gpu or fallback) and len(jax.devices()) < world:
        parser.error(f"--mesh {mesh_name} needs {world} devices, JAX sees {len(jax.devices())}")
    try:
        load_profile(args.profile or args.target)  # an unknown profile is refused before compiling
    except ValueError as e:
        parser.error(f"--profile: {e}")
    cfg = PLAN_PRESETS[args.model]
    try:
        tp_plan = tensor_plan(cfg, tensor)  # {} when tensor == 1
    except ValueError as e:
        parser.error(f"--mesh {mesh_name}: {e}")
    try:
        ep_plan = expert_plan(cfg, expert)  # {} when expert == 1; a dense preset or X not dividing the experts: refused
    except ValueError as e:
        parser.error(f"--expert {expert} (--model {args.model}): {e}")
    for flag, value in (("--seq-len", args.seq_len), ("--batch-size", args.batch_size), ("--device-memory-gb", args.device_memory_gb),
                        ("--devices-per-node", args.devices_per_node)):
        if value is not None and not value > 0:
            parser.error(f"{flag} {value}: must be positive")
    seq = cfg.seq_len if args.seq_len is None else args.seq_len
    cfg = dataclasses.replace(cfg, seq_len=seq)
    if seq % (2 * context):
        parser.error(f"--seq-len {seq} must divide by 2 x --context = {2 * context} (the head-tail order cuts each "
                     f"sequence into 2C chunks), e.g. {seq // (2 * context) * 2 * context or 2 * context}")
    batch = data if args.batch_size is None else args.batch_size
    if batch % data:
        parser.error(f"--batch-size {batch} must divide by the {data} data devices of the {mesh_name} mesh")
    dtype = jnp.dtype(args.param_dtype)
    try:
        formats = {f"{k}_format": zshard.Quant(v, block=args.quant_block or None, error_feedback=args.error_feedback and k == "reduce")
                   if v else None for k, v in (("gather", args.gather_format), ("reduce", args.reduce_format), ("replica", args.replica_format))}
    except ValueError as e:
        parser.error(f"--quant-block: {e}")
    if args.error_feedback and not args.reduce_format:
        parser.error("--error-feedback corrects the quantized gradient reduction: give --reduce-format too")
    mp = zshard.MixedPrecision(**formats) if any(formats.values()) else None
    if args.offload == "optimizer+master":  # the masters stay float32, the gathers and compute in bf16
        if dtype != jnp.float32:
            parser.error("--offload optimizer+master plans mixed precision itself (float32 masters on the host, bfloat16 "
                         "gathers and compute): leave --param-dtype float32, which here is the dtype parameters are "
                         "stored in, not python -m train's mixed-precision --param-dtype")
        mp = zshard.MixedPrecision(param_dtype="bfloat16", **formats)
    compute = args.compute_dtype or ("bfloat16" if gpu else None)
    if compute is not None:  # mixed precision: the masters in --param-dtype, the gathers and compute in `compute`
        if mp is not None and mp.param_dtype is not None and jnp.dtype(mp.param_dtype) != jnp.dtype(compute):
            parser.error(f"--compute-dtype {compute}: --offload optimizer+master computes in bfloat16")
        mp = zshard.MixedPrecision(param_dtype=compute, reduce_dtype=args.reduce_dtype, **formats)
    if args.peer and (tensor > 1 or context > 1 or expert > 1 or args.offload or any(formats.values())):
        parser.error("--peer compares with jax.jit over FSDP shardings: a mesh RxS without --tensor / --context / --expert, no --offload "
                     "and no quantized formats")
    if fallback:
        print(f"--target {args.target}: jax's CUDA plugin is not installed (the cuda12 extra): compiling on {world} "
              "emulated CPU devices instead")
    try:
        devices = target_devices(args.target, world) if gpu and not fallback else jax.devices()[:world]
        loss_fn, has_aux = loss_for(cfg)  # an MoE: cross-entropy + its router losses
        step = zshard.make_train_step(loss_fn, has_aux=has_aux, sequence_axis=1 if context > 1 else None, remat=args.remat)
    except ValueError as e:
        parser.error(str(e))
    target = "cpu" if fallback else args.target
    try:
        mesh = zshard.make_mesh(replica, shard, tensor=tensor, context=context, devices=devices,
                                **({"expert": expert} if expert > 1 else {}))  # the expert axis only when there is one
    except ValueError as e:  # e.g. expert with tensor or context: refused by make_mesh, named by its flags here
        parser.error(f"--mesh {mesh_name}: {e} (here: the flags --expert, --tensor / the mesh's third number, --context)")
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def build():
        model = build_model(cfg, nnx.Rngs(0))
        if dtype != jnp.float32:  # store every parameter in the chosen dtype
            state = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), state))
        return model

    def plan_one(strategy):
        unit = units_with_ends if args.unit == "ends" else None
        state = zshard.init(build, optax.adamw(1e-4), mesh, strategy=strategy, abstract=True, unit=unit, offload=args.offload,
                            mixed_precision=mp, tensor_parallel=tp_plan or None,
                            **({"expert_parallel": ep_plan} if ep_plan else {}))
        t0 = time.perf_counter()
        rep = zshard.report(step, state, (tokens, tokens))
        seconds = time.perf_counter() - t0
        compiled = step.lower(state, (tokens, tokens)).compile() if strategy == args.strategy else None  # jax's cache answers
        return rep, seconds, compiled

    try:
        rep, seconds, compiled = plan_one(args.strategy)
    except ValueError as e:  # a format for a collective the strategy does not have, or one that quantizes nothing
        parser.error(str(e))
    peak = peak_bytes(rep.per_device_bytes)
    memory_gb = args.device_memory_gb or TARGET_MEMORY_GB.get(target, 80.0)
    budget = memory_gb * GB
    print(rep.table())
    print()
    split = f", each sequence split over context {context} ({seq // context} tokens per device)" if context > 1 else ""
    precision = (f"{args.param_dtype} masters, {jnp.dtype(mp.param_dtype).name} gathers and compute, {jnp.dtype(mp.reduce_dtype).name} "
                 "gradient reduction" if mp is not None and mp.param_dtype is not None else f"parameters {args.param_dtype}")
    on = f"{world} emulated devices" if target == "cpu" else f"{world} x {devices[0].device_kind} by XLA:GPU (no GPU needed)"
    print(f"global batch {batch} x {seq} tokens{split}, {precision}, AdamW, --unit {args.unit}"
          f"{f', --offload {args.offload}' if args.offload else ''}; compiled in {seconds:.0f} s for {on}")
    if rep.offload is not None:
        peak = _offload_lines(rep, peak)
    verdict = "FITS" if peak <= budget else "DOES NOT FIT"
    what = "device peak (argument + output - alias + temp - host state + one parameter's update)" if rep.offload else \
        "peak per device (argument + output - alias + temp)"
    print(f"{what} = {peak / GB:.2f} GB of {memory_gb:g} GB: {verdict} (margin {(budget - peak) / GB:+.2f} GB)")
    geometry = {"cfg": cfg, "batch_per_device": batch // data, "seq": seq, "tensor": tensor}
    summary = {"model": args.model, "mesh": dict(mesh.shape), "strategy": rep.strategy, "batch": batch, "seq": seq,
               "precision": precision, "remat": rep.remat, "prefetch": getattr(rep, "prefetch", step.prefetch),
               "compile_s": seconds, "fits": peak <= budget, "device_memory_gb": memory_gb,
               **program_summary(compiled, mesh, target=target, **geometry)}
    _program_lines(summary)
    try:  # the predicted step on --target's profile (train/planning): the top-level fields of issue 51's candidates
        summary.update(plan_prediction(rep, cfg, model=args.model, target=args.profile or args.target, mesh_shape=dict(mesh.shape),
                                       batch=batch, seq=seq, peak_bytes=peak, budget_bytes=budget,
                                       devices_per_node=args.devices_per_node, mixed_precision=mp, offload=args.offload,
                                       unit=args.unit))
    except ValueError as e:
        parser.error(str(e))
    _prediction_line(summary)
    if args.peer:
        c, peer_mesh, peer_s = compile_peer(cfg, devices, dict(mesh.shape), batch, seq, optax.adamw(1e-4), remat=args.remat,
                                            compute_dtype=mp.param_dtype if mp is not None else None, build=build)
        summary["peer"] = {"name": "FSDP-compiler (jax.jit, FSDP NamedShardings)", "compile_s": peer_s,
                           **program_summary(c, peer_mesh, target=target, **geometry)}
        print(f"\nthe same step as jax.jit with FSDP shardings (the benchmark's FSDP-compiler peer; remat {args.remat}), "
              f"compiled in {peer_s:.0f} s:")
        print(side_by_side(summary, summary["peer"]))
        kernels = summary["attention"]["kernel"], summary["peer"]["attention"]["kernel"]
        if kernels[0] != kernels[1]:  # zshard.attention chose by itself (a warning above names its reason)
            print(f"attention kernels differ: zshard {kernels[0]}, peer {kernels[1]}: memory and FLOPs are not like for like")
        sums = [max(s["reduce_dtypes"], key=s["reduce_dtypes"].get, default="none") for s in (summary, summary["peer"])]
        if sums[0] != sums[1]:  # the peer sums its bf16 weight-gradient dots whatever --reduce-dtype says
            print(f"gradients are reduced in {sums[0]} by zshard, in {sums[1]} by the peer (the compiler reduces its dots' "
                  "outputs as computed): give --reduce-dtype that dtype to compare like for like")
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(compiled.as_text())
        print(f"wrote {args.hlo}")
    if args.json:
        write_json(args.json, summary)
        print(f"wrote {args.json}")

    if args.plot:
        names, rows = [], []
        for s in zshard.Strategy:
            try:
                r = rep if s.value == rep.strategy else plan_one(s.value)[0]
            except ValueError as e:  # a format this strategy has no collective for
                print(f"{s.value}: not plotted: {e}")
                continue
            ms = r.model_state_bytes["measured"]
            names.append(s.value.replace("_", "\n"))
            rows.append((ms["params"] / GB, ms["opt_state"] / GB, r.per_device_bytes["temp"] / GB))
        fig, ax = plt.subplots(figsize=(9, 4.5))
        bottom = [0.0] * len(rows)
        for i, label in enumerate(["parameters", "optimizer state", "temporaries (gradients, activations, gathered units)"]):
            vals = [row[i] for row in rows]
            ax.bar(names, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        top = max(bottom)
        if memory_gb <= 1.5 * top:  # keep the bars readable when memory dwarfs them
            ax.axhline(memory_gb, color="k", ls="--", lw=1, label=f"device memory {memory_gb:g} GB")
        else:
            ax.set_ylim(0, 1.2 * top)
            ax.text(0.01, 0.97, f"device memory {memory_gb:g} GB (off the scale)", transform=ax.transAxes, va="top", fontsize=8)
        ax.set_ylabel("GB per device")
        ax.set_title(f"{args.model} on {mesh_name}, batch {batch} x {seq}, {args.param_dtype} params, AdamW")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


def _prediction_line(summary: dict) -> None:
    """Print the predicted step time of the plan (train/planning/cost.py's model)."""
    target = summary["prediction"]["profile"]
    cut = "" if summary["target"] == target else f" (collective bytes from the {summary['target']} program)"
    print(f"predicted on {target}{cut}: {summary['step_s']:.3g} s per step, {summary['tokens_per_s_per_device']:,.0f} tokens/s "
          f"per device, MFU {summary['mfu']:.1%}, bottleneck {summary['bottleneck']} (docs/planning.md)")


def _program_lines(summary: dict) -> None:
    """Print the compiled program's attention kernel and the overlap of its collectives."""
    att = summary["attention"]
    calls = f" ({att['forward_calls']} forward, {att['backward_calls']} backward calls in the program)" if att["kernel"] == "cudnn" else \
        " (no cuDNN fused attention call: XLA's own ops)"
    print(f"attention: {att['kernel']}{calls}; {summary['flops'] / 1e12:.1f} TFLOPs per device per step")
    by_op = {}
    for c in summary["collectives"]:
        n = by_op.setdefault(c["op"], [0, 0, 0])
        n[0] += 1
        n[1] += c["async"]
        n[2] += c["compute_between"] > 0
    print("collectives in the program (a loop body counts once): " + (", ".join(
        f"{op} {n} ({a} async, {o} with compute between start and done)" for op, (n, a, o) in by_op.items()) or "none"))


def _offload_lines(rep, peak: int) -> float:
    """Print the device / host split of an offloaded plan; return the device peak estimate.

    The CPU compile counts the host leaves as arguments and outputs of the step (XLA:CPU knows
    no host memory), so they are taken out of the peak; on a GPU each offloaded leaf is on the
    device while it is updated, so one parameter's share (the largest leaf, a stacked parameter's
    all layers, times its leaves) is added back: the device peak when XLA's schedule updates
    one parameter at a time (it decides; a GPU measures it: ``python -m train.bench --offload``).
    """
    o = rep.offload
    host, device = o["measured"]["host"], o["measured"]["device"]
    calls = max(o["transfer"]["calls"].get("device", 0), 1)
    stream = o["transfer"]["largest"] * o["transfer"]["per_param"]
    print(f"model state per device: {device / GB:.2f} GB in device memory, {host / GB:.2f} GB in pinned host memory "
          f"(formula {o['formula']['device'] / GB:.2f} / {o['formula']['host'] / GB:.2f} GB); host <-> device "
          f"{o['transfer']['measured'] / GB:.2f} GB per step in {calls} + {calls} transfers (formula 2 x host)")
    return peak - host + stream


if __name__ == "__main__":
    sys.exit(main())

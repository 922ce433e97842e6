"""``python -m train.plan --search``: the command line of :mod:`train.planning.search`.

    python -m train.plan --model llama-70b --devices 64 --target h100 --seq-len 4096 \\
        --global-batch-tokens 1048576 --search --json plan.json

Every input is checked before anything compiles (an unknown model, a non-positive count, a global
batch that is not whole sequences, no mesh of the devices); the finalists are compiled by XLA:GPU
for a GPU ``--target`` where the ``cuda12`` extra is installed, else on emulated CPU devices.
"""

from __future__ import annotations

import json
import time

from train.planning.search import GB, REMATS, SEARCHED, describe, search, search_table, what_would_fit

__all__ = ["JSON_FIELDS", "search_main"]

JSON_FIELDS = ("mesh", "strategy", "remat", "micro_batch", "accumulation", "gather_format", "reduce_format", "error_feedback", "fits",
               "memory_bytes", "compiled", "reason", "step_s", "tokens_per_s_per_device", "mfu", "bottleneck", "command")
"""The fields of each candidate ``--json`` writes (issue 51, item 2)."""


def _checked(parser, args):
    """Validate the flags of a search; returns ``(cfg, seq, batch, remats, formats, block)``; ``parser.error`` on bad input."""
    from train.model import PLAN_PRESETS

    if args.model not in PLAN_PRESETS:
        parser.error(f"--model {args.model!r}: choose one of {', '.join(PLAN_PRESETS)}")
    if args.devices is None:
        parser.error("--search needs --devices N (the devices of the run)")
    if args.mesh is not None:
        parser.error("--mesh: --search chooses the mesh; leave --mesh out (or leave --search out to plan one mesh)")
    for flag, value in (("--devices", args.devices), ("--seq-len", args.seq_len), ("--global-batch-tokens", args.global_batch_tokens),
                        ("--batch-size", args.batch_size), ("--finalists", args.finalists), ("--device-memory-gb", args.device_memory_gb),
                        ("--devices-per-node", args.devices_per_node)):
        if value is not None and not value > 0 and not (flag == "--finalists" and value == 0):
            parser.error(f"{flag} {value}: must be " + ("0 or more" if flag == "--finalists" else "positive"))
    cfg = PLAN_PRESETS[args.model]
    seq = args.seq_len or cfg.seq_len
    if args.global_batch_tokens is not None:
        if args.batch_size is not None:
            parser.error("--global-batch-tokens and --batch-size both give the global batch: keep one")
        if args.global_batch_tokens % seq:
            parser.error(f"--global-batch-tokens {args.global_batch_tokens} does not divide into sequences of --seq-len {seq}: "
                         f"use a multiple of {seq}, e.g. {max(args.global_batch_tokens // seq, 1) * seq}")
        batch = args.global_batch_tokens // seq
    else:
        batch = args.batch_size or args.devices
    remats = tuple(r.strip() for r in args.remat.split(",")) if args.remat else SEARCHED
    bad = [r for r in remats if r not in REMATS]
    if bad:
        parser.error(f"--remat {','.join(bad)}: choose from {', '.join(REMATS)} (a comma list with --search)")
    formats, block = _checked_formats(parser, args)
    import dataclasses
    return dataclasses.replace(cfg, seq_len=seq), seq, batch, remats, formats, block


def _checked_formats(parser, args):
    """``--formats`` (default ``none,int8``), ``--quant-block``, ``--error-feedback``: ``(formats, block)``."""
    from train.planning.formats import parse_formats

    for flag in ("gather_format", "reduce_format", "replica_format"):
        if getattr(args, flag) is not None:
            parser.error(f"--{flag.replace('_', '-')}: --search chooses the formats; give --formats LIST (none, int8, int4, "
                         "float8_e4m3fn, float8_e5m2)" + (" (replica_format is not searched)" if flag == "replica_format" else ""))
    try:
        formats = parse_formats("none,int8" if args.formats is None else args.formats)
    except ValueError as e:
        parser.error(str(e))
    if args.quant_block < 0:
        parser.error(f"--quant-block {args.quant_block}: must be >= 0 (0: one scale per tensor)")
    block = args.quant_block or None
    import zshard

    for f in filter(None, formats):
        try:
            zshard.Quant(f, block=block)
        except ValueError as e:
            parser.error(f"--formats {f} with --quant-block {args.quant_block}: {e}")
    if args.error_feedback and not any(formats):
        parser.error("--error-feedback corrects a quantized gradient reduction: --formats must name a format besides none")
    return formats, block


def search_main(parser, args) -> int:
    """Run the search of ``args`` (``train.plan``'s parsed flags); prints the table, writes ``--json``."""
    t0, c0 = time.perf_counter(), time.process_time()
    cfg, seq, batch, remats, formats, block = _checked(parser, args)
    from train.devices import emulate_devices
    from train.plan_gpu import TARGET_MEMORY_GB, cuda_plugin, target_devices
    from train.planning.profiles import load_profile
    from train.planning.search import enumerate_candidates

    try:
        profile = load_profile(args.profile or args.target)
    except ValueError as e:
        parser.error(f"--profile: {e}")
    if not enumerate_candidates(args.devices, cfg, seq, batch, remats, devices_per_node=args.devices_per_node or profile.devices_per_node):
        parser.error(f"--devices {args.devices}: no mesh R x S x T x C of {args.devices} devices fits: R*S must divide the global "
                     f"batch of {batch} sequences, T the {cfg.n_heads} heads and {getattr(cfg, 'n_kv_heads', cfg.n_heads)} key/value "
                     f"heads, 2C the sequence of {seq}; choose a device count such as {_near(batch)}")
    gpu = args.target != "cpu"
    fallback = gpu and not cuda_plugin()
    emulate_devices(None if gpu and not fallback else args.devices, cpu_only=True)
    import jax

    import zshard

    if args.finalists == 0:
        devices = None
    elif gpu and not fallback:
        try:
            devices = target_devices(args.target, args.devices)
        except ValueError as e:
            parser.error(str(e))
    else:
        if len(jax.devices()) < args.devices:
            parser.error(f"--devices {args.devices}: JAX sees {len(jax.devices())} CPU devices to compile on")
        devices = jax.devices()[: args.devices]
    mp = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32") if gpu else None
    budget = (args.device_memory_gb * GB if args.device_memory_gb else TARGET_MEMORY_GB.get(args.target, 0) * GB or profile.hbm_bytes)
    on = "emulated CPU devices" if not gpu or fallback else f"XLA:GPU ({args.target}, no GPU needed)"
    print(f"searching {args.model} on {args.devices} devices ({profile.name} profile, {budget / GB:g} GB each): global batch "
          f"{batch} x {seq} tokens; wire formats {','.join(f or 'none' for f in formats)}"
          + (" (error feedback)" if args.error_feedback else "")
          + (f"; up to {args.finalists} finalists compiled on {on}" if args.finalists else "; nothing compiled (--finalists 0)"))
    result = search(cfg, model=args.model, devices=args.devices, seq=seq, batch=batch, profile=profile, budget=budget,
                    compile_devices=devices, mixed_precision=mp, remats=remats, finalists=args.finalists,
                    devices_per_node=args.devices_per_node, formats=formats, error_feedback=args.error_feedback, block=block)
    cands = result["candidates"]
    print(search_table(result))
    print(f"{result['considered']} candidates, {result['pruned']} pruned by the memory formulas, {result['compiled']} compiled "
          f"({result['compile_s']:.0f} s)")
    out = [c for c in cands if not c["fits"]][:3]
    if out:
        print("not fitting, e.g.: " + "; ".join(f"{describe(c)}: {c['reason']}" for c in out))
    if not any(c["fits"] for c in cands):
        e = 2 if mp is not None else 4
        psi = _psi(cfg)
        print("nothing fits; what would: " + "; ".join(what_would_fit(cfg, devices=args.devices, seq=seq, batch=batch, budget=budget,
                                                                      psi=psi, activation_bytes=e)))
    else:
        best = cands[0]
        print(f"best: {describe(best)}: {best['step_s']:.3g} s per step, {best['tokens_per_s_per_device']:,.0f} tokens/s per "
              f"device, MFU {best['mfu']:.1%}, bottleneck {best['bottleneck']}\n  {best['command']}")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"search took {wall:.0f} s wall, {cpu:.0f} s CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "devices": args.devices, "target": args.target, "seq": seq, "batch": batch,
                       "budget_bytes": budget, "considered": result["considered"], "pruned": result["pruned"],
                       "search_s": wall, "cpu_s": cpu,
                       "candidates": [{k: c[k] for k in JSON_FIELDS} for c in cands[:100]]}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _psi(cfg) -> int:
    from train.planning.cost import Workload

    return Workload.of_config(cfg, global_batch=1).psi


def _near(batch: int) -> str:
    return ", ".join(str(d) for d in (1, 2, 4, 8, 16, 32, 64) if batch % d == 0)

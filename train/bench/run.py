"""``python -m train.bench``: zshard against its peers, side by side, and at scale by simulation.

The program: the flags, the sections in order (``train/bench/sections.py``, the scale section
``train/scale.py``), the targets, and ``OUT/bench.json``, ``OUT/bench.md`` and the PNG plots
(``train/bench/tables.py``), each file written whole.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax

from train.bench.gpu import gpu_rows
from train.bench.moe import VARIANTS as MOE_VARIANTS
from train.bench.moe import moe_section, moe_table
from train.bench.offload import offload_main
from train.bench.quantized import VARIANTS, quantized_section, quantized_table
from train.bench.sections import (CONFIGS, DEPTHS, NUM_DEVICES, QUICK, STRATEGIES, TENSOR_CONFIGS, TENSOR_SIZES,
                                  bench_config, depth_sweep)
from train.bench.tables import config_table, depth_table, plots, targets, targets_table
from train.devices import emulate_devices
from train.output import progress_bar
from train.scale import SCALE_DEVICES, SCALE_MODELS, SCALE_STRATEGIES, SCALE_TENSOR, run_scale, scale_table

__all__ = ["PROG", "main"]

PROG = "python -m train.bench"


def _parse(argv):
    p = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench", help="output directory for bench.json, bench.md and the PNG plots")
    p.add_argument("--quick", action="store_true", help="smoke mode: tiny model (config Q), 3 strategies, 3 rounds, no sweep, no scale")
    p.add_argument("--repeats", type=int, default=None, metavar="N", help="interleaved timing rounds (default: S 10, P 3; --quick 3)")
    p.add_argument("--configs", default="S,P", help="section 1 configurations, comma-separated (S, P)")
    p.add_argument("--no-depth", action="store_true", help="skip the depth sweep")
    p.add_argument("--no-scale", action="store_true", help="skip scale by simulation")
    p.add_argument("--no-moe", action="store_true", help="skip the MoE section (expert parallelism against plain FSDP)")
    p.add_argument("--moe-only", action="store_true", help="only the MoE section (expert parallelism against plain FSDP)")
    p.add_argument("--no-quantized", action="store_true", help="skip the quantized collectives (six python -m train runs)")
    p.add_argument("--quant-steps", type=int, default=300, metavar="N", help="steps of each quantized-collectives run (default 300)")
    p.add_argument("--quant-only", default=None, metavar="WORDS",
                   help="only the quantized runs whose names contain one of these comma-separated words (e.g. int4), and the exact peer")
    p.add_argument("--scale-timeout", type=float, default=900.0, metavar="S", help="seconds allowed to each scale subprocess")
    p.add_argument("--offload", action="store_true", help="only the host-offload measurement on one GPU (train/bench/offload.py: HBM "
                   "saved, step-time overhead against the pinned-transfer bound); skipped without a GPU")
    p.add_argument("--planned", action="store_true", help="only the plan search against reality (train/bench/planned.py): the "
                   "top candidates of an 8-device search run for real, predicted vs measured step times, Spearman's rank correlation")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be a positive integer (timing rounds)")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            p.error(f"--configs: unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
    args.config_list = configs
    return p, args


def main(argv=None) -> int:
    parser, args = _parse(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out}: exists and is not a directory; give a directory path")
    if args.offload:  # the GPU's own devices, no emulated ones
        return offload_main(str(out), args.repeats or 10)
    emulate_devices(NUM_DEVICES)  # before jax starts (in a test process it has: its 8 stand)
    if args.planned:  # the plan search against measured steps (issue 51 item 4a)
        from train.bench.planned import planned_main  # noqa: PLC0415
        return planned_main(str(out), args.repeats or 5)
    t_start = time.perf_counter()

    if len(jax.devices("cpu")) < NUM_DEVICES:
        parser.error(f"needs {NUM_DEVICES} CPU devices, JAX sees {len(jax.devices('cpu'))} (jax started with fewer before this program asked)")
    configs = {"Q": QUICK} if args.quick else {c: CONFIGS[c] for c in args.config_list}
    strategies = ("NO_SHARD", "FULL_SHARD", "HYBRID_SHARD") if args.quick else STRATEGIES
    do_depth, do_scale = not (args.quick or args.no_depth), not (args.quick or args.no_scale)
    do_quant = not (args.quick or args.no_quantized)
    do_moe = not (args.quick or args.no_moe)
    if args.moe_only:
        configs, do_depth, do_scale, do_quant, do_moe = {}, False, False, False, True
    scale_strats = SCALE_STRATEGIES
    tp_peers = lambda c: sum(c.n_heads % t == 0 for t in TENSOR_SIZES) if c.name in TENSOR_CONFIGS else 0  # noqa: E731
    total = sum(4 + len(strategies) + (2 + tp_peers(c)) * ("FULL_SHARD" in strategies) + (args.repeats or c.repeats)
                for c in configs.values()) + (2 * len(DEPTHS) if do_depth else 0) + \
        ((len(SCALE_DEVICES) * len(SCALE_MODELS) + len(SCALE_TENSOR)) * len(scale_strats) if do_scale else 0) + \
        (len(VARIANTS) if do_quant else 0) + ((len(MOE_VARIANTS) + (args.repeats or 10)) if do_moe else 0)
    results = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
               f"{platform.system()} {platform.release()}", "jax": jax.__version__, "backend": jax.default_backend(),
               "command": " ".join([PROG] + (sys.argv[1:] if argv is None else list(argv))), "configs": {}}
    md = []  # the report (OUT/bench.md): each part printed once, to stdout, as soon as it is measured

    def report(part: str, progress=None) -> None:
        md.append(part)
        (progress.write if progress is not None else print)(part, file=sys.stdout)

    with progress_bar(total, desc="bench") as progress:  # a bar on a terminal, plain lines in a log
        report(f"## zshard benchmarks ({results['date']}; {results['machine']}; jax {results['jax']})", progress)
        report("", progress)
        for name, cfg in configs.items():
            results["configs"][name] = bench_config(cfg, strategies, args.repeats or cfg.repeats, progress)
            report(config_table(results["configs"][name]) + "\n", progress)
        if do_depth:
            results["depth"] = depth_sweep(DEPTHS, CONFIGS["S"], progress)
            report(depth_table(results["depth"]) + "\n", progress)
        if do_scale:
            results["scale"] = run_scale(SCALE_DEVICES, SCALE_MODELS, scale_strats, progress, args.scale_timeout)
            for model, n, tensor in SCALE_TENSOR:  # the tensor-parallel rows (issue 25)
                results["scale"] += run_scale([n], [model], scale_strats, progress, args.scale_timeout, tensor=tensor)
            report(scale_table(results["scale"]) + "\n", progress)
        if do_quant:
            only = [w for w in (args.quant_only or "").split(",") if w]
            results["quantized"] = quantized_section(out / "quantized", args.quant_steps, progress, only=only)
            report(quantized_table(results["quantized"]) + "\n", progress)
        if do_moe:  # section 6 (train/bench/moe.py): EP 1x4x2 against no EP 1x8
            results["moe"] = moe_section(args.repeats or 10, progress)
            report(moe_table(results["moe"]) + "\n", progress)
    if jax.default_backend() == "gpu":
        results["gpu"] = gpu_rows(["toy"], args.repeats or 10)  # train/bench/gpu.py; scripts/gpu_checks.sh adds llama-3.2-1b
        g = results["gpu"]["rows"]["toy"]
        v = g["variants"]
        mfu = "n/a (unknown peak)" if v["zshard"]["mfu"] is None else \
            f"{v['zshard']['mfu']:.1%} (plain jit, same remat {v['peer']['mfu']:.1%}; no remat {v['peer remat=none']['mfu']:.1%})"
        report(f"### GPU ({results['gpu']['device']})\n\nzshard FULL_SHARD 1x1 / plain jit step time: {g['zshard_over_peer']:.3f}; "
               f"MFU {mfu}, FLOPs = 6*N*T + 12*L*H*Q*T per token (PaLM app. B)\n")
    else:
        report(f"GPU section skipped: jax.default_backend() is {jax.default_backend()!r}, not 'gpu'.\n")
    results["targets"] = targets(results)
    results["wall_s"] = time.perf_counter() - t_start
    report(targets_table(results["targets"]))
    text = "\n".join(md)
    out.mkdir(parents=True, exist_ok=True)
    written = plots(results, out)
    for name, content in (("bench.json", json.dumps(results, indent=1)), ("bench.md", text + "\n")):
        tmp = out / (name + ".tmp")
        tmp.write_text(content)
        os.replace(tmp, out / name)
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}, {', '.join(written)} in {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 48's targets in the XLA:GPU program, compiled ahead of time on a machine without a GPU.

    python scripts/gpu_aot_check.py                                   # llama-3-8b, 8 x H100, FULL_SHARD 1x8, 8 x 8192 tokens
    python scripts/gpu_aot_check.py --model llama-70b --mesh 1x8x8    # 64 x H100, tensor 8
    python scripts/gpu_aot_check.py --json out.json --hlo out.hlo

Builds a ``train.model.PLAN_PRESETS`` model abstractly (``zshard.init(..., abstract=True)``, float32
masters, bfloat16 compute, float32 gradient reduction), compiles ``zshard.make_train_step(
cross_entropy_loss).lower(state, batch).compile()`` on ``zshard.make_mesh(..., devices=
zshard.gpu_devices(target, n))`` in this process (no ``XLA_FLAGS``: every GPU choice comes from the
mesh), and prints per-GPU memory, the cuDNN attention calls, float32 buffers of ``tokens x vocab``
elements, and how many asynchronous all-gathers / reduce-scatters have compute between start and
done (``zshard.report``'s ``overlap`` view; a scanned loop's body counts once). Exits 1 when a
target of issue 48 item 4 is missed (``--no-check``: report only). Needs ``pip install
"zshard[cuda12]"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only: the CUDA plugin compiles for the target, nothing runs

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zshard  # noqa: E402
from train.model import PLAN_PRESETS, build_model, cross_entropy_loss, tensor_plan  # noqa: E402

GB = 1e9
TEMP_LIMIT = 24e9  # issue 48 item 4: temp_size_in_bytes per GPU
OVERLAP_SHARE = 0.9  # of the async all-gather / reduce-scatter starts, with compute between start and done


def compile_step(model: str, mesh_shape: str, target: str, seq: int, batch: int, strategy: str = "FULL_SHARD"):
    """``(compiled, state, seconds)`` of the train step of ``model`` on ``target`` GPUs."""
    replica, shard, *rest = zshard.parse_mesh(mesh_shape)
    tensor = rest[0] if rest else 1
    world = replica * shard * tensor
    mesh = zshard.make_mesh(replica, shard, tensor, devices=zshard.gpu_devices(target, world))
    cfg = dataclasses.replace(PLAN_PRESETS[model], seq_len=seq)
    mp = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")
    state = zshard.init(lambda: build_model(cfg, nnx.Rngs(0)), optax.adamw(1e-4), mesh, strategy=strategy, abstract=True,
                        mixed_precision=mp, tensor_parallel=tensor_plan(cfg, tensor) or None)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    step = zshard.make_train_step(cross_entropy_loss)
    t0 = time.perf_counter()
    compiled = step.lower(state, (tokens, tokens)).compile()
    return compiled, step, state, time.perf_counter() - t0, cfg


def summarize(compiled, mesh, batch: int, seq: int, vocab: int, world_data: int) -> dict:
    hlo = compiled.as_text()
    ma = compiled.memory_analysis()
    memory = {"argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
              "alias": int(ma.alias_size_in_bytes), "temp": int(ma.temp_size_in_bytes)}
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', hlo)
    tokens = batch // world_data * seq  # one device's tokens
    # a float32 array of one device's tokens x the vocabulary, whatever its rank: [T, V], [1, T, V], [B, S, V]
    fp32_logits = sum(1 for dims in re.findall(r"\bf32\[([0-9,]+)\]", hlo)
                      if dims.endswith(f",{vocab}") and math.prod(int(d) for d in dims.split(",")) == tokens * vocab)
    overlap = zshard.parse_overlap(hlo, mesh)
    ag_rs = [o for o in overlap if o["op"] in ("all-gather", "reduce-scatter")]
    started = [o for o in ag_rs if o["async"]]
    covered = [o for o in started if o["compute_between"] > 0]
    return {
        "memory": memory,
        "attention": {"forward_calls": sum(1 for c in calls if "Backward" not in c),
                      "backward_calls": sum(1 for c in calls if "Backward" in c), "targets": sorted(set(calls))},
        "fp32_tokens_x_vocab": fp32_logits,
        "collectives": {op: {"count": sum(1 for o in overlap if o["op"] == op), "async": sum(1 for o in overlap if o["op"] == op and o["async"]),
                             "overlapped": sum(1 for o in overlap if o["op"] == op and o["compute_between"] > 0)}
                        for op in ("all-gather", "reduce-scatter", "all-reduce")},
        "async_ag_rs": len(started), "async_ag_rs_overlapped": len(covered),
        "not_overlapped": [{k: o[k] for k in ("name", "op", "bytes", "async", "computation")} for o in ag_rs if not o["compute_between"]],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", choices=sorted(PLAN_PRESETS))
    p.add_argument("--mesh", default="1x8", metavar="RxS[xT]", help="replica x shard [x tensor] (default 1x8)")
    p.add_argument("--target", default="h100", choices=sorted(zshard.gpu.TARGETS))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=None, help="global batch in sequences (default: one per data device)")
    p.add_argument("--device-memory-gb", type=float, default=80.0)
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--hlo", default=None, help="write the optimized GPU HLO here")
    p.add_argument("--no-check", action="store_true", help="report only; do not exit 1 on a missed target")
    args = p.parse_args(argv)
    if os.environ.get("XLA_FLAGS"):
        print(f"note: XLA_FLAGS is set ({os.environ['XLA_FLAGS']}); issue 48 asks for a process without it")
    replica, shard, *_ = zshard.parse_mesh(args.mesh)
    batch = args.batch_size or replica * shard
    compiled, step, state, seconds, cfg = compile_step(args.model, args.mesh, args.target, args.seq_len, batch)
    s = summarize(compiled, state.plan.mesh, batch, args.seq_len, cfg.vocab_size, replica * shard)
    s.update(model=args.model, mesh=args.mesh, target=args.target, seq_len=args.seq_len, batch=batch, compile_s=round(seconds, 1),
             prefetch=step.config.resolved_prefetch(state.plan.mesh), compiler_options=zshard.gpu.compiler_options(state.plan.mesh))
    m = s["memory"]
    print(f"{args.model} on {args.mesh} x {args.target}, {batch} x {args.seq_len} tokens, compiled in {seconds:.1f} s; prefetch {s['prefetch']}")
    print("per GPU: " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in m.items()))
    a = s["attention"]
    print(f"cuDNN attention: {a['forward_calls']} forward, {a['backward_calls']} backward calls {a['targets']}")
    print(f"float32 [tokens, vocab] buffers in the program text: {s['fp32_tokens_x_vocab']}")
    for op, c in s["collectives"].items():
        print(f"{op}: {c['count']} in the text, {c['async']} async, {c['overlapped']} with compute between start and done")
    share = s["async_ag_rs_overlapped"] / max(s["async_ag_rs"], 1)
    print(f"async all-gather / reduce-scatter starts with compute between: {s['async_ag_rs_overlapped']} of {s['async_ag_rs']} ({share:.0%})")
    for o in s["not_overlapped"]:
        print(f"  without overlap: {o['name']} ({o['op']}, {o['bytes']:,} bytes, async {o['async']}, in {o['computation']})")
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(compiled.as_text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    misses = []
    if not (a["forward_calls"] and a["backward_calls"]):
        misses.append("cuDNN attention forward and backward calls")
    if s["fp32_tokens_x_vocab"]:
        misses.append("no float32 [tokens, vocab] buffer")
    if share < OVERLAP_SHARE:
        misses.append(f">= {OVERLAP_SHARE:.0%} of async all-gather / reduce-scatter starts overlapped")
    if m["peak"] > args.device_memory_gb * GB:
        misses.append(f"peak <= {args.device_memory_gb:g} GB")
    if (replica, shard) == (1, 8) and args.model == "llama-3-8b" and m["temp"] > TEMP_LIMIT:
        misses.append(f"temp <= {TEMP_LIMIT / GB:g} GB")
    print("targets missed: " + "; ".join(misses) if misses else "all targets met")
    return 1 if misses and not args.no_check else 0


if __name__ == "__main__":
    sys.exit(main())

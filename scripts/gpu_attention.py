"""Device script (not run by the tests; needs a CUDA GPU with cuDNN): one context step's attention,
cuDNN's fused flash attention against zshard's tiled path, time and memory.

    python scripts/gpu_attention.py                       # defaults: Llama-7B-like heads, chunks of 4k-32k
    python scripts/gpu_attention.py --lengths 8192,16384 --batch 1 --heads 32 --kv-heads 8 --tiles 256,512,1024

For each local length ``2c`` (the queries of one context device) it runs, forward and backward
(``jax.grad`` of ``sum(o^2)``), in bfloat16:

- ``cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn", is_causal=True)`` on the
  chunk (one ``2c x 2c`` diagonal block, what a context step computes for its own keys);
- ``xla``: the same call with ``implementation="xla"`` (scores materialised), when it fits;
- ``tiled T``: ``zshard.attention``'s tiled block (``zshard.context.flash.block``: FlashAttention-2's
  forward and custom-VJP backward in ``lax.scan`` loops) with tile ``T``, on the same chunk;

and prints per case the median step time (ms, 10 runs after 2 warm-ups), the compiled
``memory_analysis()`` temp bytes, the device's peak bytes in use so far in the process (``memory_stats``, where the
backend reports it), and the largest difference of the output and gradients from ``cudnn``
(bf16: expect ~1e-2). Output: one JSON line per case, then a Markdown table (for
docs/long-sequences.md, "Measured on a GPU").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _tiled(q, k, v, tile):
    from zshard.context.flash import block  # noqa: PLC0415 - after jax's platform is chosen

    B, L, H, D = q.shape
    n_kv = k.shape[2]
    pos = jnp.arange(L, dtype=jnp.int32)
    opts = ((True, None, 1.0 / math.sqrt(D), None), int(tile))  # causal, no window, default scale, no soft-cap
    o = block(q.reshape(B, L, n_kv, H // n_kv, D), k, v, pos, pos, None, None, opts)  # [B, L, n_kv, G, D] float32
    return o.reshape(B, L, H, D)


def _cases(tiles, with_xla):
    out = {"cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")}
    if with_xla:
        out["xla"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    for t in tiles:
        out[f"tiled {t}"] = lambda q, k, v, t=t: _tiled(q, k, v, t)
    return out


def _measure(fn, args, runs: int = 10):
    step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    compiled = step.lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    return out, statistics.median(times) * 1e3, temp, stats.get("peak_bytes_in_use")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/gpu_attention.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,8192,16384,32768", help="local lengths 2c, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tiles", default="256,512,1024", help="tile sizes of the tiled path, comma-separated")
    p.add_argument("--xla-max", type=int, default=8192, help="longest length the materialised (xla) path is tried at")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if jax.devices()[0].platform != "gpu":
        p.error(f"needs a GPU (cuDNN flash attention); JAX sees {jax.devices()[0].platform}")
    tiles = [int(t) for t in args.tiles.split(",")]
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        rng = np.random.default_rng(0)
        shape_q = (args.batch, L, args.heads, args.head_dim)
        shape_kv = (args.batch, L, args.kv_heads, args.head_dim)
        q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in (shape_q, shape_kv, shape_kv))
        ref = None
        for name, fn in _cases(tiles, L <= args.xla_max).items():
            try:
                (value, grads), ms, temp, peak = _measure(fn, (q, k, v))
            except Exception as e:  # noqa: BLE001 - out of memory or unsupported: report and go on
                rows.append({"length": L, "case": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(json.dumps(rows[-1]), flush=True)
                continue
            if ref is None:
                ref = (value, grads)
            diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / (float(jnp.max(jnp.abs(b))) or 1.0))
                       for a, b in zip(grads, ref[1]))
            rows.append({"length": L, "case": name, "ms": ms, "temp_bytes": temp, "peak_bytes": peak,
                         "grad_rel_diff_vs_first": diff, "loss": float(value)})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| 2c | case | fwd+bwd ms | temp MiB | peak MiB | grad diff vs cudnn |\n|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['length']} | {r['case']} | {r['error'][:60]} | | | |")
        else:
            peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
            print(f"| {r['length']} | {r['case']} | {r['ms']:.2f} | {r['temp_bytes'] / 2**20:.0f} | {peak} | "
                  f"{r['grad_rel_diff_vs_first']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

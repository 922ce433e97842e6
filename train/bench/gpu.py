"""zshard against the plain ``jax.jit`` step of the same code on one GPU: tokens/s, MFU, peak HBM.

    python -m train.bench.gpu --out runs/gpu/gpu_rows.json            # llama-3.2-1b and the toy row
    python -m train.bench.gpu --rows toy --steps 10
    python -m train.bench.gpu --tiny --out /tmp/rows.json             # a tiny shape, any backend: does it run

Each row compiles the same model (``train.models``), batch, optimizer (AdamW), precision (fp32
masters and Adam moments, bf16 gathers and compute, fp32 gradient reduction) and remat policy
(each block recomputed, ``remat="block"``) twice on a 1x1 mesh of the first device:

- ``zshard``: ``zshard.init(..., strategy="FULL_SHARD", mixed_precision=...)`` and
  ``zshard.make_train_step`` (its own XLA options on a GPU mesh);
- ``peer``: :func:`train.compiler_fsdp.fsdp_jit`, a plain ``jax.jit`` of ``value_and_grad`` and
  the Optax update over the NNX model's parameters cast to bf16 inside the loss, traced under
  the same mesh (``jax.set_mesh``: the same attention kernel) with the same XLA options;
- the toy row also times ``peer remat=none`` (every activation saved), the plain step of the
  earlier GPU section (docs/benchmarks.md: zshard 17.4% against it 9.8% MFU).

Timing: after two warm-up steps, ``--steps`` steps of each (one after the other: one program's
state in memory at a time), each timed alone (``block_until_ready``); the median. Per row:
``tokens_per_s``, ``mfu`` against the GPU's dense bf16 peak (:data:`PEAK_BF16_FLOPS`; ``None``
for another device), ``memory`` (``memory_analysis()``: argument + output - alias + temp) and
``peak_hbm`` (the device's ``peak_bytes_in_use`` after the variant's steps: a running maximum over
the process, so read it in run order) and ``zshard / peer`` step-time ratio.

Model FLOPs per token (:func:`model_flops_per_token`): ``6 N + 12 L H Q T`` (PaLM, Chowdhery et
al. 2022, arXiv 2204.02311, appendix B: ``N`` the parameters that multiply, ``L`` layers, ``H``
heads of width ``Q``, ``T`` the sequence); remat's recomputation is not counted (model FLOPs,
not hardware FLOPs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zshard
from train.compiler_fsdp import fsdp_jit
from train.model import PLAN_PRESETS, GPTConfig, LlamaConfig, build_model, cross_entropy_loss
from train.models.core import head_size

__all__ = ["PEAK_BF16_FLOPS", "ROWS", "gpu_rows", "main", "model_flops_per_token", "multiplying_params"]

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}  # dense bf16, vendor sheets
# name -> (model config, global batch in sequences). The toy row is the earlier GPU section's GPT; llama-3.2-1b
# at 4 x 4096 tokens per step (compiled ahead of time for one H100: about 40 GB peak, docs/performance.md).
ROWS = {
    "llama-3.2-1b": (PLAN_PRESETS["llama-3.2-1b"], 4),
    "toy": (GPTConfig(vocab_size=256, seq_len=1024, d_model=1024, n_layers=8, n_heads=16, scan=True), 16),
}
TINY = {"toy": (GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=2, scan=True), 2),
        "llama-3.2-1b": (LlamaConfig(vocab_size=512, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                                     tie_embeddings=True, scan=True), 2)}
MP = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")


def multiplying_params(model) -> int:
    """``N`` of the FLOP count: every parameter but the lookup tables (the token embedding, unless
    it is tied to the output head, where it multiplies; GPT's position table)."""
    params = nnx.state(model, nnx.Param)
    total = sum(x.size for x in jax.tree.leaves(params))
    cfg = model.cfg
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    if isinstance(cfg, GPTConfig):
        lookup += cfg.seq_len * cfg.d_model  # learned positions
    return total - lookup


def model_flops_per_token(cfg, n: int) -> float:
    """``6 N + 12 L H Q T`` training FLOPs per token (PaLM appendix B, arXiv 2204.02311)."""
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * head_size(cfg) * cfg.seq_len


def _time(run, steps: int) -> list[float]:
    for _ in range(2):  # warm-up: the first call loads the executable
        jax.block_until_ready(run())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return times


def _memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    mem = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    mem["peak"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    return mem


def _peak_hbm(dev) -> int | None:
    stats = dev.memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _row(name: str, cfg, batch: int, steps: int, dev) -> dict:
    mesh = zshard.make_mesh(1, 1, devices=[dev])
    tx = optax.adamw(1e-4)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab_size, size=(batch, cfg.seq_len + 1), dtype=np.int32)
    data = (tok[:, :-1], tok[:, 1:])
    build = lambda: build_model(cfg, nnx.Rngs(0))  # noqa: E731
    out = {"config": {k: v for k, v in dataclasses.asdict(cfg).items() if not isinstance(v, dict)}, "batch": batch,
           "tokens_per_step": batch * cfg.seq_len, "variants": {}}
    model = build()
    out["n_multiplying"] = n = multiplying_params(model)
    flops = model_flops_per_token(cfg, n) * batch * cfg.seq_len
    peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in dev.device_kind), None)
    out["flops_per_step"], out["peak_flops"] = flops, peak_flops
    del model

    def record(label, compiled, run, seconds):
        times = _time(run, steps)
        t = statistics.median(times)
        out["variants"][label] = {"compile_s": seconds, "step_s": t, "step_s_all": times, "tokens_per_s": batch * cfg.seq_len / t,
                                  "mfu": flops / t / peak_flops if peak_flops else None, "memory": _memory(compiled),
                                  "peak_hbm": _peak_hbm(dev)}

    # zshard FULL_SHARD on 1x1 (its step applies its own XLA options on a GPU mesh)
    state = zshard.init(build, tx, mesh, strategy="FULL_SHARD", mixed_precision=MP)
    step = zshard.make_train_step(cross_entropy_loss)
    batch_z = step.put_batch(state, data)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch_z).compile()
    seconds = time.perf_counter() - t0
    box = {"s": state}

    def run_z():
        box["s"], metrics = compiled(box["s"], batch_z)
        return metrics["loss"]

    record("zshard", compiled, run_z, seconds)
    del box["s"], state
    peers = [("peer", "block")] + ([("peer remat=none", "none")] if name == "toy" else [])
    for label, remat in peers:
        record(label, *_plain(build, tx, mesh, data, remat))
    z, p = out["variants"]["zshard"], out["variants"]["peer"]
    out["zshard_over_peer"] = z["step_s"] / p["step_s"]
    return out


def _plain(build, tx, zmesh, data, remat):
    """The plain ``jax.jit`` step of the same model (:func:`fsdp_jit` on the 1x1 mesh): ``(compiled, run, seconds)``."""
    mesh = jax.sharding.Mesh(zmesh.devices, zmesh.axis_names)  # Auto axes: the compiler shards (zshard's are Explicit)
    graphdef, params = nnx.split(build())
    jitted, (p_sh, o_sh, b_sh), _ = fsdp_jit(graphdef, params, tx, mesh, "fsdp", remat, jnp.bfloat16,
                                             compiler_options=zshard.gpu.compiler_options(mesh))
    params = jax.device_put(params, p_sh)
    box = {"p": params, "o": jax.jit(tx.init, out_shardings=o_sh)(params)}
    placed = jax.device_put(data, (b_sh, b_sh))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # the attention kernel follows the mesh's devices, as inside zshard's step
        compiled = jitted.lower(box["p"], box["o"], placed).compile()
    seconds = time.perf_counter() - t0

    def run():
        box["p"], box["o"], loss = compiled(box["p"], box["o"], placed)
        return loss

    return compiled, run, seconds


def gpu_rows(names=tuple(ROWS), steps: int = 10, tiny: bool = False, done=None) -> dict:
    """The rows ``names`` (of :data:`ROWS`; ``tiny``: the same code on tiny shapes, :data:`TINY`)
    on the first device: see the module docstring for what each holds. ``done(result)`` is
    called after each row (the result so far)."""
    dev = jax.devices()[0]
    table = TINY if tiny else ROWS
    result = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "steps": steps, "tiny": tiny, "rows": {}}
    for n in names:
        result["rows"][n] = _row(n, *table[n], steps, dev)
        if done is not None:
            done(result)
    return result


def _write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each variant (default 10)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes of the same code (checks that it runs, e.g. on a CPU)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the result as JSON")
    args = p.parse_args(argv)
    names = [n for n in args.rows.split(",") if n]
    bad = [n for n in names if n not in ROWS]
    if bad or not names or args.steps < 1:
        p.error(f"--rows {args.rows!r}: choose from {', '.join(ROWS)}; --steps must be positive")
    result = gpu_rows(names, args.steps, args.tiny, done=lambda r: _write(args.out, r))  # written after each row
    for n, r in result["rows"].items():
        for label, v in r["variants"].items():
            mfu = "n/a" if v["mfu"] is None else f"{v['mfu']:.1%}"
            hbm = "n/a" if v["peak_hbm"] is None else f"{v['peak_hbm'] / 1e9:.2f} GB"
            print(f"{n:>13} {label:<16} {v['step_s'] * 1e3:9.1f} ms  {v['tokens_per_s']:10.0f} tokens/s  MFU {mfu:>6}  "
                  f"compiled peak {v['memory']['peak'] / 1e9:.2f} GB  process peak HBM {hbm}")
        print(f"{n:>13} zshard / peer step time {r['zshard_over_peer']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

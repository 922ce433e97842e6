"""``python -m train.bench --offload``: host offload measured on one GPU (docs/offload.md).

Four runs of the same GPT step on the first GPU (mesh 1x1, FULL_SHARD, AdamW), each in its own
process so that ``device.memory_stats()["peak_bytes_in_use"]`` starts fresh:

- ``fp32`` without offload and with ``offload="optimizer"``;
- ``bf16`` (``MixedPrecision(param_dtype=bfloat16)``) without offload and with ``"optimizer+master"``.

For each offloaded run, against its run without offload:

- **HBM saved** = the peak bytes in use of the run without offload minus the offloaded run's
  (``memory_stats``), beside the compiled step's ``memory_analysis()`` host fields (0 on CPU,
  where this cannot be measured) and the host bytes of the state (``zshard.report``). Goal:
  at least ``8 Psi / N`` (the Adam moments; ZeRO-Offload, arXiv 2101.06840 section 4.1).
- **Step-time overhead** = offloaded step time minus the step time without, against the
  transfer bound ``host bytes / B_h2d + host bytes / B_d2h`` (``2 * 8 Psi / N / B`` for Adam),
  with ``B`` the pinned-host bandwidth measured here (``jax.device_put`` of a 256 MiB array each
  way). Goal: at most 1.2 x the bound (the update overlapping the transfers).

On any other backend it prints that it was skipped and writes nothing: CI never needs a GPU.
The worker (``python -m train.bench.offload --worker MODE``) runs one mode and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zshard
from train.model import GPT, GPTConfig, cross_entropy_loss

__all__ = ["MODES", "bandwidth", "measure", "offload_main", "offload_table"]

# mode -> (offload, bf16 mixed precision, the run it is compared with)
MODES = {
    "fp32": (None, False, None),
    "optimizer": ("optimizer", False, "fp32"),
    "bf16": (None, True, None),
    "optimizer+master": ("optimizer+master", True, "bf16"),
}
CONFIG = GPTConfig(vocab_size=256, seq_len=1024, d_model=1024, n_layers=8, n_heads=16, scan=True)
BATCH = 8


def bandwidth(device, nbytes: int = 256 * 2**20, repeats: int = 5) -> dict:
    """Pinned host <-> device bandwidth, bytes per second (median of ``repeats`` copies each way)."""
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    host, dev = NamedSharding(mesh, P(), memory_kind="pinned_host"), NamedSharding(mesh, P(), memory_kind="device")
    x = jax.device_put(np.ones(nbytes // 4, np.float32), host)
    y = jax.device_put(x, dev).block_until_ready()
    out = {}
    for name, src, dst in (("h2d", x, dev), ("d2h", y, host)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.device_put(src, dst).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times)
    return out


def measure(mode: str, device=None, cfg: GPTConfig = CONFIG, batch: int = BATCH, repeats: int = 10) -> dict:
    """One mode's step on ``device`` (default: the first device): step time (median of
    ``repeats``), peak bytes in use (``memory_stats``, ``None`` where the backend has none),
    ``memory_analysis`` (device and host fields) and the offload lines of ``zshard.report``."""
    device = device or jax.devices()[0]
    offload, bf16, _ = MODES[mode]
    mp = zshard.MixedPrecision(param_dtype="bfloat16") if bf16 else None
    mesh = zshard.make_mesh(1, 1, devices=[device])
    state = zshard.init(lambda: GPT(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-4), mesh, mixed_precision=mp, offload=offload)
    step = zshard.make_train_step(cross_entropy_loss)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab_size, size=(batch, cfg.seq_len + 1), dtype=np.int32)
    data = step.put_batch(state, (tok[:, :-1], tok[:, 1:]))
    ma = step.lower(state, data).compile().memory_analysis()
    rep = zshard.report(step, state, data)
    for _ in range(2):  # compile and warm up
        state, metrics = step(state, data)
    jax.block_until_ready(metrics["loss"])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    stats = device.memory_stats() or {}
    fields = ("argument", "output", "temp", "alias")
    return {
        "mode": mode,
        "device": getattr(device, "device_kind", str(device)),
        "num_params": rep.num_params,
        "step_s": statistics.median(times),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "memory_analysis": {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in fields}
        | {f"host_{k}": int(getattr(ma, f"host_{k}_size_in_bytes", 0)) for k in fields},
        "offload": rep.offload,
        "loss": float(metrics["loss"]),
    }


def _compare(runs: dict, bw: dict) -> list[dict]:
    rows = []
    for mode, (offload, _, base) in MODES.items():
        if offload is None or mode not in runs or base not in runs:
            continue
        got, ref = runs[mode], runs[base]
        host = got["offload"]["measured"]["host"]
        opt_host = 8 * got["num_params"]  # 8 Psi / N, N = 1: the Adam moments in fp32
        bound = host / bw["h2d"] + host / bw["d2h"]
        saved = None if ref["peak_bytes_in_use"] is None or got["peak_bytes_in_use"] is None else \
            ref["peak_bytes_in_use"] - got["peak_bytes_in_use"]
        overhead = got["step_s"] - ref["step_s"]
        rows.append({
            "mode": mode, "against": base, "host_bytes": host, "hbm_saved": saved, "hbm_goal": opt_host,
            "hbm_met": None if saved is None else saved >= opt_host, "overhead_s": overhead, "bound_s": bound,
            "overhead_over_bound": overhead / bound if bound else None, "overhead_met": overhead <= 1.2 * bound,
            "host_fields": got["memory_analysis"]["host_argument"], "transfers": got["offload"]["transfer"]["calls"],
        })  # fmt: skip
    return rows


def offload_table(result: dict) -> str:
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    lines = [
        f"### Host offload on {result['device']} (GPT d {CONFIG.d_model}, {CONFIG.n_layers} layers, seq {CONFIG.seq_len}, "
        f"batch {BATCH}; pinned bandwidth {result['bandwidth']['h2d'] / 1e9:.1f} GB/s h2d, {result['bandwidth']['d2h'] / 1e9:.1f} GB/s d2h)",
        "",
        "| mode | against | host GiB | HBM saved GiB | goal >= 8 Psi / N | step overhead s | transfer bound s | overhead / bound (<= 1.2) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ratio = "n/a" if r["overhead_over_bound"] is None else f"{r['overhead_over_bound']:.2f}"
        lines.append(f"| {r['mode']} | {r['against']} | {gib(r['host_bytes'])} | {gib(r['hbm_saved'])} | {gib(r['hbm_goal'])} "
                     f"({'met' if r['hbm_met'] else 'missed' if r['hbm_met'] is not None else 'n/a'}) | {r['overhead_s']:.4f} | "
                     f"{r['bound_s']:.4f} | {ratio} ({'met' if r['overhead_met'] else 'missed'}) |")
    lines += ["", "| run | step s | peak bytes in use GiB | memory_analysis host argument GiB |", "|---|---:|---:|---:|"]
    for name, run in result["runs"].items():
        lines.append(f"| {name} | {run['step_s']:.4f} | {gib(run['peak_bytes_in_use'])} | {gib(run['memory_analysis']['host_argument'])} |")
    return "\n".join(lines)


def offload_main(out: str, repeats: int = 10) -> int:
    """``python -m train.bench --offload``: the four runs (one process each), the comparison,
    ``OUT/offload.json`` and ``OUT/offload.md``; on a backend other than GPU, skipped."""
    if jax.default_backend() != "gpu":
        print(f"offload benchmark skipped: jax.default_backend() is {jax.default_backend()!r}, not 'gpu' (it measures HBM and "
              "pinned-host transfers, which a CPU does not have; tests/test_offload.py checks the placement and the GPU "
              "program on any machine)")
        return 0
    device = jax.devices("gpu")[0]
    bw = bandwidth(device)
    runs = {}
    for mode in MODES:
        cmd = [sys.executable, "-m", "train.bench.offload", "--worker", mode, "--repeats", str(repeats)]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
        if res.returncode != 0:
            print(f"offload benchmark: the {mode} run failed (exit {res.returncode}):\n{res.stderr[-3000:]}", file=sys.stderr)
            return 1
        runs[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    result = {"device": device.device_kind, "bandwidth": bw, "runs": runs, "rows": _compare(runs, bw),
              "date": time.strftime("%Y-%m-%d %H:%M %Z"), "jax": jax.__version__}
    text = offload_table(result)
    print(text)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "offload.json").write_text(json.dumps(result, indent=1))
    (path / "offload.md").write_text(text + "\n")
    print(f"\nwrote {path / 'offload.json'}, {path / 'offload.md'}")
    return 0


def _worker(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m train.bench.offload")
    p.add_argument("--worker", required=True, choices=list(MODES))
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.worker, repeats=args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))

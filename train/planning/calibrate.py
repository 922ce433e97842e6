"""Measure this machine's hardware profile: ``python -m train.planning.calibrate``.

    python -m train.planning.calibrate                       # 8 emulated CPU devices -> train/planning/profiles/cpu.toml
    python -m train.planning.calibrate --devices 4 --out my-cpu.toml --rounds 7

On ``--devices`` emulated CPU devices (all of them at once, as a step runs them), each timed
``--rounds`` times after one warm-up, medians:

- **matmul**: every device multiplies its own ``[M, M] x [M, M]`` float32 matrices (``M = --size``):
  ``peak_flops = 2 M^3 / seconds`` per device (``matmul_fraction = 1``: a measured rate is achievable);
- **all-gather** and **reduce-scatter** of a ``--collective-mib`` float32 buffer over all the
  devices (``jax.lax.all_gather`` / ``psum_scatter`` in ``shard_map``): bytes one device sends
  (``X (n-1)/n``, ring) over seconds; the median of both is ``intra_node_bandwidth`` (and
  ``inter_node_bandwidth``: one process is one node; fractions 1);
- **copy**: each device reads and writes its ``--copy-mib`` buffer (``y = 2 x + 1``):
  ``hbm_bandwidth = 2 bytes / seconds``;
- ``hbm_bytes``: this machine's memory over the devices;
- ``async_collectives = false``: XLA:CPU runs every collective on its own, so nothing hides them.

The emulated devices share this machine's cores, so the rates are per device while all of them
run: what a step on them gets. Writes the profile (each number's source: this command and the
date) and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

from train.devices import emulate_devices
from train.planning.profiles import Profile, profile_dir, write_profile

__all__ = ["calibrate", "main"]


def _median_seconds(fn, args, rounds: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(devices: int, *, rounds: int = 5, size: int = 512, collective_mib: float = 16.0, copy_mib: float = 16.0) -> dict:
    """Measure the rates of :mod:`this module <train.planning.calibrate>`'s docstring on the first
    ``devices`` JAX devices.

    Returns:
      ``{"peak_flops", "hbm_bandwidth", "all_gather", "reduce_scatter", "intra_node_bandwidth",
      "hbm_bytes", "devices", "rounds", "platform"}`` (FLOP/s and bytes/s per device, bytes).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = jax.devices()[:devices]
    if len(devs) < devices:
        raise ValueError(f"--devices {devices}: JAX sees {len(devs)} devices")
    mesh = Mesh(np.asarray(devs), ("d",))
    sharded = NamedSharding(mesh, P("d"))
    smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))  # noqa: E731

    # [n*M, M] -> each device [M, M] @ [M, M]
    a = jax.device_put(jnp.ones((devices * size, size), jnp.float32), sharded)
    t_mm = _median_seconds(smap(lambda x: x @ x), (a,), rounds)
    flops = 2.0 * size**3 / t_mm

    elems = max(devices, int(collective_mib * 2**20 / 4) // devices * devices)  # X: the gathered buffer
    x = jax.device_put(jnp.ones((elems,), jnp.float32), sharded)  # [X/n] per device
    sent = 4.0 * elems * (devices - 1) / devices
    gather = smap(lambda v: jax.lax.all_gather(v, "d", tiled=True))  # [X/n] --all_gather(d)--> [X] on every device
    t_ag = _median_seconds(gather, (x,), rounds)
    y = jax.device_put(jnp.ones((devices * elems,), jnp.float32), sharded)  # [X] per device
    scatter = smap(lambda v: jax.lax.psum_scatter(v, "d", tiled=True))  # [X] --reduce_scatter(d)--> [X/n]
    t_rs = _median_seconds(scatter, (y,), rounds)

    c = jax.device_put(jnp.ones((devices * int(copy_mib * 2**20 / 4),), jnp.float32), sharded)
    t_cp = _median_seconds(smap(lambda v: v * 2.0 + 1.0), (c,), rounds)
    copy_bytes = 2.0 * 4 * c.shape[0] / devices

    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    ag, rs = sent / t_ag if devices > 1 else 0.0, sent / t_rs if devices > 1 else 0.0
    return {"peak_flops": flops, "hbm_bandwidth": copy_bytes / t_cp, "all_gather": ag, "reduce_scatter": rs,
            "intra_node_bandwidth": statistics.median([ag, rs]) if devices > 1 else copy_bytes / t_cp,
            "hbm_bytes": ram / devices if ram else 0.0, "devices": devices, "rounds": rounds, "platform": devs[0].platform}


def profile_of(m: dict, command: str, date: str) -> Profile:
    """The :class:`Profile` of :func:`calibrate`'s measurements ``m``, each source naming ``command`` and ``date``."""
    by = f"measured {date}: {command}"
    src = {
        "peak_flops": f"{by} (float32 matmul on every device at once, median)",
        "hbm_bytes": f"{by} (this machine's memory over {m['devices']} devices)",
        "hbm_bandwidth": f"{by} (y = 2x + 1 on every device: bytes read and written over seconds, median)",
        "intra_node_bandwidth": f"{by} (median of all-gather {m['all_gather'] / 1e9:.3f} and reduce-scatter "
                                f"{m['reduce_scatter'] / 1e9:.3f} GB/s sent per device, ring)",
        "inter_node_bandwidth": "the intra-node figure: the emulated devices are one process, one node",
        "devices_per_node": f"{m['devices']} emulated devices in one process",
    }
    for k in ("matmul_fraction", "intra_node_fraction", "inter_node_fraction"):
        src[k] = "1: the measured rates are achievable rates"
    src["async_collectives"] = "false: XLA:CPU runs every collective synchronously (zshard/report.py), nothing hides them"
    return Profile(name="cpu", description=f"{m['devices']} emulated {m['platform'].upper()} devices of this machine (calibrated)",
                   peak_flops=m["peak_flops"], hbm_bytes=m["hbm_bytes"] or 1.0, hbm_bandwidth=m["hbm_bandwidth"],
                   intra_node_bandwidth=m["intra_node_bandwidth"], inter_node_bandwidth=m["intra_node_bandwidth"],
                   devices_per_node=m["devices"], matmul_fraction=1.0, intra_node_fraction=1.0, inter_node_fraction=1.0,
                   async_collectives=False, sources=src)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.planning.calibrate", allow_abbrev=False,
                                description="Measure a matmul, an all-gather, a reduce-scatter and a copy on emulated CPU "
                                "devices and write the hardware profile of this machine for the planner's cost model.")
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices (default 8, as the tests and python -m train)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of each measurement; medians (default 5)")
    p.add_argument("--size", type=int, default=512, metavar="M", help="matmul [M, M] x [M, M] per device (default 512)")
    p.add_argument("--collective-mib", type=float, default=16.0, help="gathered buffer X, MiB (default 16)")
    p.add_argument("--copy-mib", type=float, default=16.0, help="copied buffer per device, MiB (default 16)")
    p.add_argument("--out", default=None, metavar="FILE.toml", help="where to write (default: the packaged cpu profile, "
                   "train/planning/profiles/cpu.toml)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for flag in ("devices", "rounds", "size", "collective_mib", "copy_mib"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    if not emulate_devices(args.devices, cpu_only=True):
        import jax
        if len(jax.devices()) < args.devices:
            p.error(f"--devices {args.devices}: JAX runs already with {len(jax.devices())} devices")
    m = calibrate(args.devices, rounds=args.rounds, size=args.size, collective_mib=args.collective_mib, copy_mib=args.copy_mib)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    given = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    given = [a for i, a in enumerate(given) if a != "--out" and (i == 0 or given[i - 1] != "--out") and not a.startswith("--out=")]
    command = " ".join(["python -m train.planning.calibrate", *given])  # where it was written is no part of the measurement
    prof = profile_of(m, command, date)
    target = args.out or profile_dir() / "cpu.toml"
    try:
        out = write_profile(prof, target, comment=f"This machine as the cost model sees it: {prof.description}.\nWritten by "
                            f"{command} on {date}; rerun it to measure again. Units: FLOP/s, bytes, bytes/s (per device).")
    except OSError as e:
        p.error(f"cannot write the profile to {target}: {e.strerror}; give --out FILE.toml (train.plan --profile FILE.toml reads it)")
    print(f"matmul {m['peak_flops'] / 1e9:.2f} GFLOP/s, all-gather {m['all_gather'] / 1e9:.3f} GB/s, reduce-scatter "
          f"{m['reduce_scatter'] / 1e9:.3f} GB/s, copy {m['hbm_bandwidth'] / 1e9:.2f} GB/s per device "
          f"({args.devices} devices, medians of {args.rounds} rounds)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

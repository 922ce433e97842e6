"""The command line of ``python -m train``: flags and ``--config FILE`` -> one :class:`train.config.Config`.

Values: the section dataclasses' defaults < ``--config FILE`` (TOML, or JSON) < flags; every
field has a flag (``--steps`` or ``--training.steps``; ``python -m train --help``). Bad input
is :func:`fail`: ``python -m train: error: ...`` alone on stderr, naming the key, its flag
and the fix, exit status 2 (as argparse), before anything compiles.
"""

from __future__ import annotations

import argparse
import os
import sys

from train import config
from train.devices import DEVICE_FLAG
from train.output import PROG

__all__ = ["EXIT_USAGE", "build_parser", "device_count", "fail", "parse_config"]

EXIT_USAGE = 2  # bad input, as argparse

LAUNCHER_ENV = ("ZSHARD_COORDINATOR", "ZSHARD_NUM_PROCESSES", "ZSHARD_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE")
"""Variables that say this process is one of several (``python -m zshard.launch``, SLURM, Open MPI)."""


def fail(message: str) -> None:
    """Bad input: ``python -m train: error: MESSAGE`` alone on stderr, exit status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


class _Parser(argparse.ArgumentParser):
    """Parses the flags, reads ``--config`` and returns ``Namespace(config=PATH, run=Config)``
    (defaults < file < flags); a bad file or value is :func:`fail` (one line, exit 2)."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        path = getattr(ns, "config", None)
        try:
            cfg = config.from_args(ns, config.load_file(path) if path else {}, source=path or "config")
        except config.ConfigError as e:
            self.error(str(e))
        return argparse.Namespace(config=path, run=cfg), rest

    def error(self, message: str):
        fail(f"{message} ({PROG} --help lists the flags)" if "argument" in message or "unrecognized" in message else message)


def build_parser() -> argparse.ArgumentParser:
    """``--config FILE`` and one flag per configuration field (``train.config.add_arguments``).

    ``parse_args`` returns ``Namespace(config=PATH or None, run=Config)``.
    """
    p = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Train a byte-level GPT with zshard (ZeRO-3 / FSDP sharding). Writes OUT/metrics.jsonl, "
        "OUT/summary.json, OUT/config.toml, OUT/samples.txt, OUT/model.safetensors and TensorBoard events in OUT/tb.",
        epilog="Values: defaults < --config FILE < flags. Optional fields take 'none'. Presets: train/configs/*.toml.",
    )
    p.add_argument("--config", metavar="FILE", default=None,
                   help="TOML (or JSON) file with [model] [data] [mesh] [optimizer] [training] [checkpoint] "
                   "[distributed] [logging] tables; flags override it")
    p.add_argument("--auto", action="store_true", default=argparse.SUPPRESS,
                   help="choose the mesh, strategy, remat and gradient accumulation with the plan search "
                   "(python -m train.plan --search) for the devices present, on the cpu profile; config.toml records the "
                   "choice, summary.json's auto the predicted and measured step_s. Refused beside --mesh, --strategy, "
                   "--zero-stage, --tensor, --context, --expert, --remat or --grad-accum (train/planning/auto.py)")
    config.add_arguments(p)
    return p


def parse_config(argv: list[str]):
    """``argv`` -> ``(Config, config file or None)``; :func:`fail` on bad input."""
    ns = build_parser().parse_args(argv)
    return ns.run, ns.config


def _multiprocess(run: config.Config) -> bool:
    """A multi-process run? (its ``[distributed]`` settings, or a launcher's / cluster's variables)."""
    d = run.distributed
    return any(v is not None for v in (d.coordinator, d.num_processes, d.process_id)) or any(os.environ.get(k) for k in LAUNCHER_ENV)


def device_count(run: config.Config, argv: list[str], config_path: str | None) -> int | None:
    """The emulated CPU devices this process asks for (``train.devices.emulate_devices``): ``mesh.devices``
    (at least 1), or ``None`` where a launcher's per-process count stands: a multi-process run whose
    ``XLA_FLAGS`` hold ``--xla_force_host_platform_device_count`` (``python -m zshard.launch
    --devices-per-proc D``) and whose flags and config file do not set ``mesh.devices``."""
    given = any(a.split("=")[0] in ("--devices", "--mesh.devices") for a in argv) or (
        config_path is not None and "devices" in config.load_file(config_path).get("mesh", {}))
    if _multiprocess(run) and not given and DEVICE_FLAG in os.environ.get("XLA_FLAGS", ""):
        return None
    return max(run.mesh.devices, 1)

"""Hardware profiles of the cost model: one TOML file per device kind, each number with its source.

``train/planning/profiles/{h100,h200,a100,cpu}.toml`` hold, per device: ``peak_flops`` (dense
bf16 FLOP/s; the CPU's measured float32), ``hbm_bytes`` and ``hbm_bandwidth`` (bytes, bytes/s),
``intra_node_bandwidth`` (NVLink, bytes/s per device each way), ``inter_node_bandwidth``
(the device's share of the network between nodes, bytes/s each way), ``devices_per_node``, and
the achievable fractions ``matmul_fraction``, ``intra_node_fraction``, ``inter_node_fraction``, and
``async_collectives`` (default true; false where collectives never overlap compute, as on XLA:CPU).
A ``[sources]`` table names where each number comes from (a datasheet, a published measurement,
or the calibration command that measured it: ``python -m train.planning.calibrate``).

:func:`load_profile` reads one by name (``"h100"``) or by path; :func:`write_profile` writes the
calibration's.
"""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources
from pathlib import Path

import tomli_w

__all__ = ["FIELDS", "Profile", "load_profile", "profile_dir", "profile_names", "write_profile"]

FIELDS = ("peak_flops", "hbm_bytes", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "devices_per_node",
          "matmul_fraction", "intra_node_fraction", "inter_node_fraction")
"""The numbers every profile gives, each with a ``[sources]`` entry."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """One device kind, as the cost model sees it (units in the field names' docstring above).

    Attributes:
      name, description: ``"h100"``; a line naming the device and its node.
      peak_flops: dense matmul FLOP/s of one device (bf16 on GPUs).
      hbm_bytes: device memory, bytes (10^9 per GB).
      hbm_bandwidth: device memory bandwidth, bytes/s.
      intra_node_bandwidth: one device's link to the others of its node, bytes/s each way.
      inter_node_bandwidth: one device's share of the links between nodes, bytes/s each way.
      devices_per_node: devices joined by the intra-node links.
      matmul_fraction: the fraction of ``peak_flops`` large matmuls reach.
      intra_node_fraction, inter_node_fraction: the fraction of each bandwidth collectives reach.
      async_collectives: collectives run beside the compute (GPUs: NCCL streams); ``False`` where
        every collective runs alone (XLA:CPU): then nothing hides them.
      sources: field -> where the number comes from.
    """

    name: str
    description: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    matmul_fraction: float
    intra_node_fraction: float
    inter_node_fraction: float
    async_collectives: bool = True
    sources: dict = dataclasses.field(default_factory=dict)

    @property
    def matmul_flops(self) -> float:
        """Achievable matmul FLOP/s: ``peak_flops * matmul_fraction``."""
        return self.peak_flops * self.matmul_fraction

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def profile_dir() -> Path:
    """The folder of the packaged profiles (``train/planning/profiles``)."""
    return Path(str(resources.files("train.planning") / "profiles"))


def profile_names() -> tuple[str, ...]:
    """The packaged profiles' names, sorted: ``("a100", "cpu", "h100", "h200")``."""
    return tuple(sorted(p.stem for p in profile_dir().glob("*.toml")))


def load_profile(name: str | Path) -> Profile:
    """The profile called ``name`` (a packaged one: :func:`profile_names`) or the TOML file at ``name``.

    Raises:
      ValueError: an unknown name (the message lists the choices), a missing or non-positive
        number, a fraction outside ``(0, 1]``, or a number without a ``[sources]`` entry.
    """
    path = Path(name)
    if path.suffix != ".toml":
        path = profile_dir() / f"{name}.toml"
        if not path.is_file():
            raise ValueError(f"hardware profile {str(name)!r}: unknown; choose one of {', '.join(profile_names())} "
                             "or give the path of a .toml profile (python -m train.planning.calibrate writes one)")
    elif not path.is_file():
        raise ValueError(f"hardware profile {str(name)!r}: no such file")
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    missing = [k for k in FIELDS if k not in raw]
    if missing:
        raise ValueError(f"hardware profile {path.name}: missing {', '.join(missing)} (every profile gives {', '.join(FIELDS)})")
    sources = raw.get("sources", {})
    unsourced = [k for k in FIELDS if not str(sources.get(k, "")).strip()]
    if unsourced:
        raise ValueError(f"hardware profile {path.name}: no [sources] entry for {', '.join(unsourced)}")
    values = {k: raw[k] for k in FIELDS}
    bad = [k for k, v in values.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0]
    bad += [k for k in FIELDS if k.endswith("_fraction") and k not in bad and values[k] > 1]
    if bad:
        raise ValueError(f"hardware profile {path.name}: {', '.join(f'{k} = {values[k]!r}' for k in bad)}: numbers must be "
                         "positive and fractions at most 1")
    overlap = raw.get("async_collectives", True)
    if not isinstance(overlap, bool):
        raise ValueError(f"hardware profile {path.name}: async_collectives = {overlap!r}: true or false")
    return Profile(name=raw.get("name", path.stem), description=raw.get("description", ""),
                   devices_per_node=int(values.pop("devices_per_node")), **{k: float(v) for k, v in values.items()},
                   async_collectives=overlap, sources=dict(sources))


def write_profile(profile: Profile, path: str | Path, comment: str = "") -> Path:
    """Write ``profile`` as TOML at ``path`` (``comment`` lines first, ``# `` prefixed); returns the path."""
    data = profile.to_dict()
    sources = data.pop("sources")
    text = "".join(f"# {line}\n" for line in comment.splitlines()) + tomli_w.dumps({**data, "sources": sources})
    path = Path(path)
    path.write_text(text)
    return path

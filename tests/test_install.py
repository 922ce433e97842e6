"""The library install is the core's: ``pip install .`` (no extra) pulls none of the trainer's
packages, and ``import zshard`` loads none of them (pyproject.toml: the ``train`` extra)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import PathDistribution

from conftest import ROOT

# The trainer's and its tools' packages (pyproject.toml's `train` extra): distribution name -> module.
TRAIN_ONLY = {"matplotlib": "matplotlib", "tensorboardX": "tensorboardX", "tqdm": "tqdm", "grain": "grain", "tomli-w": "tomli_w"}
CORE = ("jax", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "safetensors")


def _name(requirement: str) -> str:
    """``'tomli-w>=1.0; extra == "train"'`` -> ``'tomli-w'``."""
    for stop in "[<>=!~; ":
        requirement = requirement.split(stop)[0]
    return requirement


def test_the_core_install_requires_none_of_the_trainers_packages(tmp_path):
    # The metadata `pip install .` reads: setuptools' PEP 517 hook on a copy of pyproject.toml (no
    # packages are needed to write it; built from a copy, nothing is written in the checkout).
    src = tmp_path / "src"
    for name in ("zshard", "train", "meshes"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    hook = "import sys; from setuptools import build_meta as b; print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    res = subprocess.run([sys.executable, "-c", hook, str(tmp_path)], cwd=src, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    dist = PathDistribution(tmp_path / res.stdout.strip().splitlines()[-1])
    requires = dist.requires or []
    core = {_name(r) for r in requires if "extra ==" not in r}
    train = {_name(r) for r in requires if 'extra == "train"' in r}
    assert core == set(CORE), f"`pip install zshard` pulls {sorted(core)}; the core's dependencies are {CORE}"
    assert set(TRAIN_ONLY) <= train, f"the train extra lists {sorted(train)}"
    assert any(_name(r) == "zshard" and 'extra == "test"' in r for r in requires), "the test extra must pull zshard[train]"


def test_import_zshard_loads_none_of_the_trainers_packages():
    # A fresh interpreter (this one has imported the trainer); it inherits JAX_PLATFORMS=cpu and
    # XLA_FLAGS from tests/conftest.py.
    probe = (
        "import sys, zshard, zshard.checkpoint, zshard.verify\n"
        f"print(sorted(m for m in {sorted([*TRAIN_ONLY.values(), 'train'])!r} if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout

"""Every command of README.md runs in a fresh clone (``git clone`` of this repository's HEAD):
the ``python -m train`` and launcher commands of its ``bash`` blocks, shortened to 2 steps. Only the
first training command (the bare ``python -m train``, the default model) samples (``--sample-tokens 4``);
the others run with ``--sample-tokens 0``: the same sampling code, compiled again for another mesh,
is what tests/test_sample.py, tests/test_main_eval.py and tests/test_preempt_mp.py's two-process launch check."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT

SHORT = ["--steps", "2", "--eval-batches", "1", "--no-tensorboard"]


def readme_commands() -> list[str]:
    """The shell commands of README.md's ```bash blocks, continuation lines joined, comments cut."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            for part in line.split("&&"):
                if part.strip():
                    commands.append(part.strip())
    return commands


def test_readme_commands_run_in_a_fresh_clone(tmp_path):
    commands = readme_commands()
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")  # an installed copy: nothing to clone
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    env = dict(os.environ, PYTHONPATH=str(clone))  # the clone's code, this interpreter's packages
    ran, sampled = [], False
    for i, command in enumerate(commands):
        argv = shlex.split(command)
        if argv[0] in (".venv/bin/python", "python", "python3") and argv[1:2] == ["-m"]:
            argv[0] = sys.executable
        else:
            continue  # creating the venv and installing: what .ci/run does; the test suite: this run
        if not (argv[2] in ("train", "zshard.launch") or argv[2].startswith("train.")):
            continue  # python3 -m venv, pip, pytest
        if argv[2] == "zshard.launch":
            argv = [a if a != "python" else sys.executable for a in argv]
        if argv[2] == "zshard.launch" or (argv[2] == "train" and "--help" not in argv):
            argv += SHORT + ["--sample-tokens", "0" if sampled else "4", "--out", str(tmp_path / f"run{i}")]
            sampled = True
        res = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"README command failed in a fresh clone: {command}\n{(res.stdout + res.stderr)[-3000:]}"
        ran.append(command)
        if "--sample-tokens" in argv and argv[argv.index("--sample-tokens") + 1] == "4":
            assert (tmp_path / f"run{i}" / "samples.txt").read_text().strip(), command
    assert any(c.endswith("-m train") for c in ran) and any("zshard.launch" in c for c in ran), ran

"""``python -m train`` as people live with it: run folders and ``--overwrite``, Ctrl-C while
compiling, one-line errors, and the weights saved at the end. Runs of the nano model on a small
corpus: subprocesses, and ``python -m train``'s main in this process where the process is not what is checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
from flax import nnx

import zshard
from conftest import ROOT
from runs import train_main
from test_train import refused

TINY = ["--model", "nano", "--steps", "2", "--seq-len", "16", "--batch-size", "8", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-tensorboard"]  # no samples but in the weights' test


def train(*args, cwd=ROOT, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # cwd may be another folder: runs/ go there
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_each_run_gets_its_own_folder_latest_links_the_newest_and_nothing_is_overwritten(tmp_path, corpus, capsys, monkeypatch):
    # the first and the --overwrite run: python -m train's main in this process, in tmp_path (tests/runs.py's
    # train_main: a subprocess spent seconds importing jax and the trainer); the second: a process of its own
    monkeypatch.chdir(tmp_path)
    assert train_main([*TINY, "--data", corpus]) == 0
    first = capsys.readouterr()
    time.sleep(1.1)  # folders are named by the second
    second = train(*TINY, "--data", str(corpus), "--steps", "3", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if p.name != "latest")
    assert len(runs) == 2 and (tmp_path / "runs" / "latest").resolve() == runs[1].resolve()
    assert [json.loads((r / "summary.json").read_text())["steps"] for r in runs] == [2, 3]
    for r in runs:  # the weights of each run, saved at its end and named in its last line
        assert (r / "model.safetensors").exists()
        assert not (r / "samples.txt").exists()  # --sample-tokens 0: no sample written or printed
    assert f"model.safetensors in {runs[1].relative_to(tmp_path)}" in second.stderr.splitlines()[-1]
    assert "samples.txt" not in second.stderr.splitlines()[-1]
    assert "=== step" not in first.out + first.err + second.stdout + second.stderr

    before = {p.name: p.stat().st_mtime_ns for p in runs[0].iterdir()}
    # refused by python -m train's checks, run in this process (tests/test_train.py's ``refused``: exit 2, one line)
    again = refused([*TINY, "--data", str(corpus), "--out", str(runs[0])], capsys)
    assert "holds an earlier run" in again and "--overwrite" in again, again
    assert {p.name: p.stat().st_mtime_ns for p in runs[0].iterdir()} == before  # untouched
    (runs[0] / "notes.txt").write_text("mine")
    assert train_main([*TINY, "--data", corpus, "--out", runs[0], "--overwrite", "--steps", "1"]) == 0
    assert json.loads((runs[0] / "summary.json").read_text())["steps"] == 1
    assert (runs[0] / "notes.txt").read_text() == "mine"  # only the run's own files are replaced
    assert (tmp_path / "runs" / "latest").resolve() == runs[1].resolve()  # --out runs do not move the link


def test_weights_at_the_end_load_into_the_model(tmp_path, corpus, capsys):
    from train.model import GPT, MODEL_PRESETS

    out = tmp_path / "run"
    capsys.readouterr()
    code = train_main([*TINY, "--sample-tokens", "4", "--data", corpus, "--out", out, "--ckpt-every", "1", "--keep", "1"])
    said = capsys.readouterr()  # in this process (tests/runs.py's train_main)
    res = types.SimpleNamespace(stdout=said.out, stderr=said.err)
    assert code == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # checkpoint 1 was saved, then deleted by --keep 1: the summary lists what is on disk
    assert summary["weights"] == str(out / "model.safetensors") and summary["checkpoints"] == [str(out / "checkpoints" / "2")]
    assert "step 1: saving checkpoint" in res.stderr and not (out / "checkpoints" / "1").exists()
    last = res.stderr.strip().splitlines()[-1]
    for name in ("metrics.jsonl", "summary.json", "config.toml", "samples.txt", "checkpoints/", "model.safetensors"):
        assert name in last, last
    assert "=== step 2: 4 bytes after" in res.stdout + res.stderr and (out / "samples.txt").exists()  # test 1: none with 0
    assert "step 2: saving checkpoint" in res.stderr
    # the first save's time (its compile) is reported apart and left out of the throughput
    assert "step 1: saving checkpoint" in res.stderr and "this first save held the loop" in res.stderr
    assert 0 < summary["first_save_s"] <= summary["save_s"] < summary["train_s"]
    # the exported weights are the checkpoint's parameters
    cfg = MODEL_PRESETS["nano"].__class__(**{**summary["model"]["config"]})
    model = zshard.load_params(out / "model.safetensors", GPT(cfg, rngs=nnx.Rngs(1)))
    from train.cli import parse_config
    from train.job import make_optimizer

    run = parse_config([*TINY, "--data", str(corpus)])[0]
    state, _ = zshard.restore(out / "checkpoints", zshard.make_mesh(1, 8), model=lambda: GPT(cfg, rngs=nnx.Rngs(0)),
                              tx=make_optimizer(run)[0])
    want = nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()
    got = nnx.state(model, nnx.Param).to_pure_dict()
    import jax

    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_ctrl_c_while_compiling_exits_130_with_one_line_and_writes_nothing(tmp_path, corpus):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "train", *TINY, "--model", "small", "--data", str(corpus), "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()  # printed after validation, before the state is built and compiled
        assert "python -m train: small GPT" in first, first
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    # one line, no blank line before it in a log (only a terminal gets a line break first)
    assert err.splitlines() == ["python -m train: interrupted before training started; nothing was written"], err[-3000:]
    assert not out.exists()


def test_config_errors_are_one_line(tmp_path, capsys):
    # python -m train's checks in this process (tests/test_train.py's ``refused``: exit 2, one line starting
    # "python -m train: error: "); a process's whole stderr being that one line, jax imported and the devices
    # made: tests/test_train.py's test_empty_data_file_is_refused
    for args, needle in [(["--steps", "ten"], "expected an integer, got 'ten'"), (["--mesh", "3x3"], "'3x3' is 3x3 = 9 devices"),
                         (["--sample-tokens", "-1"], "logging.sample_tokens (--sample-tokens): must be >= 0")]:  # 0: no samples
        err = refused([*args, "--out", str(tmp_path / "run")], capsys)
        assert needle in err and not (tmp_path / "run").exists(), err


def test_too_few_devices_names_the_emulation_switch(tmp_path):
    """On one CPU device the mesh error tells how to emulate more, and that way works (docs/main-job.md)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")

    def python(script):
        return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    one = python("import jax, zshard\nassert len(jax.devices()) == 1\nzshard.make_mesh(2, 4)\n")
    assert one.returncode == 1, one.stderr[-2000:]
    assert 'Only 1 device(s) here: for 8 emulated CPU devices call jax.config.update("jax_num_cpu_devices", 8)' in one.stderr
    eight = python("import jax\njax.config.update('jax_num_cpu_devices', 8)\nimport zshard\nprint(dict(zshard.make_mesh(2, 4).shape))\n")
    assert eight.returncode == 0 and "{'replica': 2, 'shard': 4}" in eight.stdout, eight.stderr[-2000:]


def test_data_folder_is_its_files_in_sorted_order(tmp_path):
    from train import data

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"third")
    (tmp_path / "a.txt").write_bytes(b"first ")
    (tmp_path / "b" / "a.md").write_bytes(b"second ")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x").write_bytes(b"hidden")
    assert data.load_corpus(tmp_path).tobytes() == b"first second third"
    (tmp_path / "empty").mkdir()
    import pytest

    with pytest.raises(ValueError, match="holds no file with text in it"):
        data.load_corpus(tmp_path / "empty")

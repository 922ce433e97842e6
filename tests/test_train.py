"""The main job, `python -m train`, end to end in a subprocess (its own 8 emulated devices)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT


def run(tmp_path, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)




def test_train_writes_metrics_summary_and_report(tmp_path, corpus):
    out = tmp_path / "run"
    res = run(tmp_path, "--model", "nano", "--steps", "30", "--seq-len", "32", "--batch-size", "16", "--mesh", "2x4",
              "--strategy", "HYBRID_SHARD", "--data", str(corpus), "--eval-every", "15", "--report", "--grad-accum", "2", "--sample-tokens", "0",
              "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and "eval_loss" in lines[0]
    steps = [rec for rec in lines if "loss" in rec]
    assert [rec["step"] for rec in steps] == list(range(1, 31))
    assert all({"loss", "grad_norm", "tokens_per_s"} <= rec.keys() for rec in steps)
    assert [rec["step"] for rec in lines if "eval_loss" in rec] == [0, 15, 30]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "HYBRID_SHARD" and summary["grad_accum"] == 2
    assert set(summary["per_device_bytes"]) == {"argument", "output", "temp", "alias"}
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    report = summary["report"]
    assert set(report["per_device_bytes"]) == {"argument", "output", "temp", "alias"}
    assert {"measured", "formula"} <= set(report["model_state_bytes"])
    for axis in ("shard", "replica"):
        assert {"measured", "formula"} <= set(report["comm_bytes_per_step"][axis])
        assert abs(report["comm_bytes_per_step"][axis]["ratio"] - 1) <= 0.01


def refused(argv: list[str], capsys) -> str:
    """Steps 1-2 of ``python -m train`` (train/__main__.py, train.trainer.start) in this process: the
    flags, the device count and the checks, which must end in ``SystemExit(2)`` and one line on
    stderr before anything is compiled; returns that line. (A subprocess per case spent about 2.6 s
    of CPU importing the trainer; the process's exit status 2 for bad input:
    test_empty_data_file_is_refused below and tests/test_main_job.py.)"""
    from train.cli import device_count, parse_config  # noqa: PLC0415
    from train.job import validate  # noqa: PLC0415

    with pytest.raises(SystemExit) as e:
        cfg, config_path = parse_config(argv)
        device_count(cfg, argv, config_path)
        validate(cfg)
    err = capsys.readouterr().err
    assert e.value.code == 2, err[-2000:]
    assert err.startswith("python -m train: error: ") and len(err.strip().splitlines()) == 1, err[-2000:]
    return err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--mesh", "3x3"], "(--mesh): '3x3' is 3x3 = 9 devices"),
        (["--batch-size", "12"], "(--batch-size): 12 does not divide by the 8 devices"),
        (["--strategy", "foo"], "unknown strategy 'foo'"),
        (["--zero-stage", "5"], "zero_stage=5; choose 0, 1, 2 or 3"),
        (["--data", "/nonexistent/file.txt"], "/nonexistent/file.txt"),
        (["--model", "huge"], "invalid choice: 'huge'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_input_fails_before_compiling_and_writes_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    err = refused(["--out", str(out), *args], capsys)
    assert needle in err, err[-2000:]
    assert not out.exists()


def test_empty_data_file_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    res = run(tmp_path, "--data", str(empty), "--out", str(tmp_path / "run"), timeout=120)
    assert res.returncode == 2 and str(empty) in res.stderr
    # the process's whole stderr is one line (nothing jax or its plugins print before it)
    assert res.stderr.startswith("python -m train: error: ") and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "run").exists()

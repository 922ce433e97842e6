"""``--expert X`` (``[mesh] expert``) on ``python -m train`` and ``python -m train.plan``: parsing,
the configuration's round trip, and the refusals before anything compiles.

(The runs that train with the axis need ``zshard.make_mesh(expert=)`` and
``zshard.init(..., expert_parallel=)``: tests/test_expert_cli.py checks what the application
decides; the equality of expert-parallel training with one device is zshard's tests'.)
"""

from __future__ import annotations

import numpy as np
import pytest

from test_config import parse, write
from test_hf import FIXTURES
from train import config as C
from train import job


def test_flag_and_file_set_mesh_expert(tmp_path):
    assert parse(["--expert", "2"]).mesh.expert == 2
    assert parse(["--mesh.expert", "4"]).mesh.expert == 4
    path = write(tmp_path, "[mesh]\nexpert = 2\n")
    assert C.Config.from_dict(C.load_file(path)).mesh.expert == 2
    assert parse([]).mesh.expert is None and parse([]).expert() == 1


def test_expert_axis_counts_devices_and_round_trips(tmp_path):
    cfg = parse(["--expert", "2", "--devices", "8"])
    assert cfg.validate().mesh_shape() == (1, 4, 1)  # 1 x 4 x expert 2 = 8 devices; the batch over all 8
    resolved = cfg.resolved()
    assert resolved.mesh.expert == 2 and resolved.mesh.shape == "1x4"
    again = C.Config.from_dict(C.load_file(write(tmp_path, C.dumps_toml(resolved), "config.toml")))
    assert again == resolved and again.resolved() == resolved
    assert parse(["--expert", "1"]).resolved().mesh.expert is None  # 1: no axis, written as unset


@pytest.mark.parametrize("argv,needles", [
    (["--expert", "0"], ["mesh.expert", "--expert"]),
    (["--expert", "3"], ["mesh.expert (--expert)", "expert 3 x context 1 x tensor 1 = 3 does not divide 8", "--expert 1, 2, 4 or 8"]),
    (["--mesh", "2x4", "--expert", "2"], ["mesh.shape (--mesh)", "2x4 x expert 2 = 16 devices, but there are 8",
                                          "use a mesh of 8 devices (1x4, 2x2, 4x1 x expert 2)"]),
])
def test_bad_expert_sizes_name_the_key_and_the_fix(argv, needles):
    with pytest.raises(C.ConfigError) as e:
        parse(argv).validate()
    for n in needles:
        assert n in str(e.value), str(e.value)


def _refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        job.validate(parse(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_dense_model_with_expert_axis_is_refused_naming_the_fix(capsys, tmp_path):
    err = _refusal(capsys, ["--model", "nano", "--expert", "2", "--out", str(tmp_path / "run")])
    assert "mesh.expert (--expert) 2: expert=2: GPTConfig has no experts" in err, err
    assert "use expert=1 (--expert 1), or train a mixture of experts" in err, err
    assert not (tmp_path / "run").exists()


def test_expert_count_not_divided_is_refused(capsys, tmp_path):
    # the fixture's Qwen3-MoE has 4 experts: 8 expert devices cannot each hold whole experts
    tokens = tmp_path / "seq.bin"
    (np.arange(4000) % 97).astype(np.uint16).tofile(tokens)
    err = _refusal(capsys, ["--init-from", str(FIXTURES / "qwen3_moe"), "--data", str(tokens), "--vocab-size", "100",
                            "--expert", "8", "--batch-size", "8", "--seq-len", "8", "--out", str(tmp_path / "run")])
    assert "mesh.expert (--expert) 8: expert=8 does not divide the experts (n_experts = 4)" in err, err
    assert "use expert = 2, 4" in err, err


def test_strategy_without_expert_support_is_one_line(capsys, tmp_path):
    """``--strategy NO_SHARD --expert 2``: zshard.init's refusal (before compiling) as one line naming
    ``--strategy``, not a traceback (python -m train's main in this process)."""
    from runs import train_main  # noqa: PLC0415

    tokens = tmp_path / "seq.bin"
    (np.arange(4000) % 97).astype(np.uint16).tofile(tokens)
    with pytest.raises(SystemExit) as e:
        train_main(["--init-from", FIXTURES / "qwen3_moe", "--data", tokens, "--vocab-size", "100", "--mesh", "1x4",
                    "--expert", "2", "--strategy", "NO_SHARD", "--batch-size", "8", "--seq-len", "8", "--steps", "1",
                    "--out", tmp_path / "run"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m train: error: strategy (--strategy) NO_SHARD") and "use FULL_SHARD" in last, err[-2000:]
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,want", [
    (["--model", "llama-1b", "--mesh", "1x4", "--expert", "2"],
     "--expert 2 (--model llama-1b): expert=2: LlamaConfig has no experts"),
    (["--model", "qwen3-30b-a3b", "--mesh", "1x1", "--expert", "3"],
     "--expert 3 (--model qwen3-30b-a3b): expert=3 does not divide the experts (n_experts = 128)"),
    (["--model", "qwen3-30b-a3b", "--mesh", "1x4", "--expert", "0"], "--expert 0: must be a positive number of devices"),
    (["--model", "deepseek-v3", "--mesh", "1x2", "--expert", "2", "--batch-size", "2"],
     "--batch-size 2 must divide by the 4 data devices of the 1x2, expert 2 mesh"),
    (["--model", "qwen3-30b-a3b", "--mesh", "1x2", "--expert", "2", "--peer"], "without --tensor / --context / --expert"),
    (["--model", "qwen3-30b-a3b", "--mesh", "1x2x2", "--expert", "2"], "expert=2 with tensor=2 is not supported"),
    (["--model", "qwen3-30b-a3b", "--mesh", "1x2", "--expert", "2", "--context", "2"], "(here: the flags --expert"),
])
def test_plan_refuses_before_compiling(capsys, argv, want):
    """``python -m train.plan --expert X`` (in this process: argparse exits with status 2, nothing compiled)."""
    from train import plan  # noqa: PLC0415

    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and want in err, err[-1000:]

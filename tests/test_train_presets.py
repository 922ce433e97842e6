"""``python -m train --model`` with the zoo presets (``train.model.PLAN_PRESETS``, the plan's models), and the
``command`` the plan search prints for them (issue 51).

1. Every zoo preset is a model of ``python -m train`` (``Config.model_config``: its class and its own
   vocabulary); ``--vocab-size`` above that vocabulary is refused in one line naming the flag and the value.
2. The search's best candidate for ``llama-1b`` (shrunk in width and depth here, its 32000-token vocabulary
   kept, so that it trains in seconds on the 8 emulated devices) runs as printed, as ``python -m train``'s
   ``main`` in this process: its flags parsed by train's own parser, two steps trained on bytes;
   ``python -m train.sample`` reads the run's model, and prints a token id >= 256 as ``?``.
3. Every candidate's command of a search on an H100 profile (mixed precision, fewer devices than
   ``python -m train``'s default 8) parses and validates with train's parser and ``Config.validate``.
4. ``plan_prediction``'s ``micro_batch`` splits the batch over the expert axis too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import types

import jax
import numpy as np
import pytest
from flax import nnx

from runs import train_main
from test_config import parse
from train import config as C
from train import sample
from train.cli import build_parser
from train.model import MODEL_PRESETS, PLAN_PRESETS, MoEConfig
from train.planning.profiles import load_profile
from train.planning.search import search
from train.planning.single import plan_prediction

SMALL = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
"""llama-1b's width and depth for a run of seconds; its vocabulary (32000), RoPE and scan stay the preset's."""

QUICK = ["--steps", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "4", "--no-tensorboard"]


def test_every_zoo_preset_is_a_model_of_python_m_train():
    for name, cfg in PLAN_PRESETS.items():
        run = parse(["--model", name, "--seq-len", "64"]).validate()
        mc = run.model_config()
        assert type(mc) is type(cfg) and mc.vocab_size == cfg.vocab_size and mc.seq_len == 64 and mc.scan == cfg.scan, name
        assert run.resolved().model.scan == cfg.scan
    doc = C.field_docs(C.ModelConfig)["preset"]  # --model's --help lists them all
    assert all(name in doc for name in [*MODEL_PRESETS, *PLAN_PRESETS]), doc
    # a token file of a vocabulary up to the preset's fits under it (the model keeps its own)
    assert parse(["--model", "llama-1b", "--vocab-size", "32000"]).validate().model_config().vocab_size == 32000
    assert parse(["--model", "tiny", "--vocab-size", "300"]).validate().model_config().vocab_size == 300  # a trainer preset takes it


def test_vocab_size_above_the_zoo_presets_is_one_line(tmp_path, capsys):
    tokens = tmp_path / "tokens.bin"
    (np.arange(4000) % 97).astype(np.uint16).tofile(tokens)
    with pytest.raises(SystemExit) as e:
        train_main(["--model", "llama-1b", "--data", tokens, "--vocab-size", "50257", "--out", tmp_path / "run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("python -m train: error: data.vocab_size (--vocab-size): 50257 > the vocabulary of model.preset "
                          "'llama-1b' (32000)"), err
    assert not (tmp_path / "run").exists()


def test_search_command_of_a_zoo_preset_trains_and_samples(monkeypatch, tmp_path, corpus, capsys):
    monkeypatch.setitem(PLAN_PRESETS, "llama-1b", dataclasses.replace(PLAN_PRESETS["llama-1b"], **SMALL))
    cfg = dataclasses.replace(PLAN_PRESETS["llama-1b"], seq_len=16)
    profile = load_profile("cpu")
    best = search(cfg, model="llama-1b", devices=8, seq=16, batch=8, profile=profile, budget=profile.hbm_bytes,
                  log=lambda *a: None)["candidates"][0]
    argv = shlex.split(best["command"])
    assert argv[:3] == ["python", "-m", "train"] and best["fits"]
    out = tmp_path / "run"
    assert train_main([*argv[3:], *QUICK, "--data", corpus, "--out", out]) == 0, capsys.readouterr().err[-3000:]
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["name"] == "llama-1b Llama" and summary["model"]["preset"] == "llama-1b"
    assert summary["model"]["config"]["vocab_size"] == 32000 and summary["steps_done"] == 2
    assert summary["strategy"] == best["strategy"] and math.prod(summary["mesh"].values()) == 8
    assert "=== step 2: 4 bytes after" in (out / "samples.txt").read_text()
    # python -m train.sample's model of the run: the zoo model (its 32000 tokens) from config.toml, whose weights
    # model.safetensors holds (decoding it: tests/test_sample.py; its ids >= 256 as "?": the test below)
    source = sample.read_source(out)
    assert source.byte_level and source.cfg == dataclasses.replace(cfg, seq_len=16) and source.seq_len == 16
    params = sum(x.size for x in jax.tree.leaves(nnx.state(source.make_model(), nnx.Param)))
    assert params == summary["num_params"]


def test_sample_prints_a_token_beyond_the_bytes_as_a_question_mark():
    source = types.SimpleNamespace(byte_level=True)
    assert sample._render(source, [*b"hi ", 300, 31999, *"é".encode()]) == "hi ??é"
    assert sample._render(types.SimpleNamespace(byte_level=False), [300, 5]) == "300 5"


def test_search_commands_parse_with_trains_parser():
    """A GPU profile: the search's bf16 compute is carried (--param-dtype bfloat16 --reduce-dtype float32), and a mesh of
    4 devices carries --devices 4 (python -m train's default is 8); every flag is python -m train's."""
    cfg = PLAN_PRESETS["qwen3-30b-a3b"]
    profile = load_profile("h100")
    import zshard  # noqa: PLC0415

    mp = zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")
    parser = build_parser()
    for devices in (4, 16):
        cands = search(cfg, model="qwen3-30b-a3b", devices=devices, seq=1024, batch=16, profile=profile, budget=profile.hbm_bytes,
                       mixed_precision=mp, log=lambda *a: None)["candidates"]
        assert any(c["mesh"]["expert"] > 1 for c in cands)
        for c in cands:
            argv = shlex.split(c["command"])
            run = parser.parse_args(argv[3:]).run  # an unknown flag: SystemExit
            assert (f"--devices {devices}" in c["command"]) and run.mesh.devices == devices
            assert run.training.param_dtype == "bfloat16" and run.training.reduce_dtype == "float32"
            assert run.model.preset == "qwen3-30b-a3b" and run.training.batch_size == 16 and run.model.seq_len == 1024
            run.validate()  # the mesh fills the devices, the batch divides, the strategy takes the expert axis
            assert run.strategy() == c["strategy"] and run.training.grad_accum == c["accumulation"]


def test_plan_prediction_micro_batch_splits_over_the_expert_axis():
    """A 1x4 mesh with expert 2 and a batch of 8: 8 / (1 x 4 x 2) = 1 sequence per device (the rows split over
    replica x shard x expert, as train/planning/search.py's candidates and python -m train's batch check)."""
    cfg = MoEConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, n_experts=4, top_k=2,
                    d_expert=16, scan=True)
    rep = types.SimpleNamespace(remat="block", grad_accum=1, strategy="FULL_SHARD", collectives=[],
                                model_state_bytes={"measured": {"total": 1e6}})
    for accum, batch in ((1, 8), (2, 16)):
        rep.grad_accum = accum
        got = plan_prediction(rep, cfg, model="qwen3-30b-a3b", target="cpu", mesh_shape={"replica": 1, "shard": 4, "expert": 2},
                              batch=batch, seq=16, peak_bytes=1.0, budget_bytes=2.0)
        assert got["micro_batch"] == 1 and got["accumulation"] == accum, got
        assert "--expert 2" in got["command"] and "--devices" not in got["command"]  # 1 x 4 x expert 2 = python -m train's 8

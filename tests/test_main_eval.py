"""``python -m train`` evaluates and samples on the sharded state, and fine-tunes Hugging Face
checkpoints (``--init-from``). Each run is ``python -m train``'s main in this process, on its 8 emulated
devices (tests/runs.py's ``train_main``: a subprocess per run spent seconds importing jax and the trainer;
the process and its exit status: tests/test_train.py, tests/test_main_job.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import optax
from safetensors.numpy import load_file, save_file

import zshard
from conftest import ROOT, rel_l2
from runs import train_main
from test_train import refused
from train import data
from train.model import cross_entropy_loss, from_hf

FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def test_eval_and_sampling_fit_a_bound_the_whole_model_exceeds(tmp_path, corpus):
    out = tmp_path / "run"
    assert train_main(["--model", "tiny", "--steps", "2", "--seq-len", "32", "--batch-size", "16", "--mesh", "1x8",
                       "--data", corpus, "--eval-every", "2", "--eval-batches", "1", "--sample-every", "2",
                       "--sample-tokens", "20", "--prefetch", "0", "--out", out]) == 0
    summary = json.loads((out / "summary.json").read_text())
    model, ev = summary["model_bytes"], summary["eval_per_device_bytes"]
    assert model == 4 * summary["num_params"]
    # the sharded eval step holds its shards, one unit at a time and activations: the whole
    # model alone (what an unsharded evaluation takes as arguments) exceeds it
    assert ev["argument"] + ev["temp"] + ev["output"] < model, (ev, model)
    samples = (out / "samples.txt").read_text()
    assert "=== step 2: 20 bytes after" in samples


def test_init_from_hf_checkpoint(tmp_path, corpus):
    out = tmp_path / "run"
    args = ["--init-from", str(FIXTURES / "gpt2"), "--steps", "2", "--seq-len", "32", "--batch-size", "16",
            "--mesh", "2x4", "--strategy", "HYBRID_SHARD", "--data", str(corpus), "--eval-every", "2",
            "--eval-batches", "2", "--sample-every", "2", "--sample-tokens", "40", "--lr", "1e-3", "--out", str(out)]
    assert train_main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["init_from"] == str(FIXTURES / "gpt2") and summary["model"]["config"]["qkv_bias"] is True
    # the model trained is the checkpoint's, not the default preset
    assert summary["model"]["preset"] is None and summary["model"]["model_type"] == "gpt2"
    # the initial eval loss is that of the checkpoint's weights on the held-out batches
    _, held_out = data.split_corpus(data.load_corpus(str(corpus)))
    builder, weights = from_hf(FIXTURES / "gpt2")
    state = zshard.init(builder, optax.sgd(0.0), zshard.make_mesh(1, 8), params=weights)
    step = zshard.make_eval_step(cross_entropy_loss)
    want = np.mean([float(step(state, b)["loss"]) for b in data.eval_batches(held_out, 16, 32, 2)])
    assert rel_l2(summary["initial_eval_loss"], want) < 1e-5, (summary["initial_eval_loss"], want)
    assert "=== step 2: 40 bytes after" in (out / "samples.txt").read_text()  # 16-byte prompt + 40 > 32: two chunks


def test_init_from_small_vocab_refused(tmp_path, capsys):
    small = tmp_path / "small"
    shutil.copytree(FIXTURES / "gpt2", small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(dict(cfg, vocab_size=100)))
    tensors = load_file(small / "model.safetensors")  # a consistent checkpoint: its embedding has 100 rows
    save_file(dict(tensors, **{"transformer.wte.weight": tensors["transformer.wte.weight"][:100]}), small / "model.safetensors")
    # python -m train's checks in this process (tests/test_train.py's ``refused``: exit 2, one line)
    err = refused(["--init-from", str(small), "--out", str(tmp_path / "run")], capsys)
    assert "vocab_size is 100; the byte-level data needs >= 256 tokens" in err, err
    assert not (tmp_path / "run").exists()
    err = refused(["--init-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")], capsys)
    assert f"{str(tmp_path / 'nowhere')!r}: does not exist" in err, err

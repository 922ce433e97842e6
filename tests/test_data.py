"""Pre-tokenised token files for ``python -m train --data`` (nanoGPT layout): ``.bin`` of raw
uint16 / uint32 tokens and ``.npy`` 1-D arrays, with ``--vocab-size`` (train/data.py).

In-process: loading (memory-mapped, every dtype and suffix), the Grain batches over a memmap
(processes' rows make the global batch) and every bad input's one-line error through
``python -m train``'s own checks (``validate``), nothing written. Runs of the nano model (``python -m
train``'s main in this process): a token file trains with its vocabulary, and resume after a checkpoint
is bitwise."""

from __future__ import annotations

import json
import math
import shutil
import types

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT
from runs import train_main
from train import data
from train.output import format_sample

SMALL = ["--model", "nano", "--seq-len", "16", "--batch-size", "8", "--mesh", "1x8", "--eval-batches", "1",
         "--sample-tokens", "6", "--no-tensorboard"]


def write_tokens(path, tokens: np.ndarray, dtype: str):
    """``tokens`` as nanoGPT writes them: raw ``.bin`` (``tofile``) or ``np.save`` for ``.npy``."""
    arr = np.asarray(tokens).astype(dtype)
    if path.suffix == ".npy":
        np.save(path, arr)
    else:
        arr.tofile(path)
    return path


def pattern(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Learnable tokens: a random walk of +1 steps with random restarts, every id in ``[0, vocab)``,
    including the top ones (so a uint32 file has ids above 65535)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab, n)
    restart = rng.random(n) < 0.1
    out = np.empty(n, np.int64)
    cur = vocab - 1
    for i in range(n):
        cur = starts[i] if restart[i] else (cur + 1) % vocab
        out[i] = cur
    return out


@pytest.mark.parametrize("suffix,dtype", [(".bin", "uint16"), (".bin", "uint32"), (".npy", "uint16"), (".npy", "uint32")])
def test_token_files_are_memory_mapped_with_their_dtype(tmp_path, suffix, dtype):
    vocab = 70_000 if dtype == "uint32" else 5_000
    tokens = pattern(2_000, vocab)
    assert dtype == "uint16" or tokens.max() > 65_535  # uint32: ids above 65535 are in the file
    path = write_tokens(tmp_path / f"t{suffix}", tokens, dtype)
    got = data.load_data(path, vocab_size=vocab, token_dtype=dtype if suffix == ".bin" else None)
    assert isinstance(got, np.memmap) and got.dtype == np.dtype(dtype) and got.shape == (2_000,)
    np.testing.assert_array_equal(got, tokens)
    train_part, held_out = data.split_corpus(got)
    assert isinstance(train_part, np.memmap) and len(held_out) == 200
    data.check_split(train_part, held_out, seq_len=16, source="t")
    inputs, targets = data.train_dataset(train_part, batch_size=8, seq_len=16, seed=0)[3]
    assert inputs.dtype == np.int32 and inputs.shape == (8, 16)
    for row_in, row_t in zip(inputs, targets):  # each row is a window of the file, shifted by one
        k = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens[:1800], 16) == row_in, axis=1))[0])
        np.testing.assert_array_equal(row_t, tokens[k + 1 : k + 17])


def test_bin_defaults_to_uint16_as_nanogpt(tmp_path):
    path = write_tokens(tmp_path / "train.bin", np.arange(100) % 50, "uint16")
    got = data.load_tokens(path, vocab_size=50)
    assert got.dtype == np.uint16 and len(got) == 100


def test_processes_rows_of_a_token_file_make_the_global_batch(tmp_path):
    """Each process reads its rows of every global batch from the memmap (ShardByJaxProcess's index/count)."""
    tokens = data.load_tokens(write_tokens(tmp_path / "t.bin", pattern(3_000, 1_000), "uint16"), 1_000)
    whole = data.train_dataset(tokens, 8, 16, seed=1)
    halves = [data.train_dataset(tokens, 8, 16, seed=1, process_index=p, process_count=2) for p in range(2)]
    for i in (0, 5, 40):  # 40: a later epoch (186 windows / 8 per batch)
        for j in range(2):  # inputs, targets
            np.testing.assert_array_equal(np.concatenate([h[i][j] for h in halves]), whole[i][j])


def _validate(argv):
    """``python -m train``'s checks before compiling, in this process: its one-line error (exit 2) or ``None``."""
    from train.cli import parse_config
    from train.job import validate

    try:
        validate(parse_config(argv)[0])
    except SystemExit as e:
        assert e.code == 2
        return True
    return None


@pytest.mark.parametrize(
    "name,tokens,dtype,args,needles",
    [
        ("t.bin", np.arange(500) % 300, "uint16", [],
         ["--data '{path}' is a token file (.bin): give its vocabulary with --vocab-size N"]),
        ("t.bin", np.arange(501) % 300, "uint8", ["--vocab-size", "300"],
         ["--data '{path}': 501 bytes is not a multiple of 2 (--token-dtype uint16)", "pass --token-dtype uint32"]),
        ("t.bin", np.arange(1000) % 300, "uint32", ["--vocab-size", "300", "--token-dtype", "uint32"], None),
        ("t.bin", np.arange(1000) % 300, "uint32", ["--vocab-size", "300"],  # uint32 read as the default uint16
         ["--data '{path}': read as uint16 (the default), every second token is 0", "pass --token-dtype uint32"]),
        ("t.bin", np.arange(500) % 301, "uint16", ["--vocab-size", "300"],
         ["--data '{path}': token 300 at index 300 is >= --vocab-size 300", "(at least 301)"]),
        ("t.npy", np.arange(500) % 301, "uint32", ["--vocab-size", "300"], ["token 300 at index 300 is >= --vocab-size 300"]),
        ("t.bin", np.arange(500) % 300, "uint16", ["--vocab-size", "70000"],
         ["--vocab-size 70000: --data '{path}' holds uint16 tokens (0..65535)", "--token-dtype uint32"]),
        ("t.npy", np.arange(500) % 300, "uint16", ["--vocab-size", "70000"], ["--vocab-size 70000: --data '{path}' holds uint16 tokens"]),
        ("t.npy", np.arange(500).reshape(20, 25) % 300, "uint16", ["--vocab-size", "300"],
         ["--data '{path}': holds an array of dtype uint16 and shape (20, 25)", "1-D uint16 or uint32 array"]),
        ("t.npy", np.arange(500) % 300, "int64", ["--vocab-size", "300"], ["holds an array of dtype int64 and shape (500,)"]),
        ("t.npy", np.arange(500) % 300, "uint32", ["--vocab-size", "300", "--token-dtype", "uint16"],
         ["--token-dtype uint16: --data '{path}' holds uint32 tokens", "drop --token-dtype"]),
        ("t.bin", np.zeros(0), "uint16", ["--vocab-size", "300"], ["--data '{path}': the file holds no token"]),
        ("t.txt", np.frombuffer(b"plain text " * 100, np.uint8), "uint8", ["--vocab-size", "300"],
         ["--vocab-size 300: --data '{path}' is read as bytes (vocabulary 256)", "drop --vocab-size"]),
        ("t.txt", np.frombuffer(b"plain text " * 100, np.uint8), "uint8", ["--token-dtype", "uint32"],
         ["--token-dtype uint32: --data '{path}' is read as bytes", "drop --token-dtype"]),
        ("t.bin", np.arange(500) % 300, "uint16", ["--vocab-size", "300", "--prompt", "hello"],
         ["logging.prompt: --prompt 'hello': with a token file the prompt is token ids", "0..299"]),
        ("t.bin", np.arange(500) % 300, "uint16", ["--vocab-size", "300", "--prompt", "5 300"], ["--prompt '5 300'"]),
        ("t.bin", np.arange(500) % 300, "uint16", ["--vocab-size", "300", "--token-dtype", "int8"],
         ["data.token_dtype (--token-dtype): invalid choice: 'int8'"]),
        ("t.bin", np.arange(500) % 300, "uint16", ["--vocab-size", "1"], ["data.vocab_size (--vocab-size): must be >= 2"]),
    ],
)
def test_bad_token_input_is_one_line_naming_the_file_and_the_fix(tmp_path, capsys, name, tokens, dtype, args, needles):
    path = write_tokens(tmp_path / name, tokens, dtype)
    out = tmp_path / "run"
    failed = _validate(["--data", str(path), "--seq-len", "16", "--out", str(out), *args])
    err = capsys.readouterr().err
    if needles is None:  # the control: the same file, read right, passes
        assert failed is None, err
        return
    assert failed, "no error"
    assert len(err.strip().splitlines()) == 1 and err.startswith("python -m train: error: "), err
    for needle in needles:  # the file (where it is at fault), the flag and the fix
        assert needle.replace("{path}", str(path)) in err, err
    assert not out.exists()


def test_token_prompt_and_sample_text():
    assert data.parse_token_prompt("464, 2068 7586", 50257) == [464, 2068, 7586]
    text = format_sample(3, [464, 2068], [70_001, 5], 0.8, byte_level=False)
    assert text.splitlines() == ["=== step 3: 2 tokens after a 2-token prompt, temperature 0.8 (token ids) ===",
                                 "prompt: 464 2068", "sample: 70001 5"]
    text = format_sample(3, list(b"ab"), [ord("c"), 300], 0.8, byte_level=True)
    assert text.splitlines()[1] == "abc?"


def train(capfd, *args):
    """``python -m train``'s main in this process (tests/runs.py's ``train_main``; a subprocess per run spent
    seconds importing jax and the trainer): its exit status and what it wrote on stderr."""
    capfd.readouterr()
    code = train_main(list(args))
    return types.SimpleNamespace(returncode=code, stderr=capfd.readouterr().err)


def _assert_trained_with_vocabulary(res, out, vocab: int, steps: int):
    """A finished ``python -m train`` run on a token file of ``vocab`` ids (6,000 tokens, ``SMALL``)."""
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["config"]["vocab_size"] == vocab
    assert summary["data"]["vocab_size"] == vocab and summary["data"]["train_tokens"] == 5_400 and "train_bytes" not in summary["data"]
    # a fresh model's loss over V tokens is about ln V (2.5 for 12 and 11.2 for 70000: the vocabulary is the file's)
    assert abs(summary["initial_eval_loss"] - math.log(vocab)) < 0.5, (summary["initial_eval_loss"], math.log(vocab))
    weights = load_file(out / "model.safetensors")
    assert any(w.shape[0] == vocab and w.ndim == 2 for k, w in weights.items() if "wte" in k), {k: w.shape for k, w in weights.items()}
    lines = (out / "samples.txt").read_text().splitlines()
    assert lines[0] == f"=== step {steps}: 6 tokens after a 8-token prompt, temperature 0.8 (token ids) ==="
    prompt, sample = (list(map(int, line.split(": ")[1].split())) for line in lines[1:3])
    assert len(prompt) == 8 and len(sample) == 6 and all(0 <= t < vocab for t in prompt + sample)
    assert "nats/token" in res.stderr.splitlines()[-1]


def test_token_file_trains_with_its_vocabulary(tmp_path, capfd):
    """A .bin of uint32 ids above 65535 (--token-dtype): the model's vocabulary is the file's. (A .npy
    of uint16 ids, vocabulary 300: test_token_file_resume_is_bitwise's first run, one run fewer.)"""
    vocab = 70_000
    path = write_tokens(tmp_path / "tokens.bin", pattern(6_000, vocab), "uint32")
    out = tmp_path / "run"
    # 2 steps, not 6: nothing asserted depends on the count (the vocabulary, the initial eval loss, the
    # weights' shape, the final sample), and a step of a 70,000-token vocabulary runs 0.8 s of CPU
    res = train(capfd, *SMALL, "--steps", "2", "--lr", "0.01", "--eval-every", "0", "--data", str(path), "--vocab-size", str(vocab),
                "--token-dtype", "uint32", "--out", str(out))
    _assert_trained_with_vocabulary(res, out, vocab, 2)


def _losses(out):
    return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_token_file_resume_is_bitwise(tmp_path, capfd):
    """8 steps straight (checkpoints 4 and 8) == the same run resumed from checkpoint 4: the same
    metrics.jsonl losses bit for bit (the Grain iterator's position comes back from the checkpoint).
    The file is a .npy of uint16 ids, vocabulary 300: the first run is also the .npy case of
    test_token_file_trains_with_its_vocabulary (the model's vocabulary is the file's)."""
    path = write_tokens(tmp_path / "tokens.npy", pattern(6_000, 300), "uint16")
    out = tmp_path / "run"
    args = [*SMALL, "--steps", "8", "--lr", "0.01", "--eval-every", "4", "--data", str(path), "--vocab-size", "300",
            "--ckpt-every", "4", "--out", str(out)]
    res = train(capfd, *args)
    _assert_trained_with_vocabulary(res, out, 300, 8)
    want = _losses(out)
    assert [s for s, loss, _ in want if loss is not None] == list(range(1, 9))
    shutil.rmtree(out / "checkpoints" / "8")
    res = train(capfd, *args, "--resume", "--sample-tokens", "0")  # the samples: the first run
    assert res.returncode == 0, res.stderr[-3000:]
    assert "continuing from step 4" in res.stderr
    assert _losses(out) == want


def test_init_from_a_checkpoint_needs_room_for_the_token_ids(tmp_path, capsys):
    """--init-from keeps the checkpoint's vocabulary (256 in the fixture); the file's ids must fit in it."""
    from train.cli import parse_config
    from train.job import validate

    path = write_tokens(tmp_path / "t.bin", np.arange(2_000) % 200, "uint16")
    base = ["--init-from", str(ROOT / "tests" / "fixtures" / "hf" / "gpt2"), "--seq-len", "16", "--data", str(path),
            "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit):
        validate(parse_config([*base, "--vocab-size", "300"])[0])
    assert "the checkpoint's vocab_size is 256; --vocab-size 300 needs >= 300 tokens" in capsys.readouterr().err
    setup = validate(parse_config([*base, "--vocab-size", "200"])[0])
    assert setup.cfg.vocab_size == 256 and setup.train_data.dtype == np.uint16

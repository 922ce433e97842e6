"""Every Hugging Face family fine-tunes with ``python -m train --init-from DIR`` and samples.

1. ``python -m train --init-from tests/fixtures/hf/<family>`` on a token-id file (no
   tokenizer): a few steps on a learnable sequence, the training loss falls, the sample and
   the summary are written; the MoE's router loss lands in ``metrics.jsonl``.
2. The KV cache is exact for each family (sliding windows included): prefill + decoding
   steps give the logits of the full forward.
3. Sharded generation (``train.generate.generate``) gives the tokens of the single-device
   ``generate_local`` for each family.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT
from runs import train_main
from test_hf import FAMILIES, FIXTURES, SAME_CLASS, _state, forward, plain_model
from train.generate import generate, generate_local
from train.model import from_hf, init_cache

decode = nnx.jit(lambda model, ids, cache, pos: model(ids, cache=cache, pos=pos))
VOCAB = 128  # every fixture's vocabulary holds it (gpt2 and llama: 256)
# The trainer samples too (its Sample hook, train.generate.continue_tokens on the run's HYBRID_SHARD 2x4 state): the MoE,
# the family most unlike Llama. Gemma's sharded generation on HYBRID_SHARD 2x4 (sliding windows, soft-capping; the
# trainer sampled gemma3 too, a program of its own) is test_sharded_generation_equals_single_device[gemma3]'s, token
# for token against the single-device generate_local.
SAMPLED = {"qwen3_moe": "4"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A learnable token-id file: token t+1 = (token t + 7) mod 97, uint16."""
    path = tmp_path_factory.mktemp("tokens") / "seq.bin"
    ((np.arange(20_000) * 7) % 97).astype(np.uint16).tofile(path)
    return path


# Llama with another configuration (rope scaling, q/k/v biases, a sliding window, qwen3's q/k norms):
# the same fine-tuning path as llama (train.models.Llama); gemma2 is gemma3's (train.models.Gemma, its
# logit soft-capping a configuration). Their numbers are the other tests' in this file and
# tests/test_hf.py; these cases (tests/test_hf.py's SAME_CLASS) are -m exhaustive.


def by_class(names):
    """``names`` as pytest params, the families whose class another family already takes -m exhaustive."""
    return [pytest.param(n, marks=pytest.mark.exhaustive) if n in SAME_CLASS else n for n in names]


@pytest.mark.parametrize("name", by_class(FAMILIES))
def test_init_from_fine_tunes(name, tokens, tmp_path):
    out = tmp_path / "run"
    sample = SAMPLED.get(name, "0")  # "0": no sample; sampling of every family: test_sharded_generation_equals_single_device
    # python -m train's main in this process (tests/runs.py's train_main: a subprocess per family spent seconds
    # importing jax and the trainer; the process and its exit status: tests/test_main_job.py)
    assert train_main(["--init-from", FIXTURES / name, "--data", tokens, "--vocab-size", VOCAB, "--seq-len", "16", "--batch-size", "8",
                       "--steps", "4", "--mesh", "2x4", "--strategy", "HYBRID_SHARD", "--lr", "1e-2", "--eval-every", "4",
                       "--eval-batches", "1", "--sample-every", "4", "--sample-tokens", sample, "--prompt", "3 10 17", "--out", out]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    summary = json.loads((out / "summary.json").read_text())
    if name == "qwen3_moe":  # the router's losses, each expert's share of the routed slots, none dropped
        assert all(r["router_aux_loss"] > 0 and r["router_z_loss"] > 0 for r in steps if "loss" in r)
        assert all(len(r["expert_load"]) == 4 and abs(sum(r["expert_load"]) - 1) < 1e-6 and r["dropped_fraction"] == 0
                   for r in steps if "loss" in r)
        assert summary["moe"]["max_expert_load"] >= 1 and summary["moe"]["dropped_fraction"] == 0
    assert summary["init_from"] == str(FIXTURES / name)
    if sample != "0":
        assert "=== step 4: 4 tokens after a 3-token prompt" in (out / "samples.txt").read_text()
    else:
        assert not (out / "samples.txt").exists()
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cache_matches_full_forward(name):
    ids = np.load(FIXTURES / name / "batch.npy")[:3]  # [3, 8]: longer than the sliding windows (4)
    builder, weights = from_hf(FIXTURES / name)
    model = plain_model(builder, weights)
    full = np.asarray(forward(model, jnp.asarray(ids)))  # [3, 8, V]
    cache = init_cache(builder.config, 3, 8)
    first, cache = decode(model, jnp.asarray(ids[:, :6]), cache, jnp.int32(0))
    steps = [np.asarray(first)]
    for t in (6, 7):
        nxt, cache = decode(model, jnp.asarray(ids[:, t:t + 1]), cache, jnp.int32(t))
        steps.append(np.asarray(nxt))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)


# Sharded generation of a family whose class another family takes (SAME_CLASS) is that family's sharded
# path: their own cache numbers (sliding windows, soft-capping) are test_kv_cache_matches_full_forward's.
# FULL_SHARD 1x8, and gemma3 on HYBRID_SHARD 2x4: the mesh and strategy the trainer's samples run on
# (test_init_from_fine_tunes samples qwen3_moe's; gemma3's is this case, SAMPLED's comment)
GENERATE_MESH = {"gemma3": ("HYBRID_SHARD", 2, 4)}


@pytest.mark.parametrize("name", by_class(FAMILIES))
def test_sharded_generation_equals_single_device(name):
    builder, state, _ = _state(name, *GENERATE_MESH.get(name, ("FULL_SHARD", 1, 8)))
    prompts = np.load(FIXTURES / name / "batch.npy")[:3, :5]
    ref = generate_local(plain_model(*from_hf(FIXTURES / name)), prompts, 4, temperature=0.8, seed=3)
    got = generate(state, prompts, 4, temperature=0.8, seed=3)
    assert got.shape == (3, 4) and got.dtype == np.int32
    np.testing.assert_array_equal(got, ref)


def test_docs_name_every_family():
    """docs/eval-and-hf.md names every fixture family in its table."""
    doc = (ROOT / "docs" / "eval-and-hf.md").read_text()
    for name in FAMILIES:
        assert f"tests/fixtures/hf/{name}" in doc, name

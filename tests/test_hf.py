"""Hugging Face checkpoints into the shards and back (train/hf.py, zshard/weights.py).

Fixtures: tests/fixtures/hf/{gpt2,llama}, tiny random models written by ``transformers``
(tests/fixtures/make_hf_fixtures.py; the Llama one sharded with an index), with the logits
and the loss that ``transformers`` computed on ``batch.npy``. No torch needed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors import safe_open

import zshard
from conftest import reference_run, rel_l2
from train.model import cross_entropy_loss, from_hf, to_hf

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
MESHES = [("FULL_SHARD", 1, 8), ("HYBRID_SHARD", 2, 4)]


def _fixture(name):
    d = FIXTURES / name
    return d, np.load(d / "batch.npy"), np.load(d / "logits.npy"), json.loads((d / "loss.json").read_text())["loss"]


def _tensors(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="numpy") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("strategy,r,s", MESHES, ids=[f"{m[0]}-{m[1]}x{m[2]}" for m in MESHES])
def test_loaded_eval_loss_and_logits_match_transformers(name, strategy, r, s):
    d, ids, logits, loss = _fixture(name)
    builder, weights = from_hf(d)
    calls = {k: 0 for k in weights}

    def counted(k, fn):
        def read():
            calls[k] += 1
            return fn()

        read.shape = fn.shape
        return read

    state = zshard.init(builder, optax.sgd(0.0), zshard.make_mesh(r, s), strategy=strategy,
                        params={k: counted(k, fn) for k, fn in weights.items()})
    assert set(calls.values()) == {1}, "each tensor is read exactly once"
    got = zshard.make_eval_step(cross_entropy_loss)(state, (ids[:, :-1], ids[:, 1:]))
    assert rel_l2(got["loss"], loss) < 1e-5, (float(got["loss"]), loss)
    ours = np.asarray(zshard.unshard(state)(jnp.asarray(ids)))  # test only: the whole tiny model
    np.testing.assert_allclose(ours, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_to_hf_reproduces_tensors_bit_for_bit(name, tmp_path):
    d = FIXTURES / name
    builder, weights = from_hf(d)
    state = zshard.init(builder, optax.sgd(0.0), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD", params=weights)
    out = to_hf(state, tmp_path / "out")
    want, got = _tensors(d), _tensors(out)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # and it reads back as the same architecture
    b2, w2 = from_hf(out)
    assert b2.config == builder.config
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].keys() == want.keys()


def test_finetune_step_matches_single_device():
    d, ids, _, _ = _fixture("llama")
    builder, weights = from_hf(d)
    tx = optax.adamw(1e-2)
    batches = [(ids[:, :-1], ids[:, 1:])] * 2

    def make_ref():
        model = builder()
        flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
        nnx.update(model, nnx.from_flat_state([(p, v.replace(jnp.asarray(weights[".".join(map(str, p))]()))) for p, v in flat]))
        return model

    ref = reference_run(make_ref, tx, cross_entropy_loss, batches)
    state = zshard.init(builder, tx, zshard.make_mesh(2, 4), strategy="HYBRID_SHARD", params=weights)
    step = zshard.make_train_step(cross_entropy_loss)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    for a, b in zip(losses, ref.losses):
        assert rel_l2(a, b) < 1e-5, (losses, ref.losses)
    assert losses[1] < losses[0]


def test_mismatched_weights_named_before_placing():
    builder, weights = from_hf(FIXTURES / "gpt2")
    bad = dict(weights)
    del bad["blocks.0.attn.qkv.bias"]
    bad["blocks.9.extra"] = weights["wpe.embedding"]
    read = []

    def wrong():
        read.append(1)
        return np.zeros((3, 3), np.float32)

    wrong.shape = (3, 3)
    bad["ln_f.scale"] = wrong
    with pytest.raises(ValueError) as e:
        zshard.init(builder, optax.sgd(0.1), zshard.make_mesh(1, 8), params=bad)
    msg = str(e.value)
    assert "blocks.0.attn.qkv.bias: missing, the model's parameter is (96,)" in msg
    assert "blocks.9.extra: extra tensor (32, 32)" in msg
    assert "ln_f.scale: weights give shape (3, 3), the model's parameter is (32,)" in msg
    assert not read, "nothing is read before the check"

    # a callable without .shape is checked when read, before its tensor is placed
    undeclared = dict(weights, **{"ln_f.scale": lambda: np.zeros((4,), np.float32)})
    with pytest.raises(ValueError, match=r"ln_f.scale returned shape \(4,\), the model's parameter is \(32,\)"):
        zshard.init(builder, optax.sgd(0.1), zshard.make_mesh(1, 8), params=undeclared)


def test_from_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes((FIXTURES / "gpt2" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="model_type 'bert'"):
        from_hf(tmp_path)
    cfg = json.loads((FIXTURES / "gpt2" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, n_inner=100)))
    with pytest.raises(ValueError, match="n_inner=100"):
        from_hf(tmp_path)

"""Mixtral checkpoints in and out of Hugging Face format (train/hf/mixtral.py).

Fixture: tests/fixtures/hf/mixtral/, a tiny random ``MixtralForCausalLM`` written by
``transformers`` (tests/fixtures/make_hf_fixtures.py: 2 layers, 4 experts top-2, GQA 4/2
heads, a sliding window of 4 that changes the logits by 0.88 when removed, sharded in 8
files), with its logits, loss and per-sequence load-balancing losses on ``batch.npy``.

1. The loaded model's logits within 1e-5 (relative l2) of transformers'; its router
   load-balancing loss equals transformers' ``load_balancing_loss_func`` of each sequence
   (the model's value: their mean).
2. ``from_hf`` -> ``to_hf`` reproduces every tensor bit for bit, with the same names, and
   ``config.json`` reads back as the same config.
3. What Mixtral's architecture lacks in the zoo is refused with the key named; the router
   z-loss weight goes through ``config.json`` both ways.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_l2
from test_hf import FIXTURES, _fixture, _tensors, forward, plain_model
from train.model import MoEConfig, from_hf, to_hf

D = FIXTURES / "mixtral"


@pytest.fixture(scope="module")
def loaded():
    builder, weights = from_hf(D)
    return builder, plain_model(builder, weights)


def test_config_is_mixtral(loaded):
    cfg = loaded[0].config
    assert isinstance(cfg, MoEConfig) and cfg.family == "mixtral"
    assert (cfg.n_experts, cfg.top_k, cfg.d_expert, cfg.sliding_window) == (4, 2, 64, 4)
    assert not cfg.qk_norm and cfg.norm_topk_prob and cfg.rope_theta == 1e6


def test_logits_and_router_loss_match_transformers(loaded):
    _, model = loaded
    _, ids, logits, _ = _fixture("mixtral")
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    assert rel_l2(ours, logits) < 1e-5, rel_l2(ours, logits)
    aux = float(nnx.jit(lambda m, x: m(x, router_aux=True)[1])(model, jnp.asarray(ids)))
    rows = json.loads((D / "loss.json").read_text())["aux_loss_rows"]
    assert abs(aux - np.mean(rows)) < 1e-5 * np.mean(rows), (aux, np.mean(rows))


def test_to_hf_round_trip_is_bitwise(loaded, tmp_path):
    builder, model = loaded
    out = to_hf(model, tmp_path / "mixtral")
    want, got = _tensors(D), _tensors(out)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "mixtral" and written["architectures"] == ["MixtralForCausalLM"]
    assert written["num_local_experts"] == 4 and written["intermediate_size"] == 64
    assert from_hf(out)[0].config == builder.config


def _edited(tmp_path, src=D, **changes):
    d = tmp_path / "edited"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_refusals_name_the_key(tmp_path, loaded):
    with pytest.raises(ValueError, match="router_jitter_noise=0.01"):
        from_hf(_edited(tmp_path, router_jitter_noise=0.01))
    with pytest.raises(ValueError, match="num_local_experts"):
        from_hf(_edited(tmp_path / "b", num_local_experts=None))
    qk = dataclasses.replace(loaded[0].config, qk_norm=True)
    from train.hf import mixtral  # noqa: PLC0415

    with pytest.raises(ValueError, match="family='qwen3_moe'"):
        mixtral.hf_config(qk)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_router_z_loss_coef_reads_from_and_writes_to_config_json(name, tmp_path):
    """``router_z_loss_coef`` (not a key of either family; transformers keeps it as an attribute):
    read from ``config.json`` (default 0), written back only when set."""
    d = FIXTURES / name
    assert from_hf(d)[0].config.router_z_loss_coef == 0.0
    d = _edited(tmp_path, src=d, router_z_loss_coef=1e-3)
    builder, weights = from_hf(d)
    assert builder.config.router_z_loss_coef == 1e-3
    out = to_hf(plain_model(builder, weights), tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["router_z_loss_coef"] == 1e-3
    assert from_hf(out)[0].config == builder.config

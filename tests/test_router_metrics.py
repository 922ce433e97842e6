"""The router's z-loss and the MoE metrics (train/models/moe.py ``moe_loss``, train/metrics.py,
train/summary.py), on the Qwen3-MoE and Mixtral fixtures (tests/fixtures/hf/).

1. ``router_z_loss`` equals ST-MoE's formula (arXiv 2202.08906 eq. 5: mean over tokens of
   ``logsumexp(router logits)^2``, here over every (layer, token) pair), recomputed from each
   layer's router logits read off the blocks one by one; ``expert_load`` is the share of each
   expert among the layers' top-k choices (a bincount of ``lax.top_k``); dropless: 0 dropped.
2. The loss is ``ce + router_aux_coef * aux + router_z_loss_coef * z``: the z term counts
   with its coefficient, and not at all with the default 0.
3. The run's records turn the step's aux into JSON (the load as a list, its max over the
   mean) and the summary averages them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_hf import FIXTURES, plain_model
from train.metrics import aux_record
from train.model import MoEConfig, from_hf, moe_loss
from train.summary import moe_summary


def _router_logits(model, ids):
    """Each layer's router logits ``[L, B, T, E]`` (float32), computed block by block."""
    x, out = model.embed_tokens(ids), []
    for block in model.blocks:
        a, _ = block.attn(block.attn_norm(x))
        out.append(block.moe.router(block.mlp_norm(x + a)).astype(jnp.float32))
        x = block(x)
    return jnp.stack(out)


def _batch():
    tok = np.random.default_rng(7).integers(0, 128, size=(4, 9), dtype=np.int32)
    return jnp.asarray(tok[:, :-1]), jnp.asarray(tok[:, 1:])


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model(request):
    return plain_model(*from_hf(FIXTURES / request.param))


def test_z_loss_and_load_follow_their_formulas(model):
    batch = _batch()
    _, aux = nnx.jit(moe_loss)(model, batch)
    logits = np.asarray(nnx.jit(_router_logits)(model, batch[0]), np.float64)  # [L, B, T, E]
    lse = np.log(np.exp(logits).sum(-1))  # float64 reference
    assert float(aux["router_z_loss"]) == pytest.approx(np.mean(lse**2), rel=1e-5)
    E, k = model.cfg.n_experts, model.cfg.top_k
    _, top_e = jax.lax.top_k(jnp.asarray(logits, jnp.float32), k)  # softmax keeps the order of the logits
    load = np.bincount(np.asarray(top_e).ravel(), minlength=E) / top_e.size
    np.testing.assert_allclose(np.asarray(aux["expert_load"]), load, rtol=1e-6)
    assert float(aux["dropped_fraction"]) == 0.0  # the zoo's MoE is dropless


def test_z_loss_coefficient_enters_the_loss(model):
    batch = _batch()
    loss0, aux = nnx.jit(moe_loss)(model, batch)
    cfg = model.cfg
    assert cfg.router_z_loss_coef == 0.0  # off by default, as in Hugging Face
    np.testing.assert_allclose(float(loss0), float(aux["cross_entropy"] + cfg.router_aux_coef * aux["router_aux_loss"]),
                               rtol=1e-6)
    model.cfg = dataclasses.replace(cfg, router_z_loss_coef=0.5)
    try:
        loss1, aux1 = nnx.jit(moe_loss)(model, batch)
    finally:
        model.cfg = cfg
    assert float(aux1["router_z_loss"]) > 0
    np.testing.assert_allclose(float(loss1 - loss0), 0.5 * float(aux1["router_z_loss"]), rtol=1e-5)


def test_negative_z_coefficient_is_refused():
    with pytest.raises(ValueError, match="router_z_loss_coef -1"):
        MoEConfig(router_z_loss_coef=-1.0)


def test_records_and_summary():
    rec = aux_record({"router_aux_loss": np.float32(2.0), "expert_load": np.array([0.5, 0.25, 0.125, 0.125], np.float32),
                      "dropped_fraction": np.float32(0.0)})
    assert rec["expert_load"] == [0.5, 0.25, 0.125, 0.125] and rec["router_aux_loss"] == 2.0
    assert rec["max_expert_load"] == 2.0  # 4 experts x the largest share 0.5
    records = [{"step": 0, "eval_loss": 5.0}, {"step": 1, **rec}, {"step": 2, **rec, "expert_load": [0.25] * 4,
                                                                    "dropped_fraction": 0.1}]
    s = moe_summary(records)
    np.testing.assert_allclose(s["expert_load"], [0.375, 0.25, 0.1875, 0.1875])
    assert s["max_expert_load"] == pytest.approx(1.5) and s["dropped_fraction"] == pytest.approx(0.05)

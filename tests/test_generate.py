"""Generation with a KV cache (train/generate.py, the cache path of train/model.py).

1. The cache is exact: prefill + one decoding step give the logits of the full forward.
2. Sharded generation (per-unit gathers, and gather-once) gives the tokens of a plain
   single-device decode, for GPT and Llama (GQA), stacked layers included; the same seed
   gives the same tokens, another seed others.
3. HLO of one decoding step: sharded, one all-gather per parameter and no reduce-scatter;
   gather-once, no all-gather at all (the model was gathered before the loop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zshard
from test_structure import count, parse_collectives
from train.generate import sharded_step, generate, generate_local
from train.model import GPT, GPTConfig, Llama, LlamaConfig, init_cache

GPT_CFG = GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2)
LLAMA_CFG = LlamaConfig(vocab_size=256, seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
SCAN_CFG = GPTConfig(seq_len=32, d_model=32, n_layers=3, n_heads=2, scan=True)


def _make(cfg):
    return lambda: (GPT if isinstance(cfg, GPTConfig) else Llama)(cfg, rngs=nnx.Rngs(0))


PROMPTS = np.random.default_rng(0).integers(0, 256, (3, 5)).astype(np.int32)


@pytest.mark.parametrize("cfg", [GPT_CFG, LLAMA_CFG], ids=["gpt", "llama"])
def test_kv_cache_matches_full_forward(cfg):
    model = _make(cfg)()
    full = np.asarray(model(jnp.asarray(PROMPTS)))  # [3, 5, V]
    cache = init_cache(cfg, 3, 5)
    first, cache = model(jnp.asarray(PROMPTS[:, :3]), cache=cache, pos=jnp.int32(0))
    nxt, cache = model(jnp.asarray(PROMPTS[:, 3:4]), cache=cache, pos=jnp.int32(3))
    np.testing.assert_allclose(np.asarray(first), full[:, :3], atol=1e-5)
    np.testing.assert_allclose(np.asarray(nxt)[:, 0], full[:, 3], atol=1e-5)


CASES = [(GPT_CFG, "HYBRID_SHARD", 2, 4), (LLAMA_CFG, "FULL_SHARD", 1, 8), (SCAN_CFG, "FULL_SHARD", 2, 4)]


@pytest.mark.parametrize("cfg,strategy,r,s", CASES, ids=["gpt-hybrid-2x4", "llama-full-1x8", "gpt-scan-2x4"])
def test_sharded_generation_equals_single_device(cfg, strategy, r, s):
    state = zshard.init(_make(cfg), optax.sgd(0.1), zshard.make_mesh(r, s), strategy=strategy)
    ref = generate_local(_make(cfg)(), PROMPTS, 6, temperature=0.8, seed=3)
    got = generate(state, PROMPTS, 6, temperature=0.8, seed=3)
    once = generate(state, PROMPTS, 6, temperature=0.8, seed=3, gather_once=True)
    assert got.shape == (3, 6) and got.dtype == np.int32
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(once, ref)
    if cfg is GPT_CFG:
        np.testing.assert_array_equal(generate(state, PROMPTS, 6, temperature=0.8, seed=3), got)  # reproducible
        np.testing.assert_array_equal(generate(state, PROMPTS, 6, temperature=0.8, seed=3, prefetch=0), got)
        assert not np.array_equal(generate(state, PROMPTS, 6, temperature=0.8, seed=4), got)  # the seed matters
        greedy = generate(state, PROMPTS, 6)
        np.testing.assert_array_equal(greedy, generate_local(_make(cfg)(), PROMPTS, 6))


def _decode_hlo(state, gather_once):
    from train.generate import gather_all

    batch = NamedSharding(state.plan.mesh, P(("replica", "shard")))
    cache = jax.device_put(init_cache(GPT_CFG, 8, 8), batch)
    tok = jax.device_put(np.zeros((8, 1), np.int32), batch)
    rows = jax.device_put(np.arange(8, dtype=np.int32), batch)
    full = gather_all(state) if gather_once else {}
    args = (state, full, tok, cache, jnp.int32(3), jnp.int32(1), rows, jnp.int32(0), jnp.float32(0))
    return parse_collectives(sharded_step.lower(*args, gather_once=gather_once).compile().as_text())


def test_decode_step_collectives():
    state = zshard.init(_make(GPT_CFG), optax.sgd(0.1), zshard.make_mesh(1, 8))
    ops = _decode_hlo(state, gather_once=False)
    slots = [sl for u in state.plan.units for f in u.flats for sl in f.slots]
    assert len(state.plan.units) == 1 + GPT_CFG.n_layers and count(ops, "all-gather") == len(slots)  # one per parameter
    assert count(ops, "reduce-scatter") == 0
    once = _decode_hlo(state, gather_once=True)
    assert count(once, "all-gather") == 0 and count(once, "reduce-scatter") == 0


def test_generate_errors():
    state = zshard.init(_make(GPT_CFG), optax.sgd(0.1), zshard.make_mesh(1, 8))
    with pytest.raises(ValueError, match=r"prompt 5 \+ 28 new tokens > seq_len 32"):
        generate(state, PROMPTS, 28)
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        generate(state, PROMPTS[0], 2)

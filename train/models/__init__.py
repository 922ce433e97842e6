"""The model families of the main job, in Flax NNX, written as any user would: no zshard base
class, no sharding or collective code, one device.

| module | classes | families (Hugging Face ``model_type``) |
|---|---|---|
| ``gpt`` | :class:`GPTConfig`, :class:`GPT` | ``gpt2`` |
| ``llama`` | :class:`LlamaConfig`, :class:`Llama` | ``llama`` (2 and 3), ``mistral``, ``qwen2``, ``qwen3`` |
| ``gemma`` | :class:`GemmaConfig`, :class:`Gemma` | ``gemma2``, ``gemma3_text`` |
| ``moe`` | :class:`MoEConfig`, :class:`Qwen3Moe` | ``qwen3_moe``, ``mixtral`` |
| ``core`` | embedding, RoPE, attention, gated MLP, block runner, KV cache, loss | |
| ``tp`` | :func:`tensor_plan`, :func:`expert_plan`: the tensor- and expert-parallel plans | |

Every model takes ``model(tokens)`` -> logits ``(B, T, V)`` and ``model(tokens, cache=c,
pos=p)`` -> ``(logits, new cache)`` with ``c = init_cache(cfg, batch, length)``. Its blocks
are ``model.blocks``: an ``nnx.List`` (or stacked layers run by ``nnx.scan`` with
``cfg.scan``), zshard's units by default.
"""

from __future__ import annotations

from flax import nnx

from train.models.core import Embed, RopeScaling, init_cache
from train.models.loss import cross_entropy_loss, token_nll
from train.models.gemma import Gemma, GemmaBlock, GemmaConfig
from train.models.gpt import GPT, MODEL_PRESETS, Block, GPTConfig
from train.models.llama import Llama, LlamaBlock, LlamaConfig
from train.models.moe import MoEConfig, MoEBlock, Qwen3Moe, moe_loss
from train.models.tp import expert_plan, tensor_plan

__all__ = [
    "GPTConfig", "GPT", "Block", "LlamaConfig", "Llama", "LlamaBlock", "GemmaConfig", "Gemma", "GemmaBlock",
    "MoEConfig", "Qwen3Moe", "MoEBlock", "RopeScaling", "Embed", "MODEL_PRESETS", "PLAN_PRESETS", "build_model",
    "cross_entropy_loss", "moe_loss", "loss_for", "token_nll", "init_cache", "units_with_ends", "tensor_plan",
    "expert_plan",
]

# Shapes from the papers: GPT-2 (Radford et al. 2019, table 2; vocab 50257, context 1024,
# tied embeddings), TinyLlama 1.1B (arXiv 2401.02385, table 1), LLaMA 7B (arXiv
# 2302.13971, table 2), Llama 2 70B (arXiv 2307.09288, GQA with 8 KV heads, d_ff 28672), Llama 3 8B
# (arXiv 2407.21783, table 3: 8 KV heads, d_ff 14336, vocab 128256, RoPE base 500000), Llama 3.2 1B (Meta's
# Llama-3.2-1B config.json: 16 layers, d 2048, 32 heads / 8 KV, d_ff 8192, tied embeddings, the llama3 RoPE
# scaling of factor 32; the sequence 4096 here is a training choice, not the model's context).
# Scanned layers: compile time does not grow with depth.
#
# The mixtures of experts (their docstrings: _QWEN3_30B_A3B, _DEEPSEEK_V3) count their parameters within the
# tolerance tests/test_expert_plan.py states against the published totals.
_QWEN3_30B_A3B = MoEConfig(vocab_size=151936, seq_len=4096, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                           d_ff=6144, n_experts=128, top_k=8, d_expert=768, norm_topk_prob=True, rope_theta=1e6, scan=True)
"""Qwen3-30B-A3B (arXiv 2505.09388 table 2; Qwen's config.json): 48 layers, d_model 2048, 32 query / 4 key-value
heads of 128, q/k RMSNorm, 128 experts of width 768, top-8 softmax routing renormalised, untied embeddings, vocabulary
151936. Exact in shape (no approximation): 30.53e9 parameters, 3.35e9 active per token (published: 30.5B, 3.3B).
``d_ff`` (6144, Qwen's ``intermediate_size``) is unused: every layer is an MoE layer. The sequence 4096 is a training
choice, not the model's context."""

_DEEPSEEK_V3 = MoEConfig(vocab_size=129280, seq_len=4096, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=8, head_dim=128,
                         d_ff=18432, n_experts=256, top_k=8, d_expert=2048, norm_topk_prob=True, router_aux_coef=1e-4,
                         qk_norm=False, rope_theta=10000.0, scan=True)
"""DeepSeek-V3-shaped (arXiv 2412.19437 section 4.2): 61 layers, d_model 7168, 256 routed experts of width 2048, top-8,
vocabulary 129280, untied embeddings. What the zoo cannot express is approximated (the memory plan of an expert-parallel
run is what it is for, not the checkpoint):

- MLA (low-rank compressed keys and values, 187e6 parameters per layer) as grouped-query attention of 128 query heads
  and 8 key/value heads of 128 (249e6 per layer): +3.8e9 parameters;
- the first 3 layers' dense SwiGLU (width 18432; ``d_ff`` records it) as MoE layers like the others: +32.6e9 (+0 active:
  8 experts of 2048 are 352e6 per token against the dense 396e6, -0.13e9);
- the shared expert of each MoE layer is left out (-2.6e9, all active);
- routing is the zoo's softmax top-k renormalised, not sigmoid scores with a selection bias (the same parameters but
  for the 256 biases per layer); the sequence-wise balance loss weight 1e-4 (section 2.1.2) as ``router_aux_coef``;
- the multi-token prediction module (14e9, not counted in the published 671e9) is left out.

So 704.9e9 parameters against the published 671e9 (+5.0%) and 38.7e9 active against 37e9 (+4.5%)."""

PLAN_PRESETS = {
    "gpt2-124m": GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12, tie_embeddings=True, scan=True),
    "gpt2-1.5b": GPTConfig(vocab_size=50257, seq_len=1024, d_model=1600, n_layers=48, n_heads=25, tie_embeddings=True, scan=True),
    "llama-1b": LlamaConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, scan=True),
    "llama-7b": LlamaConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008, scan=True),
    "llama-70b": LlamaConfig(vocab_size=32000, seq_len=4096, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, scan=True),
    "llama-3-8b": LlamaConfig(vocab_size=128256, seq_len=8192, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                              rope_theta=500000.0, scan=True),
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, seq_len=4096, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                                rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True, scan=True,
                                rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "deepseek-v3": _DEEPSEEK_V3,
}

# config class -> model class; subclasses before their base (isinstance order)
_MODELS = ((MoEConfig, Qwen3Moe), (GemmaConfig, Gemma), (LlamaConfig, Llama), (GPTConfig, GPT))


def build_model(cfg, rngs: nnx.Rngs) -> nnx.Module:
    """The model of a config: ``GPT``, ``Llama``, ``Gemma`` or ``Qwen3Moe``.

    Raises:
      TypeError: a config of none of these classes.
    """
    for config_cls, model_cls in _MODELS:
        if isinstance(cfg, config_cls):
            return model_cls(cfg, rngs=rngs)
    raise TypeError(f"build_model: {type(cfg).__name__} is not a config of train.models ({[c.__name__ for c, _ in _MODELS]})")


def loss_for(cfg) -> tuple:
    """``(loss_fn, has_aux)`` for training a model of ``cfg`` with ``zshard.make_train_step``:
    :func:`moe_loss` (cross-entropy + the router's load-balancing loss and z-loss; the router
    figures in ``metrics["aux"]``) for an MoE, else :func:`cross_entropy_loss`."""
    return (moe_loss, True) if isinstance(cfg, MoEConfig) else (cross_entropy_loss, False)


def units_with_ends(path: tuple, module: nnx.Module) -> bool:
    """A zshard wrap policy (``zshard.init(..., unit=units_with_ends)``) for every model here:
    the blocks (each element of ``blocks``, or the stacked ``blocks``), the token embedding
    (``wte`` / ``embed``) and the untied output head (``head``) are units.

    zshard's default wraps only the blocks, and everything else is the root unit, gathered for
    the whole step with its full gradient held until the step's end. As units, the embedding
    is gathered for its lookup and dropped, and the head is gathered for its forward and
    again for its backward, its gradient reduce-scattered at once (the way torchtitan wraps
    Llama for FSDP2: the embedding, each block, and the final norm with the output layer).
    What stays in the root is the final norm (and GPT's position table). Llama-2-70B on 8x8,
    HYBRID_SHARD_OPT: 80.12 -> 79.08 GB per device, and 75.89 -> 75.66 GB since the per-parameter
    all-gathers (docs/memory.md). ``python -m train``: ``[mesh] unit = "ends"``.
    """
    if path == ("blocks",):
        return not isinstance(module, nnx.List)  # stacked layers (cfg.scan): one module [L, ...]
    if len(path) == 2 and path[0] == "blocks" and isinstance(path[1], int):
        return True  # one block of the nnx.List
    return path in (("embed",), ("wte",), ("head",))

"""The model families of the main job, in Flax NNX, written as any user would: no zshard base
class, no sharding or collective code, one device.

| module | classes | families (Hugging Face ``model_type``) |
|---|---|---|
| ``gpt`` | :class:`GPTConfig`, :class:`GPT` | ``gpt2`` |
| ``llama`` | :class:`LlamaConfig`, :class:`Llama` | ``llama`` (2 and 3), ``mistral``, ``qwen2``, ``qwen3`` |
| ``gemma`` | :class:`GemmaConfig`, :class:`Gemma` | ``gemma2``, ``gemma3_text`` |
| ``moe`` | :class:`MoEConfig`, :class:`Qwen3Moe` | ``qwen3_moe`` |
| ``core`` | embedding, RoPE, attention, gated MLP, block runner, KV cache, loss | |
| ``tp`` | :func:`tensor_plan`: the tensor-parallel plan of each family | |

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
from train.models.tp import tensor_plan

__all__ = [
    "GPTConfig", "GPT", "Block", "LlamaConfig", "Llama", "LlamaBlock", "GemmaConfig", "Gemma", "GemmaBlock",
    "MoEConfig", "Qwen3Moe", "MoEBlock", "RopeScaling", "Embed", "MODEL_PRESETS", "PLAN_PRESETS", "build_model",
    "cross_entropy_loss", "moe_loss", "loss_for", "token_nll", "init_cache", "units_with_ends", "tensor_plan",
]

# Shapes from the papers: GPT-2 (Radford et al. 2019, table 2; vocab 50257, context 1024,
# tied embeddings), TinyLlama 1.1B (arXiv 2401.02385, table 1), LLaMA 7B (arXiv
# 2302.13971, table 2), Llama 2 70B (arXiv 2307.09288, GQA with 8 KV heads, d_ff 28672), Llama 3 8B
# (arXiv 2407.21783, table 3: 8 KV heads, d_ff 14336, vocab 128256, RoPE base 500000), Llama 3.2 1B (Meta's
# Llama-3.2-1B config.json: 16 layers, d 2048, 32 heads / 8 KV, d_ff 8192, tied embeddings, the llama3 RoPE
# scaling of factor 32; the sequence 4096 here is a training choice, not the model's context).
# Scanned layers: compile time does not grow with depth.
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
    :func:`moe_loss` (cross-entropy + the router's load-balancing loss, ``metrics["aux"]``)
    for an MoE, else :func:`cross_entropy_loss`."""
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

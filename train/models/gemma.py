"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences.

Gemma 2 (arXiv 2408.00118 section 2): the token embedding scaled by ``sqrt(d_model)``;
GeGLU MLP (tanh GELU gate); RMSNorms computing ``x * (1 + scale)`` (:class:`OffsetRMSNorm`),
four per block (before and after attention, before and after the MLP); attention scores
scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped, ``cap * tanh(s / cap)``, as are
the final logits; sliding-window (local) and global layers alternating (``layer_types``);
the output head tied to the embedding.
Gemma 3 (arXiv 2503.19786 section 2): no soft-capping, an RMSNorm on each query and key head
(``qk_norm``), a 5:1 local:global pattern, local layers with their own RoPE base
(``local_rope_theta``) and global ones with RoPE scaling.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from train.models.core import Attention, GatedMLP, OffsetRMSNorm, head_size, rope_frequencies, softcap
from train.models.llama import Llama, LlamaConfig

__all__ = ["GemmaConfig", "Gemma", "GemmaBlock"]


@dataclasses.dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """:class:`LlamaConfig` plus Gemma's fields (``act`` defaults to ``"gelu_tanh"``).

    Attributes:
      attn_softcap: attention-score soft-cap (Gemma 2: 50.0); ``None``: none (Gemma 3).
      final_softcap: final-logit soft-cap (Gemma 2: 30.0); ``None``: none.
      query_pre_attn_scalar: scores are scaled by its ``** -0.5``; ``None``: ``head_dim``.
      local_rope_theta: RoPE base of the sliding layers, used without ``rope_scaling``
        (Gemma 3's ``rope_local_base_freq``); ``None``: every layer uses ``rope_theta`` and
        ``rope_scaling`` (Gemma 2).
    """

    act: str = "gelu_tanh"
    family: str = "gemma2"
    tie_embeddings: bool = True
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None

    def attention(self, layer: int) -> dict:
        hs = head_size(self)
        sliding = self.types()[layer] == "sliding"
        if sliding and self.local_rope_theta is not None:
            inv_freq = rope_frequencies(hs, self.local_rope_theta)
        else:
            inv_freq = rope_frequencies(hs, self.rope_theta, self.rope_scaling)
        return dict(inv_freq=inv_freq, scale=(self.query_pre_attn_scalar or hs) ** -0.5,
                    window=self.sliding_window if sliding else None, cap=self.attn_softcap)


class GemmaBlock(nnx.Module):
    """``x + post_attn_norm(attn(attn_norm(x)))``, then ``x + post_mlp_norm(mlp(mlp_norm(x)))``
    (Hugging Face's input / post_attention / pre_feedforward / post_feedforward layernorms)."""

    def __init__(self, cfg: GemmaConfig, *, layer: int = 0, rngs: nnx.Rngs):
        def norm():
            return OffsetRMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)

        self.attn_norm = norm()
        self.attn = Attention(cfg, **cfg.attention(layer), norm=OffsetRMSNorm, rngs=rngs)
        self.post_attn_norm = norm()
        self.mlp_norm = norm()
        self.mlp = GatedMLP(cfg.d_model, cfg.d_ff, cfg.act, rngs=rngs)
        self.post_mlp_norm = norm()

    def __call__(self, x, cache=None, pos=None):
        a, new = self.attn(self.attn_norm(x), cache, pos)
        x = x + self.post_attn_norm(a)
        out = x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))
        return out if cache is None else (out, new)


class Gemma(Llama):
    """Tokens (B, T) int32 -> logits (B, T, vocab_size); the cache interface of :class:`Llama`."""

    block = GemmaBlock

    @staticmethod
    def make_norm(cfg, rngs):
        return OffsetRMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)

    def embed_tokens(self, tokens):
        x = self.embed(tokens)  # (B, T, C)
        return x * jnp.asarray(self.cfg.d_model**0.5, x.dtype)  # sqrt(C), rounded to the embedding's dtype (as HF)

    def logits(self, x):
        return softcap(super().logits(x), self.cfg.final_softcap)

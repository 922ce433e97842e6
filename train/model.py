"""A GPT in Flax NNX, written as any user would: no zshard base class, no sharding code.

Pre-norm transformer blocks (Radford et al. 2019, GPT-2 section 2.3): causal multi-head
self-attention and a 4x GELU MLP, learned absolute positions, byte-level vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["GPTConfig", "GPT", "Block", "MODEL_PRESETS", "cross_entropy_loss"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape.

    Attributes:
      vocab_size: tokens (256 for bytes).
      seq_len: maximum sequence length, tokens (size of the position table).
      d_model: residual width.
      n_layers: transformer blocks.
      n_heads: attention heads; ``d_model`` must divide by it.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4


MODEL_PRESETS = {
    "nano": GPTConfig(d_model=64, n_layers=2, n_heads=2),
    "tiny": GPTConfig(d_model=128, n_layers=4, n_heads=4),
    "small": GPTConfig(d_model=256, n_layers=6, n_heads=8),
    "medium": GPTConfig(d_model=512, n_layers=8, n_heads=8),
}


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        # No qkv bias: a key bias only shifts each softmax row, so its true gradient is 0 and
        # Adam would amplify rounding noise in it (as in LLaMA, no attention biases).
        self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(cfg.d_model, cfg.d_model, rngs=rngs)

    def __call__(self, x):
        B, T, C = x.shape
        hs = C // self.n_heads
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)  # 3 x (B, T, C)
        q, k, v = (t.reshape(B, T, self.n_heads, hs) for t in (q, k, v))  # (B, T, nh, hs)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hs).astype(x.dtype)  # (B, nh, T, T)
        causal = jnp.tril(jnp.ones((T, T), dtype=bool))
        att = jax.nn.softmax(jnp.where(causal, att, jnp.finfo(att.dtype).min), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, C)  # (B, T, nh, hs) -> (B, T, C)
        return self.proj(y)


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.fc = nnx.Linear(cfg.d_model, 4 * cfg.d_model, rngs=rngs)
        self.proj = nnx.Linear(4 * cfg.d_model, cfg.d_model, rngs=rngs)

    def __call__(self, x):
        return self.proj(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``. ``x``: (B, T, d_model)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
    """Tokens (B, T) int32 -> logits (B, T, vocab_size) float32."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.wpe = nnx.Embed(cfg.seq_len, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(jnp.arange(T))[None]  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def cross_entropy_loss(model: GPT, batch) -> jax.Array:
    """Mean next-token cross-entropy (nats). ``batch = (inputs, targets)``, each (B, T) int32."""
    inputs, targets = batch
    logits = model(inputs).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

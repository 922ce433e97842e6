"""A GPT and a Llama in Flax NNX, written as any user would: no zshard base class, no
sharding code.

GPT: pre-norm transformer blocks (Radford et al. 2019, GPT-2 section 2.3): causal
multi-head self-attention and a 4x GELU MLP, learned absolute positions.
Llama (Touvron et al. 2023, arXiv 2302.13971 section 2.2): RMSNorm, SwiGLU MLP, rotary
positions (Su et al. 2021), grouped-query attention (Llama 2, arXiv 2307.09288), no biases.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["GPTConfig", "GPT", "Block", "LlamaConfig", "Llama", "MODEL_PRESETS", "PLAN_PRESETS", "cross_entropy_loss"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape.

    Attributes:
      vocab_size: tokens (256 for bytes).
      seq_len: maximum sequence length, tokens (size of the position table).
      d_model: residual width.
      n_layers: transformer blocks.
      n_heads: attention heads; ``d_model`` must divide by it.
      tie_embeddings: the output projection is the token embedding (``wte.attend``), as in GPT-2.
      scan: stack the blocks (``nnx.vmap``) and run them with ``nnx.scan``: compile time
        stays flat in depth; otherwise an ``nnx.List`` run by a Python loop.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    tie_embeddings: bool = False
    scan: bool = False


MODEL_PRESETS = {
    "nano": GPTConfig(d_model=64, n_layers=2, n_heads=2),
    "tiny": GPTConfig(d_model=128, n_layers=4, n_heads=4),
    "small": GPTConfig(d_model=256, n_layers=6, n_heads=8),
    "medium": GPTConfig(d_model=512, n_layers=8, n_heads=8, scan=True),
}


def make_blocks(block_cls, cfg, rngs: nnx.Rngs):
    """``cfg.n_layers`` blocks: an ``nnx.List``, or one module of stacked layers when ``cfg.scan``."""
    if not cfg.scan:
        return nnx.List([block_cls(cfg, rngs=rngs) for _ in range(cfg.n_layers)])

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):  # every parameter gets a leading layer axis: [n_layers, ...]
        return block_cls(cfg, rngs=rngs)

    return stacked(rngs)


def run_blocks(blocks, x, scan: bool):
    """Apply the blocks in order: a Python loop, or ``nnx.scan`` over the layer axis."""
    if not scan:
        for block in blocks:
            x = block(x)
        return x

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
        return block(x)

    return body(x, blocks)


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
        self.blocks = make_blocks(Block, cfg, rngs)
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(jnp.arange(T))[None]  # (B, T, C)
        x = run_blocks(self.blocks, x, self.cfg.scan)
        x = self.ln_f(x)
        return self.wte.attend(x) if self.cfg.tie_embeddings else self.head(x)  # (B, T, vocab)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama shape.

    Attributes:
      vocab_size: tokens.
      seq_len: sequence length, tokens (RoPE needs no table; kept for planning).
      d_model: residual width.
      n_layers: transformer blocks.
      n_heads: query heads.
      n_kv_heads: key/value heads (grouped-query attention); ``n_heads`` divides by it.
      d_ff: hidden width of the SwiGLU MLP.
      rope_theta: RoPE base.
      scan: stacked blocks run with ``nnx.scan`` (see :class:`GPTConfig`).
    """

    vocab_size: int = 32000
    seq_len: int = 2048
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    d_ff: int = 11008
    rope_theta: float = 10000.0
    scan: bool = False


def _rope(x, theta: float):
    """Rotary position embedding of ``x`` (B, T, h, hs) over its T axis."""
    B, T, h, hs = x.shape
    freqs = theta ** (-jnp.arange(0, hs // 2, dtype=jnp.float32) / (hs // 2))  # (hs/2,)
    ang = jnp.arange(T, dtype=jnp.float32)[:, None] * freqs[None]  # (T, hs/2)
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]  # (1, T, 1, hs/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class LlamaBlock(nnx.Module):
    """``x + attn(rmsnorm(x))``, then ``x + swiglu(rmsnorm(x))``. ``x``: (B, T, d_model)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        hs = cfg.d_model // cfg.n_heads
        self.cfg = cfg
        self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.wq = nnx.Linear(cfg.d_model, cfg.n_heads * hs, use_bias=False, rngs=rngs)
        self.wkv = nnx.Linear(cfg.d_model, 2 * cfg.n_kv_heads * hs, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(cfg.n_heads * hs, cfg.d_model, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.w_gate_up = nnx.Linear(cfg.d_model, 2 * cfg.d_ff, use_bias=False, rngs=rngs)
        self.w_down = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        cfg = self.cfg
        B, T, C = x.shape
        hs, rep = C // cfg.n_heads, cfg.n_heads // cfg.n_kv_heads
        h = self.attn_norm(x)
        q = _rope(self.wq(h).reshape(B, T, cfg.n_heads, hs), cfg.rope_theta)  # (B, T, nh, hs)
        k, v = jnp.split(self.wkv(h).reshape(B, T, 2 * cfg.n_kv_heads, hs), 2, axis=2)  # (B, T, nkv, hs)
        k = jnp.repeat(_rope(k, cfg.rope_theta), rep, axis=2)  # (B, T, nh, hs)
        v = jnp.repeat(v, rep, axis=2)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hs).astype(x.dtype)  # (B, nh, T, T)
        att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, jnp.finfo(att.dtype).min), axis=-1)
        x = x + self.wo(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, C))
        gate, up = jnp.split(self.w_gate_up(self.mlp_norm(x)), 2, axis=-1)  # 2 x (B, T, d_ff)
        return x + self.w_down(jax.nn.silu(gate) * up)


class Llama(nnx.Module):
    """Tokens (B, T) int32 -> logits (B, T, vocab_size)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.blocks = make_blocks(LlamaBlock, cfg, rngs)
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)  # (B, T, C)
        x = run_blocks(self.blocks, x, self.cfg.scan)
        return self.head(self.norm(x))  # (B, T, vocab)


# Shapes from the papers: GPT-2 (Radford et al. 2019, table 2; vocab 50257, context 1024,
# tied embeddings), TinyLlama 1.1B (arXiv 2401.02385, table 1), LLaMA 7B (arXiv
# 2302.13971, table 2), Llama 2 70B (arXiv 2307.09288, GQA with 8 KV heads, d_ff 28672).
# Scanned layers: compile time does not grow with depth.
PLAN_PRESETS = {
    "gpt2-124m": GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12, tie_embeddings=True, scan=True),
    "gpt2-1.5b": GPTConfig(vocab_size=50257, seq_len=1024, d_model=1600, n_layers=48, n_heads=25, tie_embeddings=True, scan=True),
    "llama-1b": LlamaConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, scan=True),
    "llama-7b": LlamaConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008, scan=True),
    "llama-70b": LlamaConfig(vocab_size=32000, seq_len=4096, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, scan=True),
}


def build_model(cfg, rngs: nnx.Rngs):
    """``GPT`` for a :class:`GPTConfig`, ``Llama`` for a :class:`LlamaConfig`."""
    return GPT(cfg, rngs=rngs) if isinstance(cfg, GPTConfig) else Llama(cfg, rngs=rngs)


def cross_entropy_loss(model: GPT, batch) -> jax.Array:
    """Mean next-token cross-entropy (nats). ``batch = (inputs, targets)``, each (B, T) int32."""
    inputs, targets = batch
    logits = model(inputs).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

"""GPT: pre-norm transformer blocks (Radford et al. 2019, GPT-2 section 2.3): causal
multi-head self-attention and a 4x GELU MLP, learned absolute positions.

``model(tokens)`` -> logits; ``model(tokens, cache=c, pos=p)`` -> ``(logits, new cache)``
(``c`` from :func:`train.models.core.init_cache`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import zshard
from train.models.core import Embed, attend, make_blocks, run_blocks
from train.models.loss import Head

__all__ = ["GPTConfig", "GPT", "Block", "MODEL_PRESETS"]


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
      qkv_bias: a bias on the fused q/k/v projection (GPT-2 has one).
      norm_eps: LayerNorm epsilon (GPT-2: 1e-5).
      gelu_approximate: ``True``: the tanh approximation of GELU (GPT-2's ``gelu_new``);
        ``False``: the exact erf form.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    tie_embeddings: bool = False
    scan: bool = False
    qkv_bias: bool = False
    norm_eps: float = 1e-6
    gelu_approximate: bool = True


MODEL_PRESETS = {
    "nano": GPTConfig(d_model=64, n_layers=2, n_heads=2),
    "tiny": GPTConfig(d_model=128, n_layers=4, n_heads=4),
    "small": GPTConfig(d_model=256, n_layers=6, n_heads=8),
    "medium": GPTConfig(d_model=512, n_layers=8, n_heads=8, scan=True),
}


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        # No qkv bias: a key bias only shifts each softmax row, so its true gradient is 0 and
        # Adam would amplify rounding noise in it (as in LLaMA, no attention biases).
        # (GPT-2 checkpoints have one: qkv_bias=True.)
        # Fused q | k | v [C, 3, C]: split over the tensor axis along its last dimension (heads),
        # each device keeps its heads' q, k and v together (Megatron-LM's column-parallel layout).
        self.qkv = nnx.LinearGeneral(cfg.d_model, (3, cfg.d_model), use_bias=cfg.qkv_bias, rngs=rngs)
        self.proj = nnx.Linear(cfg.d_model, cfg.d_model, rngs=rngs)

    def __call__(self, x, cache=None, pos=None):
        B, T, C = x.shape
        hs = C // self.n_heads
        qkv = self.qkv(x)  # (B, T, 3, C)
        q, k, v = (qkv[:, :, i].reshape(B, T, self.n_heads, hs) for i in range(3))  # (B, T, nh, hs)
        y, cache = attend(q, k, v, cache, pos, scale=hs**-0.5)  # (B, T, C)
        return self.proj(y) if cache is None else (self.proj(y), cache)


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.fc = nnx.Linear(cfg.d_model, 4 * cfg.d_model, rngs=rngs)
        self.proj = nnx.Linear(4 * cfg.d_model, cfg.d_model, rngs=rngs)
        self.approximate = cfg.gelu_approximate

    def __call__(self, x):
        return self.proj(jax.nn.gelu(self.fc(x), approximate=self.approximate))


class Block(nnx.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``. ``x``: (B, T, d_model).

    With ``cache`` (this layer's ``(k, v)``) and ``pos``: returns ``(x, new cache)``."""

    def __init__(self, cfg: GPTConfig, *, layer: int = 0, rngs: nnx.Rngs):
        del layer  # every GPT block is the same
        self.ln1 = nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, cache=None, pos=None):
        if cache is None:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        a, cache = self.attn(self.ln1(x), cache, pos)
        x = x + a
        return x + self.mlp(self.ln2(x)), cache


class GPT(nnx.Module):
    """Tokens (B, T) int32 -> logits (B, T, vocab_size) float32.

    ``model(tokens, cache=c, pos=p)`` (``c`` from ``init_cache``, ``p`` an int32 scalar,
    the position of ``tokens[:, 0]``) -> ``(logits, new cache)``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.wpe = Embed(cfg.seq_len, cfg.d_model, rngs=rngs)
        self.blocks = make_blocks(Block, cfg, rngs)
        self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def hidden(self, tokens):
        """(B, T) int -> (B, T, C): the final LayerNorm's output, what the head projects
        (``cross_entropy_loss`` takes it with :meth:`output_head` instead of the logits)."""
        positions = zshard.positions(tokens.shape[1])  # as __call__ without a cache
        x = self.wte(tokens) + self.wpe(positions)[None]  # (B, T, C)
        return self.ln_f(run_blocks(self.blocks, x, self.cfg.scan))

    def output_head(self) -> Head:
        """The output projection: the tied embedding ``wte`` ``[V, C]`` or the head's kernel ``[C, V]``."""
        if self.cfg.tie_embeddings:
            return Head(self.wte.embedding[...], 0)
        return Head(self.head.kernel[...], 1)

    def __call__(self, tokens, cache=None, pos=None):
        T = tokens.shape[1]
        # learned absolute positions: zshard.positions(T) is arange(T) on one device, this device's
        # global positions on a sequence split over context (docs/long-sequences.md)
        positions = zshard.positions(T) if cache is None else pos + jnp.arange(T)
        x = self.wte(tokens) + self.wpe(positions)[None]  # (B, T, C)
        x = run_blocks(self.blocks, x, self.cfg.scan, cache, pos)
        x, cache = (x, None) if cache is None else x
        x = self.ln_f(x)
        logits = self.wte.attend(x) if self.cfg.tie_embeddings else self.head(x)  # (B, T, vocab)
        return logits if cache is None else (logits, cache)

"""The Llama decoder, and the families that are Llama with switches: Mistral, Qwen2 / Qwen2.5,
Qwen3.

Llama (Touvron et al. 2023, arXiv 2302.13971 section 2.2): RMSNorm, SwiGLU MLP, rotary
positions (Su et al. 2021), grouped-query attention (Llama 2, arXiv 2307.09288), no biases;
Llama 3 (arXiv 2407.21783): the same, with RoPE frequency scaling (:class:`RopeScaling`).
Mistral 7B (arXiv 2310.06825 section 2): a sliding attention window (``sliding_window``).
Qwen2 (arXiv 2407.10671 section 2.2.1): biases on the q/k/v projections (``qkv_bias``).
Qwen3 (arXiv 2505.09388 section 2): no q/k/v bias, an RMSNorm on each query and key head
before RoPE (``qk_norm``), ``head_dim`` independent of ``d_model / n_heads``.

``model(tokens)`` -> logits; ``model(tokens, cache=c, pos=p)`` -> ``(logits, new cache)``.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from train.models.core import Attention, Embed, GatedMLP, RopeScaling, head_size, make_blocks, rope_frequencies, run_blocks
from train.models.loss import Head

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "RopeScaling", "LAYER_TYPES"]

LAYER_TYPES = ("full", "sliding")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3).

    Attributes:
      vocab_size: tokens.
      seq_len: sequence length, tokens (RoPE needs no table; kept for planning).
      d_model: residual width.
      n_layers: transformer blocks.
      n_heads: query heads.
      n_kv_heads: key/value heads (grouped-query attention); ``n_heads`` divides by it.
      d_ff: hidden width of the SwiGLU MLP.
      rope_theta: RoPE base.
      scan: stacked blocks run with ``nnx.scan`` (every layer then has the same structure:
        one layer type).
      norm_eps: RMSNorm epsilon (Hugging Face ``rms_norm_eps``).
      tie_embeddings: the output projection is the token embedding (``embed.attend``).
      head_dim: per-head width; ``None``: ``d_model // n_heads`` (Qwen3 and Gemma set it).
      qkv_bias: biases on the q, k and v projections (Qwen2), none on the output projection.
      qk_norm: an RMSNorm ``[head_dim]`` on each query and key head before RoPE (Qwen3).
      rope_scaling: RoPE frequency scaling (Llama 3.1+: ``RopeScaling("llama3", 8.0, ...)``).
      sliding_window: tokens a ``"sliding"`` layer's query sees, itself included (key ``j``
        seen by query ``i`` when ``i - window < j <= i``, Hugging Face's ``sliding_window``).
      layer_types: ``"full"`` or ``"sliding"`` per layer; ``None``: every layer sliding when
        ``sliding_window`` is set (Mistral), else every layer full.
      act: the MLP's gate activation, ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
      family: the Hugging Face ``model_type`` these weights came from (``to_hf`` writes it).
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
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    head_dim: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    act: str = "silu"
    family: str = "llama"

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{type(self).__name__}: n_heads {self.n_heads} does not divide by n_kv_heads {self.n_kv_heads}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"{type(self).__name__}: layer_types {self.layer_types} must give one of {LAYER_TYPES} "
                                 f"for each of the {self.n_layers} layers")
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ValueError(f"{type(self).__name__}: layer_types has sliding layers but sliding_window is None")
        if self.scan and len(set(self.types())) > 1:
            raise ValueError(f"{type(self).__name__}: scan=True needs every layer alike, got layer_types {self.types()}; "
                             "use scan=False (an nnx.List of blocks)")

    def types(self) -> tuple[str, ...]:
        """Each layer's type, ``"full"`` or ``"sliding"``."""
        if self.layer_types is not None:
            return tuple(self.layer_types)
        return ("sliding" if self.sliding_window is not None else "full",) * self.n_layers

    def attention(self, layer: int) -> dict:
        """Keyword arguments of :class:`~train.models.core.Attention` for ``layer``: RoPE
        frequencies, score scale, window, soft-cap."""
        hs = head_size(self)
        sliding = self.types()[layer] == "sliding"
        return dict(inv_freq=rope_frequencies(hs, self.rope_theta, self.rope_scaling), scale=hs**-0.5,
                    window=self.sliding_window if sliding else None, cap=None)


class LlamaBlock(nnx.Module):
    """``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``. ``x``: (B, T, d_model).

    With ``cache`` (this layer's ``(k, v)``) and ``pos``: returns ``(x, new cache)``."""

    def __init__(self, cfg: LlamaConfig, *, layer: int = 0, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        self.attn = Attention(cfg, **cfg.attention(layer), rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        self.mlp = GatedMLP(cfg.d_model, cfg.d_ff, cfg.act, rngs=rngs)

    def __call__(self, x, cache=None, pos=None):
        a, new = self.attn(self.attn_norm(x), cache, pos)
        x = x + a
        out = x + self.mlp(self.mlp_norm(x))
        return out if cache is None else (out, new)


class Llama(nnx.Module):
    """Tokens (B, T) int32 -> logits (B, T, vocab_size).

    ``model(tokens, cache=c, pos=p)`` (``c`` from ``init_cache``, ``p`` an int32 scalar,
    the position of ``tokens[:, 0]``) -> ``(logits, new cache)``."""

    block = LlamaBlock

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.blocks = make_blocks(type(self).block, cfg, rngs)
        self.norm = self.make_norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    @staticmethod
    def make_norm(cfg, rngs):
        return nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)

    def embed_tokens(self, tokens):
        """(B, T) int -> (B, T, C)."""
        return self.embed(tokens)

    def logits(self, x):
        """Final norm and output projection: (B, T, C) -> (B, T, vocab)."""
        x = self.norm(x)
        return self.embed.attend(x) if self.cfg.tie_embeddings else self.head(x)

    def hidden(self, tokens):
        """(B, T) int -> (B, T, C): the final norm's output, what the head projects
        (``cross_entropy_loss`` takes it with :meth:`output_head` instead of the logits)."""
        x = self.embed_tokens(tokens)  # (B, T, C)
        return self.norm(run_blocks(self.blocks, x, self.cfg.scan))

    def output_head(self) -> Head:
        """The output projection: the tied embedding ``[V, C]`` or the head's kernel ``[C, V]``,
        and the final soft-cap (Gemma 2's ``final_softcap``)."""
        cap = getattr(self.cfg, "final_softcap", None)
        if self.cfg.tie_embeddings:
            return Head(self.embed.embedding[...], 0, cap)
        return Head(self.head.kernel[...], 1, cap)

    def __call__(self, tokens, cache=None, pos=None):
        x = self.embed_tokens(tokens)  # (B, T, C)
        x = run_blocks(self.blocks, x, self.cfg.scan, cache, pos)
        x, cache = (x, None) if cache is None else x
        logits = self.logits(x)  # (B, T, vocab)
        return logits if cache is None else (logits, cache)

"""What every model family of ``train/models/`` shares: the embedding, rotary positions, the
attention core, the gated MLP, the block runner and the KV cache (the loss: train/models/loss.py).

Plain Flax NNX for one device: no collective, no sharding annotation. The blocks of a model
are an ``nnx.List`` (or one module of stacked layers run by ``nnx.scan``), so zshard finds
them as its units.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zshard
from train.models.linear import fused_projection

__all__ = [
    "Embed", "RopeScaling", "rope_frequencies", "rope", "attend", "Attention", "GatedMLP", "OffsetRMSNorm",
    "make_blocks", "run_blocks", "init_cache", "head_size", "softcap",
]


def _zero_after(shape, dtype, tree) -> jax.Array:
    """Zeros of ``shape`` whose value is data-dependent on ``tree`` (``0 * t``, ``t`` a finite
    scalar read from it), so that the compiler cannot allocate them before ``tree`` exists.

    XLA's CPU scheduler otherwise places a constant broadcast anywhere, and put the
    embedding gradient's ``[V, h]`` zeros at the start of the step, alive through the whole
    forward pass (docs/memory.md, "Llama-2-70B on 8x8"). Exact: ``x + 0 == x``, and no NaN or
    inf in ``tree`` can reach the zeros.
    """
    t = tree.reshape(-1)[0]
    return jnp.zeros(shape, dtype) + (jnp.where(jnp.isfinite(t), t, 0) * 0).astype(dtype)


@jax.custom_vjp
def _lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]``: ``[V, h]``, int ``[...]`` -> ``[..., h]`` (``jnp.take``, out-of-range ids give NaN)."""
    return jnp.take(table, ids, axis=0)


def _lookup_fwd(table, ids):
    return jnp.take(table, ids, axis=0), (ids, jax.ShapeDtypeStruct(table.shape, table.dtype))


def _lookup_bwd(res, g):
    ids, table = res
    # the gradient of a gather is a scatter-add of the rows into zeros [V, h]; out-of-range ids
    # are dropped, as in the gradient of jnp.take
    return _zero_after(table.shape, table.dtype, g).at[ids].add(g.astype(table.dtype), mode="drop"), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


class Embed(nnx.Embed):
    """``nnx.Embed`` (same parameter ``embedding`` ``[V, h]``, same values), whose gradient's
    zeros are allocated only once the incoming gradient exists (:func:`_zero_after`); without a
    ``dtype``, in the table's dtype as read (bf16 gathered: a bf16 residual stream, docs/performance.md)."""

    def __init__(self, *args, dtype=None, **kwargs):
        super().__init__(*args, dtype=dtype, **kwargs)
        self.dtype = dtype  # nnx.Embed fixes the creation dtype (float32) when None

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"Embed: token ids must be integers, got {inputs.dtype}")
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        return _lookup(embedding, inputs)


class OffsetRMSNorm(nnx.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + scale)``, in float32.

    The parameter ``scale`` ``[dim]`` is stored as the checkpoint stores it (zeros = identity),
    so a Gemma checkpoint loads and saves bit for bit; the ``1 +`` happens here.
    """

    def __init__(self, dim: int, *, epsilon: float, rngs: nnx.Rngs):
        del rngs
        self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.epsilon = epsilon

    def __call__(self, x):
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.epsilon)
        return (h * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def softcap(x, cap: float | None):
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping, arXiv 2408.00118 section 2); ``None``: ``x``."""
    return x if cap is None else jnp.tanh(x / cap) * cap


# ----------------------------------------------------------------------------------------
# Rotary positions
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling (Hugging Face ``rope_parameters`` / ``rope_scaling``).

    Attributes:
      kind: ``"linear"`` (every inverse frequency divided by ``factor``: position
        interpolation, Chen et al. 2023, arXiv 2306.15595) or ``"llama3"`` (Llama 3.1:
        wavelengths longer than ``original_max_position / low_freq_factor`` divided by
        ``factor``, shorter than ``original_max_position / high_freq_factor`` kept, smoothly
        interpolated between; arXiv 2407.21783 section 3.1 and Hugging Face's
        ``_compute_llama3_parameters``).
      factor: the scaling factor.
      low_freq_factor, high_freq_factor, original_max_position: ``"llama3"`` only (tokens).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@functools.lru_cache(maxsize=None)
def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple:
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [hd/2]
    if scaling is None:
        return tuple(inv)
    if scaling.kind == "linear":
        return tuple(inv / scaling.factor)
    if scaling.kind == "llama3":
        s = scaling
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = s.original_max_position / s.low_freq_factor, s.original_max_position / s.high_freq_factor
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return tuple(np.where(medium, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled))
    raise ValueError(f"RopeScaling.kind {scaling.kind!r}: supported 'linear', 'llama3'")


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies ``theta ** (-2i / head_dim)``, ``i < head_dim / 2`` (Su et al. 2021,
    arXiv 2104.09864 eq. 34), after ``scaling``: float32 ``[head_dim / 2]`` (computed in float64)."""
    return np.asarray(_inv_freq(head_dim, float(theta), scaling), np.float32)


def rope(x, inv_freq: np.ndarray, start=0, positions=None):
    """Rotary position embedding of ``x`` (B, T, h, hs), positions ``start .. start+T-1``, or
    ``positions`` (int ``[T]``, e.g. ``zshard.positions(T)``: global positions of a sequence split
    over ``context``).

    Half-split layout (x1 = first half of each head, x2 = second), as Hugging Face's
    ``rotate_half``; ``inv_freq`` from :func:`rope_frequencies`.
    """
    T = x.shape[1]
    pos = start + jnp.arange(T, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)  # (T,)
    ang = pos[:, None] * jnp.asarray(inv_freq)[None]  # (T, hs/2)
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]  # (1, T, 1, hs/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------


def attend(q, k, v, cache=None, pos=None, *, scale: float, window: int | None = None, cap: float | None = None):
    """Causal attention of ``q`` (B, T, nh, hs) over ``k, v`` (B, T, nkv, hs), through the cache.

    Query ``i`` sees key ``j`` when ``j <= i`` and, with ``window``, ``j > i - window`` (Mistral's
    and Gemma's sliding window, as Hugging Face's ``sliding_window``). Scores are
    ``softcap(q.k * scale, cap)`` (Gemma 2). Grouped-query attention: each key/value head
    serves ``nh / nkv`` query heads (Ainslie et al. 2023, arXiv 2305.13245).

    Returns ``(y (B, T, nh*hs), new cache or None)``. With a cache ``(ck, cv)`` of
    ``(B, Tmax, nkv, hs)``, ``k, v`` are written at ``pos`` and the query at ``pos + i``
    attends to cache positions ``<= pos + i`` (and within the window).

    Without a cache (training, evaluation, a prefill's whole prompt) this is ``zshard.attention``:
    ``jax.nn.dot_product_attention`` on one device, exact on a sequence split over the mesh's
    ``context`` axis inside a zshard step (keys and values all-gathered; docs/long-sequences.md).
    """
    B, T, nh, hs = q.shape
    if cache is None:
        y = zshard.attention(q, k, v, causal=True, sliding_window=window, scale=scale, softcap=cap)  # (B, T, nh, hs)
        return y.reshape(B, T, nh * hs), None  # (B, T, nh, hs) -> (B, T, nh*hs)
    qpos = jnp.arange(T)[:, None]  # (T, 1)
    if cache is not None:
        ck, cv = cache
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, pos, 0, 0))  # (B, Tmax, nkv, hs)
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, pos, 0, 0))
        k, v, cache = ck.astype(q.dtype), cv.astype(q.dtype), (ck, cv)
        qpos = pos + qpos
    kpos = jnp.arange(k.shape[1])[None, :]  # (1, S)
    mask = kpos <= qpos  # (T, S)
    if window is not None:
        mask = mask & (kpos > qpos - window)
    rep = nh // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)  # (B, S, nh, hs)
    att = softcap(jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(scale, q.dtype), cap)  # (B, nh, T, S)
    # An additive (T, S) bias, not jnp.where(mask, att, min): XLA hoists the where's operands out of
    # a scanned block, broadcast to (B, nh, T, S) (a float and a bool copy carried through the
    # forward loop: 5.4 GB for Llama-70B at T = 4096, docs/memory.md). Exact: att + 0 == att, and
    # att + min == min in float rounding.
    bias = jnp.where(mask, 0, jnp.finfo(att.dtype).min).astype(att.dtype)  # (T, S)
    att = jax.nn.softmax(att + bias, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, nh * hs), cache  # (B, T, nh, hs) -> (B, T, nh*hs)


def head_size(cfg) -> int:
    """Per-head width: ``cfg.head_dim`` where set (Qwen3, Gemma), else ``d_model // n_heads``."""
    return getattr(cfg, "head_dim", None) or cfg.d_model // cfg.n_heads


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE: one fused projection ``wqkv`` ``[C, nkv, rep + 2,
    hs]`` (``rep = nh / nkv``: for each key/value head its ``rep`` query heads, then its key, then
    its value), ``wo`` ``[nh*hs, C]``; optional q/k/v biases ``[nkv, rep + 2, hs]`` (Qwen2) and
    RMSNorms of each query and key head before RoPE (``q_norm`` / ``k_norm`` ``[hs]``: Qwen3,
    Gemma 3).

    The grouped layout is Megatron-LM's for grouped-query attention: split over the tensor
    axis along ``nkv`` (column-parallel, :func:`train.models.tensor_plan`), each device holds
    whole key/value groups with their query heads, and one fused projection means one
    all-reduce of the input's cotangent per block (separate q and k|v projections: two). Query
    head ``g * rep + r`` reads key/value head ``g`` (Hugging Face's ``repeat_kv`` order).

    Args:
      cfg: a ``LlamaConfig`` (or subclass): ``d_model``, ``n_heads``, ``n_kv_heads``,
        ``head_dim``, ``qkv_bias``, ``qk_norm``, ``norm_eps``.
      inv_freq: RoPE inverse frequencies ``[hs/2]`` (:func:`rope_frequencies`).
      scale: score scale (``hs ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
      window: sliding window in tokens, ``None``: full causal attention.
      cap: attention-score soft-cap (Gemma 2), ``None``: none.
      norm: the module of ``q_norm`` / ``k_norm`` (``nnx.RMSNorm``; Gemma: :class:`OffsetRMSNorm`).
    """

    def __init__(self, cfg, *, inv_freq, scale: float, window=None, cap=None, norm=nnx.RMSNorm, rngs: nnx.Rngs):
        hs = head_size(cfg)
        self.n_heads, self.n_kv_heads, self.hs = cfg.n_heads, cfg.n_kv_heads, hs
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static (hashable); float32 when used
        self.scale, self.window, self.cap = float(scale), window, cap
        self.rep = cfg.n_heads // cfg.n_kv_heads
        self.wqkv = nnx.LinearGeneral(cfg.d_model, (cfg.n_kv_heads, self.rep + 2, hs), use_bias=cfg.qkv_bias, rngs=rngs)
        self.wo = nnx.Linear(cfg.n_heads * hs, cfg.d_model, use_bias=False, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = norm(hs, epsilon=cfg.norm_eps, rngs=rngs)
            self.k_norm = norm(hs, epsilon=cfg.norm_eps, rngs=rngs)
        self.qk_norm = cfg.qk_norm

    def project(self, h):
        """``h`` (B, T, C) -> ``q`` (B, T, nh, hs), ``k, v`` (B, T, nkv, hs), before norms and RoPE."""
        B, T, _ = h.shape
        qkv = fused_projection(self.wqkv, h)  # (B, T, nkv, rep + 2, hs)
        q = qkv[..., : self.rep, :].reshape(B, T, self.n_heads, self.hs)  # (B, T, nkv, rep, hs) -> (B, T, nh, hs)
        return q, qkv[..., self.rep, :], qkv[..., self.rep + 1, :]  # k, v: (B, T, nkv, hs)

    def __call__(self, h, cache=None, pos=None):
        """``h`` (B, T, C) -> ``(y (B, T, C), new cache or None)``."""
        q, k, v = self.project(h)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # global positions (zshard.positions: arange on one device, this device's tokens on a split sequence)
        positions = zshard.positions(h.shape[1]) if cache is None else None
        freqs = np.asarray(self.inv_freq, np.float32)
        q, k = rope(q, freqs, pos, positions), rope(k, freqs, pos, positions)
        y, cache = attend(q, k, v, cache, pos, scale=self.scale, window=self.window, cap=self.cap)  # (B, T, nh*hs)
        return self.wo(y), cache


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # Hugging Face "gelu_pytorch_tanh"
}


class GatedMLP(nnx.Module):
    """``w_down(act(gate) * up)``, ``(gate, up) = w_gate_up(x)``: SwiGLU (``act = silu``,
    Shazeer 2020, arXiv 2002.05202) or GeGLU (``gelu_tanh``, Gemma). ``w_gate_up`` ``[C, 2, F]``
    (gate, then up: split along ``F`` over the tensor axis each device keeps its gate and up
    columns together), ``w_down`` ``[F, C]``."""

    def __init__(self, d_model: int, d_ff: int, act: str, *, rngs: nnx.Rngs):
        if act not in ACTIVATIONS:
            raise ValueError(f"GatedMLP: activation {act!r}; supported: {sorted(ACTIVATIONS)}")
        self.act = act
        self.w_gate_up = nnx.LinearGeneral(d_model, (2, d_ff), use_bias=False, rngs=rngs)
        self.w_down = nnx.Linear(d_ff, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = fused_projection(self.w_gate_up, x)  # (B, T, 2, F)
        gate, up = jnp.split(h, 2, axis=-2)  # (B, T, 1, F) each
        return self.w_down((ACTIVATIONS[self.act](gate) * up)[..., 0, :])


# ----------------------------------------------------------------------------------------
# Blocks and the KV cache
# ----------------------------------------------------------------------------------------


def make_blocks(block_cls, cfg, rngs: nnx.Rngs):
    """``cfg.n_layers`` blocks ``block_cls(cfg, layer=i, rngs=rngs)``: an ``nnx.List``, or one
    module of stacked layers when ``cfg.scan`` (all layers then have the same structure)."""
    if not cfg.scan:
        return nnx.List([block_cls(cfg, layer=i, rngs=rngs) for i in range(cfg.n_layers)])

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):  # every parameter gets a leading layer axis: [n_layers, ...]
        return block_cls(cfg, layer=0, rngs=rngs)

    return stacked(rngs)


def run_blocks(blocks, x, scan: bool, cache=None, pos=None):
    """Apply the blocks in order: a Python loop, or ``nnx.scan`` over the layer axis.

    With ``cache`` (from :func:`init_cache`): returns ``(x, new cache)``.
    """
    if cache is None:
        if not scan:
            for block in blocks:
                x = block(x)
            return x

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, blocks)
    if not scan:
        new = []
        for block, c in zip(blocks, cache):
            x, c = block(x, c, pos)
            new.append(c)
        return x, new

    # stacked cache (k, v): [B, L, Tmax, nkv, hs] each, scanned over its layer axis 1
    @nnx.scan(in_axes=(nnx.Carry, 0, 1, None), out_axes=(nnx.Carry, 1))
    def body_cached(x, block, c, pos):
        return block(x, c, pos)

    return body_cached(x, blocks, tuple(cache), pos)


def init_cache(cfg, batch: int, length: int, dtype=jnp.float32):
    """An empty KV cache for ``batch`` sequences of up to ``length`` tokens.

    Returns:
      ``cfg.n_layers`` pairs ``(k, v)``, each ``[batch, length, n_kv_heads, head_size]`` in
      ``dtype`` (a list; with ``cfg.scan`` one stacked pair ``[batch, n_layers, length, ...]``).
      Bytes: ``2 * n_layers * batch * length * n_kv_heads * head_size * itemsize``.
    """
    kv = getattr(cfg, "n_kv_heads", cfg.n_heads)
    shape = (batch, length, kv, head_size(cfg))
    if cfg.scan:
        stacked = (batch, cfg.n_layers) + shape[1:]
        return (jnp.zeros(stacked, dtype), jnp.zeros(stacked, dtype))
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.n_layers)]

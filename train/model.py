"""A GPT and a Llama in Flax NNX, written as any user would: no zshard base class, no
sharding code.

GPT: pre-norm transformer blocks (Radford et al. 2019, GPT-2 section 2.3): causal
multi-head self-attention and a 4x GELU MLP, learned absolute positions.
Llama (Touvron et al. 2023, arXiv 2302.13971 section 2.2): RMSNorm, SwiGLU MLP, rotary
positions (Su et al. 2021), grouped-query attention (Llama 2, arXiv 2307.09288), no biases.

Both take an optional KV cache for autoregressive decoding (``model(tokens, cache=cache,
pos=pos)`` -> ``(logits, cache)``; :func:`init_cache` makes an empty one): the keys and
values of positions ``< pos`` are read from the cache, those of ``tokens`` written into it at
``pos .. pos+T-1``. Without ``cache`` the models are unchanged.

About 450 lines: the two model families share the block runner, the KV cache, the embedding,
the loss (both with written-out gradients, docs/memory.md) and the wrap policy the plan tool
uses with them; split off the loss and embedding if they grow further.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "GPTConfig", "GPT", "Block", "LlamaConfig", "Llama", "MODEL_PRESETS", "PLAN_PRESETS", "cross_entropy_loss", "init_cache",
    "units_with_ends", "from_hf", "to_hf",
]


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
    zeros are allocated only once the incoming gradient exists (:func:`_zero_after`)."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"Embed: token ids must be integers, got {inputs.dtype}")
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        return _lookup(embedding, inputs)


def make_blocks(block_cls, cfg, rngs: nnx.Rngs):
    """``cfg.n_layers`` blocks: an ``nnx.List``, or one module of stacked layers when ``cfg.scan``."""
    if not cfg.scan:
        return nnx.List([block_cls(cfg, rngs=rngs) for _ in range(cfg.n_layers)])

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):  # every parameter gets a leading layer axis: [n_layers, ...]
        return block_cls(cfg, rngs=rngs)

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
    shape = (batch, length, kv, cfg.d_model // cfg.n_heads)
    if cfg.scan:
        stacked = (batch, cfg.n_layers) + shape[1:]
        return (jnp.zeros(stacked, dtype), jnp.zeros(stacked, dtype))
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.n_layers)]


def _attend(q, k, v, cache, pos):
    """Causal attention of ``q`` (B, T, nh, hs) over ``k, v`` (B, T, nkv, hs), through the cache.

    Returns ``(y (B, T, nh*hs), new cache or None)``. With a cache ``(ck, cv)`` of
    ``(B, Tmax, nkv, hs)``, ``k, v`` are written at ``pos`` and the query at ``pos + i``
    attends to cache positions ``<= pos + i``.
    """
    B, T, nh, hs = q.shape
    if cache is None:
        mask = jnp.tril(jnp.ones((T, T), bool))  # (T, T)
    else:
        ck, cv = cache
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, pos, 0, 0))  # (B, Tmax, nkv, hs)
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, pos, 0, 0))
        k, v, cache = ck.astype(q.dtype), cv.astype(q.dtype), (ck, cv)
        mask = jnp.arange(k.shape[1])[None, :] <= pos + jnp.arange(T)[:, None]  # (T, Tmax)
    rep = nh // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)  # (B, S, nh, hs)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hs).astype(q.dtype)  # (B, nh, T, S)
    # An additive (T, S) bias, not jnp.where(mask, att, min): XLA hoists the where's operands out of
    # a scanned block, broadcast to (B, nh, T, S) (a float and a bool copy carried through the
    # forward loop: 5.4 GB for Llama-70B at T = 4096, docs/memory.md). Exact: att + 0 == att, and
    # att + min == min in float rounding.
    bias = jnp.where(mask, 0, jnp.finfo(att.dtype).min).astype(att.dtype)  # (T, S)
    att = jax.nn.softmax(att + bias, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, nh * hs), cache  # (B, T, nh, hs) -> (B, T, C)


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        # No qkv bias: a key bias only shifts each softmax row, so its true gradient is 0 and
        # Adam would amplify rounding noise in it (as in LLaMA, no attention biases).
        # (GPT-2 checkpoints have one: qkv_bias=True.)
        self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, use_bias=cfg.qkv_bias, rngs=rngs)
        self.proj = nnx.Linear(cfg.d_model, cfg.d_model, rngs=rngs)

    def __call__(self, x, cache=None, pos=None):
        B, T, C = x.shape
        hs = C // self.n_heads
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)  # 3 x (B, T, C)
        q, k, v = (t.reshape(B, T, self.n_heads, hs) for t in (q, k, v))  # (B, T, nh, hs)
        y, cache = _attend(q, k, v, cache, pos)  # (B, T, C)
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

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
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

    ``model(tokens, cache=c, pos=p)`` (``c`` from :func:`init_cache`, ``p`` an int32 scalar,
    the position of ``tokens[:, 0]``) -> ``(logits, new cache)``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.wpe = Embed(cfg.seq_len, cfg.d_model, rngs=rngs)
        self.blocks = make_blocks(Block, cfg, rngs)
        self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens, cache=None, pos=None):
        T = tokens.shape[1]
        start = 0 if cache is None else pos
        x = self.wte(tokens) + self.wpe(start + jnp.arange(T))[None]  # (B, T, C)
        x = run_blocks(self.blocks, x, self.cfg.scan, cache, pos)
        x, cache = (x, None) if cache is None else x
        x = self.ln_f(x)
        logits = self.wte.attend(x) if self.cfg.tie_embeddings else self.head(x)  # (B, T, vocab)
        return logits if cache is None else (logits, cache)


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
      norm_eps: RMSNorm epsilon (Hugging Face ``rms_norm_eps``).
      tie_embeddings: the output projection is the token embedding (``embed.attend``).
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


def _rope(x, theta: float, start=0):
    """Rotary position embedding of ``x`` (B, T, h, hs), positions ``start .. start+T-1``.

    Half-split layout (x1 = first half of each head, x2 = second), as Hugging Face's
    ``rotate_half``; frequencies ``theta ** (-2i / hs)`` (Su et al. 2021, arXiv 2104.09864 eq. 34).
    """
    B, T, h, hs = x.shape
    freqs = theta ** (-jnp.arange(0, hs // 2, dtype=jnp.float32) / (hs // 2))  # (hs/2,)
    ang = (start + jnp.arange(T, dtype=jnp.float32))[:, None] * freqs[None]  # (T, hs/2)
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]  # (1, T, 1, hs/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class LlamaBlock(nnx.Module):
    """``x + attn(rmsnorm(x))``, then ``x + swiglu(rmsnorm(x))``. ``x``: (B, T, d_model)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        hs = cfg.d_model // cfg.n_heads
        self.cfg = cfg
        self.attn_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        self.wq = nnx.Linear(cfg.d_model, cfg.n_heads * hs, use_bias=False, rngs=rngs)
        self.wkv = nnx.Linear(cfg.d_model, 2 * cfg.n_kv_heads * hs, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(cfg.n_heads * hs, cfg.d_model, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        self.w_gate_up = nnx.Linear(cfg.d_model, 2 * cfg.d_ff, use_bias=False, rngs=rngs)
        self.w_down = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=False, rngs=rngs)

    def __call__(self, x, cache=None, pos=None):
        cfg = self.cfg
        B, T, C = x.shape
        hs = C // cfg.n_heads
        start = 0 if cache is None else pos
        h = self.attn_norm(x)
        q = _rope(self.wq(h).reshape(B, T, cfg.n_heads, hs), cfg.rope_theta, start)  # (B, T, nh, hs)
        k, v = jnp.split(self.wkv(h).reshape(B, T, 2 * cfg.n_kv_heads, hs), 2, axis=2)  # (B, T, nkv, hs)
        y, new = _attend(q, _rope(k, cfg.rope_theta, start), v, cache, pos)  # (B, T, C); keys repeated to nh inside
        x = x + self.wo(y)
        gate, up = jnp.split(self.w_gate_up(self.mlp_norm(x)), 2, axis=-1)  # 2 x (B, T, d_ff)
        out = x + self.w_down(jax.nn.silu(gate) * up)
        return out if cache is None else (out, new)


class Llama(nnx.Module):
    """Tokens (B, T) int32 -> logits (B, T, vocab_size)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.blocks = make_blocks(LlamaBlock, cfg, rngs)
        self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens, cache=None, pos=None):
        x = self.embed(tokens)  # (B, T, C)
        x = run_blocks(self.blocks, x, self.cfg.scan, cache, pos)
        x, cache = (x, None) if cache is None else x
        x = self.norm(x)
        logits = self.embed.attend(x) if self.cfg.tie_embeddings else self.head(x)  # (B, T, vocab)
        return logits if cache is None else (logits, cache)


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


def units_with_ends(path: tuple, module: nnx.Module) -> bool:
    """A zshard wrap policy (``zshard.init(..., unit=units_with_ends)``) for :class:`GPT` and
    :class:`Llama`: the blocks (each element of ``blocks``, or the stacked ``blocks``), the
    token embedding (``wte`` / ``embed``) and the untied output head (``head``) are units.

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


def build_model(cfg, rngs: nnx.Rngs):
    """``GPT`` for a :class:`GPTConfig`, ``Llama`` for a :class:`LlamaConfig`."""
    return GPT(cfg, rngs=rngs) if isinstance(cfg, GPTConfig) else Llama(cfg, rngs=rngs)


@jax.custom_vjp
def _token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean of ``-log softmax(logits)[targets]``: float ``[..., V]``, int ``[...]`` -> scalar."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _token_nll_fwd(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)  # [..., V]
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)), (logp, targets)


def _token_nll_bwd(res, g):
    logp, targets = res
    # d/dz_j of -log softmax(z)_t = softmax(z)_j - [j == t], averaged over the n = targets.size
    # tokens. Written out so that it is computed from the residual, in one expression: left to
    # autodiff, the gradient of the take_along_axis is a logits-sized scatter of -1/n that
    # depends on the targets only, and XLA computed it at the start of the step and kept it
    # (docs/memory.md, "Llama-2-70B on 8x8").
    onehot = jnp.arange(logp.shape[-1]) == targets[..., None]  # [..., V] bool
    return (jnp.exp(logp) - onehot) * (g / targets.size), None


_token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)


def cross_entropy_loss(model: GPT, batch) -> jax.Array:
    """Mean next-token cross-entropy (nats). ``batch = (inputs, targets)``, each (B, T) int32.

    The gradient with respect to the logits is ``(softmax(logits) - onehot(targets)) / n``,
    written out (:func:`_token_nll`) rather than left to autodiff; equal up to rounding.
    """
    inputs, targets = batch
    logits = model(inputs).astype(jnp.float32)
    return _token_nll(logits, targets)


def __getattr__(name):  # from_hf / to_hf live in train/hf.py (imported on first use)
    if name in ("from_hf", "to_hf"):
        from train import hf  # noqa: PLC0415

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

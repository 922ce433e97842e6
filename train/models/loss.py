"""The loss of ``train/models/``: the next-token cross-entropy with its gradient written out,
over the whole logits (:func:`token_nll`) or over the final hidden states and the head in
chunks of tokens, so no float32 ``[tokens, V]`` buffer exists (:func:`chunked_token_nll`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from train.models.core import _zero_after, softcap

__all__ = ["Head", "LOSS_CHUNK_ELEMENTS", "chunked_token_nll", "cross_entropy_loss", "loss_chunk", "token_nll"]

@jax.custom_vjp
def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
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


token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)


class Head(NamedTuple):
    """A model's output projection, as the chunked loss reads it (:meth:`Llama.output_head`).

    Attributes:
      weight: ``[C, V]`` (a ``Linear`` head's kernel, ``vocab_dim=1``) or ``[V, C]`` (a tied
        embedding, ``vocab_dim=0``); logits ``h @ weight`` or ``h @ weight.T``.
      vocab_dim: the dimension of ``weight`` that is the vocabulary.
      cap: final-logit soft-cap (Gemma 2, :func:`softcap`), ``None``: none.
    """

    weight: jax.Array
    vocab_dim: int
    cap: float | None = None


# [Note: chunked loss] Elements of one chunk's float32 logits [tokens, V] (64 MiB): a chunk holds
# at most max(1, LOSS_CHUNK_ELEMENTS // V) tokens, the chunks balanced (Llama 3's V = 128256: at most 130, so 64
# chunks of 128 for an 8192-token sequence, none padded). Wijmans et al. 2024 ("Cut Your Losses in
# Large-Vocabulary Language Models", arXiv 2411.09009, section 4) compute the loss blockwise and recompute each block's logits in the backward; this is that idea
# with blocks of whole rows (tokens), so that a vocabulary split over the tensor axis is left to XLA.
LOSS_CHUNK_ELEMENTS = 1 << 24


def loss_chunk(tokens: int, vocab: int, elements: int | None = None) -> int:
    """Tokens per chunk of :func:`chunked_token_nll`: ``ceil(tokens / n)`` for the fewest chunks ``n`` of at
    most ``m = min(tokens, max(1, elements // vocab))`` tokens (padded rows < n: each costs the head's FLOPs),
    ``elements`` default :data:`LOSS_CHUNK_ELEMENTS` (read when called)."""
    most = max(1, min(tokens, (LOSS_CHUNK_ELEMENTS if elements is None else elements) // vocab))
    return -(-tokens // -(-tokens // most))  # 8192 tokens, m = 130: 64 chunks of 128 (not 64 of 130, 128 rows padded)


def _chunk_logits(h, w, vocab_dim: int, cap):
    """``h`` ``[c, C]`` (compute dtype) and the head -> float32 logits ``[c, V]`` before and after the soft-cap
    (products in the compute dtype, accumulated in float32)."""
    dims = (((1,), (1 - vocab_dim,)), ((), ()))  # contract C: [c, C] x [C, V] or [c, C] x [V, C]
    raw = jax.lax.dot_general(h, w, dims, preferred_element_type=jnp.float32)  # [c, V] f32
    return raw, softcap(raw, cap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked_nll(h, w, targets, vocab_dim: int, cap, chunk: int):
    return _chunked_fwd(h, w, targets, vocab_dim, cap, chunk)[0]


def _pad_chunks(x, chunk: int):
    """``[N, ...]`` -> ``[n, chunk, ...]``, zero rows appended (``n = ceil(N / chunk)``)."""
    pad = -x.shape[0] % chunk
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x  # [N, ...] -> [n*chunk, ...]
    return x.reshape((-1, chunk) + x.shape[1:])  # [n*chunk, ...] -> [n, chunk, ...]


def _chunked_fwd(h, w, targets, vocab_dim, cap, chunk):
    N = targets.shape[0]
    hc, tc = _pad_chunks(h, chunk), _pad_chunks(targets, chunk)  # [n, c, C], [n, c]

    def body(_, xs):
        h_i, t_i = xs
        _, z = _chunk_logits(h_i, w, vocab_dim, cap)  # [c, V] f32, freed at the end of the iteration
        lse = jax.nn.logsumexp(z, axis=-1)  # [c] f32
        return None, (lse, lse - jnp.take_along_axis(z, t_i[:, None], axis=-1)[:, 0])  # [c], [c]

    _, (lse, nll) = jax.lax.scan(body, None, (hc, tc))  # [n, c] each
    valid = (jnp.arange(nll.size) < N).reshape(nll.shape)  # the padded rows count for nothing
    return jnp.sum(jnp.where(valid, nll, 0.0)) / N, (h, w, targets, lse)


def _chunked_bwd(vocab_dim, cap, chunk, res, g):
    h, w, targets, lse = res
    N, n = targets.shape[0], lse.shape[0]
    hc, tc = _pad_chunks(h, chunk), _pad_chunks(targets, chunk)  # [n, c, C], [n, c]
    scale = jnp.where(jnp.arange(n * chunk) < N, g / N, 0.0).reshape(n, chunk)  # [n, c] f32: 0 on padded rows
    wt_dims = (((1,), (vocab_dim,)), ((), ()))  # [c, V] x head -> [c, C]
    dw_dims = (((0,), (0,)), ((), ()))  # contract the chunk's tokens

    def body(dw, xs):
        h_i, t_i, lse_i, s_i = xs
        _, z = _chunk_logits(h_i, w, vocab_dim, cap)  # recomputed: [c, V] f32
        # d/dz_j of lse(z) - z_t = softmax(z)_j - [j == t], times g / N (Wijmans et al. 2024, eq. 3)
        dz = (jnp.exp(z - lse_i[:, None]) - (jnp.arange(z.shape[-1]) == t_i[:, None])) * s_i[:, None]  # [c, V]
        if cap is not None:  # d cap*tanh(r/cap) / dr = 1 - tanh^2 = 1 - (z/cap)^2
            dz = dz * (1.0 - jnp.square(z / cap))
        dz = dz.astype(h_i.dtype)  # the compute dtype, accumulated in float32 below
        dh = jax.lax.dot_general(dz, w, wt_dims, preferred_element_type=jnp.float32).astype(h.dtype)  # [c, C]
        if vocab_dim == 1:
            dw_i = jax.lax.dot_general(h_i, dz, dw_dims, preferred_element_type=jnp.float32)  # [c, C]^T [c, V] -> [C, V]
        else:
            dw_i = jax.lax.dot_general(dz, h_i, dw_dims, preferred_element_type=jnp.float32)  # [c, V]^T [c, C] -> [V, C]
        return dw + dw_i, dh

    dw0 = _zero_after(w.shape, jnp.float32, lse * g)  # f32 accumulator of the head's gradient: after lse (g is a constant 1)
    dw, dh = jax.lax.scan(body, dw0, (hc, tc, lse, scale))  # [C, V] or [V, C]; [n, c, C]
    dh = dh.reshape((-1,) + h.shape[1:])[:N]  # [n, c, C] -> [N, C]
    # a barrier: XLA would fuse this cast into the reduce's, holding the f32 [C, V] through the blocks' backward
    return dh, jax.lax.optimization_barrier(dw.astype(w.dtype)), None


_chunked_nll.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_token_nll(h: jax.Array, head: Head, targets: jax.Array, *, chunk: int | None = None) -> jax.Array:
    """Mean of ``-log softmax(h @ head)[targets]`` without the ``[tokens, V]`` float32 logits.

    Scans over chunks of ``chunk`` tokens (default :func:`loss_chunk`): each chunk's logits are
    computed (products in the compute dtype of ``h`` and the head, float32 accumulation), reduced to
    their float32 log-sum-exp and target logit, and dropped; the backward recomputes them chunk by
    chunk and writes the gradient ``(softmax - onehot) / n`` out (:func:`token_nll`'s), accumulating
    the head's gradient in one float32 buffer of the head's shape. Live at once: one chunk's float32
    ``[c, V]`` (three in the backward: logits, probabilities, their gradient) instead of the whole
    ``[tokens, V]`` (Wijmans et al. 2024, arXiv 2411.09009, "Cut Your Losses in Large-Vocabulary
    Language Models"; [Note: chunked loss]). Equal to :func:`token_nll` of the logits up to float32
    rounding; the logits' FLOPs three times (forward, and twice in the backward: as autodiff).

    Args:
      h: hidden states ``[..., C]`` after the final norm (float; the compute dtype).
      head: the output projection (:class:`Head`); a vocabulary split over the ``tensor`` axis
        stays split (the chunks are over tokens, XLA partitions each chunk's ``[c, V]``).
      targets: int ``[...]``, ids in ``[0, V)``.
      chunk: tokens per chunk (padded with rows that count for nothing).

    Returns:
      float32 scalar, nats.
    """
    C = h.shape[-1]
    if head.weight.ndim != 2 or head.weight.shape[1 - head.vocab_dim] != C:
        raise ValueError(f"chunked_token_nll: head weight {head.weight.shape} (vocab_dim {head.vocab_dim}) does not "
                         f"project hidden states of width {C}")
    if h.shape[:-1] != targets.shape:
        raise ValueError(f"chunked_token_nll: hidden states {h.shape} and targets {targets.shape} differ in tokens")
    dtype = jnp.result_type(h.dtype, head.weight.dtype)  # as nnx.Linear / Embed.attend promote
    flat_h = h.reshape(-1, C).astype(dtype)  # [..., C] -> [N, C]
    flat_t = targets.reshape(-1)  # [...] -> [N]
    V = head.weight.shape[head.vocab_dim]
    n_chunk = loss_chunk(flat_t.shape[0], V) if chunk is None else chunk
    return _chunked_nll(flat_h, head.weight.astype(dtype), flat_t, head.vocab_dim, head.cap, n_chunk)


def cross_entropy_loss(model, batch) -> jax.Array:
    """Mean next-token cross-entropy (nats). ``batch = (inputs, targets)``, each (B, T) int32.

    For the models of ``train.models`` (a ``hidden`` and an ``output_head`` method): the final hidden
    states and the head through :func:`chunked_token_nll`, so no float32 ``[tokens, V]`` logits exist
    in forward or backward. For any other model: ``model(inputs)``'s logits through
    :func:`token_nll`. Both write the gradient ``(softmax - onehot) / n`` out rather than leave it
    to autodiff; equal up to rounding.
    """
    inputs, targets = batch
    if hasattr(model, "hidden") and hasattr(model, "output_head"):
        return chunked_token_nll(model.hidden(inputs), model.output_head(), targets)
    logits = model(inputs).astype(jnp.float32)
    return token_nll(logits, targets)

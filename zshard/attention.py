"""``zshard.attention``: scaled dot-product attention that works on a sequence split over ``context``.

The kernel follows the devices of the mesh being compiled for (:func:`zshard.gpu.traced_platform`:
the enclosing ``shard_map``'s mesh, else the process's backend), never the process's default
backend alone: on a mesh of CUDA GPUs, one device's attention is cuDNN's flash attention
(:func:`cuda_attention`, with a named fallback to the tiled block where cuDNN refuses); on a split
sequence the all-gather / ring walk below runs on every platform (its merge of partial results needs
each block's log-sum-exp and a backward from the global one, which ``jax.nn``'s cuDNN call does not
expose). On CPU (and TPU, ROCm) the paths are:

Outside a step whose sequence is split (one device, ``C = 1``, an eval or forward without a
sequence axis, plain JAX) it is ``jax.nn.dot_product_attention`` (the mask passed as an additive
bias, GQA's keys and values repeated to the query heads: the same numbers, less memory in a
scanned block; :func:`_bias`). Inside one (docs/long-sequences.md),
each context device holds its queries, keys and values of ``2c = L / C`` tokens in the head-tail
order (:mod:`zshard.context.sequence`), and every query must meet every key of the sequence:

- ``impl="allgather"`` (default): the keys and values (and segment ids) are all-gathered over
  ``context`` once, ``[B, 2c, n_kv, D] --all_gather(context)--> [B, L, n_kv, D]``; the backward pass
  is the transpose, a reduce-scatter of ``dK`` and ``dV`` to their owners. Llama-3's context
  parallelism (arXiv 2407.21783 section 3.3.2) does the same: the keys are few (GQA).
- ``impl="ring"``: ring attention (Liu et al., arXiv 2310.01889): ``C`` steps, each computes this
  device's queries against the key/value chunk it holds while that chunk moves on to the next
  device (``ppermute``, issued before the step's compute so a GPU overlaps the two); the backward
  pass sends ``dK``, ``dV`` back around the ring. The same bytes as the all-gather, never the whole
  sequence's keys on one device.

Both walk the ``C`` key/value chunks of the sequence (one per source device ``j``) with an
online softmax (Milakov & Gimelshein 2018; flash attention's merge of partial results), and skip
the blocks a causal mask hides entirely: with the head-tail order every device computes the same
number of ``c x c`` blocks, ``2C + 2`` ([Note: causal blocks]). Inside a step the blocks are
computed in tiles of at most ``tile`` (512) queries x keys (FlashAttention-2, Dao 2023, arXiv
2307.08691 section 3.1: an online softmax over key tiles in ``lax.scan``), and the walk of the
sources is one ``jax.custom_vjp`` that saves only the output and the log-sum-exp of each query
row: the backward recomputes each tile's scores from them (their algorithm 2). One tile's scores
exist at a time, forward and backward, and the sources are ``lax.scan`` steps (one source's
buffers live at once), so the temporaries fall as ``1/C`` but for the gathered keys and values
(docs/long-sequences.md, "Memory"). Numbers equal ``jax.nn.dot_product_attention`` on one
device (fp32 within 1e-6, tests/test_attention.py).

The collectives run under the named scope :data:`zshard.inspection.jaxprs.CONTEXT_SCOPE`, so
``zshard.report`` finds them in the compiled program (its ``context`` row).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from zshard.gpu import cuda_attention, traced_platform
from zshard.context.flash import NEG, TILE, block_backward, block_forward, from_tiles, one_device, varying, zero
from zshard.inspection.jaxprs import CONTEXT_SCOPE
from zshard.mesh.mesh import CONTEXT
from zshard.context.sequence import AttentionCall, SequenceSplit, active

__all__ = ["IMPLS", "attention", "schedule"]

IMPLS = ("allgather", "ring")
DIAG, LOWER, UPPER = 0, 1, 2  # which blocks of (my 2 chunks) x (a source's 2 chunks) are computed

# [Note: causal blocks] Device i holds query chunks a = i and b = 2C-1-i; source device j holds key
# chunks j and 2C-1-j. Under a causal mask:
#   j == i (DIAG):  q[a, b] x k[a, b]  -- 4 blocks, masked elementwise (q_a x k_b is all masked)
#   j <  i (LOWER): q[a, b] x k[j]     -- 2 blocks: chunk 2C-1-j comes after both of mine
#   j >  i (UPPER): q[b]    x k[j, 2C-1-j] -- 2 blocks: both come before chunk b, after chunk a
# Every device meets i LOWER and C-1-i UPPER sources and one DIAG: 4 + 2(C-1) blocks, whatever i.
# The elementwise mask (positions, window, segments) is always applied, so skipping only ever drops
# blocks that are masked whole. Without a causal mask every source is DIAG.


def schedule(index: int, context: int, impl: str = "allgather", causal: bool = True) -> list[int]:
    """The block kind (``DIAG`` / ``LOWER`` / ``UPPER``) of each step on context device ``index``:
    ``allgather`` visits sources ``j = 0 .. C-1``, ``ring`` step ``t`` the chunk of ``j = (i - t) mod C``."""
    sources = range(context) if impl == "allgather" else [(index - t) % context for t in range(context)]
    return [_kind(index, j, causal) for j in sources]


def _kind(i, j, causal: bool):
    if not causal:
        return DIAG
    if isinstance(i, numbers.Integral) and isinstance(j, numbers.Integral):
        return DIAG if i == j else LOWER if j < i else UPPER
    return jnp.where(i == j, DIAG, jnp.where(j < i, LOWER, UPPER))


def _merge(a, b):
    """Two partial results over disjoint keys -> one (the online softmax's rescaling, in
    log-sum-exp form: ``lse = log(e^lse1 + e^lse2)``, ``o = o1 e^(lse1 - lse) + o2 e^(lse2 - lse)``)."""
    (o1, l1), (o2, l2) = a, b
    m = jnp.maximum(l1, l2)
    w1, w2 = jnp.exp(l1 - m), jnp.exp(l2 - m)
    total = w1 + w2
    return (o1 * w1[..., None] + o2 * w2[..., None]) / total[..., None], m + jnp.log(total)


def _empty(q, dv):
    B, Lq, H, G, _ = q.shape
    return jnp.zeros((B, Lq, H, G, dv), jnp.float32), jnp.full((B, Lq, H, G), NEG, jnp.float32)


def _step(kind, q, k, v, qpos, kpos, qseg, kseg, *, c, opts):
    """One source's keys, forward: the blocks of ``kind`` ([Note: causal blocks]); ``(o, lse)``
    partials ``[B, 2c, ...]`` for all ``2c`` queries (a query that sees nothing: ``o = 0``, ``lse``
    the masked logit)."""
    block = functools.partial(block_forward, **opts)
    sl = lambda x, lo, hi: None if x is None else x[:, lo:hi]  # noqa: E731  [B, L, ...] -> [B, lo:hi, ...]

    def diag(q, k, v, qpos, kpos, qseg, kseg):  # q[a, b] x k[both]
        return block(q, k, v, qpos, kpos, qseg, kseg)

    def lower(q, k, v, qpos, kpos, qseg, kseg):  # q[a, b] x k[first chunk]
        return block(q, k[:, :c], v[:, :c], qpos, kpos[:c], qseg, sl(kseg, 0, c))

    def upper(q, k, v, qpos, kpos, qseg, kseg):  # q[b] x k[both]; q[a] sees nothing of this source
        ob, lb = block(q[:, c:], k, v, qpos[c:], kpos, sl(qseg, c, 2 * c), kseg)
        oa, la = _empty(q[:, :c], v.shape[-1])
        return jnp.concatenate([oa, ob], 1), jnp.concatenate([la, lb], 1)  # [B, c] + [B, c] -> [B, 2c]

    return _switch(kind, (diag, lower, upper), q, k, v, qpos, kpos, qseg, kseg)


def _step_grad(kind, q, k, v, qpos, kpos, qseg, kseg, o, lse, do, *, c, opts):
    """One source's keys, backward (:func:`block_backward` of the blocks of ``kind``) from the
    final ``o``, ``lse``, ``do`` ``[B, 2c, ...]`` of this device's queries: ``(dq [B, 2c, ...], dk,
    dv [B, 2c, ...])`` float32, zero where ``kind`` skips a chunk."""
    grad = functools.partial(block_backward, **opts)
    sl = lambda x, lo, hi: None if x is None else x[:, lo:hi]  # noqa: E731  [B, L, ...] -> [B, lo:hi, ...]

    def diag(q, k, v, qpos, kpos, qseg, kseg, o, lse, do):
        return grad(q, k, v, qpos, kpos, qseg, kseg, o, lse, do)

    def lower(q, k, v, qpos, kpos, qseg, kseg, o, lse, do):  # dk, dv of the second chunk: 0
        dq, dk, dv = grad(q, k[:, :c], v[:, :c], qpos, kpos[:c], qseg, sl(kseg, 0, c), o, lse, do)
        return dq, jnp.concatenate([dk, jnp.zeros_like(dk)], 1), jnp.concatenate([dv, jnp.zeros_like(dv)], 1)

    def upper(q, k, v, qpos, kpos, qseg, kseg, o, lse, do):  # dq of the first chunk: 0
        dq, dk, dv = grad(q[:, c:], k, v, qpos[c:], kpos, sl(qseg, c, 2 * c), kseg, o[:, c:], lse[:, c:], do[:, c:])
        return jnp.concatenate([jnp.zeros_like(dq), dq], 1), dk, dv

    return _switch(kind, (diag, lower, upper), q, k, v, qpos, kpos, qseg, kseg, o, lse, do)


def _switch(kind, branches, *args):
    if isinstance(kind, numbers.Integral):  # known while tracing: one device's program
        return branches[kind](*args)
    return jax.lax.switch(kind, branches, *args)


def _bias(lq: int, lk: int, causal: bool, window, segment_ids):
    """The mask of the one-device path as an additive float32 bias, ``[1, 1, Lq, Lk]`` (``[B, 1,
    Lq, Lk]`` with segment ids), or ``None``: 0 where a query sees a key, the masked logit elsewhere.

    Exactly ``jax.nn.dot_product_attention``'s ``mask=`` / ``is_causal=`` / ``local_window_size=``
    (a masked logit's ``exp`` is 0 either way), without their ``jnp.where`` over a boolean of the
    scores' full shape: XLA hoists that ``[B, H, Lq, Lk]`` boolean out of a scanned block and keeps it
    through the forward loop (one scores-sized buffer more per step; an additive ``[Lq, Lk]`` bias
    stays small, train/models/core.py's note)."""
    keep = None
    # [Lq, Lk]: query position - key position, built in the program (an iota), not on the host
    # (a numpy mask of 100k tokens is 74.5 GiB before anything compiles, and a constant in the HLO)
    dist = jax.lax.broadcasted_iota(jnp.int32, (lq, lk), 0) - jax.lax.broadcasted_iota(jnp.int32, (lq, lk), 1)
    if causal:
        keep = dist >= 0
    if window is not None:
        near = (dist < window) & (dist > -window)
        keep = near if keep is None else keep & near
    bias = None if keep is None else jnp.where(keep, 0.0, NEG).astype(jnp.float32)[None, None]  # [1, 1, Lq, Lk]
    if segment_ids is not None:
        same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, Lq, Lk]
        seg = jnp.where(same, 0.0, NEG).astype(jnp.float32)
        bias = seg if bias is None else jnp.minimum(bias, seg)
    return bias


def _check(q, k, v, causal, segment_ids, sliding_window, scale, impl, softcap=None, tile=TILE) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(f"zshard.attention: {name} has shape {jnp.shape(x)} ({jnp.result_type(x)}); q, k and v are "
                             "floating [batch, length, heads, head_dim]")
    (B, L, H, D), (Bk, Lk, Hk, Dk) = q.shape, k.shape
    if v.shape != k.shape or Bk != B or Dk != D:
        raise ValueError(f"zshard.attention: q {q.shape}, k {k.shape}, v {v.shape}: k and v must have one shape "
                         "[B, S, n_kv, D] with q's batch and head_dim")
    if H % Hk:
        raise ValueError(f"zshard.attention: {H} query heads do not divide into {Hk} key/value heads (GQA needs "
                         "heads % kv_heads == 0)")
    if segment_ids is not None and (jnp.shape(segment_ids) != (B, L) or not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer)):
        raise ValueError(f"zshard.attention: segment_ids has shape {jnp.shape(segment_ids)} ({jnp.result_type(segment_ids)}); "
                         f"give integer ids [batch, length] = {[B, L]}, one per token (self-attention: q and k share them)")
    if segment_ids is not None and Lk != L:
        raise ValueError(f"zshard.attention: segment_ids need self-attention (q length {L}, k length {Lk})")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral)
                                       or sliding_window < 1):
        raise ValueError(f"zshard.attention: sliding_window={sliding_window!r} must be a positive int (keys within "
                         "that many positions, the query's own included)")
    if scale is not None and not (isinstance(scale, numbers.Real) and math.isfinite(scale)):
        raise ValueError(f"zshard.attention: scale={scale!r} must be a finite number (default 1/sqrt(head_dim))")
    if softcap is not None and not (isinstance(softcap, numbers.Real) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"zshard.attention: softcap={softcap!r} must be a positive finite number (Gemma 2: 50.0)")
    if isinstance(tile, bool) or not isinstance(tile, numbers.Integral) or tile < 1:
        raise ValueError(f"zshard.attention: tile={tile!r} must be a positive int (tokens per query / key tile, "
                         f"default {TILE})")
    if impl not in IMPLS:
        raise ValueError(f"zshard.attention: impl={impl!r}; choose one of {', '.join(map(repr, IMPLS))}")
    if not isinstance(causal, bool):
        raise ValueError(f"zshard.attention: causal={causal!r} must be True or False")


def attention(q, k, v, *, causal: bool = True, segment_ids=None, sliding_window: int | None = None,
              scale: float | None = None, softcap: float | None = None, impl: str = "allgather",
              tile: int = TILE) -> jax.Array:
    """Scaled dot-product attention, exact on a sequence split over the ``context`` axis.

    Args:
      q: queries ``[B, L, H, D]`` (this device's tokens; inside a split step ``L = L_global / C``
        in the head-tail order of :mod:`zshard.context.sequence`).
      k, v: keys and values ``[B, L, n_kv, D]``; ``n_kv < H`` is grouped-query attention (query
        head ``h`` reads key/value head ``h // (H / n_kv)``, as ``jax.nn.dot_product_attention``).
      causal: each query sees only keys at global positions ``<=`` its own.
      segment_ids: int ``[B, L]``: packed documents; a query sees only keys of its own segment.
        A batch leaf with the sequence axis, so it is split and ordered like the tokens.
      sliding_window: ``W``: a query at position ``p`` sees keys at ``p' > p - W`` (and
        ``p' < p + W`` when not causal): ``W`` keys including its own under a causal mask
        (Mistral's ``sliding_window``; ``jax.nn.dot_product_attention(local_window_size=(W-1, W-1))``).
      scale: the logits' factor, default ``1 / sqrt(D)``.
      softcap: ``cap``: logits ``cap * tanh(s / cap)`` before the mask and softmax (Gemma 2,
        arXiv 2408.00118 section 2); ``None``: none. ``jax.nn.dot_product_attention`` has no such
        option: with a soft-cap the one-device path is this module's own tiled block (the same
        math as on a split sequence: one ``L x L`` block in tiles of ``tile``).
      impl: ``"allgather"`` (keys and values all-gathered over ``context``) or ``"ring"``
        (passed around the ring with ``ppermute``); equal in numbers, equal in bytes.
      tile: tokens per query and per key tile of the tiled (flash) block that computes each
        context step and the soft-capped one-device path (FlashAttention-2, Dao 2023, arXiv
        2307.08691 section 3.1): one tile's ``[B, tile, H, tile]`` float32 scores exist at a
        time, forward and backward. A chunk shorter than ``tile`` is one tile; a length ``tile``
        does not divide is cut into ``ceil(n / tile)`` equal tiles, the last padded with masked
        tokens. The plain one-device path (``jax.nn.dot_product_attention``) does not tile.

    On a mesh of CUDA GPUs (``zshard.gpu_devices`` or real ones) one device's call (no split
    sequence) is cuDNN's flash attention (:func:`cuda_attention`; ``tile`` unused), falling back to
    the tiled block with a warning naming the reason (:func:`cudnn_refusal`, or cuDNN's own).

    Returns:
      ``[B, L, H, D]`` in ``q``'s dtype (logits and softmax in float32).

    Raises:
      ValueError: shapes, dtypes or options as named above; inside a split step, ``q`` not holding
        this device's ``L_global / C`` tokens of each sequence (a model that slices its input first).
    """
    _check(q, k, v, causal, segment_ids, sliding_window, scale, impl, softcap, tile)
    record = active()
    split = None if record is None else record.split
    if (split is None or split.context == 1) and traced_platform(q) == "cuda":  # the mesh's devices decide
        return cuda_attention(q, k, v, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window, scale=scale,
                              softcap=softcap, tile=tile)
    if (split is None or split.context == 1) and softcap is not None:
        return one_device(q, k, v, causal, segment_ids, sliding_window, scale, softcap, tile)
    if split is None or split.context == 1:
        # GQA: K/V repeated to the query heads, [B, S, n_kv, D] -> [B, S, H, D]: jax.nn's grouped
        # [B, n_kv, G, L, S] scores cost one scores-sized copy more in a scanned block (measured:
        # a 4-layer scanned Llama at T = 1024, temp 904 -> 847 MB, the same as without GQA)
        rep = q.shape[2] // k.shape[2]
        k, v = (k, v) if rep == 1 else (jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2))
        return jax.nn.dot_product_attention(q, k, v, bias=_bias(q.shape[1], k.shape[1], causal, sliding_window, segment_ids),
                                            scale=scale)
    if q.shape[1] != split.local or k.shape[1] != split.local:
        raise ValueError(
            f"zshard.attention: q {q.shape} and k {k.shape} must hold this device's {split.local} tokens of each sequence "
            f"(L={split.length} over context={split.context}); attention on a slice of the placed sequence is not defined"
        )
    record.record(AttentionCall(q.shape[0], split.length, k.shape[2], k.shape[3], v.shape[3], jnp.dtype(k.dtype).itemsize,
                                segment_ids is not None, impl))
    return context_attention(q, k, v, split, jax.lax.axis_index(CONTEXT), causal=causal, segment_ids=segment_ids,
                             sliding_window=sliding_window, scale=scale, softcap=softcap, impl=impl, tile=tile)


def context_attention(q, k, v, split: SequenceSplit, index, *, causal=True, segment_ids=None, sliding_window=None,
                      scale=None, softcap=None, impl="allgather", gathered=None, tile=TILE):
    """Inside ``shard_map`` (manual over ``context``): attention of context device ``index`` (traced,
    or a Python int for one device's program) on the split sequence (see :func:`attention`).

    One ``jax.custom_vjp`` over the walk of the ``C`` sources: the forward merges each source's
    tiled partial (:func:`_step`) with the online softmax and saves only this device's final
    ``o [B, 2c, n_kv, G, Dv]`` and ``lse [B, 2c, n_kv, G]`` (float32) besides its inputs; the
    backward walks the sources again, each step's tiles recomputing their scores from that ``lse``
    (:func:`_step_grad`, FlashAttention-2's algorithm 2, Dao 2023 section 3.1): no source's scores
    or partials are kept from the forward.

    ``gathered``: ``(k_all, v_all, seg_all)`` already in the placed order ``[B, L, ...]`` instead of
    gathering (``impl="allgather"`` only): one device's program without collectives, for counting
    its FLOPs (``cost_analysis``) and measuring its memory (``memory_analysis``)."""
    B, L2, H, D = q.shape
    n_kv, C, c, Dv = k.shape[2], split.context, split.chunk, v.shape[-1]
    opts = dict(causal=causal, window=sliding_window, scale=float(1 / math.sqrt(D) if scale is None else scale),
                cap=None if softcap is None else float(softcap), tile=int(tile))
    qg = q.reshape(B, L2, n_kv, H // n_kv, D)  # [B, 2c, H, D] -> [B, 2c, n_kv, G, D]
    static = isinstance(index, numbers.Integral)  # one device's program: the kinds known while tracing
    where = lambda idx: index if static else idx  # noqa: E731
    step, grad = functools.partial(_step, c=c, opts=opts), functools.partial(_step_grad, c=c, opts=opts)

    if impl == "allgather":
        if gathered is None:
            with jax.named_scope(CONTEXT_SCOPE):
                # [B, 2c, n_kv, D] --all_gather(context, tiled)--> [B, L, n_kv, D] (placed order: device j at [2c j, 2c (j+1)))
                # its transpose, the backward's reduce-scatter of dK, dV, comes from autodiff (outside the custom VJP)
                k_all = jax.lax.all_gather(k, CONTEXT, axis=1, tiled=True)
                v_all = jax.lax.all_gather(v, CONTEXT, axis=1, tiled=True)
                seg_all = None if segment_ids is None else jax.lax.all_gather(segment_ids, CONTEXT, axis=1, tiled=True)
        else:
            k_all, v_all, seg_all = gathered
        # source j's [2c] tokens of the gathered [L]: [B, L, ...] --dynamic_slice--> [B, 2c, ...]
        src = lambda x, j: None if x is None else jax.lax.dynamic_slice_in_dim(x, 2 * c * j, 2 * c, 1)  # noqa: E731

        def forward(qg, k_all, v_all, qseg, seg_all, idx):
            i = where(idx)

            def source(state, j):  # one source per iteration (lax.scan: one source's buffers live at a time)
                part = step(_kind(i, j, causal), qg, src(k_all, j), src(v_all, j), split.chunk_positions(i),
                            split.chunk_positions(j), qseg, src(seg_all, j))
                return _merge(state, part), None

            init = varying(_empty(qg, Dv), qg, k_all, v_all, qseg, seg_all, idx)
            return jax.lax.scan(source, init, jnp.arange(C, dtype=jnp.int32))[0]

        def backward(res, do):
            qg, k_all, v_all, qseg, seg_all, idx, o, lse = res
            i = where(idx)

            def source(dq, j):
                dqj, dkj, dvj = grad(_kind(i, j, causal), qg, src(k_all, j), src(v_all, j), split.chunk_positions(i),
                                     split.chunk_positions(j), qseg, src(seg_all, j), o, lse, do)
                return dq + dqj, (dkj.astype(k_all.dtype), dvj.astype(v_all.dtype))

            dq0 = varying(jnp.zeros(qg.shape, jnp.float32), qg, k_all, v_all, qseg, seg_all, idx, do)
            dq, (dk, dv) = jax.lax.scan(source, dq0, jnp.arange(C, dtype=jnp.int32))
            # [C, B, 2c, n_kv, D] --> [B, L, n_kv, D]: dK, dV of the gathered keys, source j at [2c j, 2c (j+1))
            return dq.astype(qg.dtype), from_tiles(dk), from_tiles(dv), zero(qseg), zero(seg_all), zero(idx)

        args = (qg, k_all, v_all, segment_ids, seg_all, None if static else index)
    elif impl == "ring":
        perm = [(d, (d + 1) % C) for d in range(C)]  # device d sends what it holds to d + 1
        back = [(d, (d - 1) % C) for d in range(C)]  # the backward: d sends to d - 1

        def kind_at(i, t):  # the block kind of step t (traced): the chunk held is device (i - t)'s
            if not causal:  # no mask to skip blocks by
                return DIAG
            return jnp.where(t == 0, DIAG, jnp.where(t <= i, LOWER, UPPER))  # j = i - t >= 0 exactly when t <= i

        def compute(i, t, state, held, qg, qseg):
            part = step(kind_at(i, t), qg, held[0], held[1], split.chunk_positions(i), split.chunk_positions((i - t) % C),
                        qseg, held[2])
            return _merge(state, part)

        def walk(qg, k, v, qseg, idx):
            i = where(idx)

            def turn(carry, t):  # steps 0 .. C-2: pass the chunk on while computing it
                state, held = carry
                with jax.named_scope(CONTEXT_SCOPE):
                    # [B, 2c, n_kv, D] --ppermute(context, d -> d+1)--> [B, 2c, n_kv, D]: the chunk of device (i - t - 1)
                    nxt = jax.tree.map(lambda x: jax.lax.ppermute(x, CONTEXT, perm), held)
                return (compute(i, t, state, held, qg, qseg), nxt), held

            init = (varying(_empty(qg, Dv), qg, k, v, qseg, idx), (k, v, qseg))
            (state, last), kept = jax.lax.scan(turn, init, jnp.arange(C - 1, dtype=jnp.int32))
            state = compute(i, C - 1, state, last, qg, qseg)  # step C-1: nothing left to send
            kept = jax.tree.map(lambda ks, x: jnp.concatenate([ks, x[None]]), kept, last)  # [C, B, 2c, ...]: chunk of step t
            return state, kept

        def forward(qg, k, v, qseg, idx):
            return walk(qg, k, v, qseg, idx)[0]

        def fwd_saving(qg, k, v, qseg, idx):  # saves the C chunks held (the gathered K/V's bytes), o and lse
            (o, lse), kept = walk(qg, k, v, qseg, idx)
            return (o, lse), (qg, qseg, idx, kept, o, lse)

        def backward(res, do):
            qg, qseg, idx, kept, o, lse = res
            i = where(idx)

            def contribution(t):
                kt, vt, st = jax.tree.map(lambda x: x[t], kept)
                return grad(kind_at(i, t), qg, kt, vt, split.chunk_positions(i), split.chunk_positions((i - t) % C), qseg,
                            st, o, lse, do)

            def turn(carry, t):  # t = C-1 .. 1: add step t's dK, dV and pass them on, d -> d - 1 (the forward's transpose)
                dq, acc = carry
                dqt, dkt, dvt = contribution(t)
                with jax.named_scope(CONTEXT_SCOPE):
                    # [B, 2c, n_kv, D] --ppermute(context, d -> d-1)--> [B, 2c, n_kv, D]: dK, dV of device (i - t + 1)'s chunk
                    acc = (jax.lax.ppermute((acc[0] + dkt).astype(kept[0].dtype), CONTEXT, back),
                           jax.lax.ppermute((acc[1] + dvt).astype(kept[1].dtype), CONTEXT, back))
                return (dq + dqt, acc), None

            zeros = (jnp.zeros(qg.shape, jnp.float32), (jnp.zeros(kept[0].shape[1:], kept[0].dtype),
                                                        jnp.zeros(kept[1].shape[1:], kept[1].dtype)))
            init = varying(zeros, qg, qseg, idx, kept, do)
            (dq, acc), _ = jax.lax.scan(turn, init, jnp.arange(C - 1, 0, -1, dtype=jnp.int32))
            dq0, dk0, dv0 = contribution(0)  # this device's own chunk: its dK, dV stay here
            return ((dq + dq0).astype(qg.dtype), (acc[0] + dk0).astype(kept[0].dtype), (acc[1] + dv0).astype(kept[1].dtype),
                    zero(qseg), zero(idx))

        args = (qg, k, v, segment_ids, None if static else index)
    else:  # pragma: no cover - checked by attention()
        raise ValueError(impl)

    run = jax.custom_vjp(lambda *a: forward(*a)[0])
    if impl == "allgather":
        run.defvjp(lambda *a: (lambda s: (s[0], (*a, *s)))(forward(*a)), backward)
    else:
        run.defvjp(lambda *a: (lambda out, res: (out[0], res))(*fwd_saving(*a)), backward)
    o = run(*args)  # [B, 2c, n_kv, G, Dv] float32
    return o.astype(q.dtype).reshape(B, L2, H, Dv)  # [B, 2c, n_kv, G, Dv] -> [B, 2c, H, Dv]

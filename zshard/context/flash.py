"""The tiled attention block of :mod:`zshard.attention`: FlashAttention-2 (Dao 2023, arXiv
2307.08691, section 3.1) in JAX, for one context step's queries against one source's keys.

Queries and keys are cut into tiles of at most ``tile`` tokens (:func:`_tiles`; a length that
``tile`` does not divide is cut into equal tiles, the last padded with masked keys and dropped
query rows). The forward (algorithm 1) runs an online softmax over the key tiles of each query
tile (``lax.map`` over query tiles, ``lax.scan`` over key tiles) and returns the normalised output
and each row's log-sum-exp; the backward (algorithm 2) recomputes each tile's probabilities
``P = exp(S - lse)`` from them. One tile's scores exist at a time, forward and backward; a tile the
mask hides whole is skipped (``lax.cond``). Shapes: queries ``[B, Lq, n_kv, G, D]`` (GQA's ``G``
query heads per key head), keys and values ``[B, Lk, n_kv, D]``, positions ``[L]`` int32, segment
ids ``[B, L]`` int32 or ``None``; outputs float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from zshard.mesh.axes import varying_axes, vary

__all__ = ["NEG", "TILE", "block", "block_backward", "block_forward", "from_tiles", "one_device", "varying", "zero"]

NEG = float(-0.7 * np.finfo(np.float32).max)  # jax.nn.dot_product_attention's masked logit


TILE = 512  # tokens per query / key tile of the tiled block (zshard.attention's ``tile``)


def _tiles(n: int, tile: int) -> tuple[int, int]:
    """``(t, nt)``: ``n`` tokens cut into ``nt = ceil(n / tile)`` tiles of ``t = ceil(n / nt) <= tile``
    tokens (the last padded by ``nt t - n < nt`` masked tokens); a chunk shorter than ``tile`` is one tile."""
    nt = -(-n // tile)
    return -(-n // nt), nt


def _tile_logits(q, k, opts):
    """One tile's logits, ``q [B, tq, n_kv, G, D]``, ``k [B, tk, n_kv, D]`` -> ``[B, tq, n_kv, G, tk]``
    float32, soft-capped, unmasked."""
    _, _, scale, cap = opts
    s = jnp.einsum("bqhgd,bkhd->bqhgk", q, k, preferred_element_type=jnp.float32) * scale  # [B, tq, n_kv, G, tk]
    if cap is not None:  # Gemma 2's soft-cap of the logits: cap * tanh(s / cap)
        s = cap * jnp.tanh(s / cap)
    return s


def _tile_mask(qpos, kpos, qseg, kseg, kvalid, opts):
    """One tile's mask, ``[B | 1, tq, 1, 1, tk]`` bool: the key is a real one, and causal, window and
    segments let the query see it."""
    causal, window, _, _ = opts
    dist = qpos[:, None] - kpos[None, :]  # [tq, tk]: query position - key position
    mask = jnp.broadcast_to(kvalid[None, :], dist.shape)  # padded keys are never seen
    if causal:
        mask = mask & (dist >= 0)
    if window is not None:
        mask = mask & (dist < window) & (dist > -window)
    mask = mask[None, :, None, None, :]  # [1, tq, 1, 1, tk]
    if qseg is not None:
        mask = mask & (qseg[:, :, None] == kseg[:, None, :])[:, :, None, None, :]  # [B, tq, 1, 1, tk]
    return mask


def _unless_hidden(mask, opts, qseg, compute, skip, *args):
    """``compute(*args)``, or ``skip(*args)`` when ``mask`` hides the whole tile (``lax.cond``: a
    tile above the causal diagonal, past the window, or of other segments costs no FLOPs). Without
    a causal mask, window or segments every tile has a visible key (padding is under one tile)."""
    causal, window, _, _ = opts
    if not causal and window is None and qseg is None:
        return compute(*args)
    return jax.lax.cond(jnp.any(mask), compute, skip, *args)


def varying(inits, *refs):
    """``inits`` made varying over every mesh axis any of ``refs`` varies over (inside
    ``shard_map``): a ``lax.scan`` carry must keep one type through its body, which mixes them."""
    axes = tuple(sorted(frozenset().union(*(varying_axes(r) for r in jax.tree.leaves(refs)))))
    return jax.tree.map(lambda x: vary(x, axes), inits) if axes else inits


def _key_tile(j, t, k, v, kpos, kseg, kvalid):
    """Key tile ``j`` (traced) of ``t`` tokens: ``[B, L, ...] --dynamic_slice--> [B, t, ...]`` of the
    keys, values, positions, segment ids and the valid flags."""
    cut = lambda x, axis: None if x is None else jax.lax.dynamic_slice_in_dim(x, j * t, t, axis)  # noqa: E731
    return cut(k, 1), cut(v, 1), cut(kpos, 0), cut(kseg, 1), cut(kvalid, 0)


def _to_tiles(x, t):
    """``[B, n t, ...] -> [n, B, t, ...]``: the tile index leading, for ``lax.scan`` / ``lax.map``."""
    if x is None:
        return None
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // t, t, *x.shape[2:]), 1, 0)


def from_tiles(x):
    """``[n, B, t, ...] -> [B, n t, ...]``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _flash_forward(opts, tq, tk, q, k, v, qpos, kpos, qseg, kseg, kvalid):
    """FlashAttention-2's forward (Dao 2023, arXiv 2307.08691, section 3.1, algorithm 1): for each
    query tile (``lax.map``) an online softmax over the key tiles (``lax.scan``); only one tile's
    ``[B, tq, n_kv, G, tk]`` scores exist at a time. ``(o [B, Lq, n_kv, G, Dv] float32 normalised,
    lse [B, Lq, n_kv, G] float32)``; a row that sees no key has ``o = 0``, ``lse = NEG``."""
    B, Lq, n_kv, G, _ = q.shape
    Dv = v.shape[-1]
    keys = jnp.arange(k.shape[1] // tk)  # the key tiles, sliced in the loop (no transposed copy of the keys)

    def query_tile(xs):
        qi, qp, qs = xs  # [B, tq, n_kv, G, D], [tq], [B, tq]

        def key_tile(carry, j):
            kj, vj, kp, ks, kval = _key_tile(j, tk, k, v, kpos, kseg, kvalid)
            mask = _tile_mask(qp, kp, qs, ks, kval, opts)

            def compute(carry):
                o, m, l = carry  # [B, tq, n_kv, G, Dv] unnormalised, row max and row sum [B, tq, n_kv, G]
                s = _tile_logits(qi, kj, opts)
                m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, NEG), axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # [B, tq, n_kv, G, tk]
                alpha = jnp.exp(m - m_new)
                o = o * alpha[..., None] + jnp.einsum("bqhgk,bkhd->bqhgd", p.astype(vj.dtype), vj,
                                                       preferred_element_type=jnp.float32)
                return o, m_new, l * alpha + jnp.sum(p, axis=-1)

            return _unless_hidden(mask, opts, qs, compute, lambda carry: carry, carry), None

        init = (jnp.zeros((B, tq, n_kv, G, Dv), jnp.float32), jnp.full((B, tq, n_kv, G), NEG, jnp.float32),
                jnp.zeros((B, tq, n_kv, G), jnp.float32))
        (o, m, l), _ = jax.lax.scan(key_tile, varying(init, xs, k, v, kpos, kseg), keys)
        seen = l > 0
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG)
        return jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0), lse

    o, lse = jax.lax.map(query_tile, (_to_tiles(q, tq), qpos.reshape(-1, tq), _to_tiles(qseg, tq)))  # [nq, B, tq, ...]
    return from_tiles(o), from_tiles(lse)


def _flash_backward(opts, tq, tk, q, k, v, qpos, kpos, qseg, kseg, kvalid, o, lse, do):
    """FlashAttention-2's backward (Dao 2023, arXiv 2307.08691, section 3.1, algorithm 2):
    ``(dq, dk, dv)`` in float32 from the saved output ``o`` and log-sum-exp ``lse`` of the whole
    softmax row (every key of the sequence, not only these) and the cotangent ``do``. Each tile's
    scores are recomputed and ``P = exp(S - lse)`` is the row's final probability, so the tiles of
    one context step (or of one source device) need nothing from the others:
    ``dV = P^T dO``, ``dS = P * (dO V^T - D)`` with ``D = rowsum(dO * O)``, ``dQ = dS K``,
    ``dK = dS^T Q`` (times the scale); soft-cap: ``dS_raw = dS * (1 - (S / cap)^2)``. Outer loop
    over key tiles (``dK_j``, ``dV_j`` in the inner loop's carry), inner over query tiles (their
    ``dQ_i`` summed over the outer loop), as algorithm 2."""
    causal, window, scale, cap = opts
    delta = jnp.sum(do * o, axis=-1)  # [B, Lq, n_kv, G]: FA2's D_i
    queries = (_to_tiles(q, tq), _to_tiles(do, tq), _to_tiles(lse, tq), _to_tiles(delta, tq), qpos.reshape(-1, tq),
               _to_tiles(qseg, tq))

    def key_tile(dq, j):
        kj, vj, kp, ks, kval = ys = _key_tile(j, tk, k, v, kpos, kseg, kvalid)  # [B, tk, n_kv, D], [B, tk, n_kv, Dv], [tk], [B, tk], [tk]

        def query_tile(carry, xs):
            qi, doi, lsei, di, qp, qs = xs
            mask = _tile_mask(qp, kp, qs, ks, kval, opts)

            def compute(carry):
                dk, dv = carry  # [B, tk, n_kv, D], [B, tk, n_kv, Dv] float32
                s = _tile_logits(qi, kj, opts)
                p = jnp.where(mask, jnp.exp(s - lsei[..., None]), 0.0)  # [B, tq, n_kv, G, tk]
                dv = dv + jnp.einsum("bqhgk,bqhgd->bkhd", p, doi, preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqhgd,bkhd->bqhgk", doi, vj, preferred_element_type=jnp.float32)
                ds = p * (dp - di[..., None])
                if cap is not None:  # d(cap tanh(x / cap)) / dx = 1 - tanh^2
                    ds = ds * (1.0 - jnp.square(s / cap))
                ds = ds * scale
                dqi = jnp.einsum("bqhgk,bkhd->bqhgd", ds, kj, preferred_element_type=jnp.float32)
                dk = dk + jnp.einsum("bqhgk,bqhgd->bkhd", ds, qi, preferred_element_type=jnp.float32)
                return (dk, dv), dqi

            def skip(carry):  # a hidden tile: no dK, dV, dQ
                return carry, varying(jnp.zeros(qi.shape, jnp.float32), qi, doi, kj, vj, qs, ks, carry)

            return _unless_hidden(mask, opts, qs, compute, skip, carry)

        init = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32))
        (dk, dv), dqs = jax.lax.scan(query_tile, varying(init, ys, queries), queries)  # dqs [nq, B, tq, n_kv, G, D]
        return dq + dqs, (dk, dv)

    dq0 = varying(jnp.zeros(queries[0].shape, jnp.float32), queries, k, v, kpos, kseg)  # [nq, B, tq, n_kv, G, D]
    dq, (dk, dv) = jax.lax.scan(key_tile, dq0, jnp.arange(k.shape[1] // tk))
    return from_tiles(dq), from_tiles(dk), from_tiles(dv)


def _padded(q, k, v, qpos, kpos, qseg, kseg, tile):
    """The inputs padded to whole tiles (:func:`_tiles`): ``(tq, tk, q, k, v, qpos, kpos, qseg, kseg,
    kvalid, pad)``, ``kvalid [Lk + pk]`` false on the padded keys, ``pad(x, n)`` the row padding."""
    Lq, Lk = q.shape[1], k.shape[1]
    (tq, nq), (tk, nk) = _tiles(Lq, tile), _tiles(Lk, tile)
    pq, pk = nq * tq - Lq, nk * tk - Lk

    def pad(x, n, value=0):  # [B, L, ...] -> [B, L + n, ...]
        return x if x is None or n == 0 else jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

    kvalid = jnp.arange(Lk + pk) < Lk  # [nk tk]
    return (tq, tk, pad(q, pq), pad(k, pk), pad(v, pk), jnp.pad(qpos, (0, pq)), jnp.pad(kpos, (0, pk)), pad(qseg, pq),
            pad(kseg, pk), kvalid, functools.partial(pad, n=pq))


def block_forward(q, k, v, qpos, kpos, qseg, kseg, *, causal, window, scale, cap=None, tile=TILE):
    """Attention of queries ``q [B, Lq, n_kv, G, D]`` on keys / values ``[B, Lk, n_kv, D]`` in tiles
    of at most ``tile`` tokens (:func:`_flash_forward`): ``(o [B, Lq, n_kv, G, Dv] float32
    normalised, lse [B, Lq, n_kv, G] float32 log-sum-exp)``; a row with no visible key has ``o = 0``
    and ``lse`` the masked logit. Lengths that ``tile`` does not divide are cut into equal tiles
    (:func:`_tiles`), the last padded: padded keys are masked, padded queries' rows dropped."""
    Lq = q.shape[1]
    tq, tk, *args, _ = _padded(q, k, v, qpos, kpos, qseg, kseg, tile)
    o, lse = _flash_forward((causal, window, scale, cap), tq, tk, *args)
    return o[:, :Lq], lse[:, :Lq]


def block_backward(q, k, v, qpos, kpos, qseg, kseg, o, lse, do, *, causal, window, scale, cap=None, tile=TILE):
    """:func:`_flash_backward` of :func:`block_forward`'s block, given the row's final ``o``, ``lse``
    ``[B, Lq, ...]`` and ``do``: ``(dq, dk, dv)`` float32. Padded query rows get ``do = 0`` and an
    ``lse`` of ``-NEG`` (their probabilities ``exp(S - lse)`` are 0)."""
    Lq, Lk = q.shape[1], k.shape[1]
    tq, tk, *args, pad = _padded(q, k, v, qpos, kpos, qseg, kseg, tile)
    dq, dk, dv = _flash_backward((causal, window, scale, cap), tq, tk, *args, pad(o), pad(lse, value=-NEG), pad(do))
    return dq[:, :Lq], dk[:, :Lk], dv[:, :Lk]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def block(q, k, v, qpos, kpos, qseg, kseg, opts):
    """:func:`block_forward` with FlashAttention-2's backward: saves only the inputs, ``o`` and
    ``lse`` (the one-device soft-capped path). ``opts``: ``((causal, window, scale, cap), tile)``."""
    return block_forward(q, k, v, qpos, kpos, qseg, kseg, **_kw(opts))[0]


def _kw(opts):
    (causal, window, scale, cap), tile = opts
    return dict(causal=causal, window=window, scale=scale, cap=cap, tile=tile)


def _block_fwd(q, k, v, qpos, kpos, qseg, kseg, opts):
    o, lse = block_forward(q, k, v, qpos, kpos, qseg, kseg, **_kw(opts))
    return o, (q, k, v, qpos, kpos, qseg, kseg, o, lse)


def _block_bwd(opts, res, do):
    q, k, v, qpos, kpos, qseg, kseg, o, lse = res
    dq, dk, dv = block_backward(q, k, v, qpos, kpos, qseg, kseg, o, lse, do, **_kw(opts))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero(qpos), zero(kpos), zero(qseg), zero(kseg))


block.defvjp(_block_fwd, _block_bwd)


def zero(x):
    """The cotangent of an integer input (positions, segment ids, a device index): float0 zeros."""
    return None if x is None else np.zeros(jnp.shape(x), jax.dtypes.float0)


def one_device(q, k, v, causal, segment_ids, sliding_window, scale, softcap, tile):
    """One device's attention by the tiled block (:func:`block`): one ``L x L`` block
    in tiles of ``tile``, FlashAttention-2's backward. ``q [B, L, H, D]`` -> ``[B, L, H, Dv]``."""
    B, L, H, D = q.shape
    pos = jnp.arange(L, dtype=jnp.int32)
    cap = None if softcap is None else float(softcap)
    opts = ((causal, sliding_window, float(1 / math.sqrt(D) if scale is None else scale), cap), int(tile))
    o = block(q.reshape(B, L, k.shape[2], H // k.shape[2], D), k, v, pos, pos, segment_ids, segment_ids,
              opts)  # [B, L, n_kv, G, Dv] float32
    return o.astype(q.dtype).reshape(B, L, H, v.shape[3])  # -> [B, L, H, Dv]

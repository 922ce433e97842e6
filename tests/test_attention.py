"""``zshard.attention`` against ``jax.nn.dot_product_attention`` on one device, and
``zshard.positions``: outside a split sequence, inside one (all-gather and ring), forward and
gradients; the causal blocks each device computes (per-device FLOPs from ``cost_analysis``); bad
inputs (docs/long-sequences.md)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zshard
from zshard.attention import DIAG, LOWER, UPPER, context_attention, schedule
from zshard.context.sequence import SequenceSplit, head_tail_order, tracing

B, L, H, KV, HD = 2, 64, 4, 2, 8
RNG = np.random.default_rng(0)
Q = RNG.standard_normal((B, L, H, HD)).astype(np.float32)
K = RNG.standard_normal((B, L, KV, HD)).astype(np.float32)
VV = RNG.standard_normal((B, L, KV, HD)).astype(np.float32)
SEG = np.sort(RNG.integers(0, 4, (B, L)), axis=1).astype(np.int32)  # packed documents
W = np.cos(np.arange(L) * 0.3).astype(np.float32)  # a weight per position: the loss depends on the order


def reference(q, k, v, causal, segments, window, cap=None):
    mask = (SEG[:, :, None] == SEG[:, None, :])[:, None] if segments else None
    if cap is not None:  # Gemma 2's soft-capped logits, written out: jax.nn.dot_product_attention has no soft-cap
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)  # [B, L, KV, hd] -> [B, L, H, hd]
        s = cap * jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]) / cap)  # [B, H, L, L]
        i, j = np.arange(q.shape[1])[:, None], np.arange(q.shape[1])[None, :]
        keep = np.ones((q.shape[1],) * 2, bool) if not causal else j <= i
        if window is not None:
            keep = keep & (abs(i - j) < window)
        keep = keep[None, None] if mask is None else keep[None, None] & mask
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep, s, -1e30), axis=-1), v)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                        local_window_size=None if window is None else (window - 1, window - 1))


# The reference and its gradients as one jitted program per case (op by op, each operation of the
# eager reference and of its backward compiled a program of its own per shape: most of this file's compiles)
STATIC = ("causal", "segments", "window", "cap")
reference_jit = jax.jit(reference, static_argnames=STATIC)


@functools.partial(jax.jit, static_argnames=STATIC)
def reference_grads(q, k, v, causal, segments, window, cap=None):
    """Gradients of ``sum(W * reference**2)`` with respect to q, k, v."""
    loss = lambda q, k, v: jnp.sum(W[None, :, None, None] * reference(q, k, v, causal, segments, window, cap) ** 2)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


OPTIONS = [  # causal, segment ids, sliding window
    (True, False, None), (False, False, None), (True, True, None), (True, False, 12), (False, True, 7),
]


@pytest.mark.parametrize("causal,segments,window", OPTIONS)
def test_outside_a_split_it_is_jax_dot_product_attention(causal, segments, window):
    got = zshard.attention(Q, K, VV, causal=causal, segment_ids=SEG if segments else None, sliding_window=window)
    np.testing.assert_array_equal(got, reference(Q, K, VV, causal, segments, window))


@functools.cache
def _split_program(C, impl, causal, segments, window, cap=None, tile=None):
    """``(value, grads)`` of ``sum(W * attention**2)`` on a ``1 x 2 x C`` mesh, inputs placed in
    the head-tail order, as one jitted program (compiled once per case); ``tile``: the tiled
    block's tile size (``None``: the default, one tile per chunk at these lengths)."""
    tiles = {} if tile is None else {"tile": tile}
    mesh = zshard.make_mesh(1, 2, context=C, devices=jax.devices()[: 2 * C])
    spec = P(("replica", "shard"), "context")
    order = head_tail_order(L, C)
    weight = jax.device_put(W[order], NamedSharding(mesh, P("context")))

    def local(q, k, v, seg, w):
        with tracing(SequenceSplit(C, L)):
            o = zshard.attention(q, k, v, causal=causal, segment_ids=seg if segments else None, sliding_window=window,
                                 softcap=cap, impl=impl, **tiles)
        return jax.lax.psum(jnp.sum(w[None, :, None, None] * o.astype(jnp.float32) ** 2), ("replica", "shard", "context")), o

    f = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4 + (P("context"),), out_specs=(P(), spec))
    grad = jax.jit(jax.value_and_grad(lambda q, k, v, s: f(q, k, v, s, weight), argnums=(0, 1, 2), has_aux=True))
    put = lambda x: jax.device_put(x[:, order], NamedSharding(mesh, spec))  # noqa: E731
    with jax.set_mesh(mesh):
        (_, out), grads = grad(put(Q), put(K), put(VV), put(SEG))
    inverse = np.argsort(order)  # the placed order back to the sequence's
    return np.asarray(out)[:, inverse], [np.asarray(g)[:, inverse] for g in grads]


# C, impl, causal, segment ids, sliding window, tile: both impls, C = 2 and 4, every option. L = 64: chunks
# of c = 16 (C = 2) or 8 (C = 4) tokens, 2c per device. Tiles: None (the default 512: one tile per
# block); 8 / 4: several tiles per block, the causal and window masks hiding some tiles whole (a
# query tile before a key tile, a window of 12 or 7 past a tile); 5: lengths no tile divides
# (2c = 32 -> 7 tiles of 5, 3 padded keys; c = 16 -> 4 tiles of 4), rows of some tiles all padding.
SPLIT_CASES = [
    (2, "allgather", True, False, None, None), (2, "ring", False, True, 7, 8), (4, "allgather", True, True, 12, 5),
    (4, "ring", True, True, 12, 4), (4, "ring", True, False, None, 5), (4, "allgather", False, False, None, 4),
]


@pytest.mark.parametrize("C,impl,causal,segments,window,tile", SPLIT_CASES)
def test_on_a_split_sequence_forward_and_gradients_equal_one_device(C, impl, causal, segments, window, tile):
    opts = dict(causal=causal, segments=segments, window=window)
    want_grads = reference_grads(Q, K, VV, **opts)
    got, grads = _split_program(C, impl, causal, segments, window, tile=tile)
    assert rel(got, reference_jit(Q, K, VV, **opts)) <= 1e-6
    for name, g, w in zip("qkv", grads, want_grads):
        assert rel(g, w) <= 1e-6, (name, rel(g, w))


def test_softcap_equals_the_written_out_formula_on_one_device_and_on_a_split():
    want = reference_jit(Q, K, VV, causal=True, segments=True, window=12, cap=2.0)
    capped = jax.jit(lambda q, k, v, cap: zshard.attention(q, k, v, segment_ids=SEG, sliding_window=12, softcap=cap),
                     static_argnums=3)  # one program each, not op by op
    assert rel(capped(Q, K, VV, 2.0), want) <= 1e-6
    assert rel(capped(Q, K, VV, None), want) > 1e-3  # the cap matters here
    want_grads = reference_grads(Q, K, VV, causal=True, segments=True, window=12, cap=2.0)
    # one device, 64 tokens in tiles of 16 (the soft-capped path is the tiled block): forward and gradients
    one = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(W[None, :, None, None] * zshard.attention(
        q, k, v, segment_ids=SEG, sliding_window=12, softcap=2.0, tile=16) ** 2), argnums=(0, 1, 2)))
    assert abs(float(one(Q, K, VV)[0]) / float(jnp.sum(W[None, :, None, None] * want**2)) - 1) <= 1e-6
    for name, g, w in zip("qkv", one(Q, K, VV)[1], want_grads):
        assert rel(g, w) <= 1e-6, ("one device", name, rel(g, w))
    got, grads = _split_program(2, "ring", True, True, 12, 2.0, tile=8)  # 2c = 32: 4 x 4 tiles on the diagonal
    assert rel(got, want) <= 1e-6
    for name, g, w in zip("qkv", grads, want_grads):
        assert rel(g, w) <= 1e-6, (name, rel(g, w))


# --- load balance: the blocks each context device computes -----------------------------------------------


def _branch_flops(kind, c=16, g=2, hd=32):
    """FLOPs (XLA ``cost_analysis``, forward and backward) of one source step of ``kind`` for ``2c``
    queries: the work a device's ``lax.switch`` runs for that source (one tile per block: XLA counts
    a loop's body once)."""
    from zshard.attention import _step, _step_grad

    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 2 * c, KV, g, hd)).astype(np.float32)
    k = rng.standard_normal((2, 2 * c, KV, hd)).astype(np.float32)
    pos = jnp.arange(2 * c)
    opts = dict(causal=True, window=None, scale=0.2)

    def cost(f, *args):
        got = jax.jit(f).lower(*args).compile().cost_analysis()
        return (got[0] if isinstance(got, list) else got)["flops"]

    o, lse = jax.jit(lambda q, k: _step(kind, q, k, k, pos, pos, None, None, c=c, opts=opts))(q, k)
    forward = cost(lambda q, k, v: _step(kind, q, k, v, pos, pos, None, None, c=c, opts=opts), q, k, k)
    backward = cost(lambda q, k, v, o, lse: _step_grad(kind, q, k, v, pos, pos, None, None, o, lse, o, c=c, opts=opts),
                    q, k, k, o, lse)
    return forward + backward


def test_head_tail_order_gives_every_device_the_same_attention_flops():
    flops = {kind: _branch_flops(kind) for kind in (DIAG, LOWER, UPPER)}
    # a LOWER / UPPER source computes 2 of the 4 c x c blocks of a DIAG one (the causal mask hides the rest)
    assert abs(flops[LOWER] / flops[DIAG] - 0.5) < 0.05 and abs(flops[UPPER] / flops[DIAG] - 0.5) < 0.05, flops
    for C in (2, 4, 8):
        for impl in ("allgather", "ring"):
            kinds = [schedule(i, C, impl) for i in range(C)]
            assert all(sorted(k) == sorted(schedule(i, C, "allgather")) for i, k in enumerate(kinds))  # the same work, any order
            per_device = [sum(flops[k] for k in ks) for ks in kinds]
            assert max(per_device) / min(per_device) <= 1.05, (C, impl, per_device)
            assert [ks.count(DIAG) for ks in kinds] == [1] * C  # i LOWER, C-1-i UPPER, one DIAG: 2C + 2 blocks each
            assert [ks.count(LOWER) for ks in kinds] == list(range(C))
    # without a causal mask nothing is skipped: every source is DIAG
    assert schedule(1, 4, causal=False) == [DIAG] * 4


# --- memory: one attention call's compiled temporaries ----------------------------------------------------


@functools.cache
def _call_temp(C, tile, length=1024):
    """``memory_analysis().temp_size_in_bytes`` of one context device's attention forward and
    backward (``context_attention`` on keys and values already gathered: no collectives), float32,
    ``[1, length / C, 2, 8]`` queries, 2 key/value heads."""
    split = SequenceSplit(C, length)
    q = jax.ShapeDtypeStruct((1, length // C, 2, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, 2, 8), jnp.float32)

    def f(q, k_all, v_all):
        o = context_attention(q, q, q, split, 0, gathered=(k_all, v_all, None), tile=tile)
        return jnp.sum(o**2)

    return jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


def test_temporaries_fall_with_the_tile_and_as_one_over_c():
    # one tile per block (tile >= 2c = 512): the diagonal step's [1, 512, 2, 1, 512] float32 scores, 2 MiB each
    whole, tiled = _call_temp(2, 512), _call_temp(2, 16)
    assert tiled < whole / 10, (whole, tiled)
    # in tiles of 16 the temporaries are O(L / C) buffers (queries, outputs, dQ) plus the gathered keys' dK, dV
    # (O(L), outside the 1/C): measured 404208, 210800, 116720 bytes for C = 2, 4, 8 (docs/long-sequences.md)
    t2, t4 = _call_temp(2, 16), _call_temp(4, 16)
    assert t4 < 0.6 * t2, (t2, t4)


# --- positions ----------------------------------------------------------------------------------------


def test_positions():
    np.testing.assert_array_equal(zshard.positions(5), np.arange(5))
    with pytest.raises(ValueError, match=r"give the length"):
        zshard.positions()
    split = SequenceSplit(4, 32)  # chunks of 4 tokens
    for i in range(4):
        np.testing.assert_array_equal(split.chunk_positions(i), head_tail_order(32, 4)[8 * i : 8 * (i + 1)])
    np.testing.assert_array_equal(split.chunk_positions(1), [4, 5, 6, 7, 24, 25, 26, 27])
    np.testing.assert_array_equal(split.chunk_positions(jnp.int32(1)), split.chunk_positions(1))  # traced: the same
    with tracing(split), pytest.raises(ValueError, match=r"zshard.positions\(32\): this device holds 8 tokens"):
        zshard.positions(32)


# --- bad input ------------------------------------------------------------------------------------------


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"4 query heads do not divide into 3 key/value heads"):
        zshard.attention(Q, np.zeros((B, L, 3, HD), np.float32), np.zeros((B, L, 3, HD), np.float32))
    with pytest.raises(ValueError, match=r"q has shape \(2, 64, 32\)"):
        zshard.attention(Q.reshape(B, L, -1), K, VV)
    with pytest.raises(ValueError, match=r"k and v must have one shape"):
        zshard.attention(Q, K, VV[:, :, :1])
    with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 63\)"):
        zshard.attention(Q, K, VV, segment_ids=SEG[:, 1:])
    with pytest.raises(ValueError, match=r"sliding_window=0 must be a positive int"):
        zshard.attention(Q, K, VV, sliding_window=0)
    with pytest.raises(ValueError, match=r"softcap=-1.0 must be a positive finite number"):
        zshard.attention(Q, K, VV, softcap=-1.0)
    with pytest.raises(ValueError, match=r"tile=0 must be a positive int"):
        zshard.attention(Q, K, VV, tile=0)
    with pytest.raises(ValueError, match=r"impl='flash'; choose one of 'allgather', 'ring'"):
        zshard.attention(Q, K, VV, impl="flash")
    with tracing(SequenceSplit(4, 4 * L)), pytest.raises(ValueError, match=r"must hold this device's 64 tokens"):
        zshard.attention(Q[:, :32], K[:, :32], VV[:, :32])

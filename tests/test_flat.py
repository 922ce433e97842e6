"""ParamLayout (the storage format) and FlatParameter layout: pad, shard, gather, split back; uneven sizes."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec as P

from zshard.params.flat import FlatParameter, ParamLayout, padded_size

SHAPES = [("a",), (13,)], [("b", 0, "w"), (19, 3)], [("c",), ()], [("d",), (1,)]


def _build(n):
    return FlatParameter.build("blocks.0", [ParamLayout.build(p, s, np.float32, n) for p, s in SHAPES], n)


def _values(seed=0):
    rng = np.random.default_rng(seed)
    # + 1 so no logical element is zero: padding is then recognisable
    return [rng.standard_normal(s).astype(np.float32) + 10.0 for _, s in SHAPES]


def _unflatten(flat, full):
    """Gathered FlatParameter ``[N, L/N]`` -> the parameters in their logical shapes (the optimizer's
    ``split_padded``, then each record's ``from_storage``)."""
    return [s.param.from_storage(v) for s, v in zip(flat.slots, flat.split_padded(full))]  # [n_pad] -> shape


def _flatten(flat, values):
    """Logical values -> the gathered FlatParameter ``[N, L/N]`` they make, zero padding (the reference
    layout: row ``r`` of every parameter, concatenated)."""
    rows = [s.param.to_storage(jnp.asarray(v)).reshape(flat.num_shards, -1) for s, v in zip(flat.slots, values)]  # [N, n_pad/N]
    return jnp.concatenate(rows, axis=1)  # [N, L/N]


def _device_shards(flat, values):
    """Per device r: concat of row r of every padded parameter (the FlatParameter shard)."""
    n = flat.num_shards
    rows = [slot.param.to_storage(np.asarray(v)).reshape(n, -1) for slot, v in zip(flat.slots, values)]
    return [np.asarray(flat.concat_shards([jnp.asarray(r[d]) for r in rows])) for d in range(n)]


@pytest.mark.parametrize("size,n,expected", [
    (13, 8, 16), (13, 4, 16), (13, 2, 14), (13, 1, 13), (57, 8, 64), (64, 8, 64),
    (1, 8, 8), (1, 1, 1), (0, 8, 0), (7, 3, 9), (9, 3, 9),
])
def test_padded_size(size, n, expected):
    assert padded_size(size, n) == expected
    if size:
        assert padded_size(size, n) == math.ceil(size / n) * n


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_build_slots(n):
    flat = _build(n)
    assert flat.num_shards == n and flat.dtype == np.float32 and flat.unit == "blocks.0"
    sizes = [13, 57, 1, 1]
    offset = 0
    for slot, (path, shape), size in zip(flat.slots, SHAPES, sizes):
        assert slot.path == path and slot.shape == shape and slot.size == size
        assert slot.padded == math.ceil(size / n) * n and slot.padded % n == 0
        assert slot.offset == offset
        offset += slot.padded // n
    assert flat.shard_size == offset
    assert flat.size == sum(sizes)
    assert flat.padded_size == flat.shard_size * n == sum(s.padded for s in flat.slots)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_round_trip(n):
    flat = _build(n)
    values = _values()
    shards = _device_shards(flat, values)
    for s in shards:
        assert s.shape == (flat.shard_size,)
    full = np.stack(shards)  # what the untiled all_gather returns: [N, L/N]
    assert full.shape == (n, flat.shard_size)

    out = _unflatten(flat, jnp.asarray(full))
    assert len(out) == len(values)
    for o, v in zip(out, values):
        assert o.shape == v.shape and o.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(o), v)

    # the layout's definition, independent of concat_shards: the same buffer, zero padding
    back = np.asarray(_flatten(flat, values))
    assert back.shape == (n, flat.shard_size)
    np.testing.assert_array_equal(back, full)


def test_zero_padding_location():
    n = 8
    flat = _build(n)
    values = _values()
    full = np.asarray(_flatten(flat, values))
    for slot, v in zip(flat.slots, values):
        rows = full[:, slot.offset : slot.offset + slot.padded // n].reshape(-1)  # [n_pad]
        np.testing.assert_array_equal(rows[: slot.size], v.reshape(-1))
        np.testing.assert_array_equal(rows[slot.size :], 0.0)
    # every element of the buffer is either a value (>= 5 here) or padding (exactly 0)
    assert np.count_nonzero(full == 0) == flat.padded_size - flat.size


def test_to_storage_numpy_and_jax():
    rec = ParamLayout.build(("w",), (13,), np.float32, 8)
    assert rec.padded == 16 and rec.storage_shape == (16,) and rec.spec == P()
    x = np.arange(1, 14, dtype=np.float32)
    p = rec.to_storage(x)
    assert isinstance(p, np.ndarray) and p.shape == (16,)
    np.testing.assert_array_equal(p[:13], x)
    np.testing.assert_array_equal(p[13:], 0)
    col = ParamLayout.build(("w",), (13, 1), np.float32, 8)
    pj = col.to_storage(jnp.asarray(x).reshape(13, 1))
    assert isinstance(pj, jnp.ndarray) and pj.shape == (16,)
    np.testing.assert_array_equal(np.asarray(pj), p)
    assert ParamLayout.build(("s",), (), np.float32, 4).to_storage(np.float32(3.0).reshape(())).tolist() == [3.0, 0, 0, 0]
    assert ParamLayout.build(("e",), (8,), np.float32, 8).to_storage(np.ones(8, np.float32)).shape == (8,)


@pytest.mark.parametrize("xp", [np, jnp])
@pytest.mark.parametrize("shape,layers", [((19, 3), None), ((19, 3), 4), ((), None), ((), 3), ((1,), 2)])
def test_storage_round_trip(xp, shape, layers):
    """to_storage / from_storage are inverse, full and stacked, numpy and jax; padding is zero."""
    rec = ParamLayout.build(("p",), shape, np.float32, 8, layers=layers, axes=("shard",))
    assert rec.spec == (P("shard") if layers is None else P(None, "shard"))
    lead = () if layers is None else (layers,)
    assert rec.logical_shape == lead + shape and rec.storage_shape == lead + (rec.padded,)
    x = xp.asarray(np.random.default_rng(0).standard_normal(rec.logical_shape).astype(np.float32) + 10)
    stored = rec.to_storage(x)
    assert stored.shape == rec.storage_shape and type(stored) is type(x)
    np.testing.assert_array_equal(np.asarray(stored)[..., rec.size :], 0.0)
    back = rec.from_storage(stored)
    assert back.shape == rec.logical_shape
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    # one layer of a stacked parameter (inside a scan): no leading dimension
    if layers is not None:
        np.testing.assert_array_equal(np.asarray(rec.from_storage(rec.to_storage(x[0]))), np.asarray(x[0]))
    # the optimizer's view keeps the logical rank: [*lead, 1, .., n_pad/parts]
    assert rec.view_shape(4) == lead + (1,) * (max(len(shape), 1) - 1) + (rec.padded // 4,)
    assert rec.format_key() == ParamLayout.build(("other",), shape, np.float32, 8, layers=layers).format_key()


def test_build_refuses_indivisible_padding():
    with pytest.raises(ValueError, match="multiple of num_shards=4"):
        FlatParameter.build("root", [ParamLayout.build(("w",), (5,), np.float32, 3)], 4)  # 6 elements


def test_single_parameter_concat_is_identity():
    flat = FlatParameter.build("root", [ParamLayout.build(("w",), (13,), np.float32, 4)], 4)
    x = jnp.arange(4.0)
    assert flat.concat_shards([x]) is x


# --- split over the tensor axis: the order of the pieces ----------------------------------------------


@pytest.mark.parametrize("shape,dim,T,layers", [((6, 8), -1, 2, None), ((6, 8), 0, 3, None), ((4, 3, 8), 2, 4, None),
                                               ((8,), 0, 2, None), ((6, 8), 1, 2, 3), ((5, 6), 1, 3, 2)])
def test_tensor_pieces_are_contiguous_blocks_of_the_split_dimension(shape, dim, T, layers):
    """Piece ``t`` of a parameter split over ``tensor`` is the ``t``-th contiguous block of its
    split dimension, flattened and padded on its own (the bug class of a strided or permuted
    piece order: pytorch issues 129206 / 129229, torchtitan PR 1483)."""
    rec = ParamLayout.build(("w",), shape, np.float32, 4, layers, axes=("shard",), tp_dim=dim, tp=T)
    lead = () if layers is None else (layers,)
    x = np.arange(int(np.prod(lead + shape)), dtype=np.float32).reshape(lead + shape) + 1
    stored = rec.to_storage(x)
    d = dim % len(shape)
    piece = shape[:d] + (shape[d] // T,) + shape[d + 1 :]
    n = int(np.prod(piece))
    assert rec.storage_shape == lead + (T, padded_size(n, 4)) == stored.shape
    assert rec.spec == (P("tensor", "shard") if layers is None else P(None, "tensor", "shard"))
    for t in range(T):
        block = np.take(x, range(t * shape[d] // T, (t + 1) * shape[d] // T), axis=len(lead) + d)  # [..., *piece]
        np.testing.assert_array_equal(stored[..., t, :n], block.reshape(lead + (n,)))
        assert not stored[..., t, n:].any()  # zero padding, per piece
        np.testing.assert_array_equal(rec.piece_from_storage(stored[..., t, :]), block)
    np.testing.assert_array_equal(rec.from_storage(stored), x)  # and back
    np.testing.assert_array_equal(np.asarray(rec.from_storage(jnp.asarray(stored))), x)  # jax too


def test_tensor_split_needs_a_divisible_dimension():
    with pytest.raises(ValueError, match=r"dimension 1 \(6\) does not divide by tensor=4"):
        ParamLayout.build(("blocks", 0, "w"), (8, 6), np.float32, 4, tp_dim=1, tp=4)
    rec = ParamLayout.build(("w",), (8, 6), np.float32, 4, tp_dim=1, tp=1)  # T = 1: not split, as without
    assert not rec.split and rec == ParamLayout.build(("w",), (8, 6), np.float32, 4)

"""FlatParameter layout: pad, flatten, shard, gather, unflatten; uneven sizes."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from zshard.flat import FlatParameter, pad_flat, padded_size

SHAPES = [("a",), (13,)], [("b", 0, "w"), (19, 3)], [("c",), ()], [("d",), (1,)]


def _build(n):
    return FlatParameter.build("blocks.0", [(p, s, np.float32) for p, s in SHAPES], n)


def _values(seed=0):
    rng = np.random.default_rng(seed)
    # + 1 so no logical element is zero: padding is then recognisable
    return [rng.standard_normal(s).astype(np.float32) + 10.0 for _, s in SHAPES]


def _device_shards(flat, values):
    """Per device r: concat of row r of every padded parameter (the FlatParameter shard)."""
    n = flat.num_shards
    rows = [pad_flat(np.asarray(v), n).reshape(n, -1) for v in values]
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

    out = flat.unflatten(jnp.asarray(full))
    assert len(out) == len(values)
    for o, v in zip(out, values):
        assert o.shape == v.shape and o.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(o), v)

    # flatten (used for gradients) is the exact inverse, with zero padding
    back = np.asarray(flat.flatten([jnp.asarray(v) for v in values]))
    assert back.shape == (n, flat.shard_size)
    np.testing.assert_array_equal(back, full)


def test_zero_padding_location():
    n = 8
    flat = _build(n)
    values = _values()
    full = np.asarray(flat.flatten([jnp.asarray(v) for v in values]))
    for slot, v in zip(flat.slots, values):
        rows = full[:, slot.offset : slot.offset + slot.padded // n].reshape(-1)  # [n_pad]
        np.testing.assert_array_equal(rows[: slot.size], v.reshape(-1))
        np.testing.assert_array_equal(rows[slot.size :], 0.0)
    # every element of the buffer is either a value (>= 5 here) or padding (exactly 0)
    assert np.count_nonzero(full == 0) == flat.padded_size - flat.size


def test_pad_flat_numpy_and_jax():
    x = np.arange(1, 14, dtype=np.float32)
    p = pad_flat(x, 8)
    assert isinstance(p, np.ndarray) and p.shape == (16,)
    np.testing.assert_array_equal(p[:13], x)
    np.testing.assert_array_equal(p[13:], 0)
    pj = pad_flat(jnp.asarray(x).reshape(13, 1), 8)
    assert pj.shape == (16,)
    np.testing.assert_array_equal(np.asarray(pj), p)
    assert pad_flat(np.float32(3.0).reshape(()), 4).tolist() == [3.0, 0, 0, 0]
    assert pad_flat(np.ones(8, np.float32), 8).shape == (8,)


def test_flatten_casts_to_dtype():
    flat = FlatParameter.build("root", [(("w",), (5,), np.float32)], 4)
    out = flat.flatten([jnp.arange(5, dtype=jnp.bfloat16)])
    assert out.dtype == jnp.float32 and out.shape == (4, 2)


def test_single_parameter_concat_is_identity():
    flat = FlatParameter.build("root", [(("w",), (13,), np.float32)], 4)
    x = jnp.arange(4.0)
    assert flat.concat_shards([x]) is x

"""The FlatParameter: one unit's parameters of one dtype as one flat, padded, sharded buffer.

How it is laid out (docs/design.md section 4; the FlatParameter of PyTorch FSDP, arXiv 2304.11277 section 3.2).
With ``N`` devices in a shard group, every parameter of ``n`` elements is flattened and
zero-padded to ``n_pad = ceil(n / N) * N`` elements, viewed as ``[N, n_pad / N]``; row ``r``
goes to device ``r``. Device ``r``'s FlatParameter shard is the concatenation of row ``r``
of every parameter of the unit::

    param p (shape s, n elements) -> [n] -> pad -> [n_pad] -> [N, n_pad/N]
    device r's shard:  concat_p( p_rows[r] )            # [L/N],  L = sum_p n_pad
    all_gather over the shard axes (untiled):            # [N, L/N]
    param p  = full[:, off_p : off_p + n_pad/N]          # [N, n_pad/N] -> [n_pad] -> [:n] -> s

At rest each parameter's shard is kept as its own array, globally ``[n_pad]`` with
``PartitionSpec(shard_axes)`` (local ``[n_pad / N]``), so the optimizer sees per-parameter
shards; the step concatenates them into the FlatParameter just before the collective.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FlatParameter", "ParamSlot", "padded_size", "pad_flat"]


def padded_size(size: int, num_shards: int) -> int:
    """``size`` rounded up to a multiple of ``num_shards`` (elements)."""
    return -(-size // num_shards) * num_shards  # 0 stays 0


def pad_flat(value, num_shards: int, layers: int | None = None):
    """A parameter -> its padded flat form: ``[n_pad]``, or ``[L, n_pad]`` for a stacked
    parameter ``[L, *shape]`` (``layers=L``; each layer padded on its own). numpy or jax input."""
    xp = np if isinstance(value, np.ndarray) else jnp
    lead = () if layers is None else (layers,)
    flat = xp.reshape(value, lead + (-1,))  # [n] or [L, n]
    pad = padded_size(flat.shape[-1], num_shards) - flat.shape[-1]
    return xp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)]) if pad else flat


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's FlatParameter.

    Attributes:
      path: the parameter's path in the model state, e.g. ``("blocks", 0, "mlp", "kernel")``.
      shape: logical shape.
      dtype: dtype (numpy).
      size: ``prod(shape)`` elements.
      padded: ``size`` rounded up to a multiple of the shard count (elements).
      offset: column of this parameter's row inside one device's FlatParameter shard.
    """

    path: tuple
    shape: tuple[int, ...]
    dtype: np.dtype
    size: int
    padded: int
    offset: int


@dataclasses.dataclass(frozen=True)
class FlatParameter:
    """Where one unit's parameters of one dtype sit in its flat buffer, over ``num_shards`` devices.

    Attributes:
      unit: name of the unit (``"blocks.0"``, ``"root"``).
      dtype: the dtype shared by every slot.
      num_shards: ``N``, devices in one shard group.
      slots: the parameters, in buffer order.
      trainable: ``False`` for frozen parameters: gathered, never reduce-scattered.
    """

    unit: str
    dtype: np.dtype
    num_shards: int
    slots: tuple[ParamSlot, ...]
    trainable: bool = True

    @classmethod
    def build(
        cls,
        unit: str,
        params: Sequence[tuple[tuple, tuple[int, ...], np.dtype]],
        num_shards: int,
        pad_multiple: int | None = None,
        trainable: bool = True,
    ):
        """Lay out ``(path, shape, dtype)`` triples (all of one dtype) in the given order.

        ``pad_multiple`` (a multiple of ``num_shards``; default ``num_shards``) is what each
        parameter is padded to: SHARD_OPT keeps whole parameters (``num_shards=1``) padded
        to a multiple of the optimizer's shard count (all devices), so that it can slice them.
        """
        pad_multiple = pad_multiple or num_shards
        if pad_multiple % num_shards:
            raise ValueError(f"pad_multiple={pad_multiple} must be a multiple of num_shards={num_shards}")
        slots, offset = [], 0
        for path, shape, dtype in params:
            size = int(np.prod(shape, dtype=np.int64))
            padded = padded_size(size, pad_multiple)
            slots.append(ParamSlot(path, tuple(shape), np.dtype(dtype), size, padded, offset))
            offset += padded // num_shards
        return cls(unit, np.dtype(params[0][2]), num_shards, tuple(slots), trainable)

    @property
    def shard_size(self) -> int:
        """Elements of one device's shard, ``L / N``."""
        return sum(s.padded for s in self.slots) // self.num_shards

    @property
    def size(self) -> int:
        """Logical elements (no padding)."""
        return sum(s.size for s in self.slots)

    @property
    def padded_size(self) -> int:
        """Elements of the whole padded FlatParameter, ``L``."""
        return self.shard_size * self.num_shards

    def over_replicas(self, parts: int) -> "FlatParameter":
        """This device's shard ``[L/N]`` as a FlatParameter of its own over ``parts`` devices.

        HYBRID_SHARD_OPT splits each parameter's shard ``[n_pad/N]`` again into ``parts``
        rows (``n_pad`` is a multiple of ``N * parts``): slot ``p`` of the result has
        ``padded = n_pad/N`` and device ``r`` of the ``replica`` group owns row ``r`` of every
        slot, ``[L/(N*parts)]``. Its ``split_padded`` turns the all-gathered rows
        ``[parts, ..., L/(N*parts)]`` back into each parameter's shard ``[..., n_pad/N]``.
        """
        slots, offset = [], 0
        for s in self.slots:
            n = s.padded // self.num_shards  # [n_pad/N], the slot's shard
            if n % parts:
                raise ValueError(f"{s.path}: shard of {n} elements does not split into {parts} rows; pad to a multiple of N*{parts}")
            slots.append(ParamSlot(s.path, (n,), s.dtype, n, n, offset))
            offset += n // parts
        return FlatParameter(self.unit, self.dtype, parts, tuple(slots), self.trainable)

    def rows(self, values: Sequence[jax.Array]) -> jax.Array:
        """Per-slot arrays ``[..., padded]`` -> ``[N, ..., L/N]``: row ``r`` is device ``r``'s
        shard (the reduce-scatter input; ``flatten`` for already padded, stacked values)."""
        parts = []
        for s, v in zip(self.slots, values):
            v = v.reshape(v.shape[:-1] + (self.num_shards, s.padded // self.num_shards))  # [..., n_pad] -> [..., N, n_pad/N]
            parts.append(jnp.moveaxis(v, -2, 0))  # [N, ..., n_pad/N]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)  # [N, ..., L/N]

    def split_shard(self, shard: jax.Array) -> list[jax.Array]:
        """This device's FlatParameter shard ``[..., L/N]`` -> each slot's row ``[..., n_pad/N]``."""
        return [shard[..., s.offset : s.offset + s.padded // self.num_shards] for s in self.slots]

    def concat_shards(self, shards: Sequence[jax.Array]) -> jax.Array:
        """Per-parameter local shards ``[..., n_pad/N]`` -> this device's FlatParameter shard ``[..., L/N]``."""
        return shards[0] if len(shards) == 1 else jnp.concatenate(shards, axis=-1)

    def split_padded(self, full: jax.Array) -> list[jax.Array]:
        """Gathered FlatParameter ``[N, ..., L/N]`` -> each parameter padded and flat, ``[..., n_pad]``."""
        out = []
        for s in self.slots:
            rows = full[..., s.offset : s.offset + s.padded // self.num_shards]  # [N, ..., n_pad/N]
            rows = jnp.moveaxis(rows, 0, -2)  # [..., N, n_pad/N]
            out.append(rows.reshape(rows.shape[:-2] + (-1,)))  # [..., n_pad]
        return out

    def unflatten(self, full: jax.Array) -> list[jax.Array]:
        """Gathered FlatParameter ``[N, L/N]`` -> the parameters in their logical shapes."""
        # [n_pad] -> [n] -> shape
        return [v[: s.size].reshape(s.shape) for s, v in zip(self.slots, self.split_padded(full))]

    def flatten(self, values: Sequence[jax.Array], dtype=None) -> jax.Array:
        """Full-size values (e.g. gradients) in logical shapes -> ``[N, L/N]`` in ``dtype``
        (default: the FlatParameter's), zero padding."""
        rows = []
        for s, v in zip(self.slots, values):
            flat = v.astype(dtype or self.dtype).reshape(-1)
            flat = jnp.pad(flat, (0, s.padded - s.size)) if s.padded > s.size else flat  # [n] -> [n_pad]
            rows.append(flat.reshape(self.num_shards, -1))  # [N, n_pad/N]
        return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)  # [N, L/N]

"""The per-parameter storage record (ParamLayout) and the FlatParameter: one unit's records of one dtype.

How a parameter is stored (docs/design.md section 4; after the FlatParameter of PyTorch FSDP,
arXiv 2304.11277 section 3.2). With ``N`` devices in a shard group, every parameter of ``n``
elements is flattened and zero-padded to ``n_pad = ceil(n / N) * N`` elements, viewed as
``[N, n_pad / N]``; row ``r`` goes to device ``r``. At rest each parameter's shard is its own
array, globally ``[n_pad]`` with ``PartitionSpec(shard_axes)`` (local ``[n_pad / N]``), so the
optimizer sees per-parameter shards. A unit call gathers each parameter into its own buffer
(``collectives.gather_params``) and reduce-scatters each gradient from its own ``[n_pad]``::

    param p (shape s, n elements) -> [n] -> pad -> [n_pad] -> [N, n_pad/N]   (row r on device r)
    device r's shard of p:                               # [n_pad/N]
    all_gather over the shard axes (tiled):              # [n_pad]
    param p  = full[:n].reshape(s)                       # [n_pad] -> [:n] -> s

Unlike FSDP's, this FlatParameter is metadata, not a buffer: a unit's records of one dtype, each
at an offset (:class:`ParamSlot`) in the *flat shard* ``[L/N]`` (``L = sum_p n_pad``), row ``r``
of every parameter side by side. That concatenation is built as an array only where one
collective over a unit's parameters is worth a copy: the optimizer's all-gather of the updated
slices for SHARD_OPT / HYBRID_SHARD_OPT (``optim.py``: ``concat_shards`` -> ``[W, L/W]`` ->
``split_padded``; HYBRID_SHARD_OPT's slices are laid out by :meth:`FlatParameter.over_replicas`),
and HYBRID_SHARD_OPT's replica reduce-scatter of the gradient rows
(:func:`zshard.wire.grad_exit.replica_slices`, ``[R, L/(R*S)]``).

:class:`ParamLayout` is the one record per parameter that knows the stored form
(``to_storage`` / ``from_storage``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zshard.mesh.mesh import EXPERT, TENSOR

__all__ = ["FlatParameter", "ParamLayout", "ParamSlot", "padded_size"]


def padded_size(size: int, num_shards: int) -> int:
    """``size`` rounded up to a multiple of ``num_shards`` (elements)."""
    return -(-size // num_shards) * num_shards  # 0 stays 0


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One parameter's storage format: the only place that knows how a parameter is stored.

    A parameter of logical shape ``shape`` (one layer's) is stored flat and zero-padded:
    ``[n_pad]``, or ``[L, n_pad]`` for a stacked parameter ``[L, *shape]`` (each layer padded
    on its own), with ``PartitionSpec(shard_axes)`` (``PartitionSpec(None, shard_axes)``
    stacked) at rest.

    A parameter split over the ``tensor`` mesh axis (``tp_dim`` set, ``T = tp`` devices) is
    split along ``tp_dim`` FIRST, into ``T`` contiguous pieces of shape :attr:`piece_shape`
    (``shape`` with ``shape[tp_dim] / T``); then each piece is flattened, padded and
    FSDP-sharded on its own: stored ``[T, n_pad]`` (stacked ``[L, T, n_pad]``) with
    ``PartitionSpec("tensor", shard_axes)``, ``n_pad`` the padded size of one piece. Piece
    ``t`` holds ``x[..., t*s/T:(t+1)*s/T, ...]`` (``s = shape[tp_dim]``), the slice that device
    ``t`` of a tensor group computes with (Megatron-LM's column / row split, arXiv 1909.08053
    section 3).

    An expert parameter (``ep_dim`` set, ``X = ep`` devices of the ``expert`` axis; never also
    split over ``tensor``) is cut along its expert dimension into ``X`` groups of ``E/X`` whole
    experts (:attr:`piece_shape`: ``shape`` with ``shape[ep_dim] / X``); each group is flattened
    and padded to ``n_pad/X`` on its own, and the groups lie side by side: stored ``[X * n_pad/X]``
    (stacked ``[L, X * n_pad/X]``) with ``PartitionSpec(("expert", *shard_axes))``, so device
    ``(e, r)`` holds row ``r`` of expert group ``e``: the step sees a flat ``[n_pad/N]`` shard as
    for any parameter, gathers it over ``shard_axes`` only into its group ``[n_pad/X]`` and gets
    ``[E/X, ...]`` (:meth:`piece_from_storage`; docs/expert-parallel.md).
    :meth:`to_storage` / :meth:`from_storage` are the only code that orders the
    pieces and groups: every module that turns a parameter (or a parameter-shaped gradient, optimizer
    leaf or checkpoint array) into its stored form or back calls them.

    Attributes:
      path: the parameter's path in the model state, ``("blocks", 0, "mlp", "kernel")``.
      shape: logical shape of one layer.
      dtype: the parameter's dtype (numpy).
      padded: ``n_pad``: the elements of one layer (of one tensor piece, when split) rounded
        up to a multiple of the devices the optimizer state is split over
        (``Plan.opt_shards``), so that every shard count used on it divides it (elements).
      layers: ``L`` of a stacked parameter (the layer axis is never sharded), else ``None``.
      spec: PartitionSpec of the stored array at rest (``PartitionSpec()``: replicated).
      trainable: ``False`` for a frozen parameter (no gradient, no optimizer state).
      unit: name of the unit that gathers it (``"blocks.0"``, ``"root"``).
      tp_dim: the dimension of ``shape`` split over the ``tensor`` axis, or ``None``.
      tp: ``T``, devices of the ``tensor`` axis (1 when not split).
      ep_dim: the dimension of ``shape`` split over the ``expert`` axis (the expert dimension), or ``None``.
      ep: ``X``, devices of the ``expert`` axis (1 when not an expert parameter); ``padded``
        then counts all ``X`` groups (``X`` times one group's padded size, :attr:`piece_padded`).
    """

    path: tuple
    shape: tuple[int, ...]
    dtype: np.dtype
    padded: int  # n_pad (of one tensor piece)
    layers: int | None = None
    spec: P = P()
    trainable: bool = True
    unit: str = ""
    tp_dim: int | None = None
    tp: int = 1
    ep_dim: int | None = None
    ep: int = 1

    @classmethod
    def build(cls, path, shape, dtype, pad_multiple: int, layers=None, axes: tuple[str, ...] = (), trainable=True, unit="",
              tp_dim: int | None = None, tp: int = 1, ep_dim: int | None = None, ep: int = 1):
        """The record of a parameter whose layer has logical ``shape``, padded to a multiple of
        ``pad_multiple``, split over the mesh ``axes`` at rest (and, with ``tp_dim``, over the
        ``tensor`` axis of ``tp`` devices first; with ``ep_dim``, into ``ep`` expert groups, each
        padded to a multiple of ``pad_multiple / ep``, laid side by side over ``("expert", *axes)``).

        Raises:
          ValueError: ``tp`` does not divide ``shape[tp_dim]``, ``ep`` does not divide
            ``shape[ep_dim]`` or ``pad_multiple``, or both splits on one parameter.
        """
        shape = tuple(int(d) for d in shape)
        if ep_dim is not None and (ep <= 1 or not shape):
            ep_dim, ep = None, 1
        if ep_dim is not None:
            name = ".".join(map(str, path))
            if tp_dim is not None and tp > 1:
                raise ValueError(f"parameter {name} {list(shape)} is split over both expert and tensor; split it over one")
            ep_dim = ep_dim % len(shape)
            if shape[ep_dim] % ep or pad_multiple % ep:
                raise ValueError(f"parameter {name} {list(shape)}: dimension {ep_dim} ({shape[ep_dim]}) does not divide by "
                                 f"expert={ep}; use an expert size that divides the number of experts")
            group = shape[:ep_dim] + (shape[ep_dim] // ep,) + shape[ep_dim + 1 :]
            size = int(np.prod(group, dtype=np.int64))
            spec = P(*(() if layers is None else (None,)), (EXPERT,) + tuple(a for a in axes if a != EXPERT))
            padded = ep * padded_size(size, pad_multiple // ep)  # X groups of n_pad/X side by side
            return cls(tuple(path), shape, np.dtype(dtype), padded, layers, spec, trainable, unit, None, 1, ep_dim, ep)
        if tp_dim is not None and (tp <= 1 or not shape):
            tp_dim, tp = None, 1
        if tp_dim is not None:
            if shape[tp_dim] % tp:
                raise ValueError(
                    f"parameter {'.'.join(map(str, path))} {list(shape)}: dimension {tp_dim} ({shape[tp_dim]}) does not "
                    f"divide by tensor={tp}; pick a tensor size that divides it, or split another dimension"
                )
            tp_dim = tp_dim % len(shape)
        piece = shape if tp_dim is None else shape[:tp_dim] + (shape[tp_dim] // tp,) + shape[tp_dim + 1 :]
        size = int(np.prod(piece, dtype=np.int64))
        lead = () if layers is None else (None,)
        split = () if tp_dim is None else (TENSOR,)
        spec = P(*lead, *split, axes if axes else None) if (axes or split) else P()
        return cls(tuple(path), shape, np.dtype(dtype), padded_size(size, pad_multiple), layers, spec, trainable, unit, tp_dim, tp)

    @property
    def split(self) -> bool:
        """The parameter is split over the ``tensor`` axis."""
        return self.tp_dim is not None

    @property
    def expert(self) -> bool:
        """The parameter is split over the ``expert`` axis (``E/X`` whole experts per device)."""
        return self.ep_dim is not None

    @property
    def piece_padded(self) -> int:
        """Stored elements of one piece: ``n_pad`` (one expert group's ``n_pad/X`` for an expert
        parameter): the gathered buffer the step sees."""
        return self.padded // self.ep

    @property
    def size(self) -> int:
        """``n = prod(shape)``: logical elements of one layer."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """One tensor piece of one layer: ``shape`` with ``shape[tp_dim] / T``; one expert group:
        ``shape`` with ``shape[ep_dim] / X`` (``[E/X, ...]``); ``shape`` unsplit."""
        if self.expert:
            d, parts = self.ep_dim, self.ep
        elif self.split:
            d, parts = self.tp_dim, self.tp
        else:
            return self.shape
        return self.shape[:d] + (self.shape[d] // parts,) + self.shape[d + 1 :]

    @property
    def piece_size(self) -> int:
        """Elements of one tensor piece of one layer (``size`` unsplit)."""
        return int(np.prod(self.piece_shape, dtype=np.int64))

    @property
    def pieces(self) -> tuple[int, ...]:
        """``(T,)`` for a parameter split over ``tensor``, else ``()``."""
        return (self.tp,) if self.split else ()

    @property
    def lead(self) -> tuple[int, ...]:
        """``(L,)`` for a stacked parameter, else ``()``."""
        return () if self.layers is None else (self.layers,)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """``[*shape]``, or ``[L, *shape]`` stacked: the parameter as the model holds it."""
        return self.lead + self.shape

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """``[n_pad]`` (``[T, n_pad]`` split), with ``[L, ...]`` in front stacked: the global stored array."""
        return self.lead + self.pieces + (self.padded,)

    def shard_shape(self, parts: int) -> tuple[int, ...]:
        """``[n_pad/parts]`` (``[T, n_pad/parts]`` split; ``[L, ...]`` stacked): one device's
        piece over ``parts`` devices of the data axes, as a ``shard_map`` body over them sees it."""
        if self.padded % parts:
            raise ValueError(f"{self.path}: {self.padded} padded elements do not split over {parts} devices")
        return self.lead + self.pieces + (self.padded // parts,)

    def piece_to_storage(self, x):
        """One tensor piece or expert group ``[..., *piece_shape]`` -> ``[..., n_pad]`` (``n_pad/X``
        for an expert group: :attr:`piece_padded`), zero padding (numpy or jax)."""
        xp = np if isinstance(x, np.ndarray) else jnp
        lead = tuple(np.shape(x)[: np.ndim(x) - len(self.shape)])
        flat = xp.reshape(x, lead + (self.piece_size,))  # [..., *piece] -> [..., n]
        pad = self.piece_padded - self.piece_size
        return xp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)]) if pad else flat  # [..., n] -> [..., n_pad]

    def piece_from_storage(self, x):
        """``[..., n_pad]`` -> one tensor piece or expert group ``[..., *piece_shape]``; padding dropped."""
        return x[..., : self.piece_size].reshape(tuple(np.shape(x)[:-1]) + self.piece_shape)

    def to_storage(self, x):
        """A value in logical form ``[..., *shape]`` -> stored form ``[..., (T,) n_pad]``, zero padding.

        ``...`` is any leading dimensions: none (one layer, or an unstacked parameter), ``[L]``
        (all layers of a stacked one). numpy in, numpy out; jax in, jax out. The dtype is kept.
        Split over ``tensor``: ``[..., s_0, .., s_d, ..]`` -> ``[..., s_0, .., T, s_d/T, ..]``
        (piece ``t`` is the ``t``-th contiguous block of dimension ``d``) -> ``[..., T, *piece]``.
        Expert: ``[..., E, ..]`` -> ``[..., X, *piece]`` (group ``e``: experts ``e E/X .. (e+1) E/X - 1``)
        -> ``[..., X, n_pad/X]`` -> ``[..., X * n_pad/X]``.
        """
        if self.expert:
            return self._groups_to_storage(x)
        if not self.split:
            return self.piece_to_storage(x)
        xp = np if isinstance(x, np.ndarray) else jnp
        nl = np.ndim(x) - len(self.shape)
        lead, d = tuple(np.shape(x)[:nl]), self.tp_dim
        blocks = xp.reshape(x, lead + self.shape[:d] + (self.tp, self.shape[d] // self.tp) + self.shape[d + 1 :])
        pieces = xp.moveaxis(blocks, nl + d, nl)  # [..., T, *piece]
        return self.piece_to_storage(pieces)  # [..., T, n_pad]

    def from_storage(self, x):
        """Stored form ``[..., (T,) n_pad]`` -> logical form ``[..., *shape]``; padding dropped.

        ``...`` as in :meth:`to_storage`. numpy or jax. (An optimizer view ``[.., 1, n_pad]``
        is reshaped to :attr:`storage_shape` first.)
        """
        if self.expert:
            return self._groups_from_storage(x)
        if not self.split:
            return self.piece_from_storage(x)  # [..., n_pad] -> [..., n] -> [..., *shape]
        xp = np if isinstance(x, np.ndarray) else jnp
        pieces = self.piece_from_storage(x)  # [..., T, *piece]
        nl, d = np.ndim(x) - 2, self.tp_dim
        blocks = xp.moveaxis(pieces, nl, nl + d)  # [..., s_0, .., T, s_d/T, ..]
        return xp.reshape(blocks, tuple(np.shape(x)[:nl]) + self.shape)

    def _groups_to_storage(self, x):
        """Expert parameter: ``[..., *shape]`` -> ``[..., X * n_pad/X]`` (:meth:`to_storage`)."""
        xp = np if isinstance(x, np.ndarray) else jnp
        nl, d, X = np.ndim(x) - len(self.shape), self.ep_dim, self.ep  # noqa: N806
        lead = tuple(np.shape(x)[:nl])
        blocks = xp.reshape(x, lead + self.shape[:d] + (X, self.shape[d] // X) + self.shape[d + 1 :])  # [..., s_0, .., X, E/X, ..]
        groups = self.piece_to_storage(xp.moveaxis(blocks, nl + d, nl))  # [..., X, *piece] -> [..., X, n_pad/X]
        return xp.reshape(groups, lead + (self.padded,))  # [..., X, n_pad/X] -> [..., X * n_pad/X]

    def _groups_from_storage(self, x):
        """Expert parameter: ``[..., X * n_pad/X]`` -> ``[..., *shape]`` (:meth:`from_storage`)."""
        xp = np if isinstance(x, np.ndarray) else jnp
        nl, d, X = np.ndim(x) - 1, self.ep_dim, self.ep  # noqa: N806
        lead = tuple(np.shape(x)[:nl])
        groups = self.piece_from_storage(xp.reshape(x, lead + (X, self.piece_padded)))  # [..., X, *piece]
        blocks = xp.moveaxis(groups, nl, nl + d)  # [..., s_0, .., X, E/X, ..]
        return xp.reshape(blocks, lead + self.shape)

    def tp_spec(self, lead: int = 0) -> P:
        """PartitionSpec of the logical value ``[<lead dims>, *shape]`` split over ``tensor``
        along ``tp_dim`` (what a gather hands the model; ``P()`` unsplit)."""
        if not self.split:
            return P()
        return P(*([None] * lead), *[TENSOR if i == self.tp_dim else None for i in range(len(self.shape))])

    @property
    def view_ndim(self) -> int:
        """Rank of the optimizer's view of one layer: the logical rank, at least 1."""
        return max(len(self.shape), 1)

    def view_shape(self, parts: int) -> tuple[int, ...]:
        """The optimizer's view of one device's piece over ``parts`` devices:
        ``[*lead, 1, ..., 1, n_pad/parts]`` with the logical rank (:attr:`view_ndim`), so that
        Optax masks and labels (``p.ndim > 1``) see weights and biases as they are. Split over
        ``tensor``: ``[*lead, T, 1, ..., n_pad/parts]`` (rank >= 2) or ``[*lead, T * n_pad/parts]``
        (a vector)."""
        piece = self.shard_shape(parts)
        if not self.split:
            return piece[:-1] + (1,) * (self.view_ndim - 1) + piece[-1:]
        lead, k = piece[:-2], piece[-1]
        if self.view_ndim == 1:
            return lead + (self.tp * k,)
        return lead + (self.tp,) + (1,) * (self.view_ndim - 2) + (k,)

    def opt_shape(self, parts: int) -> tuple[int, ...]:
        """Local shape of a stored optimizer-state leaf of this parameter: the view
        (:meth:`view_shape`), or for a parameter split over ``tensor`` its shard
        ``[*lead, T, n_pad/parts]`` (the optimizer converts it to the view and back)."""
        return self.shard_shape(parts) if self.split else self.view_shape(parts)

    def view_spec(self, axes: tuple[str, ...]) -> P:
        """PartitionSpec of a stored optimizer-state leaf (:meth:`opt_shape`, the last dimension
        split over ``axes``; split parameters also over ``tensor``)."""
        if self.split:
            return P(*([None] * len(self.lead)), TENSOR, axes if axes else None)
        if self.expert:  # the groups side by side, as the parameter lies (:meth:`build`)
            axes = (EXPERT,) + tuple(a for a in axes if a != EXPERT)
        return P(*([None] * (len(self.lead) + self.view_ndim - 1)), axes) if axes else P()

    def format_key(self) -> "ParamLayout":
        """This record without its identity (path, spec, trainable, unit): equal for every
        parameter stored alike, the static argument of a program compiled once per format."""
        return ParamLayout((), self.shape, self.dtype, self.padded, self.layers, tp_dim=self.tp_dim, tp=self.tp,
                           ep_dim=self.ep_dim, ep=self.ep)


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter (its :class:`ParamLayout`) lives in its unit's FlatParameter.

    Attributes:
      param: the parameter's record.
      offset: column of this parameter's row inside one device's FlatParameter shard.

    ``path``, ``shape``, ``dtype``, ``size`` and ``padded`` are the record's.
    """

    param: ParamLayout
    offset: int

    path = property(lambda self: self.param.path)
    shape = property(lambda self: self.param.shape)
    dtype = property(lambda self: self.param.dtype)
    size = property(lambda self: self.param.size)
    padded = property(lambda self: self.param.padded)


@dataclasses.dataclass(frozen=True)
class FlatParameter:
    """Where one unit's parameters of one dtype sit in its flat shard ``[L/N]``, over ``num_shards``
    devices (metadata: the step gathers and reduce-scatters each parameter on its own).

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
    def build(cls, unit: str, params: Sequence[ParamLayout], num_shards: int, trainable: bool = True):
        """Lay out parameter records (all of one dtype) in the given order over ``num_shards`` devices.

        Each record's ``padded`` must divide by ``num_shards``: records are padded to the
        optimizer's shard count (SHARD_OPT keeps whole parameters, ``num_shards=1``, padded to
        a multiple of all devices, so that it can slice them).

        Raises:
          ValueError: a record's ``padded`` does not divide by ``num_shards``.
        """
        slots, offset = [], 0
        for p in params:
            if p.padded % num_shards:
                raise ValueError(f"{p.path}: padded size {p.padded} must be a multiple of num_shards={num_shards}")
            slots.append(ParamSlot(p, offset))
            offset += p.padded // num_shards
        return cls(unit, np.dtype(params[0].dtype), num_shards, tuple(slots), trainable)

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
            slots.append(ParamSlot(ParamLayout(s.path, (n,), s.dtype, n, unit=self.unit), offset))
            offset += n // parts
        return FlatParameter(self.unit, self.dtype, parts, tuple(slots), self.trainable)

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

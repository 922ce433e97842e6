"""Quantized collectives: block-quantized weight all-gathers and gradient all-to-alls (ZeRO++ qwZ / qgZ).

ZeRO++ (Wang et al., arXiv 2306.10209 section 3) cuts the bytes of FSDP's collectives by sending
integers or floats of one byte (or half a byte) with one fp32 scale per block of ``B`` elements:

- **qwZ** (section 3.1), the weight all-gather: each device quantizes its own parameter shard
  ``[n_pad/N]`` (absmax per block), all-gathers the payload ``u8[n_pad/N]`` and the scales
  ``f32[n_pad/(N*B)]``, and dequantizes the gathered ``[n_pad]`` to ``param_dtype``. Bytes one
  device receives: ``Psi (1 + 4/B)`` for 8-bit formats against ``2 Psi`` (bf16), ``4 Psi`` (fp32).
- **qgZ** (section 3.3), the gradient reduce-scatter: each device quantizes its full gradient
  ``[n_pad]`` in blocks, sends chunk ``j`` (``[n_pad/N]`` with its scales) to device ``j`` in one
  all-to-all, and dequantizes and sums the ``N`` chunks it receives in fp32. Integers are never
  summed: an integer sum wraps (an int4 reduce-scatter errs by 16).

Parameters are padded so that no block straddles two shards (``n_pad`` a multiple of ``N*B``,
:func:`pad_multiple`): scales stay local, no extra collective, and quantizing the shards before
the gather equals quantizing the gathered parameter, bit for bit. Matrices with fewer than ``B``
elements per shard, and every parameter of rank < 2 (norms, biases), are not quantized
(:func:`quantizes`); :func:`coverage` lists them. The wire payload is bitcast to ``uint8``, so no
backend widens it (XLA:CPU widens fp8 collectives to f16 and int4 to s8 otherwise).

This module owns the formats (:class:`Quant`), quantize / dequantize, the three quantized
collectives (:func:`all_gather`, :func:`reduce_scatter`, :func:`all_reduce`), which parameter each
format applies to (:func:`quantizes`, read by the planner into each parameter's wire record,
zshard/wire/wire.py), the padding it needs, and the bytes it moves. It imports no other zshard module
at load time. docs/quantized.md has the formulas and the errors measured.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FORMATS",
    "Quant",
    "all_gather",
    "all_reduce",
    "as_quant",
    "check_plan",
    "coverage",
    "dequantize",
    "feedback_bytes",
    "feedback_layout",
    "moved_bytes",
    "pad_multiple",
    "quantize",
    "quantizes",
    "reduce_scatter",
    "reduce_scatter_feedback",
    "wire_bytes",
]

# name -> (bits on the wire, largest magnitude a block's absmax maps to, storage dtype)
FORMATS = {
    "int8": (8, 127.0, jnp.int8),
    "int4": (4, 7.0, jnp.int8),  # two per byte on the wire, [-7, 7] + 8 in a nibble
    "float8_e4m3fn": (8, 448.0, jnp.float8_e4m3fn),
    "float8_e5m2": (8, 57344.0, jnp.float8_e5m2),
}


@dataclasses.dataclass(frozen=True)
class Quant:
    """A quantized wire format of one collective: ``Quant("int8", block=256)``.

    Attributes:
      name: ``"int8"``, ``"int4"`` (two per byte), ``"float8_e4m3fn"`` or ``"float8_e5m2"``.
      block: elements per fp32 absmax scale (ZeRO++'s block quantization), or ``None`` for one
        scale per tensor (torchao's tensorwise fp8: the absmax over all shards, one scalar
        ``pmax``). A parameter is padded to a multiple of ``N * block`` so no block straddles
        two shards.
      error_feedback: ``reduce_format`` only: each device keeps what quantizing its gradient
        dropped (an fp32 residual ``[n_pad]`` per quantized parameter, ``ShardedState.feedback``,
        zshard/wire/feedback.py) and adds it to its next gradient before quantizing (:func:`reduce_scatter_feedback`;
        1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019, arXiv 1901.09847; LoCo,
        arXiv 2407.04480). ``replica_format`` and ``gather_format`` refuse it.

    Raises:
      ValueError: an unknown ``name`` (the known ones listed), a ``block`` that is not a
        positive integer or ``None``, an odd ``block`` for int4.
    """

    name: str
    block: int | None = 256
    error_feedback: bool = False

    def __post_init__(self):
        if self.name not in FORMATS:
            raise ValueError(f"Quant({self.name!r}): unknown format; choose one of {', '.join(map(repr, FORMATS))}")
        b = self.block
        if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1):
            raise ValueError(f"Quant({self.name!r}, block={b!r}): block must be a positive integer (elements per scale), "
                             "or None for one scale per tensor")
        if b is not None:
            object.__setattr__(self, "block", int(b))
            if self.name == "int4" and b % 2:
                raise ValueError(f"Quant('int4', block={b}): int4 packs two values per byte, so the block must be even")
        object.__setattr__(self, "error_feedback", bool(self.error_feedback))

    @property
    def bits(self) -> int:
        return FORMATS[self.name][0]

    @property
    def qmax(self) -> float:
        return FORMATS[self.name][1]

    @property
    def multiple(self) -> int:
        """Elements a quantized buffer's length must be a multiple of: ``block`` (int4
        tensorwise: 2, one byte)."""
        return self.block if self.block else (2 if self.bits == 4 else 1)

    @property
    def label(self) -> str:
        """``"int8/256"``, ``"float8_e4m3fn/tensorwise"``."""
        return f"{self.name}/{self.block if self.block else 'tensorwise'}"


def as_quant(value, field: str) -> Quant | None:
    """``None``, a :class:`Quant`, or a format name (``"int8"``: ``Quant("int8")``, blocks of 256).

    Raises:
      ValueError / TypeError: an unknown name, or a value of another type, naming ``field``.
    """
    if value is None or isinstance(value, Quant):
        return value
    if isinstance(value, str):
        try:
            return Quant(value)
        except ValueError as e:
            raise ValueError(f"MixedPrecision({field}={value!r}): {e}") from None
    raise TypeError(f"MixedPrecision({field}={value!r}): give zshard.Quant(name, block=...), a format name "
                    f"({', '.join(FORMATS)}) or None")


# --- quantize / dequantize ---------------------------------------------------------------------------


def quantize(x: jax.Array, fmt: Quant, amax_axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """``[..., n]`` floating -> ``(payload u8[..., n*bits/8], scales f32[..., n/B])`` (tensorwise:
    scales ``f32[..., 1]``, the absmax taken over ``amax_axes`` too, a ``pmax``).

    Per block: ``scale = absmax / qmax`` (1 for an all-zero block), ``q = round(x / scale)``
    clipped to ``[-qmax, qmax]`` (integers; round half to even) or ``x / scale`` in the fp8 format.

    Raises:
      ValueError: ``n`` is not a multiple of ``fmt.multiple`` (the padding it needs named).
    """
    n = x.shape[-1]
    if n % fmt.multiple:
        raise ValueError(f"zshard.wire.quant: a buffer of {n} elements does not split into blocks of {fmt.multiple} "
                         f"({fmt.label}); pad it to {-(-n // fmt.multiple) * fmt.multiple}")
    lead = x.shape[:-1]
    width = fmt.block or n
    blocks = x.astype(jnp.float32).reshape(lead + (n // width if width else 0, width))  # [..., n] -> [..., n/B, B]
    amax = jnp.max(jnp.abs(blocks), axis=-1)  # [..., n/B]
    if not fmt.block and amax_axes:
        amax = jax.lax.pmax(amax, amax_axes)  # one scale for the whole tensor: [..., 1] --all_reduce(max)--> [..., 1]
    scale = jnp.where(amax > 0, amax / fmt.qmax, jnp.float32(1))
    y = jnp.clip(blocks / scale[..., None], -fmt.qmax, fmt.qmax)
    if fmt.name.startswith("int"):
        q = jnp.round(y).astype(jnp.int8)
    else:
        q = y.astype(FORMATS[fmt.name][2])
    q = q.reshape(lead + (n,))  # [..., n/B, B] -> [..., n]
    if fmt.bits == 4:  # [..., n] in [-7, 7] -> +8 -> nibbles [..., n/2, 2] -> u8[..., n/2]
        nib = (q + 8).astype(jnp.uint8).reshape(lead + (n // 2, 2))
        return nib[..., 0] | (nib[..., 1] << 4), scale
    return jax.lax.bitcast_convert_type(q, jnp.uint8), scale  # 1 byte per element on the wire


def dequantize(payload: jax.Array, scales: jax.Array, fmt: Quant, dtype) -> jax.Array:
    """``(u8[..., n*bits/8], f32[..., n/B] or [..., 1])`` -> ``[..., n]`` in ``dtype``
    (``q * scale`` in fp32, then cast)."""
    if fmt.bits == 4:  # u8[..., n/2] -> [..., n/2, 2] -> [..., n], back to [-7, 7]
        nib = jnp.stack([payload & 15, payload >> 4], axis=-1)
        q = (nib.astype(jnp.int8) - 8).reshape(payload.shape[:-1] + (2 * payload.shape[-1],))
    else:
        q = jax.lax.bitcast_convert_type(payload, FORMATS[fmt.name][2])
    n, lead = q.shape[-1], q.shape[:-1]
    width = fmt.block or n
    blocks = q.astype(jnp.float32).reshape(lead + (n // width if width else 0, width))  # [..., n/B, B]
    return (blocks * scales[..., None]).reshape(lead + (n,)).astype(dtype)


# --- the collectives ---------------------------------------------------------------------------------


def _gather_last(x: jax.Array, axes: tuple[str, ...], invariant: bool = False) -> jax.Array:
    """``[..., m] --all_gather(axes, tiled, last dim)--> [..., N*m]``."""
    if invariant:
        return jax.lax.all_gather(x, axes, axis=x.ndim - 1, tiled=True, to="invarying")
    return jax.lax.all_gather(x, axes, axis=x.ndim - 1, tiled=True)


def all_gather(shard: jax.Array, axes: tuple[str, ...], fmt: Quant, dtype, *, invariant: bool = False) -> jax.Array:
    """qwZ: a parameter shard ``[..., n/N]`` -> the gathered ``[..., n]`` in ``dtype``, quantized on the wire.

    ``[..., n/N] --quantize--> u8[..., n/N] + f32[..., n/(N B)] --all_gather(axes, tiled)-->
    u8[..., n] + f32[..., n/B] --dequantize--> [..., n]`` (int4: ``u8[..., n/(2N)]``). Tensorwise:
    one scale, the ``pmax`` of the shards' absmax, and only the payload is gathered. ``invariant``:
    the result typed as the same on every device of ``axes``.
    """
    payload, scales = quantize(shard, fmt, axes)
    payload = _gather_last(payload, axes, invariant)  # u8[..., n/N] --all_gather(axes, tiled)--> u8[..., n]
    if fmt.block:
        scales = _gather_last(scales, axes, invariant)  # f32[..., n/(N B)] --all_gather(axes, tiled)--> f32[..., n/B]
    return dequantize(payload, scales, fmt, dtype)


def reduce_scatter(g: jax.Array, axes: tuple[str, ...], fmt: Quant) -> jax.Array:
    """qgZ: this device's gradient ``[..., n]`` -> the sum over ``axes`` of chunk ``i`` (this
    device's index), ``f32[..., n/N]``: one all-to-all of quantized blocks, then dequantize and sum
    in fp32 (what ``psum_scatter(tiled=True)`` computes exactly).

    ``[..., n] --quantize--> u8[..., N, n/N] + f32[..., N, n/(N B)] --all_to_all(axes)--> (row j
    from device j) --dequantize--> f32[..., N, n/N] --sum over N--> f32[..., n/N]``. Tensorwise:
    the device's own scale travels with every chunk (``f32[..., N, 1]``).
    """
    return _exchange(*quantize(g, fmt), g.shape, axes, fmt)


def reduce_scatter_feedback(g: jax.Array, residual: jax.Array, axes: tuple[str, ...], fmt: Quant) -> tuple[jax.Array, jax.Array]:
    """qgZ with error feedback: ``(gradient [..., n], residual f32[..., n])`` -> ``(f32[..., n/N],
    new residual f32[..., n])``.

    Error feedback (Seide et al. 2014, "1-bit SGD", section 3; Karimireddy et al. 2019, EF-SGD,
    arXiv 1901.09847, algorithm 2; LoCo, Xie et al., arXiv 2407.04480, section 3, for ZeRO++'s
    int4 all-to-all): this device quantizes ``x = g + e`` (fp32), sends it as :func:`reduce_scatter`
    does, and keeps what the quantizer dropped, ``e' = x - dequantize(quantize(x))``, for the next
    reduction. Only the uncompensated form (LoCo without its moving average and its low-bit
    storage of ``e``): the residual stays fp32, ``4 n`` bytes per device.
    """
    x = g.astype(jnp.float32) + residual  # [..., n] + [..., n], fp32
    payload, scales = quantize(x, fmt)
    dropped = x - dequantize(payload, scales, fmt, jnp.float32)  # [..., n]: what the wire does not carry
    return _exchange(payload, scales, g.shape, axes, fmt), dropped


def _exchange(payload: jax.Array, scales: jax.Array, shape: tuple, axes: tuple[str, ...], fmt: Quant) -> jax.Array:
    """The all-to-all and fp32 sum of :func:`reduce_scatter`, from the quantized ``[..., n]``."""
    n_dev = jax.lax.axis_size(axes)
    lead = shape[:-1]
    payload = payload.reshape(lead + (n_dev, -1))  # u8[..., n] -> u8[..., N, n/N]
    if fmt.block:
        scales = scales.reshape(lead + (n_dev, -1))  # f32[..., n/B] -> f32[..., N, n/(N B)]
    else:
        scales = jnp.broadcast_to(scales[..., None, :], lead + (n_dev, 1))  # f32[..., 1] -> f32[..., N, 1]
    k = len(lead)
    payload = jax.lax.all_to_all(payload, axes, k, k, tiled=True)  # u8[..., N, n/N] --all_to_all(axes)--> row j from device j
    scales = jax.lax.all_to_all(scales, axes, k, k, tiled=True)  # f32[..., N, n/(N B)] --all_to_all(axes)-->
    return jnp.sum(dequantize(payload, scales, fmt, jnp.float32), axis=k)  # [..., N, n/N] -> [..., n/N], fp32


def all_reduce(x: jax.Array, axes: tuple[str, ...], fmt: Quant) -> jax.Array:
    """A quantized all-reduce ``f32[..., n] -> f32[..., n]``, the same on every device of ``axes``:
    :func:`reduce_scatter` (all-to-all of quantized blocks, fp32 sums), then :func:`all_gather`
    of the quantized partial sums (``n`` a multiple of ``N * block``)."""
    part = reduce_scatter(x, axes, fmt)  # [..., n] --all_to_all(axes), sum--> [..., n/N]
    return all_gather(part, axes, fmt, jnp.float32, invariant=True)  # [..., n/N] --all_gather(axes)--> [..., n]


# --- which parameters, what padding, what bytes ------------------------------------------------------


def quantizes(fmt: Quant | None, rec, parts: int) -> bool:
    """Whether ``fmt`` quantizes parameter ``rec`` (a :class:`~zshard.params.flat.ParamLayout`) when its
    buffer is split over ``parts`` devices: a floating matrix (rank >= 2 per layer) with at least
    ``block`` elements per device (tensorwise: at least one). Norms, biases and small matrices
    move in the dtype they would without a format."""
    if fmt is None or not jnp.issubdtype(rec.dtype, jnp.floating) or len(rec.piece_shape) < 2 or parts < 1:
        return False
    return -(-rec.piece_size // parts) >= (fmt.block or 1)


def roles(mp, num_shards: int, world: int) -> tuple:
    """``(role, format, devices its buffer splits over)`` of each format set on ``mp``: the
    shard-axis gather and reduction over ``N = num_shards``, the replica reduction over all
    ``world`` data devices (its all-to-all splits the shard ``[n_pad/N]`` ``R`` ways)."""
    out = [("gather", mp.gather_format, num_shards), ("reduce", mp.reduce_format, num_shards),
           ("replica", mp.replica_format, world)]
    return tuple(r for r in out if r[1] is not None)


def pad_multiple(mp, rec, num_shards: int, opt_shards: int, world: int) -> int:
    """The multiple ``rec`` is padded to: ``opt_shards``, and ``parts * fmt.multiple`` of every
    format that quantizes it (so no block straddles two shards)."""
    m = opt_shards
    for _, fmt, parts in roles(mp, num_shards, world):
        if quantizes(fmt, rec, parts):
            m = math.lcm(m, parts * fmt.multiple)
    return m


def wire_bytes(fmt: Quant | None, n: int, dtype) -> float:
    """Bytes of ``n`` elements on the wire: ``n * bits/8 + 4 n / B`` (tensorwise ``+ 4``), or
    ``n * itemsize`` of ``dtype`` unquantized (ZeRO++, arXiv 2306.10209 section 3)."""
    if fmt is None:
        return n * np.dtype(dtype).itemsize
    return n * fmt.bits / 8 + 4 * (n / fmt.block if fmt.block else 1)


def moved_bytes(plan, role: str, rec) -> float:
    """Bytes one layer (one tensor piece) of ``rec`` puts on the wire in ``role``: ``"gather"``
    (``param_dtype`` or ``gather_format``), ``"reduce"`` (``reduce_dtype`` or ``reduce_format``),
    ``"replica"`` (``reduce_dtype`` or ``replica_format``), ``"master"`` (its own dtype)."""
    n = rec.piece_size
    if role == "master":
        return n * rec.dtype.itemsize
    w = plan.wires[rec.path]  # the parameter's wire record (zshard/wire/wire.py)
    fmt = {"gather": w.gather_format, "reduce": w.reduce_format, "replica": w.replica_format}[role]
    return wire_bytes(fmt, n, w.gather_dtype if role == "gather" else w.reduce_dtype)


def coverage(plan) -> dict:
    """Per format role (``"gather"``, ``"reduce"``, ``"replica"``): its label, and the dotted
    paths of the parameters it quantizes and of those it leaves in ``param_dtype`` /
    ``reduce_dtype`` (``fallback``)."""
    from zshard.params.units import path_str  # noqa: PLC0415  (units imports nothing of this module; keeps quant leaf-light)

    out = {}
    for role, fmt, _ in roles(plan.mp, plan.num_shards, plan.world):
        recs = [r for r in plan.layouts.values() if role == "gather" or r.trainable]
        on = [getattr(plan.wires[r.path], f"{role}_format") is not None for r in recs]  # each parameter's wire
        yes = [path_str(r.path) for r, q in zip(recs, on) if q]
        no = [path_str(r.path) for r, q in zip(recs, on) if not q]
        out[role] = {"format": fmt.label, "quantized": yes, "fallback": no}
    return out


def feedback_layout(plan) -> dict:
    """Error feedback: ``path -> (global shape, PartitionSpec)`` of each residual
    (``ShardedState.feedback``), one per trainable parameter ``reduce_format`` quantizes; ``{}``
    without ``error_feedback``.

    Every device keeps its own residual of its whole gradient before the reduction,
    ``f32[n_pad]`` (``[L, n_pad]`` stacked): globally ``[..., W * n_pad]`` with
    ``PartitionSpec(..., data_axes)`` on the last dimension (``W``: the data devices).
    """
    if not plan.mp.error_feedback:
        return {}
    world, axes = plan.world, plan.data_axes
    out = {}
    for p, rec in plan.layouts.items():
        if plan.wires[p].residual:  # trainable and quantized by reduce_format (its wire record)
            out[p] = (rec.lead + (world * rec.padded,), jax.sharding.PartitionSpec(*([None] * len(rec.lead)), axes))
    return out


def feedback_bytes(plan) -> int:
    """Bytes of the error-feedback residuals on one device: ``4 n_pad`` per quantized trainable
    parameter (``4 L n_pad`` stacked); 0 without ``error_feedback``."""
    return sum(4 * int(np.prod(shape)) // plan.world for shape, _ in feedback_layout(plan).values())


def check_plan(plan) -> None:
    """Refuse, before compiling, a format that would apply to nothing.

    Raises:
      ValueError: ``gather_format`` / ``reduce_format`` on a strategy without shard axes
        (NO_SHARD, SHARD_OPT: nothing is gathered or reduce-scattered), ``replica_format`` on one
        without replica axes (FULL_SHARD, SHARD_GRAD_OP), or a format that quantizes no parameter
        (every one too small for its block): each names the strategy or the largest parameter and the fix;
        ``error_feedback`` with HYBRID_SHARD_OPT (its gradients land in the replica-sharded optimizer slices) or a parameter split over ``tensor``.
    """
    mp, st = plan.mp, plan.strategy
    if mp.error_feedback and st.scatters_replica:
        raise ValueError(
            f"MixedPrecision(reduce_format=Quant({mp.reduce_format.name!r}, error_feedback=True)): {st.value} reduces "
            "gradients into its optimizer slices (sharded over replica), which error feedback does not support yet; "
            "use HYBRID_SHARD or FULL_SHARD, or error_feedback=False"
        )
    if mp.error_feedback:
        split = [r for r in plan.layouts.values() if r.split and plan.wires[r.path].residual]
        if split:
            raise ValueError(
                f"MixedPrecision(reduce_format=Quant({mp.reduce_format.name!r}, error_feedback=True)): parameter "
                f"{'.'.join(map(str, split[0].path))} is split over tensor; error feedback is not built for tensor-parallel "
                "parameters; use error_feedback=False, or no tensor split for it"
            )
    if not plan.shard_axes:
        for field in ("gather_format", "reduce_format"):
            if getattr(mp, field) is not None:
                raise ValueError(
                    f"MixedPrecision({field}={getattr(mp, field).label}): {st.value} keeps every parameter whole on every "
                    "device, so there is no shard-axis all-gather or reduce-scatter to quantize; quantize its gradient "
                    "all-reduce with replica_format=zshard.Quant(...), or pick a sharded strategy"
                )
    if not plan.replica_axes and mp.replica_format is not None:
        raise ValueError(
            f"MixedPrecision(replica_format={mp.replica_format.label}): {st.value} splits the parameters over every mesh "
            "axis, so no gradient is reduced across replicas; use reduce_format for its reduce-scatter, or a HYBRID strategy"
        )
    for role, fmt, parts in roles(mp, plan.num_shards, plan.world):
        recs = [r for r in plan.layouts.values() if role == "gather" or r.trainable]
        if recs and not any(getattr(plan.wires[r.path], f"{role}_format") is not None for r in recs):
            big = max(recs, key=lambda r: r.piece_size)
            field = {"gather": "gather_format", "reduce": "reduce_format", "replica": "replica_format"}[role]
            raise ValueError(
                f"MixedPrecision({field}={fmt.label}) quantizes no parameter: the largest, {'.'.join(map(str, big.path))} "
                f"{list(big.piece_shape)}, has {-(-big.piece_size // parts)} elements on each of {parts} devices, fewer than "
                f"one block of {fmt.block}; use a smaller block (Quant({fmt.name!r}, block=...)) or no format"
            )

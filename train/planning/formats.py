"""The quantized wire formats in the plan search (``python -m train.plan --search --formats none,int8``).

A candidate's formats are ``gather_format`` (the parameter all-gathers over the shard axes, ZeRO++ qwZ),
``reduce_format`` (the gradient reduction over the shard axes: an all-to-all of quantized blocks summed in
fp32, ZeRO++ qgZ) and ``error_feedback`` (on ``reduce_format``: an fp32 residual per quantized parameter
element, on every device); ``zshard.Quant`` and docs/quantized.md define them. This module says which
combinations zshard takes on a candidate (:func:`format_pairs`), how many parameters a format quantizes
(:class:`Matrices`), the bytes per element on the wire (:func:`element_bytes`) and the HBM bytes of
quantizing and dequantizing (:func:`quant_hbm_bytes`). ``replica_format`` is not searched.
"""

from __future__ import annotations

import dataclasses
import math

import zshard

__all__ = ["FORMAT_NAMES", "Matrices", "element_bytes", "format_pairs", "parse_formats", "quant_hbm_bytes", "shard_devices"]

FORMAT_NAMES = ("none", "int8", "int4", "float8_e4m3fn", "float8_e5m2")
"""``--formats`` names: ``none`` (unquantized: ``param_dtype`` gathers, ``reduce_dtype`` reduce-scatters) and
zshard's formats (``zshard.Quant``'s names)."""


def parse_formats(text: str) -> tuple:
    """``"none,int8"`` -> ``(None, "int8")``.

    Raises:
      ValueError: an unknown name (the known ones listed), or an empty list."""
    names = [n.strip() for n in text.split(",")]  # an empty item ("", "none,,int8") is refused with the rest
    bad = [n for n in names if n not in FORMAT_NAMES]
    if bad or not names:
        raise ValueError(f"--formats {text!r}: choose a comma list of {', '.join(FORMAT_NAMES)}")
    return tuple(dict.fromkeys(None if n == "none" else n for n in names))


def shard_devices(c: dict) -> int:
    """``N``: the devices a parameter is gathered and reduce-scattered over (the strategy's shard axes);
    0 where there is no shard-axis gather (NO_SHARD, SHARD_OPT)."""
    m, s = c["mesh"], c["strategy"]
    if s in ("NO_SHARD", "SHARD_OPT"):
        return 0
    return m["shard"] * m["context"] * (1 if s.startswith("HYBRID") else m["replica"])


@dataclasses.dataclass(frozen=True)
class Matrices:
    """The floating matrices of a model (rank >= 2 per layer: what ``zshard.wire.quant.quantizes`` may
    quantize): ``(elements per layer, layers)`` each, from the abstract model (nothing allocated)."""

    sizes: tuple

    @classmethod
    def of_config(cls, cfg) -> "Matrices":
        import jax
        from flax import nnx

        from train.model import build_model

        model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
        out = []
        for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
            stacked = getattr(cfg, "scan", False) and getattr(path[0], "key", None) == "blocks"  # [L, ...] under nnx.scan
            shape = x.shape[1:] if stacked else x.shape
            if len(shape) >= 2:
                out.append((math.prod(shape), x.shape[0] if stacked else 1))
        return cls(tuple(out))

    def quantized(self, parts: int, block: int | None) -> int:
        """Elements of the matrices with at least ``block`` elements on each of ``parts`` devices (a lower bound:
        ``parts`` counts the tensor axis too, which splits only some of them)."""
        return sum(n * layers for n, layers in self.sizes if parts and -(-n // parts) >= (block or 1))


def format_pairs(c: dict, formats, *, scan: bool, error_feedback: bool = False) -> list[tuple]:
    """The ``(gather_format, reduce_format, error_feedback)`` of candidate ``c`` zshard takes, over ``formats``
    (``None`` for unquantized): only ``(None, None, False)`` where nothing is gathered over a shard axis
    (NO_SHARD, SHARD_OPT, ``N = 1``: zshard refuses the formats there, or they would apply to nothing) or on an
    ``expert`` mesh (zshard refuses quantized collectives there). Also left out:

    - a ``gather_format`` with a ``tensor`` axis when the layers are scanned (``cfg.scan``): the quantized gather
      of a tensor-split parameter inside ``nnx.scan`` fails to lower on jax 0.10.2 (Shardy's verifier:
      "manual axis tensor after free axis shard"; checked 2026-12-06), while the reduce works;
    - with ``error_feedback`` (every quantized ``reduce_format`` carries it): HYBRID_SHARD_OPT and a ``tensor``
      axis, which zshard's ``check_plan`` refuses with error feedback."""
    m = c["mesh"]
    if shard_devices(c) <= 1 or m.get("expert", 1) > 1:
        return [(None, None, False)]
    # a quantized gather of a tensor-split parameter inside nnx.scan: "'sdy.manual_computation' op operand sharding ...
    # must have all manual axes come before free axes ... Saw manual axis "tensor" after free axis "shard"" (jax 0.10.2,
    # Shardy's verifier, when the step is lowered; still so 2026-12-06); not scanned, it lowers and compiles
    gathers = [g for g in formats if g is None or not (scan and m["tensor"] > 1)]
    reduces = [r for r in formats if r is None or not error_feedback or (c["strategy"] != "HYBRID_SHARD_OPT" and m["tensor"] == 1)]
    return [(g, r, bool(error_feedback and r)) for g in gathers for r in reduces]


def element_bytes(fmt: str | None, block: int | None, plain: float) -> float:
    """Bytes per element on the wire: ``bits/8 + 4/B`` (one fp32 scale per block; tensorwise ~0), or ``plain``."""
    if fmt is None:
        return plain
    return zshard.Quant(fmt).bits / 8 + (4 / block if block else 0.0)  # zshard's wire bytes, per element


def quant_hbm_bytes(psi_q: float, *, gather: str | None, reduce: str | None, feedback: bool, block: int | None,
                    passes: int, accumulation: int, activation_bytes: float) -> float:
    """HBM bytes per device and step of quantizing and dequantizing ``psi_q`` elements (memory-bound elementwise
    kernels, not hidden behind the matmuls): a quantized gather dequantizes the gathered parameters, reading ``q``
    and writing ``e`` bytes per element, ``passes x k`` times; a quantized reduction reads the gradient (``e``),
    writes and reads ``q`` (quantize, then dequantize what arrives) and writes and sums fp32 (``8``), ``k`` times,
    plus reading and writing the fp32 residual (``8``) with error feedback. ``q`` = :func:`element_bytes`."""
    out = 0.0
    if gather:
        out += passes * accumulation * psi_q * (element_bytes(gather, block, 0) + activation_bytes)
    if reduce:
        out += accumulation * psi_q * (activation_bytes + 2 * element_bytes(reduce, block, 0) + 8 + (8 if feedback else 0))
    return out

"""The prediction of one planned configuration: the fields ``python -m train.plan --json`` writes at its top level.

:func:`plan_prediction` takes the compiled step's :class:`zshard.Report` and the plan's settings
and returns the candidate fields of issue 51's search (one configuration, compiled): ``mesh``
(``{replica, shard, tensor, context}`` and any other axis), ``strategy``, ``remat``,
``micro_batch`` / ``accumulation`` (DeepSpeed's ``train_micro_batch_size_per_gpu`` /
``gradient_accumulation_steps``), ``fits``, ``memory_bytes``, ``compiled``, ``reason``,
``step_s``, ``tokens_per_s_per_device``, ``mfu``, ``bottleneck``, ``command`` and
``prediction`` (every term of :class:`train.planning.cost.Prediction`, with the profile used).
"""

from __future__ import annotations

import math

import numpy as np

from train.planning.cost import REMAT, Workload, predict, traffic_of_report
from train.planning.profiles import load_profile
from train.sections import MeshConfig, PrecisionConfig

__all__ = ["plan_prediction", "train_command"]


def train_command(model: str, mesh: dict, strategy: str, batch: int, seq: int, remat: str, accumulation: int = 1, *,
                  formats: dict | None = None, mixed_precision=None, offload: str | None = None, unit: str = "blocks") -> str:
    """The ``python -m train`` command line of a configuration, every flag one ``python -m train --help`` lists.

    ``--model`` (``python -m train`` takes the plan presets, ``train.model.PLAN_PRESETS``, as well as its
    own), ``--mesh RxS[xT]``, ``--context C``, ``--expert X``, ``--strategy``, ``--batch-size`` (global,
    sequences), ``--seq-len``, ``--remat``, ``--grad-accum``; ``--devices N`` when the mesh's ``N = R S T C X``
    devices are not ``python -m train``'s default (``[mesh] devices``, 8). ``formats``: ``{"gather_format",
    "reduce_format", "error_feedback", "block"}`` (a format name or ``None``; ``block`` ``None``: tensorwise):
    ``--gather-format``, ``--reduce-format``, ``--error-feedback``, ``--quant-block`` (``python -m train``'s
    ``[precision]`` flags). ``mixed_precision`` (a ``zshard.MixedPrecision``: the search's bf16 compute for a
    GPU target, the plan's ``--compute-dtype`` and wire formats) becomes ``--param-dtype`` / ``--reduce-dtype``,
    and its formats (``--replica-format`` too) those flags when ``formats`` is not given; ``offload``
    ``--offload``; ``unit`` ``ends`` ``--unit ends``. (``python -m train.plan --param-dtype bfloat16``
    stores the parameters themselves in bf16, which ``python -m train`` does not do: it is not carried.)"""
    shape = f"{mesh.get('replica', 1)}x{mesh.get('shard', 1)}" + (f"x{mesh['tensor']}" if mesh.get("tensor", 1) > 1 else "")
    parts = [f"python -m train --model {model} --mesh {shape}"]
    if mesh.get("context", 1) > 1:
        parts.append(f"--context {mesh['context']}")
    if mesh.get("expert", 1) > 1:
        parts.append(f"--expert {mesh['expert']}")
    devices = math.prod(int(v) for v in mesh.values())
    if devices != MeshConfig.devices:  # python -m train checks the mesh against --devices (default 8)
        parts.append(f"--devices {devices}")
    parts.append(f"--strategy {strategy} --batch-size {batch} --seq-len {seq} --remat {remat}")
    if accumulation > 1:
        parts.append(f"--grad-accum {accumulation}")
    parts += _dtype_flags(mixed_precision)
    parts += _format_flags(formats or _formats_of(mixed_precision))
    if offload is not None:
        parts.append(f"--offload {offload}")
    if unit != "blocks":
        parts.append(f"--unit {unit}")
    return " ".join(parts)


def _dtype_flags(mp) -> list[str]:
    """``--param-dtype`` / ``--reduce-dtype`` of a ``zshard.MixedPrecision`` (``[training]``'s mixed precision)."""
    return [] if mp is None else [f"--{name.replace('_', '-')} {np.dtype(getattr(mp, name)).name}"
                                  for name in ("param_dtype", "reduce_dtype") if getattr(mp, name) is not None]


def _formats_of(mp) -> dict:
    """The wire formats of a ``zshard.MixedPrecision`` as :func:`_format_flags` takes them (``{}``: none)."""
    qs = {k: getattr(mp, k, None) for k in ("gather_format", "reduce_format", "replica_format")}
    if not any(qs.values()):
        return {}
    return {**{k: q.name if q is not None else None for k, q in qs.items()}, "error_feedback": mp.error_feedback,
            "block": next(q.block for q in qs.values() if q is not None)}  # one block for every format (the plan's --quant-block)


def _format_flags(f: dict) -> list[str]:
    if not (f.get("gather_format") or f.get("reduce_format") or f.get("replica_format")):
        return []
    out = [f"--{k.replace('_', '-')} {f[k]}" for k in ("gather_format", "reduce_format", "replica_format") if f.get(k)]
    if f.get("error_feedback"):
        out.append("--error-feedback")
    if f.get("block", PrecisionConfig.block) != PrecisionConfig.block:  # python -m train's default block is 256
        out.append(f"--quant-block {f.get('block') or 0}")
    return out


def plan_prediction(rep, cfg, *, model: str, target: str, mesh_shape: dict, batch: int, seq: int, peak_bytes: float,
                    budget_bytes: float, devices_per_node: int | None = None, mixed_precision=None, offload: str | None = None,
                    unit: str = "blocks") -> dict:
    """The top-level ``--json`` fields of one compiled plan (this module's docstring), predicted on
    the ``target`` profile (``cpu``, ``h100``, ``h200``, ``a100``) from the report's collectives.

    ``mesh_shape``: the mesh's axes in device order (``dict(mesh.shape)``); ``peak_bytes``: the
    device peak the plan's verdict uses; ``budget_bytes``: the device memory; ``mixed_precision``,
    ``offload``, ``unit``: the plan's, carried into ``command`` (:func:`train_command`).
    ``micro_batch``: sequences per data device per micro-batch, the global batch over the
    ``replica x shard x expert`` devices that split its rows (``context`` splits each sequence,
    ``tensor`` shares them) and the accumulation.

    Raises:
      ValueError: an unknown target profile (the message lists the profiles).
    """
    profile = load_profile(target)
    remat = rep.remat if rep.remat in REMAT else "dots"  # a custom policy saves some matmuls: recompute like dots
    w = Workload.of_config(cfg, global_batch=batch, seq_len=seq, remat=remat, accumulation=rep.grad_accum)
    pred = predict(w, traffic_of_report(rep), profile, dict(mesh_shape), strategy=rep.strategy,
                   state_bytes=rep.model_state_bytes["measured"]["total"], devices_per_node=devices_per_node)
    mesh = {"replica": 1, "shard": 1, "tensor": 1, "context": 1, **{k: int(v) for k, v in mesh_shape.items()}}
    data = mesh["replica"] * mesh["shard"] * mesh.get("expert", 1)  # the rows' split, as train/planning/search.py's
    fits = peak_bytes <= budget_bytes
    return {
        "mesh": mesh, "strategy": rep.strategy, "remat": rep.remat,
        "micro_batch": batch // data // rep.grad_accum, "accumulation": rep.grad_accum,
        "fits": fits, "memory_bytes": int(peak_bytes), "compiled": True,
        "reason": None if fits else f"peak {peak_bytes / 1e9:.2f} GB per device > {budget_bytes / 1e9:g} GB",
        "step_s": pred.step_s, "tokens_per_s_per_device": pred.tokens_per_s_per_device, "mfu": pred.mfu,
        "bottleneck": pred.bottleneck,
        "command": train_command(model, mesh, rep.strategy, batch, seq, rep.remat, rep.grad_accum,
                                 mixed_precision=mixed_precision, offload=offload, unit=unit),
        "prediction": {**pred.to_dict(), "profile_description": profile.description},
    }

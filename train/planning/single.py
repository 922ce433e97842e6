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

from train.planning.cost import REMAT, Workload, predict, traffic_of_report
from train.planning.profiles import load_profile

__all__ = ["plan_prediction", "train_command"]


def train_command(model: str, mesh: dict, strategy: str, batch: int, seq: int, remat: str, accumulation: int = 1, *,
                  formats: dict | None = None) -> str:
    """The ``python -m train`` command line of a configuration (``--mesh RxS[xT]``, ``--context C``, ``--expert X``).

    ``model`` is the plan's preset name: ``python -m train --model`` takes the trainer's presets
    (``train.model.MODEL_PRESETS``), so the line runs as is for those; a ``PLAN_PRESETS`` model
    needs the trainer to take it too. ``formats``: ``{"gather_format", "reduce_format", "error_feedback", "block"}``
    (a format name or ``None``; ``block`` ``None``: tensorwise): ``--gather-format``, ``--reduce-format``,
    ``--error-feedback``, ``--quant-block`` (``python -m train``'s ``[precision]`` flags)."""
    shape = f"{mesh.get('replica', 1)}x{mesh.get('shard', 1)}" + (f"x{mesh['tensor']}" if mesh.get("tensor", 1) > 1 else "")
    parts = [f"python -m train --model {model} --mesh {shape}"]
    if mesh.get("context", 1) > 1:
        parts.append(f"--context {mesh['context']}")
    if mesh.get("expert", 1) > 1:
        parts.append(f"--expert {mesh['expert']}")
    parts.append(f"--strategy {strategy} --batch-size {batch} --seq-len {seq} --remat {remat}")
    if accumulation > 1:
        parts.append(f"--grad-accum {accumulation}")
    parts += _format_flags(formats or {})
    return " ".join(parts)


def _format_flags(f: dict) -> list[str]:
    if not (f.get("gather_format") or f.get("reduce_format")):
        return []
    out = [f"--{k.replace('_', '-')} {f[k]}" for k in ("gather_format", "reduce_format") if f.get(k)]
    if f.get("error_feedback"):
        out.append("--error-feedback")
    if f.get("block", 256) != 256:  # python -m train's default block is 256
        out.append(f"--quant-block {f.get('block') or 0}")
    return out


def plan_prediction(rep, cfg, *, model: str, target: str, mesh_shape: dict, batch: int, seq: int, peak_bytes: float,
                    budget_bytes: float, devices_per_node: int | None = None) -> dict:
    """The top-level ``--json`` fields of one compiled plan (this module's docstring), predicted on
    the ``target`` profile (``cpu``, ``h100``, ``h200``, ``a100``) from the report's collectives.

    ``mesh_shape``: the mesh's axes in device order (``dict(mesh.shape)``); ``peak_bytes``: the
    device peak the plan's verdict uses; ``budget_bytes``: the device memory.

    Raises:
      ValueError: an unknown target profile (the message lists the profiles).
    """
    profile = load_profile(target)
    remat = rep.remat if rep.remat in REMAT else "dots"  # a custom policy saves some matmuls: recompute like dots
    w = Workload.of_config(cfg, global_batch=batch, seq_len=seq, remat=remat, accumulation=rep.grad_accum)
    pred = predict(w, traffic_of_report(rep), profile, dict(mesh_shape), strategy=rep.strategy,
                   state_bytes=rep.model_state_bytes["measured"]["total"], devices_per_node=devices_per_node)
    mesh = {"replica": 1, "shard": 1, "tensor": 1, "context": 1, **{k: int(v) for k, v in mesh_shape.items()}}
    data = mesh["replica"] * mesh["shard"]
    fits = peak_bytes <= budget_bytes
    return {
        "mesh": mesh, "strategy": rep.strategy, "remat": rep.remat,
        "micro_batch": batch // data // rep.grad_accum, "accumulation": rep.grad_accum,
        "fits": fits, "memory_bytes": int(peak_bytes), "compiled": True,
        "reason": None if fits else f"peak {peak_bytes / 1e9:.2f} GB per device > {budget_bytes / 1e9:g} GB",
        "step_s": pred.step_s, "tokens_per_s_per_device": pred.tokens_per_s_per_device, "mfu": pred.mfu,
        "bottleneck": pred.bottleneck,
        "command": train_command(model, mesh, rep.strategy, batch, seq, rep.remat, rep.grad_accum),
        "prediction": {**pred.to_dict(), "profile_description": profile.description},
    }

"""Memory and communication of the compiled step, next to the ZeRO / FSDP formulas.

``zshard.report(step, state, batch)`` compiles the step ahead of time and reads:

- per-device bytes from ``compiled.memory_analysis()`` (argument, output, temp, alias);
- model-state bytes per device from the shard shapes, against the formula of the strategy
  (ZeRO, arXiv 1910.02054 section 5; FSDP, arXiv 2304.11277 section 3.2);
- every collective of the compiled HLO text: kind, the mesh axis its replica groups span,
  and the bytes one device sends with a ring algorithm (all-gather and reduce-scatter of a
  full buffer ``X`` over ``n`` devices: ``X(n-1)/n``; all-reduce: ``2X(n-1)/n``; Patarasuk &
  Yuan 2009), against docs/design.md section 3. Collectives inside a ``while`` body count once
  per iteration (``known_trip_count``).

XLA:CPU upcasts bf16 collectives to f32 while compiling (float normalisation); with
``MixedPrecision(param_dtype=bfloat16)`` the compiled CPU program therefore moves twice the
gather bytes of the formula. GPU backends keep bf16. Quantized formats (zshard/wire/quant.py) put
``u8`` payloads on the wire, which no backend widens; an all-to-all of ``X`` bytes over ``n``
devices sends ``X(n-1)/n``. ``step.lower(...).as_text(dialect="hlo")``
shows the program as zshard emits it, and :func:`parse_collectives` reads that text too.

The HLO reader is :mod:`zshard.inspection.hlo`, the formulas :mod:`zshard.formulas`; this module
compiles, measures and puts the two side by side in one :class:`Report`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict

import jax

from zshard.mesh.mesh import CONTEXT, REPLICA, SHARD, TENSOR
from zshard.optim.offload import _local_bytes, offload_report
from zshard.wire.quant import coverage
from zshard.formulas import (
    PARAM_CONTEXT, PARAM_EXPERT, _formula_comm, _moves, _param_axis, _policy_name, _state_formula,
    _tensor_formula, context_formula, optimizer_report,
)
from zshard.expert_formulas import dispatch_formula
from zshard.inspection.hlo import Collective, parse_collectives, parse_overlap, parse_replica_groups

EXPERT = "expert"  # the expert-parallel mesh axis (zshard.moe's token dispatch runs over it)

__all__ = ["Collective", "Report", "attention_calls", "optimizer_report", "parse_collectives", "parse_overlap",
           "parse_replica_groups", "report"]

@dataclasses.dataclass
class Report:
    """What :func:`report` measured. Bytes are per device; ``ratio`` = measured / formula.

    Attributes:
      strategy, mesh: the run's strategy name and ``{"replica": R, "shard": S}``.
      num_params: logical parameter count ``Psi``.
      per_device_bytes: ``memory_analysis()``: ``argument``, ``output``, ``temp``, ``alias``.
      model_state_bytes: ``measured`` and ``formula`` dicts of ``params``, ``opt_state``,
        ``total`` (gradients are step temporaries in JAX, never persistent state), and
        ``ratio`` of the totals; with error feedback also ``feedback`` (the fp32 residuals,
        in ``total``).
      comm_bytes_per_step: per mesh axis (``shard``, ``replica``, ``world``): ``measured``,
        ``formula``, ``ratio``; the formula includes the optimizer's (``optimizer["formula"]``).
      collectives: per ``(kind, axis)``: ``count`` (executions per step) and ``bytes``.
      units: ``name``, ``params`` (logical) and ``padded`` elements of each unit.
      remat: the step's activation-checkpointing policy (``make_train_step(remat=...)``);
        it sets ``per_device_bytes["temp"]``.
      grad_accum: micro-batches per step.
      tensor: with a ``tensor`` axis, its all-reduces (:func:`_tensor_formula`):
        ``activation_bytes`` (``X = b s h e``), ``arrays_per_block`` (Megatron's count ``k``) and
        the measured one, ``root_bytes`` (outside the blocks); else ``None``.
      context: with a ``context`` axis, ``zshard.attention``'s keys and values over it
        (:func:`context_formula`): ``measured`` and ``formula`` bytes, ``kv_bytes`` (``2 b s n_kv d
        e`` of one call), ``forward_passes`` (1, or 2 with the block recomputed), ``calls``,
        ``collectives`` (``kind``, ``buffer_bytes`` ``X``, ``count`` per step); also the row
        ``comm_bytes_per_step["context"]``. ``None`` without one.
      expert: with an ``expert`` axis, ``zshard.moe``'s token dispatch over it
        (:func:`zshard.expert_formulas.dispatch_formula`): ``measured`` (the all-to-alls over
        ``expert``) and ``formula`` bytes per step (padded ``[X, cap, D]`` buffers, 4 per MoE layer
        and micro-batch, 6 with the block recomputed, plus the slot counts; ``None`` when the trace
        recorded no call), ``calls``, ``layers``, ``collectives`` (``buffer_bytes``, ``count``); also
        the row ``comm_bytes_per_step["expert"]``. ``None`` without one.
      offload: with ``zshard.init(..., offload=...)``, :func:`zshard.optim.offload.offload_report`:
        ``mode``; model-state bytes per device in ``device`` and ``host`` memory, ``measured``
        (from each leaf's shard shape and memory kind) and ``formula``; ``transfer``: host <->
        device bytes per step of the GPU program (exported for ``cuda``: ``to_device``,
        ``to_host``, ``calls``), ``measured`` against ``formula`` = ``2 * host``. Else ``None``.
      optimizer: the optimizer step measured apart (``None`` when not measured): ``path``
        (``"elementwise"``: Optax on the local slices, no collective; or ``"global view
        (<transformation>)"``, :mod:`zshard.optim.optim_global`), ``collectives`` (per kind and
        axis: count and bytes one device sends), ``measured`` and ``formula`` (bytes per
        step), ``temp`` (temporary bytes of the optimizer step compiled alone).
      moves: per mesh axis of ``comm_bytes_per_step``, what its collectives move:
        ``"gather int8/256, reduce int8/256"``, ``"reduce float32"``.
      quantized: with quantized formats (:func:`zshard.wire.quant.coverage`), per role (``gather``,
        ``reduce``, ``replica``): ``format``, the parameters it ``quantized`` and the ``fallback``
        ones left in ``param_dtype`` / ``reduce_dtype`` (rank < 2, or under one block per device); else ``None``.
      overlap: each all-gather, reduce-scatter and all-reduce of the compiled program text (a
        scanned loop's body counts once; :func:`zshard.inspection.hlo.parse_overlap`): ``op``, ``axis``,
        ``bytes`` (the full buffer ``X``), ``async`` (XLA:GPU runs it on its own stream; XLA:CPU
        never does), ``compute_between`` (fusions, dots, custom calls, loops scheduled between its
        start and its done), ``name``, ``trips``, ``computation``.
      prefetch: units gathered ahead in this program (``make_train_step(prefetch=...)``, or the
        default of the mesh's platform: 1 on GPUs, 0 on CPU).
      attention: the attention kernel of the compiled program: ``kernel`` (``"cudnn"`` when
        cuDNN's fused attention calls are present, else ``"xla"``: zshard's own or jax.nn's XLA
        path), ``forward_calls`` and ``backward_calls`` (``__cudnn$fmha*`` custom calls in the text).
    """

    strategy: str
    mesh: dict
    num_params: int
    per_device_bytes: dict
    model_state_bytes: dict
    comm_bytes_per_step: dict
    collectives: list
    units: list
    remat: str = "block"
    grad_accum: int = 1
    optimizer: dict | None = None
    tensor: dict | None = None
    context: dict | None = None
    expert: dict | None = None
    offload: dict | None = None
    moves: dict = dataclasses.field(default_factory=dict)
    quantized: dict | None = None
    overlap: list = dataclasses.field(default_factory=list)
    attention: dict = dataclasses.field(default_factory=dict)
    prefetch: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """Markdown tables, MiB per device."""
        mib = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
        ms = self.model_state_bytes
        lines = [
            f"### {self.strategy} on {'x'.join(str(v) for v in self.mesh.values())} ({self.num_params:,} parameters, "
            f"remat={self.remat}, grad_accum={self.grad_accum})",
            "",
            "| memory per device | MiB |",
            "|---|---:|",
            *(f"| {k} (memory_analysis) | {mib(v)} |" for k, v in self.per_device_bytes.items()),
            f"| model state measured (params + optimizer{' + error feedback' if 'feedback' in ms['measured'] else ''}) | "
            f"{mib(ms['measured']['total'])} |",
            *([f"| error-feedback residuals (fp32, measured / formula) | {mib(ms['measured']['feedback'])} / "
               f"{mib(ms['formula']['feedback'])} |"] if "feedback" in ms["measured"] else []),
            f"| model state formula | {mib(ms['formula']['total'])} |",
            f"| ratio | {ms['ratio']:.4f} |",
            "",
            "| communication per step | measured MiB | formula MiB | ratio | moves |",
            "|---|---:|---:|---:|---|",
            *(f"| {axis} | {mib(v['measured'])} | {mib(v['formula'])} | {v['ratio']:.4f} | {self.moves.get(axis, '')} |"
              for axis, v in self.comm_bytes_per_step.items()),
            "",
            "| collective | axis | count | MiB sent |",
            "|---|---|---:|---:|",
            *(f"| {c['kind']} | {c['axis']} | {c['count']} | {mib(c['bytes'])} |" for c in self.collectives),
        ]
        if self.quantized:
            lines += ["", "| quantized | format | parameters | left unquantized (rank < 2 or under one block per device) |",
                      "|---|---|---:|---|"]
            for role, c in self.quantized.items():
                rest = ", ".join(c["fallback"][:4]) + (f" and {len(c['fallback']) - 4} more" if len(c["fallback"]) > 4 else "")
                lines.append(f"| {role} | {c['format']} | {len(c['quantized'])} | {rest or '-'} |")
        started = [o for o in self.overlap if o["async"] and o["op"] in ("all-gather", "reduce-scatter")]
        if started:  # a GPU program (XLA:CPU runs every collective synchronously)
            lines += ["", f"async all-gathers / reduce-scatters (program text, a loop body once): {len(started)}, "
                      f"{sum(o['compute_between'] > 0 for o in started)} with compute between start and done; attention: "
                      f"{self.attention.get('kernel')} ({self.attention.get('forward_calls', 0)} forward, "
                      f"{self.attention.get('backward_calls', 0)} backward calls)"]
        if self.tensor is not None:
            t = self.tensor
            lines += [
                "",
                f"tensor axis: {t['measured_arrays_per_block']:.2f} all-reduces of one block's activation "
                f"({t['activation_bytes']:,} bytes) per block call, Megatron-LM's count {t['arrays_per_block']}; "
                f"outside the blocks {mib(t['root_bytes'])} MiB",
            ]
        if self.context is not None:
            x = self.context
            lines += [
                "",
                f"context axis: {mib(x['measured'])} MiB of keys and values ({x['impl']}) against "
                f"{mib(x['formula'])} MiB = {x['calls']} attention calls x ({x['forward_passes']} forward + 1 backward) x "
                f"(C-1)/C x {x['kv_bytes']:,} bytes (2 b s n_kv d e){' + segment ids' if x['segment_bytes'] else ''}",
            ]
        if self.expert is not None:
            x = self.expert
            n = sum(c["count"] for c in x["collectives"])
            lines += ["", f"expert axis: {mib(x['measured'])} MiB of token dispatch ({n} all-to-alls per step) against "
                      + (f"{mib(x['formula'])} MiB = {x['layers']} MoE layer calls x padded [X, cap, D] all-to-alls"
                         if x["formula"] is not None else "no formula (no zshard.moe call recorded)")]
        if self.offload is not None:
            o = self.offload
            t = o["transfer"]
            lines += [
                "",
                f"| offload={o['mode']} | measured MiB | formula MiB |",
                "|---|---:|---:|",
                f"| model state in device memory | {mib(o['measured']['device'])} | {mib(o['formula']['device'])} |",
                f"| model state in host memory (pinned_host) | {mib(o['measured']['host'])} | {mib(o['formula']['host'])} |",
                f"| host <-> device per step (GPU program: {t['calls'].get('device', 0)} + {t['calls'].get('pinned_host', 0)} "
                f"transfers) | {mib(t['measured'])} | {mib(t['formula'])} |",
            ]
        if self.optimizer is not None:
            o = self.optimizer
            lines += [
                "",
                f"| optimizer: {o['path']} | MiB |",
                "|---|---:|",
                f"| temp of the optimizer step alone (memory_analysis) | {mib(o['temp'])} |",
                f"| collectives measured | {mib(o['measured'])} |",
                f"| collectives formula | {mib(o['formula'])} |",
                *(f"| {c['kind']} ({c['axis']}) x {c['count']} | {mib(c['bytes'])} |" for c in o["collectives"]),
            ]
        return "\n".join(lines)


def report(step, state, batch) -> Report:
    """Compile ``step`` for ``(state, batch)`` ahead of time and account for memory and bytes.

    ``state`` is not consumed (lowering does not donate). ``batch`` may hold arrays or
    ``jax.ShapeDtypeStruct`` leaves. On a mesh of GPUs (real, or :func:`zshard.gpu_devices` on any
    machine) this is XLA:GPU's program, compiled with the step's GPU compiler options
    (:data:`zshard.gpu.GPU_COMPILER_OPTIONS`); ``overlap`` and ``attention`` read its schedule.
    """
    plan = state.plan
    compiled = step.lower(state, batch).compile()
    ma = compiled.memory_analysis()
    per_device = {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
    }
    measured = {
        "params": sum(_local_bytes(x) for x in jax.tree.leaves(state.params)),
        "opt_state": sum(_local_bytes(x) for x in jax.tree.leaves(state.opt_state)),
    }
    measured["total"] = measured["params"] + measured["opt_state"]
    if plan.mp.error_feedback:  # the fp32 residuals, [n_pad] per quantized parameter on every device
        measured["feedback"] = sum(_local_bytes(x) for x in jax.tree.leaves(state.feedback))
        measured["total"] += measured["feedback"]
    formula = _state_formula(plan)
    split = {k: formula.pop(k) for k in ("opt_state_host", "masters", "copies")}  # the offload lines' formula

    text = compiled.as_text()
    colls = parse_collectives(text, plan.mesh)
    by_axis: dict[str, float] = defaultdict(float)
    table: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for c in colls:
        if c.axis == "none" or (c.kind == "all-reduce" and c.buffer_bytes <= 64 and c.phase == "step"):
            continue  # size-1 groups; the step's scalar metrics (loss, grad norm; a small parameter's gather counts)
        if c.phase == "context":
            axis = CONTEXT  # zshard.attention's keys and values: the context row
        else:
            axis = PARAM_CONTEXT if c.axis == CONTEXT else c.axis
            if c.axis == EXPERT and c.kind != "all-to-all":
                axis = PARAM_EXPERT  # a parameter collective over expert alone (S = 1); its all-to-alls: the tokens
        by_axis[axis] += c.sent_bytes * c.trips
        table[(c.kind, axis)][0] += c.trips
        table[(c.kind, axis)][1] += c.sent_bytes * c.trips
    formula_comm = _formula_comm(plan, step.config.grad_accum, step.config.hpz)
    tensor = _tensor_formula(plan, colls, step.config) if plan.tensor > 1 else None
    if tensor is not None:
        by_axis[TENSOR] = tensor["measured"]  # the blocks' all-reduces (the root's are in tensor["root_bytes"])
        formula_comm[TENSOR] = tensor["formula"]
    context = None
    if plan.context > 1:
        _, trace = step.trace(state, batch)  # what the step's trace found: its attention calls (zshard.programs.program.TraceInfo)
        context = context_formula(plan, trace, step.config)
        formula_comm[CONTEXT] = context["formula"]
        context["measured"] = by_axis.get(CONTEXT, 0.0)
        ops = Counter((c.kind, c.buffer_bytes) for c in colls if c.phase == "context" for _ in range(c.trips))
        context["collectives"] = [{"kind": k, "buffer_bytes": x, "count": n} for (k, x), n in sorted(ops.items())]
    expert = None
    if plan.mesh.shape.get(EXPERT, 1) > 1:
        expert = dispatch_formula(_moe_calls(step, state, batch), colls, step.config.grad_accum,
                                  _policy_name(step.config.remat) == "block")
        formula_comm[EXPERT] = expert["formula"] or 0.0
    opt = optimizer_report(state)
    if opt["formula"]:  # the global-view optimizer's collectives run over the optimizer axes
        opt_axis = _param_axis(plan.mesh, plan.opt_axes)
        formula_comm[opt_axis] = formula_comm.get(opt_axis, 0.0) + opt["formula"]
    comm = {}
    extra = [a for a in [*formula_comm, *by_axis] if a not in (SHARD, REPLICA, "world", "none")]
    for axis in dict.fromkeys([SHARD, REPLICA, "world", *extra]):
        f, m = formula_comm.get(axis, 0.0), by_axis.get(axis, 0.0)
        if f or m or axis in (SHARD, REPLICA):
            ratio = m / f if f else (1.0 if not m else float("inf"))
            comm[axis] = {"measured": m, "formula": f, "ratio": ratio}
    return Report(
        strategy=plan.strategy.value,
        mesh=dict(plan.mesh.shape),
        num_params=plan.num_params(),
        per_device_bytes=per_device,
        model_state_bytes={"measured": measured, "formula": formula, "ratio": measured["total"] / formula["total"]},
        comm_bytes_per_step=comm,
        collectives=[{"kind": k, "axis": a, "count": n, "bytes": b} for (k, a), (n, b) in sorted(table.items())],
        units=[
            {"name": u.name, "layers": u.layers or 1, "params": u.num_params(), "padded": (u.layers or 1) * sum(f.padded_size for f in u.flats)}
            for u in plan.units
        ],
        remat=_policy_name(step.config.remat),
        grad_accum=step.config.grad_accum,
        optimizer=opt,
        tensor=tensor,
        context=context,
        expert=expert,
        offload=offload_report(step, state, batch, {**formula, **split}) if plan.offload else None,
        moves=_moves(plan, step.config.hpz),
        quantized=coverage(plan) if plan.mp.quantized else None,
        overlap=parse_overlap(text, plan.mesh),
        attention=attention_calls(text),
        prefetch=step.config.resolved_prefetch(plan.mesh),
    )


def _moe_calls(step, state, batch) -> list | None:
    """``[(None, MoE layers per step, MoECall)]`` for :func:`dispatch_formula`: the ``zshard.moe`` call
    the step's trace found (``TraceInfo.experts``), once per block unit holding expert parameters
    (its layers: a scanned stack traces its body once). ``None`` when the trace found no call or
    calls of different shapes."""
    _, trace = step.trace(state, batch)
    calls = trace.experts
    if len(set(calls)) != 1:
        return None
    plan = state.plan
    layers = sum(u.layers or 1 for u in plan.units if any(getattr(s.param, "expert", False) for f in u.flats for s in f.slots))
    return [(None, layers, calls[0])]


def attention_calls(hlo: str) -> dict:
    """``{"kernel", "forward_calls", "backward_calls"}`` of a compiled program: cuDNN's fused
    attention custom calls (``__cudnn$fmha...``; ``...Backward`` the backward), ``kernel`` ``"cudnn"``
    when there is one, else ``"xla"``."""
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', hlo)
    backward = sum("Backward" in c for c in calls)
    return {"kernel": "cudnn" if calls else "xla", "forward_calls": len(calls) - backward, "backward_calls": backward}

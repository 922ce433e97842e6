"""The compiled program's collectives, read from its HLO text (``compiled.as_text()``).

:func:`parse_collectives` lists every collective: its kind, the mesh axis its replica groups
span (both notations: explicit ``{{0,1},{2,3}}`` and iota ``[2,2]<=[4]``, and jax 0.12's mesh
form), the buffer, and the bytes one device sends with a ring algorithm (all-gather and
reduce-scatter of ``X`` over ``n`` devices: ``X(n-1)/n``; all-reduce: ``2X(n-1)/n``; Patarasuk
& Yuan 2009); a collective inside a ``while`` body counts once per iteration
(``known_trip_count``). :mod:`zshard.report` checks them against the formulas
(:mod:`zshard.formulas`).

:func:`parse_overlap` reads the schedule: for each all-gather, reduce-scatter and all-reduce,
whether it is asynchronous (an XLA:GPU ``*-start`` whose backend config says ``"is_sync":false``)
and how many compute instructions the scheduled text puts between its start and its done.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from zshard.mesh.mesh import REPLICA, SHARD, TENSOR
from zshard.inspection.jaxprs import CONTEXT_SCOPE, OPTIMIZER_SCOPE, unit_of

__all__ = ["COMPUTE_OPS", "Collective", "parse_collectives", "parse_overlap", "parse_replica_groups"]

_KINDS = {
    "all-gather": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce",
    "all-to-all": "all-to-all",
    "collective-permute": "permute",
    "collective-broadcast": "other",
}
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e\dm\d(?:fn)?)?)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled step.

    Attributes:
      kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``, ``"all-to-all"`` (the quantized
        gradient reduction), ``"permute"`` (a collective-permute: each device sends its buffer to one
        other) or ``"other"``.
      axis: mesh axis the groups span: ``"shard"``, ``"replica"``, ``"context"``, ``"expert"`` (the token
        dispatch's all-to-alls), ``"tensor"``,
        ``"world"`` (every data axis, ``replica`` and ``shard`` among them), several joined with
        ``+`` (``"shard+context"``), or ``"none"`` (groups of one device).
      group_size: ``n``, devices per replica group.
      buffer_bytes: ``X``, bytes of the full (unsharded) buffer, all tuple elements.
      sent_bytes: bytes one device sends per execution (ring algorithm).
      trips: executions per step (product of enclosing ``while`` trip counts).
      phase: ``"optimizer"`` for a collective the global-view optimizer issues
        (:mod:`zshard.optim.optim_global`, named scope ``zshard.optimizer``), ``"context"`` for one of
        ``zshard.attention``'s (keys and values over ``context``, named scope ``zshard.context``),
        else ``"step"``.
      unit: the unit whose call emitted it (``"blocks.0"``, ``"root"`` for the root unit's
        gather; from the ``zshard.unit.<unit>.*`` scope in its ``op_name``), or ``None``
        (the loss, the head, the optimizer). Not part of equality.
    """

    name: str
    kind: str
    axis: str
    group_size: int
    buffer_bytes: int
    sent_bytes: float
    trips: int = 1
    phase: str = "step"
    unit: str | None = dataclasses.field(default=None, compare=False)


def _shape_bytes(shape_text: str) -> list[int]:
    """Bytes of each array in an HLO shape (``f32[4,8]{1,0}`` or a tuple of them)."""
    return [_DTYPE_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            for dt, dims in _ARRAY.findall(shape_text)]


def parse_replica_groups(text: str, num_devices: int | None = None) -> list[list[int]]:
    """Replica groups of an HLO attribute in any of its notations.

    - explicit lists: ``{{0,1,2,3},{4,5,6,7}}`` (``{}`` = all devices, needs ``num_devices``);
    - iota: ``[2,4]<=[8]`` or ``[4,2]<=[2,4]T(1,0)`` (reshape ``arange`` to the dims after
      ``<=``, transpose, reshape to ``[groups, size]``);
    - mesh axes: ``@mesh<"replica"=2,"shard"=4> {shard}`` (jax 0.10) or
      ``mesh['replica'=2,'shard'=4] {'shard'}`` (jax 0.12): groups along the named axes.

    Raises:
      ValueError: an unrecognised notation.
    """
    text = text.strip()
    if text.startswith("{"):
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9,\s]*)\}", text[1:-1])]
        groups = [g for g in groups if g]
        if not groups:
            if num_devices is None:
                raise ValueError("replica_groups={} (all devices) needs num_devices")
            groups = [list(range(num_devices))]
        return groups
    m = re.fullmatch(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    if m:
        out_dims = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(int(np.prod([int(x) for x in m.group(2).split(",")]))).reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(-1, out_dims[-1]).tolist()
    m = re.fullmatch(r"@?mesh(?:<([^>]*)>|\[([^\]]*)\])\s*\{([^}]*)\}", text)
    if m:
        axes = re.findall(r"[\"']?(\w+)[\"']?\s*=\s*(\d+)", m.group(1) or m.group(2))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        dims, grouped = [], []
        for name, size in zip(names, sizes):
            refs = [r for r in re.findall(r"[\"']?(\w+)[\"']?(?::\((\d+)\)(\d+))?", m.group(3)) if r[0] == name]
            if not refs:
                dims.append(size)
            elif not refs[0][1]:
                grouped.append(len(dims))
                dims.append(size)
            else:  # sub-axis a:(pre)size -> reshape [pre, size, rest], group the middle
                pre, sub = int(refs[0][1]), int(refs[0][2])
                dims += [pre, sub, size // (pre * sub)]
                grouped.append(len(dims) - 2)
        ids = np.arange(int(np.prod(sizes))).reshape(dims)
        rest = [i for i in range(len(dims)) if i not in grouped]
        group_size = int(np.prod([dims[i] for i in grouped]))
        return ids.transpose(rest + grouped).reshape(-1, group_size).tolist()
    raise ValueError(f"unrecognised replica_groups notation: {text!r}")


def _axis_name(mesh, axes) -> str:
    """The mesh axes a collective spans (size-1 axes ignored) -> ``shard`` / ``replica`` /
    ``context`` / ``expert`` / ``tensor`` / ``world`` (every data axis, ``replica`` and ``shard`` among them) /
    ``none``; other combinations joined with ``+`` (``shard+context``, ``shard+tensor``: a
    collective over data and tensor devices at once)."""
    axes = {a for a in axes if mesh.shape[a] > 1}
    if not axes:
        return "none"
    # the data axes: every axis but tensor (replica, shard, context, expert), read off the mesh itself so that
    # any mesh's collectives can be named (a hand-made shard_map mesh too)
    data = {a for a in mesh.axis_names if a != TENSOR and mesh.shape[a] > 1}
    if {REPLICA, SHARD} <= axes and axes == data:
        return "world"
    return "+".join(a for a in mesh.axis_names if a in axes)


def _axis_of(groups: list[list[int]], mesh) -> str:
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    pos = {int(d): rs for rs, d in np.ndenumerate(ids)}
    group = [pos[d] for d in groups[0]]
    varies = {name for i, name in enumerate(mesh.axis_names) if len({p[i] for p in group}) > 1}
    return _axis_name(mesh, varies)


def _pairs_axes(pairs: list[list[int]], mesh) -> set:
    """The mesh axes along which a permute's sources and targets differ."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    pos = {int(d): idx for idx, d in np.ndenumerate(ids)}
    return {name for i, name in enumerate(mesh.axis_names) for a, b in pairs if pos[a][i] != pos[b][i]}


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            comps[current] = []
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


def _trip_counts(comps: dict[str, list[str]]) -> dict[str, int]:
    """Executions per step of each computation reachable from ENTRY through while/call."""
    trips = {"ENTRY": 1}
    todo = ["ENTRY"]
    while todo:
        name = todo.pop()
        for line in comps.get(name, []):
            n = 1
            if re.search(r"\swhile\(", line):
                k = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = int(k.group(1)) if k else 1
            for callee in re.findall(r"(?:body|calls|to_apply|condition|branch_computations)=\{?%?([\w.\-]+)", line):
                if callee in comps and callee not in trips:
                    trips[callee] = trips[name] * (n if "body=" in line or "condition=" in line else 1)
                    todo.append(callee)
    return trips


def parse_collectives(hlo: str, mesh) -> list[Collective]:
    """Every collective of a compiled HLO module (``compiled.as_text()``).

    Tuple-shaped (combined) collectives count as one instruction whose buffer is the sum of
    their elements; async pairs count once (the ``-start``; ``-done`` is skipped).
    """
    comps = _computations(hlo)
    trips = _trip_counts(comps)
    out = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, shape, op, rest = m.groups()
            base = op[: -len("-start")] if op.endswith("-start") else op
            if base not in _KINDS or op.endswith("-done"):
                continue
            g = re.search(r"replica_groups=(\{(?:\{[0-9,]*\},?)*\}|\[[^\s]*?\]<=\[[0-9,]+\](?:T\([0-9,]+\))?|@?mesh(?:<[^>]*>|\[[^\]]*\])\s*\{[^}]*\})", rest)
            pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
            if pairs:  # a permute: the axes along which source and target differ
                groups = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
            else:
                groups = parse_replica_groups(g.group(1), mesh.size) if g else [list(range(mesh.size))]
            n = len(groups[0])
            sizes = _shape_bytes(shape)
            if op.endswith("-start") and base != "all-reduce" and len(sizes) >= 2:
                sizes = sizes[len(sizes) // 2 :]  # (operands, outputs) -> outputs
            result = sum(sizes)
            kind = _KINDS[base]
            full = result * n if kind == "reduce-scatter" else result  # X: the unsharded buffer (all-to-all: its own)
            factor = 2 if kind == "all-reduce" else 1
            sent = factor * full * (n - 1) / n if kind not in ("other", "permute") else float(result)
            phase = "optimizer" if OPTIMIZER_SCOPE in rest else "context" if CONTEXT_SCOPE in rest else "step"
            op = re.search(r'op_name="([^"]*)"', rest)
            unit = unit_of(op.group(1)) if op else None
            axis = _axis_of(groups, mesh) if not pairs else _axis_name(mesh, _pairs_axes(groups, mesh))
            out.append(Collective(name, kind, axis, n if not pairs else 2, full, sent, trips.get(comp, 1), phase, unit))
    return out


COMPUTE_OPS = ("fusion", "dot", "convolution", "custom-call", "while", "conditional", "call")
_OVERLAP_KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def parse_overlap(hlo: str, mesh) -> list[dict]:
    """How each all-gather, reduce-scatter and all-reduce of a compiled program overlaps compute.

    One entry per instruction of the program text (a collective in a scanned loop's body counts
    once, however many iterations run), in program order: ``{"name", "op"`` (``"all-gather"``,
    ``"reduce-scatter"``, ``"all-reduce"``), ``"axis"`` (the mesh axis, as :func:`parse_collectives`),
    ``"bytes"`` (the full buffer ``X`` of :func:`parse_collectives`), ``"async"`` (an ``*-start``
    with ``"is_sync":false``: XLA:GPU issues it on its own stream), ``"compute_between"`` (the
    instructions of :data:`COMPUTE_OPS` (fusions, dots, custom calls such as cuBLAS GEMMs and cuDNN
    attention, loops and calls) scheduled between the start and its done in the same computation;
    0 for a synchronous one), ``"trips"`` (executions per step), ``"computation"``}.

    The compiled text is in schedule order (``is_scheduled=true``), so the instructions between a
    start's line and its done's line are what the GPU stream runs while the collective is in flight.
    """
    info = {c.name: c for c in parse_collectives(hlo, mesh)}
    out = []
    for comp, lines in _computations(hlo).items():
        parsed = [m.groups() for m in map(_INSTR.match, lines) if m]
        for i, (name, _shape, op, rest) in enumerate(parsed):
            base = op[: -len("-start")] if op.endswith("-start") else op
            if base not in _OVERLAP_KINDS or name not in info:
                continue
            is_async = op.endswith("-start") and re.search(r'"is_sync":\s*false', rest) is not None
            between = 0
            if is_async:  # the done is the instruction that takes this start as its operand
                ref = re.compile(rf"%{re.escape(name)}\b")
                done = next((j for j in range(i + 1, len(parsed)) if parsed[j][2] == f"{base}-done" and ref.search(parsed[j][3])),
                            len(parsed))
                between = sum(1 for _, _, o, _ in parsed[i + 1 : done] if o in COMPUTE_OPS)
            c = info[name]
            out.append({"name": name, "op": c.kind, "axis": c.axis, "bytes": c.buffer_bytes, "async": bool(is_async),
                        "compute_between": between, "trips": c.trips, "computation": comp})
    return out

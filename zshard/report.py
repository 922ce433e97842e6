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
gather bytes of the formula. GPU backends keep bf16. Quantized formats (zshard/quant.py) put
``u8`` payloads on the wire, which no backend widens; an all-to-all of ``X`` bytes over ``n``
devices sends ``X(n-1)/n``. ``step.lower(...).as_text(dialect="hlo")``
shows the program as zshard emits it, and :func:`parse_collectives` reads that text too.

A little over 400 lines: the HLO reader (collectives, replica groups in both notations, while
trip counts) and the three formulas it is checked against (model state, per-step bytes,
optimizer program) meet in one :class:`Report`; apart they would pass the parsed program
between modules.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict

import jax
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.mesh import CONTEXT, REPLICA, SHARD, TENSOR, data_axes
from zshard.offload import master_paths, offload_report
from zshard.optim import optimizer_grad_specs, optimizer_program
from zshard.jaxprs import CONTEXT_SCOPE, OPTIMIZER_SCOPE, unit_of
from zshard.quant import coverage, moved_bytes
from zshard.strategy import Strategy

__all__ = ["Collective", "Report", "optimizer_report", "parse_collectives", "parse_replica_groups", "report"]

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
      axis: mesh axis the groups span: ``"shard"``, ``"replica"``, ``"context"``, ``"tensor"``,
        ``"world"`` (every data axis, ``replica`` and ``shard`` among them), several joined with
        ``+`` (``"shard+context"``), or ``"none"`` (groups of one device).
      group_size: ``n``, devices per replica group.
      buffer_bytes: ``X``, bytes of the full (unsharded) buffer, all tuple elements.
      sent_bytes: bytes one device sends per execution (ring algorithm).
      trips: executions per step (product of enclosing ``while`` trip counts).
      phase: ``"optimizer"`` for a collective the global-view optimizer issues
        (:mod:`zshard.optim_global`, named scope ``zshard.optimizer``), ``"context"`` for one of
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
    ``context`` / ``tensor`` / ``world`` (every data axis, ``replica`` and ``shard`` among them) /
    ``none``; other combinations joined with ``+`` (``shard+context``, ``shard+tensor``: a
    collective over data and tensor devices at once)."""
    axes = {a for a in axes if mesh.shape[a] > 1}
    if not axes:
        return "none"
    if {REPLICA, SHARD} <= axes and axes == {a for a in data_axes(mesh) if mesh.shape[a] > 1}:
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


def _itemsize(dtype) -> int:
    """Bytes per element; a PRNG key (``add_noise``'s state) counts its key data (threefry: 8)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 4 * int(np.prod(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape))
    return np.dtype(dtype).itemsize


def _local_bytes(x) -> int:
    """Bytes of one device's shard of ``x`` (an array or a ``ShapeDtypeStruct`` with a sharding)."""
    return int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * _itemsize(x.dtype)


def _formula_comm(plan, k: int = 1) -> dict[str, float]:
    """Bytes one device sends per step, docs/design.md section 3 (ring algorithm).

    ``Psi * b`` is counted per collective in the dtype it moves: gathers in the mixed
    precision ``param_dtype``, gradient reductions in ``reduce_dtype``, SHARD_OPT's gather of
    updated parameters in the master dtype; a parameter a quantized format applies to in its
    payload and scales, ``Psi (bits/8 + 4/B)`` (ZeRO++, arXiv 2306.10209 section 3;
    :func:`zshard.quant.moved_bytes`; its all-to-all counts as a reduce-scatter of those bytes). With ``k`` micro-batches (gradient
    accumulation) the per-unit gathers and reduce-scatters run once per micro-batch and the
    cross-replica all-reduce once per step; gathers that do not depend on the micro-batch
    (the root unit's, and every unrolled unit's under SHARD_GRAD_OP) are loop-invariant and
    XLA hoists them out of the micro-batch loop, so they count once.
    """
    mesh, mp = plan.mesh, plan.mp
    size = lambda axes: int(np.prod([mesh.shape[a] for a in axes]))  # noqa: E731

    def total(role, units, trainable_only=False):  # sum over parameters of size * itemsize (a tensor piece if split)
        return sum(
            (u.layers or 1) * moved_bytes(plan, role, s.param)
            for u in units
            for f in u.flats
            if f.trainable or not trainable_only
            for s in f.slots
        )

    master = total("master", plan.units, trainable_only=True)  # SHARD_OPT gathers updated parameters
    ag = total("gather", plan.units)  # one all-gather of every unit
    ag_root = total("gather", [u for u in plan.units if not u.path])
    rs = total("reduce", plan.units, trainable_only=True)  # one reduction of every trainable gradient
    rr = total("replica", plan.units, trainable_only=True)  # ... and its reduction over the replica axes
    st = plan.strategy
    ring = lambda n: (n - 1) / n  # noqa: E731
    name = lambda axes: _param_axis(mesh, axes)  # noqa: E731
    if st is Strategy.NO_SHARD:
        return {name(plan.replica_axes): 2 * rr * ring(size(plan.replica_axes))}
    if st is Strategy.SHARD_OPT:
        return {name(plan.opt_axes): (2 * rr + master) * ring(size(plan.opt_axes))}
    # AG forward (+ AG backward for resharding strategies; the root unit is gathered once and
    # kept through backward, as FSDP keeps its root) + RS of the gradients.
    if st.reshard_after_forward:
        gathers = k * 2 * (ag - ag_root) + ag_root
    else:  # stacked units gather inside their own scan, which is not hoisted: once per micro-batch
        ag_stacked = total("gather", [u for u in plan.units if u.layers])
        gathers = ag - ag_stacked + k * ag_stacked
    per_step = gathers + k * rs
    N = plan.num_shards  # S (x C on a context mesh) for the hybrids
    shard = {name(plan.shard_axes): per_step * ring(N)}
    if st in (Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD):
        return shard
    R = size(plan.replica_axes)
    if st.scatters_replica:
        # HYBRID_SHARD_OPT: the gradient shard (G/S) is reduce-scattered over replica in each
        # unit's backward (once per micro-batch) and the updated slices all-gathered back
        # (master dtype) once per step: with one dtype and no accumulation, 2 (G/S)(R-1)/R,
        # the bytes of HYBRID_SHARD's all-reduce.
        return {**shard, name(plan.replica_axes): (k * rr + master) / N * ring(R)}
    return {**shard, name(plan.replica_axes): 2 * (rr / N) * ring(R)}


PARAM_CONTEXT = "context (parameters)"  # the key of parameter collectives over a group that is the context axis alone


def _param_axis(mesh, axes) -> str:
    """:func:`_axis_name` for the parameters' collectives; ``"context"`` (a ``1 x 1 x C`` mesh) is
    :data:`PARAM_CONTEXT`, the name ``"context"`` being the attention's row."""
    axis = _axis_name(mesh, axes)
    return PARAM_CONTEXT if axis == CONTEXT else axis


@dataclasses.dataclass
class Report:
    """What :func:`report` measured. Bytes are per device; ``ratio`` = measured / formula.

    Attributes:
      strategy, mesh: the run's strategy name and ``{"replica": R, "shard": S}``.
      num_params: logical parameter count ``Psi``.
      per_device_bytes: ``memory_analysis()``: ``argument``, ``output``, ``temp``, ``alias``.
      model_state_bytes: ``measured`` and ``formula`` dicts of ``params``, ``opt_state``,
        ``total`` (gradients are step temporaries in JAX, never persistent state), and
        ``ratio`` of the totals.
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
      offload: with ``zshard.init(..., offload=...)``, :func:`zshard.offload.offload_report`:
        ``mode``; model-state bytes per device in ``device`` and ``host`` memory, ``measured``
        (from each leaf's shard shape and memory kind) and ``formula``; ``transfer``: host <->
        device bytes per step of the GPU program (exported for ``cuda``: ``to_device``,
        ``to_host``, ``calls``), ``measured`` against ``formula`` = ``2 * host``. Else ``None``.
      optimizer: the optimizer step measured apart (``None`` when not measured): ``path``
        (``"elementwise"``: Optax on the local slices, no collective; or ``"global view
        (<transformation>)"``, :mod:`zshard.optim_global`), ``collectives`` (per kind and
        axis: count and bytes one device sends), ``measured`` and ``formula`` (bytes per
        step), ``temp`` (temporary bytes of the optimizer step compiled alone).
      moves: per mesh axis of ``comm_bytes_per_step``, what its collectives move:
        ``"gather int8/256, reduce int8/256"``, ``"reduce float32"``.
      quantized: with quantized formats (:func:`zshard.quant.coverage`), per role (``gather``,
        ``reduce``, ``replica``): ``format``, the parameters it ``quantized`` and the ``fallback``
        ones left in ``param_dtype`` / ``reduce_dtype`` (rank < 2, or under one block per device); else ``None``.
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
    offload: dict | None = None
    moves: dict = dataclasses.field(default_factory=dict)
    quantized: dict | None = None

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
            f"| model state measured (params + optimizer) | {mib(ms['measured']['total'])} |",
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
    ``jax.ShapeDtypeStruct`` leaves.
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
    formula = _state_formula(plan)
    split = {k: formula.pop(k) for k in ("opt_state_host", "masters", "copies")}  # the offload lines' formula

    colls = parse_collectives(compiled.as_text(), plan.mesh)
    by_axis: dict[str, float] = defaultdict(float)
    table: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for c in colls:
        if c.axis == "none" or (c.kind == "all-reduce" and c.buffer_bytes <= 64 and c.phase == "step"):
            continue  # size-1 groups; the step's scalar metrics (loss, grad norm; a small parameter's gather counts)
        if c.phase == "context":
            axis = CONTEXT  # zshard.attention's keys and values: the context row
        else:
            axis = PARAM_CONTEXT if c.axis == CONTEXT else c.axis
        by_axis[axis] += c.sent_bytes * c.trips
        table[(c.kind, axis)][0] += c.trips
        table[(c.kind, axis)][1] += c.sent_bytes * c.trips
    formula_comm = _formula_comm(plan, step.config.grad_accum)
    tensor = _tensor_formula(plan, colls, step.config) if plan.tensor > 1 else None
    if tensor is not None:
        by_axis[TENSOR] = tensor["measured"]  # the blocks' all-reduces (the root's are in tensor["root_bytes"])
        formula_comm[TENSOR] = tensor["formula"]
    context = None
    if plan.context > 1:
        context = context_formula(plan, getattr(step, "last_trace", None), step.config)
        formula_comm[CONTEXT] = context["formula"]
        context["measured"] = by_axis.get(CONTEXT, 0.0)
        ops = Counter((c.kind, c.buffer_bytes) for c in colls if c.phase == "context" for _ in range(c.trips))
        context["collectives"] = [{"kind": k, "buffer_bytes": x, "count": n} for (k, x), n in sorted(ops.items())]
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
        offload=offload_report(step, state, batch, {**formula, **split}) if plan.offload else None,
        moves=_moves(plan),
        quantized=coverage(plan) if plan.mp.quantized else None,
    )


def _moves(plan) -> dict:
    """Per mesh axis, what its collectives move (the dtype, or the quantized format; XLA:CPU
    widens a bfloat16 collective to float32 while compiling, never a ``u8`` payload)."""
    mp = plan.mp
    dt = lambda d: np.dtype(d).name  # noqa: E731
    master = next(iter(plan.layouts.values())).dtype if plan.layouts else np.dtype("float32")
    gather = mp.gather_format.label if mp.gather_format else dt(mp.gather_dtype(master))
    reduce = mp.reduce_format.label if mp.reduce_format else dt(mp.grad_dtype(master))
    replica = mp.replica_format.label if mp.replica_format else dt(mp.grad_dtype(master))
    out = {}
    if plan.shard_axes:
        out[_axis_name(plan.mesh, plan.shard_axes)] = f"gather {gather}, reduce {reduce}"
    if plan.replica_axes:
        out[_axis_name(plan.mesh, plan.replica_axes)] = f"reduce {replica}"
    return out


# Tensor all-reduces of one block's activation per block call (Megatron-LM, arXiv 1909.08053
# section 3: two in forward, after the attention and the MLP output projections, two in backward,
# before their column-parallel input projections). Full block recompute adds the forward's two
# (Korthikanti et al. 2022, arXiv 2205.05198 section 4: 6); XLA drops the recomputed block's
# last one, whose value the backward does not read: 5. "dots" saves the matmul outputs: 4.
_TENSOR_ARRAYS = {"none": 4, "block": 5, "dots": 4}


def context_formula(plan, trace, config) -> dict:
    """Bytes one device sends over ``context`` per step for ``zshard.attention``'s keys and values.

    Per attention call on a sequence of ``s`` tokens split over ``C`` devices, ``b`` rows on this
    device, ``n_kv`` key/value heads of ``d`` (keys) and ``d_v`` (values) elements in ``e`` bytes:
    the forward moves ``X = b s n_kv (d + d_v) e`` (``2 b s n_kv d e``) once, ``(C-1)/C X`` per
    device (an all-gather, or ``C-1`` ring permutes of ``X/C``); a recomputed block
    (``remat="block"``) moves it again in backward; the backward sends ``dK`` and ``dV`` back,
    ``(C-1)/C X`` (a reduce-scatter, or the ring reversed). Segment ids, ``4 b s`` bytes of int32,
    are the same array in every layer: XLA merges their identical gathers into one per micro-batch
    (measured, tests/test_context.py). Calls are counted from the step's trace
    (:class:`zshard.sequence.SequenceTrace`): each call made in a unit's forward, times the unit's
    layers (a scanned stack) and the micro-batches.
    """
    C, k = plan.context, config.grad_accum
    ring = (C - 1) / C
    recompute = 2 if _policy_name(config.remat) == "block" else 1  # "dots" keeps the gathered K/V (measured)
    formula, calls, kv_bytes, seg_bytes, impls = 0.0, 0, 0, 0, set()
    for unit, layers, call in ([] if trace is None else trace.calls):
        n = (layers or 1) * k
        kv = call.batch * call.length * call.kv_heads * (call.head_dim + call.value_dim) * call.itemsize
        passes = recompute if unit is not None else 1  # the root unit is never recomputed
        formula += n * ring * (passes + 1) * kv
        calls, kv_bytes = calls + n, kv
        seg_bytes = max(seg_bytes, 4 * call.batch * call.length if call.segments else 0)
        impls.add(call.impl)
    formula += k * ring * seg_bytes  # the segment ids: one gather per micro-batch
    return {"formula": formula, "measured": 0.0, "calls": calls, "kv_bytes": kv_bytes, "segment_bytes": seg_bytes,
            "forward_passes": recompute, "impl": "+".join(sorted(impls)) or "none"}


def _tensor_formula(plan, colls, config) -> dict:
    """Bytes one device sends over ``tensor`` per step against Megatron-LM's count.

    ``X``, the bytes of one block's activation ``b * s * h * e`` (this device's rows), is read from
    the program: the most frequent size of the tensor all-reduces inside the block units. Formula: ``block calls * k *
    2 (T - 1) / T * X`` (ring all-reduce), ``k`` from :data:`_TENSOR_ARRAYS` for the remat policy.
    All-reduces outside the blocks (a vocabulary-split embedding's output, the head's input
    cotangent, the softmax statistics over a split vocabulary) are counted apart (``root_bytes``).
    """
    T = plan.tensor
    ring = 2 * (T - 1) / T
    blocks = [c for c in colls if c.axis == TENSOR and c.kind == "all-reduce" and c.unit not in (None, "root")]
    root = [c for c in colls if c.axis == TENSOR and c not in blocks]
    sizes = Counter(c.buffer_bytes for c in blocks)  # mostly one size; a tuple combined with a small one is rarer
    X = max(sizes, key=lambda b: (sizes[b], b)) if sizes else 0
    calls = config.grad_accum * sum(u.layers or 1 for u in plan.units if u.path != ())
    k = _TENSOR_ARRAYS.get(_policy_name(config.remat), 4)
    measured = sum(c.sent_bytes * c.trips for c in blocks)
    return {
        "measured": measured,
        "formula": calls * k * ring * X,
        "activation_bytes": X,
        "arrays_per_block": k,
        "measured_arrays_per_block": measured / (calls * ring * X) if calls and X else 0.0,
        "root_bytes": sum(c.sent_bytes * c.trips for c in root),
    }


def _state_formula(plan) -> dict:
    """Model-state bytes per device: ``(param + K opt slots) bytes * (Psi_split / (T N) +
    Psi_rest / N)`` (ZeRO, arXiv 1910.02054 section 5, with Megatron-LM's split of the
    tensor-parallel parameters over ``T``, arXiv 1909.08053 section 3): each parameter over the
    devices of its shard axes (``N``) and, split over ``tensor``, its ``T`` pieces; each
    optimizer leaf shaped like a parameter likewise over the optimizer's axes; leaves held whole
    (counts, Adafactor's factors) on every device."""
    T, N, N_opt = plan.tensor, plan.num_shards, plan.opt_shards
    params = sum(
        int(np.prod(rec.logical_shape, dtype=np.int64)) * rec.dtype.itemsize / (N * (T if rec.split else 1))
        for rec in plan.layouts.values()
    )
    logical = traverse_util.unflatten_dict({p: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype) for p, v in plan.template})
    trainable, _ = plan.split_trainable(logical)
    state = jax.eval_shape(plan.tx.init, trainable)
    leaves = jax.tree.leaves(state)
    if plan.opt_view is not None:  # leaves not shaped like their parameter are replicated
        owners = list(plan.opt_view.state_paths)
    else:
        refs = traverse_util.unflatten_dict({p: _Ref(p) for p in plan.trainable})
        marked = optax.tree_map_params(
            plan.tx, lambda leaf, ref: leaf if isinstance(leaf, optax.MaskedNode) else _Ref(ref.path), state, refs,
            transform_non_params=lambda _: _Ref(None), is_leaf=lambda x: isinstance(x, (_Ref, optax.MaskedNode)),
        )
        owners = [m.path for m in jax.tree.leaves(marked, is_leaf=lambda x: isinstance(x, _Ref))]
    opt = opt_host = 0.0
    for x, owner in zip(leaves, owners):
        b = x.size * _itemsize(x.dtype)
        if owner is None:
            b = b if plan.opt_view is not None else b / N_opt  # whole on every device (a count: negligible)
        else:
            b = b / (N_opt * (T if plan.layouts[owner].split else 1))
        opt += b
        opt_host += b if plan.offload and x.ndim else 0.0  # offload: the leaves with a dimension (zshard.offload)
    # offload="optimizer+master": the masters on the host, their param_dtype copies on the device
    per = lambda rec, itemsize: int(np.prod(rec.logical_shape, dtype=np.int64)) * itemsize / (N * (T if rec.split else 1))  # noqa: E731
    masters = [plan.layouts[p] for p in master_paths(plan)]
    host_masters = sum(per(rec, rec.dtype.itemsize) for rec in masters)
    copies = sum(per(rec, np.dtype(plan.mp.gather_dtype(rec.dtype)).itemsize) for rec in masters)
    return {"params": params, "opt_state": opt, "total": params + opt, "opt_state_host": opt_host, "masters": host_masters, "copies": copies}


class _Ref:
    """A parameter path as an opaque pytree leaf."""

    def __init__(self, path):
        self.path = path


def optimizer_report(state) -> dict:
    """The optimizer step compiled alone (:func:`zshard.optim.optimizer_program`): its temp
    bytes and collectives, against a formula.

    Formula (bytes one device sends per step, ring algorithm, Patarasuk & Yuan 2009): each
    collective the global-view optimizer issues while tracing, with ``X`` the bytes of its
    whole buffer and ``n`` the devices of the optimizer axes: an all-gather of one padded
    parameter (a whole-matrix update such as Muon: one per matrix) ``X(n-1)/n``; an
    all-reduce (a scalar for a global or per-parameter norm, ``[rows]`` / ``[cols]`` for
    Adafactor's factored moments) ``2X(n-1)/n``. An elementwise chain issues none (ZeRO,
    arXiv 1910.02054 section 5.1: each device updates only its partition).
    """
    plan = state.plan
    record: list = []
    train, _ = plan.split_trainable(state.params)
    grads = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(plan.mesh, spec)),
        train,
        optimizer_grad_specs(plan),
        is_leaf=lambda x: isinstance(x, P),
    )
    compiled = optimizer_program(plan, record).lower(train, grads, state.opt_state).compile()
    n = plan.opt_shards
    ring = (n - 1) / n if n > 1 else 0.0
    formula = sum((2 if kind == "all-reduce" else 1) * x * ring for kind, x in record)
    table: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for c in parse_collectives(compiled.as_text(), plan.mesh):
        if c.phase == "optimizer" and c.axis != "none":
            table[(c.kind, c.axis)][0] += c.trips
            table[(c.kind, c.axis)][1] += c.sent_bytes * c.trips
    view = plan.opt_view
    return {
        "path": "elementwise" if view is None else f"global view ({view.why})",
        "collectives": [{"kind": k, "axis": a, "count": m, "bytes": b} for (k, a), (m, b) in sorted(table.items())],
        "measured": sum(b for _, b in table.values()),
        "formula": formula,
        "temp": int(compiled.memory_analysis().temp_size_in_bytes),
    }


def _policy_name(remat) -> str:
    return remat if isinstance(remat, str) else getattr(remat, "__name__", repr(remat))

"""The formulas a compiled step is checked against (docs/design.md section 3).

Model state per device (ZeRO, arXiv 1910.02054 section 5; FSDP, arXiv 2304.11277 section
3.2; Megatron-LM's ``1/T`` for tensor-split parameters), bytes per step and mesh axis
(:func:`formula_comm`, ring algorithm), Megatron-LM's tensor all-reduces per block
(:func:`tensor_formula`), the context axis's keys and values (:func:`context_formula`) and
the optimizer program measured apart (:func:`optimizer_report`). :mod:`zshard.report` puts
them next to what it measured.

The whole step's memory in closed form, for model shapes that are not built
(``python -m train.scale``, docs/memory.md "The scale table"): :func:`memory_formula` (the same
ZeRO state as :func:`_state_formula`, counted from ``Psi`` for Adam in one dtype, plus the
gradient shards), :func:`moment_bytes` (what a step holds beyond that at each instant that can
set its peak), :func:`expected_peak` (their sum) and :func:`activation_bytes` (Korthikanti et
al.'s saved activations). This is the one set: ``train.scale`` re-exports them.

Expert parallelism (the ``expert`` axis: the token dispatch's all-to-all bytes, the model state,
gathered block and gathers with ``X``) is :mod:`zshard.expert_formulas`, re-exported here.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import jax
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.wire.hpz import secondary_axes
from zshard.mesh.mesh import CONTEXT, TENSOR
from zshard.optim.offload import _itemsize, master_paths
from zshard.optim.optim import optimizer_grad_specs, optimizer_program
from zshard.wire.quant import feedback_bytes, moved_bytes, wire_bytes
from zshard.mesh.strategy import Strategy
from zshard.inspection.hlo import _axis_name, parse_collectives
from zshard.expert_formulas import (  # noqa: F401  (expert parallelism in closed form, re-exported: zshard.formulas.X)
    A2A_PER_MOE_LAYER, all_to_all_bytes, dispatch_formula, dropless_capacity, expert_all_to_all_per_step, expert_gather_bytes,
    expert_gather_ratio, expert_state_bytes, gathered_block_bytes, padded_all_to_all_bytes,
)

__all__ = [
    "PARAM_CONTEXT", "PARAM_EXPERT", "activation_bytes", "context_formula", "expected_peak", "memory_formula", "moment_bytes", "optimizer_report",
    "A2A_PER_MOE_LAYER", "all_to_all_bytes", "dispatch_formula", "dropless_capacity", "expert_all_to_all_per_step", "expert_gather_bytes",
    "expert_gather_ratio", "expert_state_bytes", "gathered_block_bytes", "padded_all_to_all_bytes",
]

def _formula_comm(plan, k: int = 1, hpz: bool = False) -> dict[str, float]:
    """Bytes one device sends per step, docs/design.md section 3 (ring algorithm): :func:`_comm_of`
    of the dense parameters over the shard axes and, on a mesh with an ``expert`` axis of ``X``
    devices, of the expert parameters (``E/X`` experts each) over the shard axes without ``expert``
    (``N/X`` devices; docs/expert-parallel.md, :func:`zshard.expert_formulas.expert_gather_bytes`)."""
    if not any(getattr(s.param, "expert", False) for u in plan.units for f in u.flats for s in f.slots):
        return _comm_of(plan, k, hpz)
    out = _comm_of(plan, k, hpz, experts=False)
    for axis, b in _comm_of(plan, k, False, experts=True).items():
        out[axis] = out.get(axis, 0.0) + b
    return out


def _comm_of(plan, k: int = 1, hpz: bool = False, experts: bool | None = None) -> dict[str, float]:
    """Bytes one device sends per step for the parameters ``experts`` selects (``None``: all; ``True``
    / ``False``: the expert / dense ones), docs/design.md section 3 (ring algorithm).

    ``Psi * b`` is counted per collective in the dtype it moves: gathers in the mixed
    precision ``param_dtype``, gradient reductions in ``reduce_dtype``, SHARD_OPT's gather of
    updated parameters in the master dtype; a parameter a quantized format applies to in its
    payload and scales, ``Psi (bits/8 + 4/B)`` (ZeRO++, arXiv 2306.10209 section 3;
    :func:`zshard.wire.quant.moved_bytes`; its all-to-all counts as a reduce-scatter of those bytes). With ``k`` micro-batches (gradient
    accumulation) the per-unit gathers and reduce-scatters run once per micro-batch and the
    cross-replica all-reduce once per step; gathers that do not depend on the micro-batch
    (the root unit's, and every unrolled unit's under SHARD_GRAD_OP) are loop-invariant and
    XLA hoists them out of the micro-batch loop, so they count once. With ``hpz`` (ZeRO++ hpZ,
    zshard/wire/hpz.py; FULL_SHARD) the block units' backward gathers leave the world and move their
    ``[n_pad/S]`` slices over ``shard`` (x ``context``) in the gather dtype, unquantized:
    ``k Psi_blocks b (S-1)/S`` there, the world keeping the forward gathers and the reductions.
    """
    mesh = plan.mesh
    size = lambda axes: int(np.prod([mesh.shape[a] for a in axes]))  # noqa: E731
    shard_axes, N = plan.shard_axes, plan.num_shards  # S (x C, x X on an expert mesh) for the hybrids
    if experts:  # the local experts: over the shard axes inside one expert group
        shard_axes = tuple(a for a in shard_axes if a != "expert")
        N //= mesh.shape["expert"]

    def total(role, units, trainable_only=False):  # sum over parameters of size * itemsize (a tensor piece if split)
        return sum(
            (u.layers or 1) * moved_bytes(plan, role, s.param)
            for u in units
            for f in u.flats
            if f.trainable or not trainable_only
            for s in f.slots
            if experts is None or bool(getattr(s.param, "expert", False)) == experts
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
    if hpz:  # ZeRO++ hpZ: backward re-gathers of the block units over the axes inside a node only
        inside = secondary_axes(plan.shard_axes)
        regather = sum((u.layers or 1) * wire_bytes(None, s.param.piece_size, plan.mp.gather_dtype(s.param.dtype))
                       for u in plan.units if u.path for f in u.flats for s in f.slots)
        world = (k * (ag - ag_root) + ag_root + k * rs) * ring(plan.num_shards)
        return {name(plan.shard_axes): world, name(inside): k * regather * ring(size(inside))}
    if st.reshard_after_forward:
        gathers = k * 2 * (ag - ag_root) + ag_root
    else:  # stacked units gather inside their own scan, which is not hoisted: once per micro-batch
        ag_stacked = total("gather", [u for u in plan.units if u.layers])
        gathers = ag - ag_stacked + k * ag_stacked
    per_step = gathers + k * rs
    shard = {name(shard_axes): per_step * ring(N)}
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
PARAM_EXPERT = "expert (parameters)"  # ... over the expert axis alone (S = 1): "expert" is the token dispatch's row


def _param_axis(mesh, axes) -> str:
    """:func:`_axis_name` for the parameters' collectives; ``"context"`` (a ``1 x 1 x C`` mesh) is
    :data:`PARAM_CONTEXT`, the name ``"context"`` being the attention's row; ``"expert"`` (a ``1 x 1 x X``
    mesh) is :data:`PARAM_EXPERT`, the name ``"expert"`` being the token dispatch's row."""
    axis = _axis_name(mesh, axes)
    return {CONTEXT: PARAM_CONTEXT, "expert": PARAM_EXPERT}.get(axis, axis)


def _moves(plan, hpz: bool = False) -> dict:
    """Per mesh axis, what its collectives move (the dtype, or the quantized format; XLA:CPU
    widens a bfloat16 collective to float32 while compiling, never a ``u8`` payload); ``hpz``:
    the axes inside a node also move the backward re-gathers in the gather dtype."""
    mp = plan.mp
    dt = lambda d: np.dtype(d).name  # noqa: E731
    master = next(iter(plan.layouts.values())).dtype if plan.layouts else np.dtype("float32")
    gather = mp.gather_format.label if mp.gather_format else dt(mp.gather_dtype(master))
    reduce = mp.reduce_format.label if mp.reduce_format else dt(mp.grad_dtype(master))
    replica = mp.replica_format.label if mp.replica_format else dt(mp.grad_dtype(master))
    out = {}
    if plan.shard_axes:
        out[_param_axis(plan.mesh, plan.shard_axes)] = f"gather {gather}, reduce {reduce}"
    if "expert" in plan.shard_axes:  # the local experts over the shard axes inside an expert group; the tokens over expert
        inside = tuple(a for a in plan.shard_axes if a != "expert")
        if inside and _param_axis(plan.mesh, inside) != "none":
            out[_param_axis(plan.mesh, inside)] = f"gather {gather}, reduce {reduce}"
        out["expert"] = "token dispatch (padded all-to-all)"
    if plan.replica_axes:
        out[_axis_name(plan.mesh, plan.replica_axes)] = f"reduce {replica}"
    if hpz:
        out[_axis_name(plan.mesh, secondary_axes(plan.shard_axes))] = f"hpZ re-gather {dt(mp.gather_dtype(master))}"
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
    (:class:`zshard.programs.program.TraceInfo`): each call made in a unit's forward, times the unit's
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
    (counts, Adafactor's factors) on every device. With error feedback (``reduce_format=Quant(...,
    error_feedback=True)``) the fp32 residuals are not sharded: ``4 n_pad`` bytes per device for
    each quantized trainable parameter (``feedback``, counted in ``total``;
    :func:`zshard.wire.quant.feedback_bytes`): the whole gradient of those parameters on every
    device, against the ``16 Psi / N`` of Adam's fp32 model state (EF-SGD, arXiv 1901.09847, keeps one per worker)."""
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
        opt_host += b if plan.offload and x.ndim else 0.0  # offload: the leaves with a dimension (zshard.optim.offload)
    # offload="optimizer+master": the masters on the host, their param_dtype copies on the device
    per = lambda rec, itemsize: int(np.prod(rec.logical_shape, dtype=np.int64)) * itemsize / (N * (T if rec.split else 1))  # noqa: E731
    masters = [plan.layouts[p] for p in master_paths(plan)]
    host_masters = sum(per(rec, rec.dtype.itemsize) for rec in masters)
    copies = sum(per(rec, np.dtype(plan.mp.gather_dtype(rec.dtype)).itemsize) for rec in masters)
    out = {"params": params, "opt_state": opt, "total": params + opt, "opt_state_host": opt_host, "masters": host_masters, "copies": copies}
    if plan.mp.error_feedback:
        out["feedback"] = float(feedback_bytes(plan))
        out["total"] += out["feedback"]
    return out


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


# --------------------------------------------------------------------------------------
# The memory of a whole step in closed form (pure Python: no jax; python -m train.scale's formula)
# --------------------------------------------------------------------------------------


def activation_bytes(d_model: int, n_layers: int, n_heads: int, d_ff: int, vocab: int, seq: int, batch: int, glu: bool,
                     itemsize: int = 4) -> dict:
    """The activations a step saves with full recomputation per block, Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198).

    Their section 4.1 counts what a transformer layer saves for backward: ``s*b*h*(34 +
    5*a*s/h)`` bytes at 16 bits with dropout. Here, with ``e = itemsize`` bytes per element (fp32:
    4), no dropout, ``f = d_ff``, per layer: attention: norm input, QKV input, Q, K, V, attention
    output, ``6*s*b*h``, and the softmax output ``a*s^2*b``; MLP: norm input and fc input
    ``2*s*b*h``, then ``2*s*b*f`` (GELU: pre-activation and output) or ``4*s*b*f`` (SwiGLU:
    gate|up, silu(gate), product). With full recomputation (their section 4.3) only each layer's
    input ``s*b*h`` is kept, and one layer's set exists at a time, in its backward.

    This is the allowance of ``train.bench``'s config P targets (temp beyond activations, in
    gathered units). What a compiled step holds at its fullest instants, gradients and
    temporaries included, is :func:`moment_bytes`.

    Returns:
      ``{"block": e*(L*s*b*h + s*b*(8h + m*f) + a*s^2*b)}``, ``m`` = 2 (GELU) or 4 (SwiGLU).
    """
    s, b, h, a, f, L = seq, batch, d_model, n_heads, d_ff, n_layers
    layer = s * b * (8 * h + (4 if glu else 2) * f) + a * s * s * b
    return {"block": float(itemsize * (L * s * b * h + layer))}


def moment_bytes(d_model: int, n_layers: int, n_heads: int, d_ff: int, vocab: int, seq: int, batch: int, glu: bool,
                 psi_layer: int, psi_mlp_out: int, tied: bool, itemsize: int = 4, tensor: int = 1,
                 vocab_split: bool = False, context: int = 1, kv_heads: int | None = None, tile: int = 512) -> dict:
    """Bytes a zshard step holds beyond its state and gradient shards (:func:`memory_formula`) at
    each instant that can set its peak, with full recomputation per block, scanned blocks,
    per-parameter all-gathers and reduce-scatters, and fp32 (``e = itemsize``).

    Every term was read off XLA's buffer live ranges (:func:`live_peak`; docs/memory.md, "The
    scale table"). Notation as Korthikanti et al. 2022 (arXiv 2205.05198) section 4: ``s`` seq,
    ``b`` batch per device, ``h`` d_model, ``a`` heads, ``f`` d_ff, ``L`` layers, ``V`` vocab;
    ``Psi_layer`` one block's parameters, ``Psi_out`` its MLP output projection. At every instant:
    all ``L`` layer inputs, ``L*s*b*h`` (the scan's residual buffer, from the forward loop to the
    end of the backward loop; their section 4.3). Then:

    - ``"mlp"``, the recomputed layer's MLP backward: the recomputed attention's exponentials
      and probabilities ``2*a*s^2*b`` (written-out softmax, no fused attention; kept for the
      attention's backward, which comes next). SwiGLU (``glu``), where the gate|up gradient is
      formed: the unit without ``Psi_out`` (``w_gate_up`` and the attention's weights gathered;
      ``w_down`` used and its gradient reduce-scattered already), ``8*s*b*f`` (the recomputed
      gate|up ``[s, 2f]``, its gradient and that gradient's transpose ``[2f, s]``, each ``2*s*b*f``:
      XLA:CPU builds the last two in two fusions that both read the first; the ``[s, f]``
      gradient of the product and the gate's silu) and ``(9 + 4/T)*s*b*h`` (residual stream,
      norm inputs and outputs, their gradients; four per-head buffers, queries, keys and the
      attention output, split over ``T``). GELU (GPT-2): the whole unit ``Psi_layer`` (each
      parameter gathered or its gradient waiting for its reduce-scatter), ``2*s*b*f``,
      ``12*s*b*h``;
    - ``"attention"``, its attention backward: ``3*a*s^2*b`` (exponentials, probabilities, and
      the probabilities' gradient), the unit without ``Psi_out`` (that gradient is already
      reduce-scattered), ``10*s*b*h + s*b*f``;
    - ``"forward"``, a layer's attention in the forward loop: ``2*a*s^2*b``, the unit gathered
      ``Psi_layer``, the output projection gathered for the step ``h*V`` (Llama's head; GPT-2's
      tied embedding), ``4*s*b*h``;
    - ``"head"``, the output layer's backward: the log-probabilities the loss keeps, the logits'
      gradient and its transpose ``3*s*b*V`` (``train.model._token_nll`` writes the gradient
      out as ``(softmax - onehot) / n``), the gathered output projection ``h*V``, ``4*s*b*h``.

    A tied embedding (``tied``: GPT-2) adds its whole gradient ``h*V`` to ``"mlp"`` and
    ``"attention"``: the head's and the lookup's gradients are summed before the one
    reduce-scatter, so it is held through the whole backward loop. An untied head is
    reduce-scattered right after its backward (a ``1/S`` shard, in the gradient term).

    With a tensor axis of ``T`` devices (Megatron-LM's tensor parallelism without sequence
    parallelism: Korthikanti et al. 2022 section 4.2.1, ``s b h (10 + 24/T + 5 a s/(h T))`` per
    layer), what is split over the heads or the MLP width is divided by ``T``: the softmax
    terms (``a/T`` heads per device), the ``s*b*f`` terms, and the vocabulary terms when
    ``vocab_split``; the ``s*b*h`` terms (the layer inputs, norms, the residual stream: all
    replicated over ``tensor``) are not. ``psi_layer`` and ``psi_mlp_out`` are then the
    per-device (TP-local) counts.

    With a context axis of ``C`` devices (``seq`` the global length; docs/long-sequences.md),
    every per-token term has ``s -> s/C`` (Korthikanti et al.'s count on the local tokens), and
    ``zshard.attention`` computes each context step in tiles with a custom VJP
    (FlashAttention-2): no ``a s^2`` term; instead one tile's scores, ``a t^2 b`` with ``t =
    min(tile, s / (2C))``, three at once in the backward (scores, probabilities, their gradient),
    two in the forward; and the gathered keys and values ``2 b s n_kv d`` (``kv_heads``, ``d = h /
    a``): held by the forward, twice in the MLP and the attention backward (with the buffers of
    their gradients ``dK``, ``dV``, before the reduce-scatter). The MLP backward's terms were read
    off the live set of Llama-7B at 32k tokens, ``C = 4``, 64 devices (``8 s b f``, ``15 s b h``;
    docs/long-sequences.md, "Memory"); GELU MLPs (GPT-2) are not measured on a context mesh.

    Returns:
      ``{"mlp", "attention", "forward", "head"}``, bytes (floats).
    """
    C = context
    s, b, h, L = seq / C, batch, d_model, n_layers
    a, f, V = n_heads / tensor, d_ff / tensor, vocab / tensor if vocab_split else vocab
    inputs, softmax, sbh, sbf = L * s * b * h, a * s * s * b, s * b * h, s * b * f
    kv = 0.0
    if C > 1:  # tiled attention: one tile's scores instead of the whole [a, s, s]; the gathered K/V
        t = min(tile, seq / (2 * C))
        softmax = a * t * t * b
        kv = 2 * b * seq * (kv_heads or n_heads) / tensor * (d_model // n_heads)
    tied_grad = h * V if tied else 0
    # the recomputed layer's MLP backward on a context mesh (read off the live set of llama-7b at 32k, C = 4, 64
    # devices, 2026-12-05): the gathered K/V and, allocated ahead of the attention backward, its dK/dV buffers
    # (2 kv); SwiGLU's 8 s b f as without context; the residual stream, norms and the attention's dQ / output
    # buffers (15 s b h)
    mlp_sbf, mlp_sbh, mlp_kv = ((8, 15, 2) if glu else (2, 15, 2)) if C > 1 else ((8, 9 + 4 / tensor, 0) if glu else (2, 12, 0))
    mlp_psi = psi_layer - psi_mlp_out if glu else psi_layer  # SwiGLU: w_down done by the gate|up gradient
    elements = {
        "mlp": inputs + 2 * softmax + mlp_kv * kv + mlp_psi + mlp_sbf * sbf + mlp_sbh * sbh + tied_grad,
        "attention": inputs + 3 * softmax + 2 * kv + psi_layer - psi_mlp_out + sbf + 10 * sbh + tied_grad,
        "forward": inputs + 2 * softmax + kv + psi_layer + h * V + 4 * sbh,
        "head": inputs + 3 * s * b * V + h * V + 4 * sbh,
    }
    return {k: float(itemsize * v) for k, v in elements.items()}


def expected_peak(formula: dict, moments: dict) -> tuple[float, str]:
    """Per-device peak bytes of a step: ``state + grad_shard + max(moments)``
    (:func:`memory_formula`, :func:`moment_bytes`), and the name of the moment that sets it."""
    moment = max(moments, key=moments.get)
    return formula["state"] + formula["grad_shard"] + moments[moment], moment


def memory_formula(psi: int, shards: int, itemsize: int = 4, opt_slots: int = 2, opt_shards: int | None = None) -> dict:
    """Per-device bytes a zshard FULL_SHARD / HYBRID_SHARD / HYBRID_SHARD_OPT step holds from its
    start to its optimizer step, activations and transients excluded (:func:`moment_bytes`).

    ZeRO (arXiv 1910.02054) section 5.2 / FSDP (arXiv 2304.11277) section 3.2, for ``Psi``
    parameters sharded ``N`` ways, Adam (``K = opt_slots`` moments), ``e`` bytes per element:

    - ``state``: parameters + optimizer state, ``(1 + K) * e * Psi / N`` (persistent, donated);
      HYBRID_SHARD_OPT (optimizer state over ``M = opt_shards = R*S``): ``e Psi / N + K e Psi / M``;
    - ``grad_shard``: the reduce-scattered gradients, ``e * Psi / M`` with ``M = opt_shards``
      (``N`` for FULL_SHARD / HYBRID_SHARD; ``R*S`` for HYBRID_SHARD_OPT, whose units
      reduce-scatter over ``replica`` inside their backward); the stacked units' buffers are
      allocated before the forward loop; the optimizer updates in place.

    The gathered units, the root and the FlatParameter copies of earlier versions are transient
    and belong to the moments (:func:`moment_bytes`): since the per-parameter all-gathers and
    reduce-scatters (issue 17) no unit is gathered for the whole step and nothing is copied out
    of a gathered buffer (docs/memory.md).

    Returns:
      ``{"state", "grad_shard", "total"}``, bytes.
    """
    opt = opt_shards or shards
    out = {"state": itemsize * psi / shards + opt_slots * itemsize * psi / opt, "grad_shard": itemsize * psi / opt}
    out["total"] = out["state"] + out["grad_shard"]
    return out

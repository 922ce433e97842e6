"""The predicted time of one training step: compute, the collectives the schedule cannot hide, the optimizer.

A step is three phases on each device (docs/planning.md, "Predicted step time"):

- **compute**: the step's FLOPs over the profile's achievable matmul rate (``peak_flops *
  matmul_fraction``). Training FLOPs per token (:func:`step_flops`): ``6 N`` for the parameters
  that multiply (forward ``2 N``, backward ``4 N``: Kaplan et al. 2020, arXiv 2001.08361, section
  2.1) plus attention, ``12 L H Q T`` FLOPs (``L`` layers, ``H`` heads of width ``Q``, ``T``
  tokens a query attends; PaLM, arXiv 2204.02311, appendix B; Chinchilla, arXiv 2203.15556,
  appendix F counts the same terms) of which a causal kernel executes half. Remat adds what it
  recomputes (Korthikanti et al. 2022, arXiv 2205.05198, section 5): ``block`` one more forward,
  ``dots`` the attention's forward (their selective recomputation), ``none`` / ``offload``
  nothing. MFU counts model FLOPs only: no recomputation, and causal attention halved
  (``6 N + 6 L H Q T``: :func:`step_flops`), the attention the executed step computes, so MFU
  never exceeds the profile's ``matmul_fraction`` (PaLM, MosaicML's tables and torchtitan count
  it whole: ``6 N + 12 L H Q T``).
- **communication**: each collective's bytes (one device sends, ring algorithm: the compiled
  program's, :func:`traffic_of_report`, or the formulas', :func:`formula_traffic`) over its mesh
  axis's link (:func:`axis_link`: NVLink inside a node, the network across nodes). Parameter
  all-gathers hide behind the compute of the forward and backward passes, gradient reductions
  behind the backward, one unit ahead (prefetch): of ``n`` units per pass, one unit's
  collective is exposed and each later unit exposes what its collective takes beyond its compute
  (:func:`_pipeline`). Tensor all-reduces, the context axis's keys and values and the expert
  axis's all-to-alls sit between a unit's matmuls: exposed whole; so is every collective on a
  profile without ``async_collectives`` (XLA:CPU).
- **optimizer**: memory-bound: the optimizer reads the parameters, gradients and moments and
  writes the parameters and moments (``2 * state + gradients`` bytes) at the HBM bandwidth, plus
  the collectives that run after the backward (SHARD_OPT's and HYBRID_SHARD_OPT's all-gather of the
  updated parameters; with accumulation, the cross-replica all-reduce of the accumulated gradient).

Not modelled: pipeline parallelism, kernel-level effects (non-matmul time, attention kernels
slower than GEMMs, launch overheads), collective latency (small messages), host offload traffic.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from train.planning.profiles import Profile

__all__ = ["AXES", "REMAT", "Prediction", "Workload", "axis_link", "collective_seconds", "formula_traffic", "phase_of",
           "predict", "step_flops", "traffic_of_report"]

REMAT = ("none", "block", "dots", "offload")
AXES = ("replica", "shard", "context", "tensor", "expert")
"""Mesh axes a collective may span; ``world`` (every data axis) and ``a+b`` name several."""
_DATA = ("replica", "shard", "context")
RESHARD = ("FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_OPT")  # gather again in backward
_STRATEGIES = ("NO_SHARD", "SHARD_OPT", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "HYBRID_SHARD_OPT")


@dataclasses.dataclass(frozen=True)
class Workload:
    """The shape of one optimizer step (all devices together).

    Attributes:
      params: ``N``, parameters that multiply (all but lookup tables; a tied embedding counts as the head).
      layers: ``L``, transformer blocks (the units each pass runs in turn).
      d_model: residual width (bytes of the tensor axis's activation all-reduces).
      attn_width: ``H * Q``, query heads times head width.
      seq_len: tokens per sequence.
      global_batch: sequences per optimizer step (all micro-batches).
      remat: ``none``, ``block``, ``dots`` or ``offload`` (make_train_step(remat=...)).
      accumulation: micro-batches per step (gradient accumulation).
      kv_width: key/value heads times head width (grouped-query attention); default ``attn_width``.
      state_params: ``Psi``, every parameter (gathered and updated); default ``params``.
      causal: causal attention (a kernel computes half the scores).
      expert_params: parameters of the routed experts (``w_gate_up``, ``w_down`` of every MoE layer; 0: dense),
        included in ``state_params``: split over the ``expert`` axis.
      n_experts, top_k: experts per MoE layer and experts per token (0: dense).
    """

    params: int
    layers: int
    d_model: int
    attn_width: int
    seq_len: int
    global_batch: int
    remat: str = "block"
    accumulation: int = 1
    kv_width: int | None = None
    state_params: int | None = None
    causal: bool = True
    expert_params: int = 0
    n_experts: int = 0
    top_k: int = 0

    def __post_init__(self):
        if self.remat not in REMAT:
            raise ValueError(f"Workload: remat={self.remat!r}; choose one of {', '.join(REMAT)}")
        for k in ("params", "layers", "d_model", "attn_width", "seq_len", "global_batch", "accumulation"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Workload: {k}={v!r} must be a positive integer")
        if self.global_batch % self.accumulation:
            raise ValueError(f"Workload: global_batch={self.global_batch} does not divide into accumulation={self.accumulation} "
                             "micro-batches")

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.global_batch * self.seq_len

    @property
    def psi(self) -> int:
        return self.state_params or self.params

    @classmethod
    def of_config(cls, cfg, *, global_batch: int, seq_len: int | None = None, remat: str = "block", accumulation: int = 1):
        """The workload of a ``train.models`` config (a preset of ``train.model.PLAN_PRESETS``): its
        parameters counted on the abstract model (``nnx.eval_shape``: nothing allocated). For a
        mixture of experts (a config with ``n_experts``, ``top_k``, ``d_expert``), ``params`` is what
        one token multiplies: ``top_k`` of the ``n_experts`` SwiGLU experts of every layer
        (``3 d d_expert`` each), the training FLOPs ``6 N_active`` of Switch Transformer
        (Fedus et al. 2021, arXiv 2101.03961, section 2); ``state_params`` keeps every expert."""
        import jax
        from flax import nnx

        from train.bench.gpu import multiplying_params
        from train.model import build_model
        from train.models.core import head_size

        model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
        total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        q = head_size(cfg)
        idle = (cfg.n_experts - cfg.top_k) * 3 * cfg.d_model * cfg.d_expert * cfg.n_layers if hasattr(cfg, "n_experts") else 0
        return cls(params=multiplying_params(model) - idle, layers=cfg.n_layers, d_model=cfg.d_model, attn_width=cfg.n_heads * q,
                   seq_len=seq_len or cfg.seq_len, global_batch=global_batch, remat=remat, accumulation=accumulation,
                   kv_width=getattr(cfg, "n_kv_heads", cfg.n_heads) * q, state_params=total,
                   expert_params=cfg.n_experts * 3 * cfg.d_model * cfg.d_expert * cfg.n_layers if hasattr(cfg, "n_experts") else 0,
                   n_experts=getattr(cfg, "n_experts", 0), top_k=getattr(cfg, "top_k", 0))


def step_flops(w: Workload, devices: int = 1) -> dict:
    """FLOPs of one step per device (the whole step's over ``devices``).

    Per token: ``model`` = PaLM's ``6 N + 12 L H Q T`` (Kaplan et al. section 2.1; PaLM appendix B,
    which counts the attention whole) with causal attention halved, ``6 N + 6 L H Q T``: a causal
    kernel computes half the scores (FlashAttention-2, arXiv 2307.08691, section 4.1; Megatron-LM's
    and MaxText's MFU, since MaxText PR 1988, halve it too); ``executed`` = ``model`` plus
    ``recompute`` (``block``: ``2 N`` and the attention forward; ``dots``: the attention forward;
    Korthikanti et al. 2022, arXiv 2205.05198, section 5). So ``model <= executed``.

    Returns:
      ``{"model", "executed", "recompute", "forward", "backward"}`` (``forward`` + ``backward`` =
      ``executed``; the recomputation runs in backward).
    """
    att_fwd_model = 4.0 * w.layers * w.attn_width * w.seq_len  # QK^T and PV, 2 FLOPs per multiply-add each
    att_fwd = att_fwd_model / 2 if w.causal else att_fwd_model
    recompute = {"block": 2.0 * w.params + att_fwd, "dots": att_fwd}.get(w.remat, 0.0)
    per = w.tokens / devices
    forward = (2.0 * w.params + att_fwd) * per
    backward = (4.0 * w.params + 2 * att_fwd + recompute) * per
    return {"model": (6.0 * w.params + 3 * att_fwd) * per, "executed": forward + backward, "recompute": recompute * per,
            "forward": forward, "backward": backward}


def _axes_of(axis: str, mesh: dict) -> list[str]:
    """The mesh axes a collective's axis name spans (``world``: every data axis; ``a+b``; ``context (parameters)``)."""
    if axis == "world":
        names = [a for a in mesh if a in _DATA and mesh[a] > 1]
    else:
        names = [a.strip() for a in axis.replace(" (parameters)", "").split("+")]
    unknown = [a for a in names if a not in mesh]
    if unknown or not names:
        raise ValueError(f"collective axis {axis!r}: not an axis of the mesh {mesh} (mesh axes, 'world' or 'a+b')")
    return names


def axis_link(axis: str, mesh: dict, profile: Profile, devices_per_node: int | None = None) -> dict:
    """The link a collective over ``axis`` runs on, for devices laid out in ``mesh`` order (the last
    axis innermost, as ``zshard.make_mesh`` lays them), ``devices_per_node`` consecutive devices per node.

    A group inside one node runs at NVLink speed (``intra_node_bandwidth * intra_node_fraction``).
    A group spanning nodes is a ring through every node it touches: each node sends the ring's
    bytes out once per group, over its devices' network links; ``m`` members per node share
    ``m`` links, so the ring runs at ``min(intra, m * inter_node_bandwidth * inter_node_fraction)``.

    Returns:
      ``{"axes", "size", "nodes", "members_per_node", "crosses_nodes", "bandwidth"}`` (bytes/s).

    Raises:
      ValueError: ``axis`` names an axis ``mesh`` does not have.
    """
    dpn = devices_per_node or profile.devices_per_node
    names = _axes_of(axis, mesh)
    shape = [int(v) for v in mesh.values()]
    ranges = [range(s) if a in names else range(1) for a, s in zip(mesh, shape)]
    flat = np.ravel_multi_index(np.meshgrid(*ranges, indexing="ij"), shape).ravel()  # the group of device 0
    nodes = len(set((flat // dpn).tolist()))
    size = len(flat)
    m = size // nodes
    intra = profile.intra_node_bandwidth * profile.intra_node_fraction
    inter = profile.inter_node_bandwidth * profile.inter_node_fraction
    bw = intra if nodes == 1 else min(intra, m * inter)
    return {"axes": names, "size": size, "nodes": nodes, "members_per_node": m, "crosses_nodes": nodes > 1, "bandwidth": bw}


def collective_seconds(kind: str, axis: str, sent_bytes: float, mesh: dict, profile: Profile,
                       devices_per_node: int | None = None) -> float:
    """Seconds of ``sent_bytes`` (what one device sends) of a collective over ``axis``: over the
    ring's bandwidth (:func:`axis_link`); an all-to-all across nodes sends its remote share
    ``(n - m) / (n - 1)`` over the device's own network link while the rest crosses NVLink."""
    link = axis_link(axis, mesh, profile, devices_per_node)
    if kind == "all-to-all" and link["crosses_nodes"]:
        n, m = link["size"], link["members_per_node"]
        remote = sent_bytes * (n - m) / (n - 1)
        return max((sent_bytes - remote) / (profile.intra_node_bandwidth * profile.intra_node_fraction),
                   remote / (profile.inter_node_bandwidth * profile.inter_node_fraction))
    return sent_bytes / link["bandwidth"]


def phase_of(kind: str, axis: str, strategy: str, accumulation: int = 1) -> str:
    """When a collective runs and what can hide it: ``"gather"`` (parameter all-gathers: behind the
    forward and backward compute), ``"backward"`` (gradient reductions, a quantized one's all-to-all
    over the shard axes too: behind the backward),
    ``"critical"`` (tensor, context, expert: exposed), ``"optimizer"`` (after the backward: exposed).

    With ``accumulation > 1`` the cross-replica all-reduce of HYBRID_SHARD, HYBRID_SHARD_ZERO2,
    NO_SHARD and SHARD_OPT runs once, after the micro-batches (``zshard.ReplicaReduce.PER_STEP``):
    ``"optimizer"``."""
    names = set(axis.split("+"))
    if "tensor" in names or names in ({"context"}, {"expert"}) or (kind == "all-to-all" and "expert" in names):
        # "context (parameters)": the parameters' own collectives; the expert axis's all-to-all of the tokens (a gather
        # over shard+expert hides); an all-to-all over the shard axes is a quantized gradient reduction (below)
        return "critical"
    if kind == "all-reduce" and accumulation > 1 and strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "NO_SHARD", "SHARD_OPT"):
        return "optimizer"  # the accumulated gradient, all-reduced once per step
    if kind == "all-gather":
        if strategy == "SHARD_OPT" or (strategy == "HYBRID_SHARD_OPT" and names == {"replica"}):
            return "optimizer"  # the updated parameters, gathered after the optimizer's update
        return "gather"
    return "backward"


def traffic_of_report(rep) -> list[dict]:
    """The collectives of a :class:`zshard.Report` (``rep.collectives``): ``{"kind", "axis", "count",
    "bytes"}`` per kind and axis, ``bytes`` sent by one device per step (ring)."""
    return [{k: c[k] for k in ("kind", "axis", "count", "bytes")} for c in rep.collectives]


def _name(axes, mesh) -> str:
    axes = [a for a in mesh if a in axes and mesh[a] > 1]
    data = [a for a in mesh if a in _DATA and mesh[a] > 1]
    if {"replica", "shard"} <= set(axes) and axes == data:
        return "world"
    return "+".join(axes)


def formula_traffic(w: Workload, mesh: dict, strategy: str = "FULL_SHARD", *, gather_bytes: float = 2, reduce_bytes: int = 4,
                    master_bytes: int = 4, activation_bytes: int = 2, quantized_reduce: tuple = (0.0, 0.0)) -> list[dict]:
    """The collectives of a step by formula, for configurations not compiled (docs/design.md section
    3, ring algorithm; ``zshard/formulas.py`` checks the same counts against compiled programs).

    Per device per step, ``Psi' = Psi / T`` (parameters split over ``tensor``), ``k`` micro-batches,
    ``N`` devices sharing each parameter, ``r(n) = (n - 1) / n``: all-gathers ``2 k Psi' g r(N)``
    (forward and backward; ``k Psi' g r(N)`` for SHARD_GRAD_OP / HYBRID_SHARD_ZERO2), reduce-scatters
    ``k Psi' d r(N)``; across replicas the all-reduce ``2 (Psi'/N) d r(R)`` (HYBRID_SHARD) or
    reduce-scatter ``k (Psi'/N) d r(R)`` and all-gather ``(Psi'/N) m r(R)`` (HYBRID_SHARD_OPT);
    NO_SHARD an all-reduce ``2 Psi' d r(W)``, SHARD_OPT that plus an all-gather ``Psi' m r(W)``.
    Tensor: Megatron-LM's all-reduces of a block's activation ``X = b s h e`` (``b`` sequences and
    ``s`` tokens of a device per micro-batch), 4 per block per micro-batch (5 with ``block``
    remat: zshard/formulas.py's count), ``2 X r(T)`` each. Context: the keys and values
    ``2 b T n_kv d e`` per layer, ``r(C)`` of it per forward pass (2 with ``block``) and for the
    backward's reduce-scatter. The root unit's single gather is left out. Quantized formats (train/planning/formats.py):
    ``gather_bytes`` the wire bytes per element of a quantized gather; ``quantized_reduce = (share, q)``: that share of
    ``Psi'`` is reduced over the shard axes by an all-to-all of ``q`` bytes per element (ZeRO++ qgZ), the rest reduce-scattered.
    Expert (``X = mesh["expert"]``, an MoE workload): the dense parameters ``Psi_D' = Psi' - Psi_E`` are
    sharded over ``shard x expert`` (and ``replica`` for a flat strategy: ``N_D = N X``), the routed
    experts ``Psi_E / X`` per expert group over the shard axes only (``N``): gathers and reduce-scatters
    as above per part; across replicas the all-reduce ``2 (Psi/(N X)) d r(R)``; the tokens'
    all-to-all over ``expert``, dispatch and combine in forward and backward (twice more with
    ``block`` remat), each ``zshard.moe.a2a_bytes`` of the ``b s`` tokens (dropless capacity).

    ``g``, ``d``, ``m``, ``e``: bytes per element of the gathers, the gradient reductions, the
    master parameters and the activations (bf16 gathers and compute, fp32 reductions and masters).

    Raises:
      ValueError: an unknown strategy (the message lists them).
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: choose one of {', '.join(_STRATEGIES)}")
    R, S, C, T, X = (int(mesh.get(a, 1)) for a in ("replica", "shard", "context", "tensor", "expert"))
    r = lambda n: (n - 1) / n  # noqa: E731
    k, psi = w.accumulation, w.psi / T
    out = []
    if X > 1:
        return _expert_traffic(w, mesh, strategy, (R, S, X), gather_bytes, reduce_bytes, activation_bytes)

    def add(kind, axes, sent, count):
        name = _name(axes, mesh)
        if name and sent > 0:
            out.append({"kind": kind, "axis": name, "count": int(count), "bytes": float(sent)})

    if strategy in ("NO_SHARD", "SHARD_OPT"):
        W = R * S * C
        add("all-reduce", _DATA, 2 * psi * reduce_bytes * r(W), w.layers)
        if strategy == "SHARD_OPT":
            add("all-gather", _DATA, psi * master_bytes * r(W), w.layers)
    else:
        hybrid = strategy.startswith("HYBRID")
        axes = ("shard", "context") if hybrid else _DATA
        N = S * C * (1 if hybrid else R)
        passes = 2 if strategy in RESHARD else 1
        add("all-gather", axes, passes * k * psi * gather_bytes * r(N), passes * k * w.layers)
        share, q = quantized_reduce
        add("reduce-scatter", axes, k * psi * (1 - share) * reduce_bytes * r(N), k * w.layers)
        add("all-to-all", axes, k * psi * share * q * r(N), k * w.layers)
        if strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            add("all-reduce", ("replica",), 2 * psi / N * reduce_bytes * r(R), w.layers)
        elif strategy == "HYBRID_SHARD_OPT":
            add("reduce-scatter", ("replica",), k * psi / N * reduce_bytes * r(R), k * w.layers)
            add("all-gather", ("replica",), psi / N * master_bytes * r(R), w.layers)
    micro = w.global_batch // (R * S) // k  # sequences of one data group per micro-batch
    if T > 1:
        x = micro * (w.seq_len // C) * w.d_model * activation_bytes
        n = (5 if w.remat == "block" else 4) * w.layers * k
        add("all-reduce", ("tensor",), n * 2 * x * r(T), n)
    if C > 1:
        kv = 2 * micro * w.seq_len * (w.kv_width or w.attn_width) // T * activation_bytes
        n = ((2 if w.remat == "block" else 1) + 1) * w.layers * k
        add("all-gather", ("context",), n * kv * r(C), n)
    return out


def _expert_traffic(w: Workload, mesh: dict, strategy: str, sizes, g: int, d: int, e: int) -> list[dict]:
    """:func:`formula_traffic` on a mesh with an ``expert`` axis (its docstring; zshard refuses tensor and context there)."""
    from zshard.moe import a2a_bytes

    if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        raise ValueError(f"strategy {strategy!r} with expert={sizes[2]}: zshard supports FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD "
                         "and HYBRID_SHARD_ZERO2 with an expert axis")
    if not w.n_experts:
        raise ValueError(f"expert={sizes[2]}: the workload has no experts (a dense model): use expert=1")
    R, S, X = sizes
    r = lambda n: (n - 1) / n  # noqa: E731
    k, hybrid = w.accumulation, strategy.startswith("HYBRID")
    N = S * (1 if hybrid else R)
    passes = 2 if strategy in RESHARD else 1
    out = []

    def add(kind, axes, sent, count):
        name = "+".join(a for a in mesh if a in axes and mesh[a] > 1)
        if name and sent > 0:
            out.append({"kind": kind, "axis": name, "count": int(count), "bytes": float(sent)})

    dense, experts = w.psi - w.expert_params, w.expert_params / X
    shard_axes = ("shard",) if hybrid else ("replica", "shard")
    # dense [Psi_D/(N X)] --all_gather(shard x expert)--> [Psi_D]; experts [Psi_E/(X N)] --all_gather(shard)--> [Psi_E/X]
    add("all-gather", (*shard_axes, "expert"), passes * k * dense * g * r(N * X), passes * k * w.layers)
    add("reduce-scatter", (*shard_axes, "expert"), k * dense * d * r(N * X), k * w.layers)
    add("all-gather", shard_axes, passes * k * experts * g * r(N), passes * k * w.layers)
    add("reduce-scatter", shard_axes, k * experts * d * r(N), k * w.layers)
    if hybrid:
        add("all-reduce", ("replica",), 2 * w.psi / (N * X) * d * r(R), w.layers)
    micro = w.global_batch // (R * S * X) // k  # sequences of one device per micro-batch
    n = (6 if w.remat == "block" else 4) * w.layers * k  # dispatch + combine, forward and backward (+ recompute)
    add("all-to-all", ("expert",), n * a2a_bytes(micro * w.seq_len, w.top_k, X, w.n_experts, w.d_model, e), n)
    return out


@dataclasses.dataclass
class Prediction:
    """What :func:`predict` predicts for one step on one device.

    Attributes:
      step_s: seconds per optimizer step.
      tokens_per_s_per_device: tokens of the global batch per second, over the devices.
      mfu: model FLOPs (no recomputation, causal attention halved) per device / (``step_s`` *
        ``peak_flops``), a fraction, at most the profile's ``matmul_fraction``.
      bottleneck: ``"compute"``, ``"memory"`` (the optimizer's HBM time) or the mesh axis whose
        exposed collectives take longest, whichever of these is largest.
      compute_s, forward_s, backward_s: executed FLOPs over ``peak_flops * matmul_fraction``.
      memory_s: the optimizer's bytes (and any quantize / dequantize kernels') over the HBM bandwidth.
      exposed_s: per axis, seconds of its collectives not hidden behind compute.
      comm_s: per axis, seconds of all its collectives.
      links: per axis, :func:`axis_link`'s answer.
      flops: :func:`step_flops`.
      profile: the profile's name.
    """

    step_s: float
    tokens_per_s_per_device: float
    mfu: float
    bottleneck: str
    compute_s: float
    forward_s: float
    backward_s: float
    memory_s: float
    exposed_s: dict
    comm_s: dict
    links: dict
    flops: dict
    profile: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _pipeline(comm: float, compute: float, units: int) -> float:
    """Exposed seconds of ``units`` equal collectives each prefetched behind the previous unit's
    compute: the first unit's whole, then each later one's excess, ``c + (n-1) max(0, c - w)`` per unit."""
    c, w = comm / units, compute / units
    return c + (units - 1) * max(0.0, c - w)


def predict(w: Workload, traffic: list[dict], profile: Profile, mesh: dict, *, strategy: str = "FULL_SHARD",
            state_bytes: float | None = None, devices_per_node: int | None = None, quant_bytes: float = 0.0) -> Prediction:
    """The predicted step of workload ``w`` on ``mesh`` (``{"replica": R, "shard": S, ...}`` in
    device order) of ``profile`` devices, with ``traffic``'s collectives
    (:func:`traffic_of_report` or :func:`formula_traffic`).

    ``state_bytes``: parameters and optimizer state on one device (``Report.model_state_bytes
    ["measured"]["total"]``); default: fp32 parameters and two Adam moments, ``12 Psi / (T N)``
    over the ``N`` devices the strategy shards them on (``12 Psi / (N X)`` with an ``expert`` axis). The optimizer moves ``2 * state + grads``
    bytes (gradients: a third of the fp32 state). ``quant_bytes``: HBM bytes of quantizing and dequantizing
    (``train.planning.formats.quant_hbm_bytes``), added to the memory-bound time.

    Raises:
      ValueError: a collective over an axis the mesh does not have, a bad strategy.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: choose one of {', '.join(_STRATEGIES)}")
    devices = int(np.prod([int(v) for v in mesh.values()]))
    fl = step_flops(w, devices)
    rate = profile.matmul_flops
    fwd, bwd = fl["forward"] / rate, fl["backward"] / rate
    if state_bytes is None:
        R, S, C, T = (int(mesh.get(a, 1)) for a in ("replica", "shard", "context", "tensor"))
        n = {"NO_SHARD": 1, "HYBRID_SHARD": S * C, "HYBRID_SHARD_ZERO2": S * C}.get(strategy, R * S * C)
        state_bytes = 12.0 * w.psi / (T * n * int(mesh.get("expert", 1)))  # dense over shard x expert, experts E/X each
    memory_s = (2 * state_bytes + state_bytes / 3 + quant_bytes) / profile.hbm_bandwidth
    units = w.layers * w.accumulation
    split = 0.5 if strategy in RESHARD else 1.0  # the gathers' share in the forward pass
    per_phase: dict = {}  # (phase, link) -> {axis: seconds}
    comm_s, links, exposed = {}, {}, {}
    whole = 0.0  # seconds of the collectives nothing hides (critical, after the backward, or never asynchronous)
    for t in traffic:
        link = links.setdefault(t["axis"], axis_link(t["axis"], mesh, profile, devices_per_node))
        s = collective_seconds(t["kind"], t["axis"], t["bytes"], mesh, profile, devices_per_node)
        comm_s[t["axis"]] = comm_s.get(t["axis"], 0.0) + s
        phase = phase_of(t["kind"], t["axis"], strategy, w.accumulation)
        where = "inter" if link["crosses_nodes"] else "intra"
        if phase in ("gather", "backward") and not profile.async_collectives:
            phase = "critical"  # collectives that never overlap compute (XLA:CPU): exposed whole
        if phase == "gather":
            for p, share in (("forward", split), ("backward", 1 - split)):
                if share:
                    d = per_phase.setdefault((p, where), {})
                    d[t["axis"]] = d.get(t["axis"], 0.0) + share * s
        elif phase == "backward":
            d = per_phase.setdefault(("backward", where), {})
            d[t["axis"]] = d.get(t["axis"], 0.0) + s
        else:  # critical or optimizer: nothing hides it
            exposed[t["axis"]] = exposed.get(t["axis"], 0.0) + s
            whole += s
    pipelined = 0.0  # seconds the prefetch pipeline leaves exposed
    for p, window in (("forward", fwd), ("backward", bwd)):
        cands = {where: d for (ph, where), d in per_phase.items() if ph == p}
        if not cands:
            continue
        per_link = {where: _pipeline(sum(d.values()), window, units) for where, d in cands.items()}
        top = max(per_link, key=per_link.get)  # the links run side by side: the slower one sets the exposure
        pipelined += per_link[top]
        total = sum(cands[top].values())
        for axis, s in cands[top].items():
            exposed[axis] = exposed.get(axis, 0.0) + per_link[top] * s / total
    step = fwd + bwd + pipelined + whole + memory_s
    terms = {"compute": fwd + bwd, "memory": memory_s, **exposed}
    bottleneck = max(terms, key=terms.get)
    return Prediction(step_s=step, tokens_per_s_per_device=w.tokens / devices / step if step else math.inf,
                      mfu=fl["model"] / (step * profile.peak_flops), bottleneck=bottleneck, compute_s=fwd + bwd,
                      forward_s=fwd, backward_s=bwd, memory_s=memory_s, exposed_s=exposed, comm_s=comm_s, links=links,
                      flops=fl, profile=profile.name)

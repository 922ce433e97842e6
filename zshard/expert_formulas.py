"""Expert parallelism in closed form: the all-to-all bytes of the token dispatch, and the model
state, gathered block and gather bytes per device with an ``expert`` axis of ``X`` devices.

Pure Python (no jax): :mod:`zshard.formulas` re-exports these, :mod:`zshard.report` checks the
compiled step against them and ``python -m train.scale --moe`` plans MoE shapes with them
(docs/expert-parallel.md, "The formulas").

Notation, per device and per micro-batch: ``n`` tokens, each routed to ``k`` (top-k) of ``E``
experts, ``D`` d_model, ``e`` bytes per activation element, ``X`` devices of the ``expert`` axis
(one expert group holds all ``E`` experts, ``E/X`` per device). Parameters: ``Psi_d`` dense (the
attention, norms, router, embeddings, shared experts), ``Psi_x`` routed experts' (all ``E``);
``N`` the devices a dense parameter is FSDP-sharded over (``S*X``, ``R*S*X`` for FULL_SHARD
across hosts). Sources:

- the dispatch and combine all-to-alls: GShard (Lepikhin et al. 2020, arXiv 2006.16668) section
  2.2 and its Algorithm 2 (``AllToAll`` before and after the experts), DeepSpeed-MoE
  (Rajbhandari et al. 2022, arXiv 2201.05596) section 5 (expert parallelism inside the
  data-parallel groups, one all-to-all each way);
- the capacity of an expert (tokens beyond it dropped): Switch Transformer (Fedus et al. 2021,
  arXiv 2101.03961) section 2.2, ``capacity = (tokens / experts) x capacity factor``;
- the sharded model state: ZeRO (arXiv 1910.02054) section 5, with the experts split over the
  expert-parallel group first (DeepSpeed-MoE section 5; torchtitan's ``dp_shard`` carving the
  expert axis out of FSDP).
"""

from __future__ import annotations

import math

__all__ = [
    "A2A_PER_MOE_LAYER", "all_to_all_bytes", "dropless_capacity", "expert_all_to_all_per_step", "expert_gather_bytes",
    "expert_gather_ratio", "expert_state_bytes", "dispatch_formula", "gathered_block_bytes", "padded_all_to_all_bytes",
]

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

A2A_PER_MOE_LAYER = {False: 4, True: 6}
"""All-to-alls per MoE layer per micro-batch: forward dispatch and combine, and their transposes in
backward (4); with the block recomputed in backward (``remat="block"``) the forward's two again (6)."""


def _check(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < (1 if name in ("expert", "top_k") else 0):
            raise ValueError(f"expert formula: {name}={v!r} must be a {'positive' if name in ('expert', 'top_k') else 'non-negative'} number")


def all_to_all_bytes(tokens: float, top_k: int, d_model: int, itemsize: int, expert: int) -> float:
    """Bytes one device sends in one exact (ragged) all-to-all of the token dispatch over ``expert``.

    Each of the ``n`` local tokens goes to ``k`` experts: ``n k`` rows of ``D`` elements leave the
    device, of which the ``1/X`` bound for its own expert group stay (GShard, arXiv 2006.16668
    section 2.2; DeepSpeed-MoE, arXiv 2201.05596 section 5)::

        n * k * D * e * (X - 1) / X      (bytes; 0 for X = 1)

    with routing balanced over the groups (the combine sends the same rows back).

    Raises:
      ValueError: a negative size, or ``top_k`` / ``expert`` < 1.
    """
    _check(tokens=tokens, top_k=top_k, d_model=d_model, itemsize=itemsize, expert=expert)
    return float(tokens * top_k * d_model * itemsize * (expert - 1) / expert)


def dropless_capacity(tokens: int, top_k: int, experts: int | None = None, expert: int = 1) -> int:
    """Rows per destination device of the padded dropless dispatch (``zshard.moe``'s ``cap``): the worst
    case ``n * min(k, E/X)``, every token's experts on one device (a token's ``k`` experts are distinct,
    at most ``E/X`` of them live on one device), so no slot is ever dropped; ``n * k`` without ``experts``."""
    _check(tokens=tokens, top_k=top_k, expert=expert)
    return int(tokens * (top_k if experts is None else min(top_k, experts // expert)))


def padded_all_to_all_bytes(capacity: int, d_model: int, itemsize: int, expert: int) -> float:
    """Bytes one device sends in one padded all-to-all over ``expert`` (``jax.lax.all_to_all`` of
    the buffer ``[X, cap, D]``: ``cap`` rows to each group, unused rows zero).

    The buffer is ``X cap D e`` bytes and ``(X-1)/X`` of it leaves the device::

        cap * D * e * (X - 1)            (bytes)

    Dropless (:func:`dropless_capacity`): ``cap = n min(k, E/X)``; with ``k <= E/X``, ``X`` times the
    exact :func:`all_to_all_bytes` whatever the routing. With a capacity factor ``c`` (Switch
    Transformer, arXiv 2101.03961 section 2.2, per expert ``c n k / E``): ``cap = c n k / X`` per
    group of ``E/X`` experts, ``c`` times the exact bytes.

    Raises:
      ValueError: a negative size, or ``expert`` < 1.
    """
    _check(capacity=capacity, d_model=d_model, itemsize=itemsize, expert=expert)
    return float(capacity * d_model * itemsize * (expert - 1))


def expert_all_to_all_per_step(moe_layers: int, tokens: float, top_k: int, d_model: int, itemsize: int, expert: int,
                               grad_accum: int = 1, remat: bool = True, capacity: int | None = None) -> float:
    """Bytes one device sends over ``expert`` per training step for the token dispatch.

    ``moe_layers * grad_accum * a * per_call``, ``a`` = :data:`A2A_PER_MOE_LAYER` (4; 6 with the
    block recomputed, ``remat``), ``per_call`` the exact :func:`all_to_all_bytes` of ``tokens``
    (per device, per micro-batch) or, given ``capacity`` rows per group, the padded
    :func:`padded_all_to_all_bytes`.
    """
    _check(moe_layers=moe_layers, grad_accum=grad_accum)
    per = (all_to_all_bytes(tokens, top_k, d_model, itemsize, expert) if capacity is None
           else padded_all_to_all_bytes(capacity, d_model, itemsize, expert))
    return float(moe_layers * grad_accum * A2A_PER_MOE_LAYER[bool(remat)] * per)


def expert_state_bytes(psi_dense: float, psi_expert: float, shards: int, expert: int, itemsize: int = 4,
                       opt_slots: int = 2) -> dict:
    """Model-state bytes per device with expert parallelism (ZeRO, arXiv 1910.02054 section 5;
    DeepSpeed-MoE, arXiv 2201.05596 section 5).

    A dense parameter is FSDP-sharded over the ``N`` devices of ``shard x expert`` (x ``replica``
    for FULL_SHARD across hosts); an expert parameter is split over ``expert`` (``E/X`` whole
    experts per device) and its ``E/X`` experts FSDP-sharded over the other ``N/X``::

        params    = e (Psi_d / N + Psi_x / (X * N/X))
        opt_state = K * params            (Adam: K = 2 moments in the parameters' dtype)

    Per device this is ``(1 + K) e Psi / N`` as without the axis, on ``N`` devices: the
    ``expert`` axis moves where the expert bytes are, not how many each device holds.

    Returns:
      ``{"dense", "expert", "params", "opt_state", "total"}``, bytes (floats).
    Raises:
      ValueError: ``expert`` not dividing ``shards`` (the mesh's ``N``), or a bad size.
    """
    _check(psi_dense=psi_dense, psi_expert=psi_expert, shards=shards, expert=expert, itemsize=itemsize, opt_slots=opt_slots)
    if shards % expert:
        raise ValueError(f"expert_state_bytes: expert={expert} must divide shards={shards} (N = S*X devices a dense "
                         "parameter is split over)")
    dense = itemsize * psi_dense / shards
    experts = itemsize * psi_expert / (expert * (shards // expert))
    params = dense + experts
    return {"dense": dense, "expert": experts, "params": params, "opt_state": opt_slots * params,
            "total": (1 + opt_slots) * params}


def gathered_block_bytes(psi_layer_dense: float, psi_layer_expert: float, expert: int, itemsize: int) -> float:
    """Bytes of one block unit gathered on a device: its dense part whole and the ``E/X`` local
    experts, ``e (Psi_layer_d + Psi_layer_x / X)`` (without the axis, ``X = 1``: every expert).

    Raises:
      ValueError: a negative size, or ``expert`` < 1.
    """
    _check(psi_layer_dense=psi_layer_dense, psi_layer_expert=psi_layer_expert, expert=expert, itemsize=itemsize)
    return float(itemsize * (psi_layer_dense + psi_layer_expert / expert))


def expert_gather_bytes(psi_dense: float, psi_expert: float, shards: int, expert: int, itemsize: int,
                        gathers: int = 2) -> dict:
    """Bytes one device sends per step all-gathering the block units (ring algorithm, Patarasuk &
    Yuan 2009), the dense part over the ``N`` devices of ``shard x expert`` and the local experts over
    the ``N/X`` of ``shard`` only::

        dense   = g * e * Psi_d * (N - 1) / N
        experts = g * e * (Psi_x / X) * (N/X - 1) / (N/X)

    ``g`` gathers per unit per step (2: forward and the backward's re-gather, FULL_SHARD; 1
    without resharding); ``e`` bytes per gathered element (the ``param_dtype``).

    Returns:
      ``{"dense", "expert"}``, bytes (floats).
    Raises:
      ValueError: ``expert`` not dividing ``shards``, or a bad size.
    """
    _check(psi_dense=psi_dense, psi_expert=psi_expert, shards=shards, expert=expert, itemsize=itemsize, gathers=gathers)
    if shards % expert:
        raise ValueError(f"expert_gather_bytes: expert={expert} must divide shards={shards}")
    n = shards // expert  # devices one expert is FSDP-sharded over
    return {"dense": float(gathers * itemsize * psi_dense * (shards - 1) / shards),
            "expert": float(gathers * itemsize * psi_expert / expert * (n - 1) / n)}


def expert_gather_ratio(shards: int, expert: int) -> float:
    """Expert bytes gathered per step with the ``expert`` axis over those without it, on the same
    ``N`` devices: ``(1/X) ((N/X - 1)/(N/X)) / ((N - 1)/N)`` (:func:`expert_gather_bytes` with
    ``X`` against ``X = 1``); ``N = 8, X = 2``: ``0.375 / 0.875 = 3/7``."""
    if shards < 2:
        raise ValueError(f"expert_gather_ratio: shards={shards} must be >= 2 (no gather on one device)")
    with_ep = expert_gather_bytes(0, 1, shards, expert, 1, 1)["expert"]
    without = expert_gather_bytes(0, 1, shards, 1, 1, 1)["expert"]
    return with_ep / without if without else math.nan


def dispatch_formula(calls, colls, grad_accum: int = 1, remat: bool = True) -> dict:
    """The token dispatch over ``expert`` of one compiled step: measured against the padded formula.

    ``calls``: the traced ``zshard.moe`` calls, each a record with ``groups`` X, ``local_experts``
    E/X, ``capacity`` cap, ``d_model`` D and ``dtype`` (``zshard.moe``'s ``MoECall``), or a ``(unit,
    layers, record)`` triple (a scanned stack's one trace runs ``layers`` times); ``None``: not
    recorded (formula ``None``). Per call and micro-batch: :data:`A2A_PER_MOE_LAYER` padded
    all-to-alls of ``[X, cap, D]`` (:func:`padded_all_to_all_bytes`) and, once per forward pass (2
    with ``remat``), the slot counts ``[X, E/X]`` int32, ``(X-1) (E/X) 4`` bytes.
    ``colls``: :func:`zshard.report.parse_collectives` of the compiled program; the measured bytes
    are its all-to-alls over ``expert`` (``sent_bytes x trips``).

    Returns:
      ``{"measured", "formula", "calls", "layers", "collectives": [{"buffer_bytes", "count"}]}``
      (bytes per device per step; ``formula`` ``None`` without ``calls``).
    """
    ours = [c for c in colls if c.kind == "all-to-all" and c.axis == "expert"]
    counts: dict[int, int] = {}
    for c in ours:
        counts[c.buffer_bytes] = counts.get(c.buffer_bytes, 0) + c.trips
    out = {"measured": float(sum(c.sent_bytes * c.trips for c in ours)), "formula": None, "calls": 0, "layers": 0,
           "collectives": [{"buffer_bytes": b, "count": n} for b, n in sorted(counts.items())]}
    if calls is None:
        return out
    calls = list(calls)
    formula, layers = 0.0, 0
    passes = A2A_PER_MOE_LAYER[bool(remat)]
    for entry in calls:
        n, call = (entry[1] or 1, entry[2]) if isinstance(entry, tuple) else (1, entry)
        X = call.groups
        per = passes * padded_all_to_all_bytes(call.capacity, call.d_model, _ITEMSIZE[str(call.dtype)], X)
        per += (2 if remat else 1) * (X - 1) * call.local_experts * 4  # the slot counts, forward only
        formula += grad_accum * n * per
        layers += n
    out.update(formula=formula, calls=len(calls), layers=layers)
    return out

"""``zshard.moe``: a mixture-of-experts layer whose experts may be split over the ``expert`` axis.

``moe(x, router, w_gate_up, w_down, top_k=k)`` -> ``(y, MoEStats)``: each token ``x[n]`` ``[D]``
picks ``k`` of ``E`` gated (SwiGLU) experts and ``y[n] = sum_j w[n, j] * expert_{e[n, j]}(x[n])``,
plus the optional shared experts. It is the one op model code calls for the ``expert`` mesh axis,
as :func:`zshard.attention` is for ``context``.

Routing (:func:`route`; the router always runs in float32, at full matmul precision, also under
mixed precision: ``logits = float32(x) @ float32(router)`` ``[N, E]``):

- ``score="softmax"`` (Switch Transformer, arXiv 2101.03961 section 2.1; Mixtral, arXiv 2401.04088
  section 2.1; Qwen3-MoE): ``p = softmax(logits)``, the ``k`` largest ``p`` are chosen and weigh
  the experts; ``norm_topk_prob=True`` renormalises those ``k`` weights to sum to 1 (Mixtral's
  ``softmax(top-k logits)``, Qwen3-MoE's ``norm_topk_prob``; False: Qwen2-MoE / Switch's raw
  probabilities).
- ``score="sigmoid"`` (DeepSeek-V3, arXiv 2412.19437 section 2.1.2, "Basics of DeepSeekMoE" and
  "Auxiliary-Loss-Free Load Balancing"): ``s = sigmoid(logits)``;
  the experts are chosen by ``s + router_bias`` (the auxiliary-loss-free balancing bias ``b_i``,
  used for the selection only), weighted by ``s`` normalised over the chosen ``k`` (``+ 1e-20``),
  times ``routed_scaling_factor``. ``limit_groups=(n_group, topk_group)``: group-limited routing
  (DeepSeek-V3 section 2.1.2, "Node-Limited Routing", as Hugging Face's ``n_group`` /
  ``topk_group``): the groups ranked by the sum of their two best scores, the experts outside the
  best ``topk_group`` excluded (``-inf``, where Hugging Face writes 0).

The router z-loss (ST-MoE, arXiv 2202.08906, ``mean(logsumexp(logits)^2)``) and the
load-balancing loss are the model's: :class:`MoEStats` carries ``logits``, ``probs``, ``top_e``.

Dispatch. ``X = E // w_gate_up.shape[0]`` expert groups (``router`` names all ``E`` experts, the
expert weights hold this device's ``E/X``). Slots are ``s = n*k + j`` (token ``n``'s ``j``-th expert).

- ``X == 1`` (one device, or the experts whole on each): the ``N*k`` slots sorted by expert
  (stable) run as two grouped matmuls (``jax.lax.ragged_dot``, gradient included): each token
  costs ``k`` experts' FLOPs. Usable anywhere, inside or outside ``shard_map``.
- ``X > 1`` (inside ``shard_map`` with the mesh axis ``"expert"`` of size ``X`` bound; device ``d``
  holds experts ``[d*E/X, (d+1)*E/X)``): slots sorted by expert (so by destination device) are
  packed into a padded buffer ``[X, cap, D]``, sent by ``jax.lax.all_to_all`` over ``expert``
  (split and concat axis 0; with the per-(destination, local expert) slot counts ``[X, E/X]`` int32
  by a second, tiny all-to-all), the received ``X*cap`` rows are grouped by local expert and run
  as the same grouped matmuls, sent back by the reverse all-to-all, unpacked and combined with the
  routing weights. ``jax.lax.all_to_all`` is differentiable (its transpose is the reverse
  all-to-all): the backward pass sends the gradients the same way (tests/test_moe_op.py checks
  forward and gradients equal to ``X == 1``). The padded all-to-all runs on every backend
  (``ragged_all_to_all`` does not run on XLA:CPU).

Capacity (``cap``, rows per (source, destination) device pair):

- dropless, ``capacity_factor=None`` (the default): ``cap = N * min(k, E/X)``, the worst case (a
  token's ``k`` experts are distinct, at most ``min(k, E/X)`` of them live on one device): nothing
  is dropped and the result equals the dense formula on one device (the batch split does not
  change it).
- ``capacity_factor=c``: ``cap = min(ceil(c * N * k / X), N * min(k, E/X))``, Switch Transformer's
  expert capacity (arXiv 2101.03961 section 2.2, eq. 3: ``tokens / experts * capacity factor``;
  GShard's expert capacity, arXiv 2006.16668) summed over the ``E/X`` experts of one device. Each
  destination takes its slots in token order (slot index ``s``) and drops the rest: a dropped
  slot contributes 0 (the token keeps its other experts, the shared experts and the residual) and
  is counted in ``MoEStats.dropped``. At ``X == 1`` the same rule with one destination.

All-to-all bytes per device of one dispatch or combine (``b`` bytes of ``x``'s dtype, ``(X-1)/X``
of the buffer leaves the device; four per MoE layer per step: dispatch and combine, forward and
backward, six when the block's forward is recomputed): dropless ``(X - 1) * N * min(k, E/X) * D * b``;
capacity ``(X - 1) * cap * D * b`` (``~ c * N * k * D * b * (X-1)/X``); plus the counts'
``(X - 1) * (E/X) * 4`` bytes once per forward (int32, no backward). :func:`a2a_bytes` evaluates
them. The price of exact dropless with static shapes: each buffer holds ``X * N * min(k, E/X)``
rows (``X`` times the ``N * k`` slots when ``k <= E/X``), and the receiver's grouped matmuls
run over ``X * cap`` rows, the padding last (``ragged_dot`` gives 0 past the group sizes).

Shared experts (DeepSeek-V3 section 2.1.2, Qwen2-MoE): ``shared_gate_up`` ``[D, 2Fs]`` and
``shared_down`` ``[Fs, D]``, a dense gated MLP on every token added to ``y``; Qwen2-MoE's
``shared_gate`` ``[D, 1]`` scales it by ``sigmoid(x @ shared_gate)``.

While tracing, every call is appended to the list of an enclosing :func:`recording` (a
:class:`MoECall`: experts, groups, capacity), so a step can tell whether its expert-split
parameters went through this op.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import numbers
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["ACTS", "EXPERT", "EXPERT_SCOPE", "SCORES", "MoECall", "MoEStats", "a2a_bytes", "capacity", "moe", "recording", "route"]

EXPERT = "expert"
EXPERT_SCOPE = "zshard.expert"  # the named scope of the all-to-alls ('zshard.expert.dispatch' / '.combine')
SCORES = ("softmax", "sigmoid")
ACTS: dict[str, Callable] = {
    "silu": jax.nn.silu,  # SwiGLU (Shazeer 2020, arXiv 2002.05202)
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


class MoEStats(NamedTuple):
    """What :func:`moe` tells the model about its routing (shapes for ``x`` ``[..., D]``, ``E`` experts)."""

    top_e: jax.Array  # int32 [..., k]: the chosen experts of each token, best first
    weights: jax.Array  # float32 [..., k]: their combine weights (normalised, scaled)
    probs: jax.Array  # float32 [..., E]: router probabilities (softmax) or scores (sigmoid)
    logits: jax.Array  # float32 [..., E]: router logits (for the z-loss)
    dropped: jax.Array  # float32 []: token-slots dropped for capacity on this device (0 when dropless)
    load: jax.Array  # float32 [E]: token-slots routed to each expert on this device (dropped ones included)


@dataclasses.dataclass(frozen=True)
class MoECall:
    """One traced :func:`moe` call: ``experts`` E, ``groups`` X (1: no all-to-all), ``local_experts``
    E/X, ``top_k``, ``tokens`` N on this device, ``capacity`` rows per destination (``N*k`` at X = 1
    dropless), ``d_model`` D, ``dtype`` of the dispatched rows."""

    experts: int
    groups: int
    local_experts: int
    top_k: int
    tokens: int
    capacity: int
    dropless: bool
    d_model: int
    dtype: str


_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("zshard_moe_record", default=None)


@contextlib.contextmanager
def recording():
    """Inside: every :func:`moe` call traced is appended (a :class:`MoECall`) to the yielded list; an
    enclosing recording receives them too on leaving (``zshard.report`` records around a program body
    that records its own)."""
    outer = _RECORD.get()
    calls: list[MoECall] = []
    token = _RECORD.set(calls)
    try:
        yield calls
    finally:
        _RECORD.reset(token)
        if outer is not None:
            outer.extend(calls)


def capacity(tokens: int, top_k: int, groups: int, experts: int, capacity_factor: float | None = None) -> int:
    """Rows per destination device of the dispatch buffer ``[X, cap, D]`` (module docstring):
    dropless ``N * min(k, E/X)``; else ``min(ceil(c * N * k / X), N * min(k, E/X))``."""
    worst = tokens * min(top_k, experts // groups)
    if capacity_factor is None:
        return worst
    return min(math.ceil(capacity_factor * tokens * top_k / groups), worst)


def a2a_bytes(tokens: int, top_k: int, groups: int, experts: int, d_model: int, itemsize: int,
              capacity_factor: float | None = None) -> int:
    """Bytes one device sends off-device in one dispatch (or combine) all-to-all of :func:`moe`:
    ``(X - 1) * cap * D * itemsize`` (``cap`` from :func:`capacity`); 0 when ``X == 1``."""
    return (groups - 1) * capacity(tokens, top_k, groups, experts, capacity_factor) * d_model * itemsize


def route(x, router, top_k: int, *, score: str = "softmax", norm_topk_prob: bool = True, router_bias=None,
          routed_scaling_factor: float = 1.0, limit_groups: tuple[int, int] | None = None):
    """Router of :func:`moe`: ``x`` ``[N, D]``, ``router`` ``[D, E]`` -> ``(logits, probs, top_e, weights)``:
    float32 ``[N, E]``, float32 ``[N, E]``, int32 ``[N, k]``, float32 ``[N, k]`` (module docstring)."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)  # [N, E]
    probs = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)  # [N, E]
    choice = probs if router_bias is None else probs + router_bias.astype(jnp.float32)  # [N, E] what picks
    if limit_groups is not None:  # group-limited routing: only the experts of the best topk_group groups compete
        (G, top_g), (N, E) = limit_groups, choice.shape
        by_group = choice.reshape(N, G, E // G)  # [N, E] -> [N, G, E/G]
        group_score = jnp.sum(jax.lax.top_k(by_group, min(2, E // G))[0], axis=-1)  # [N, G]: its best two
        chosen = jnp.sum(jax.nn.one_hot(jax.lax.top_k(group_score, top_g)[1], G, dtype=jnp.bool_), axis=1)  # [N, G]
        choice = jnp.where(chosen[:, :, None], by_group, -jnp.inf).reshape(N, E)  # [N, G, E/G] -> [N, E]
    if router_bias is None and limit_groups is None:
        weights, top_e = jax.lax.top_k(probs, top_k)  # [N, k] each
    else:  # the bias (and the groups) pick, the unbiased score weighs (DeepSeek-V3 section 2.1.2)
        _, top_e = jax.lax.top_k(choice, top_k)  # [N, k]
        weights = jnp.take_along_axis(probs, top_e, axis=-1)  # [N, k]
    if norm_topk_prob:
        total = jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights / (total + 1e-20 if score == "sigmoid" else total)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return logits, probs, top_e.astype(jnp.int32), weights


def _check(x, router, w_gate_up, w_down, top_k, score, capacity_factor, act, router_bias, shared, limit_groups):
    """The shapes and options of :func:`moe`, checked before tracing: ``(D, E, El, X, F)``."""
    if x.ndim < 1:
        raise ValueError("zshard.moe: x must be [..., D] tokens; got a scalar")
    D = x.shape[-1]
    if router.ndim != 2 or router.shape[0] != D:
        raise ValueError(f"zshard.moe: router has shape {tuple(router.shape)}; it must be [D, E] = [{D}, experts] "
                         f"(x is [..., {D}]): pass the router kernel, d_model rows by one column per expert; inside "
                         "zshard's step, a router split over expert means an expert_parallel glob or an annotation also "
                         "matched the router: name only the expert weights (e.g. {'blocks*.moe.w_*': 0})")
    E = router.shape[1]
    if w_gate_up.ndim != 3 or w_down.ndim != 3:
        raise ValueError(f"zshard.moe: w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} must be "
                         "[E/X, D, 2F] and [E/X, F, D]: the experts stacked on the first dimension")
    El, F = w_gate_up.shape[0], w_down.shape[1]
    if w_gate_up.shape[1] != D or w_down.shape[2] != D or w_down.shape[0] != El or w_gate_up.shape[2] != 2 * F:
        raise ValueError(f"zshard.moe: w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not "
                         f"match [E/X, D, 2F] and [E/X, F, D] with D = {D} (x's last dimension): the gate and up "
                         "columns of each expert side by side in w_gate_up, the same experts in both; inside zshard's "
                         "step, check that expert_parallel names dimension 0 (the experts) of each expert weight")
    if El == 0 or E % El:
        raise ValueError(f"zshard.moe: router [D, E] names E = {E} experts but w_gate_up holds {El}: the expert "
                         f"weights must hold E/X experts for X expert groups (E = {E} a multiple of {El}); pass the "
                         "router of all experts and this device's experts, or fix the expert_parallel dimension")
    if not (isinstance(top_k, numbers.Integral) and 1 <= top_k <= E):
        raise ValueError(f"zshard.moe: top_k = {top_k!r} must be an int in [1, E = {E}] (router's experts): "
                         "lower top_k or give the router more experts")
    if score not in SCORES:
        raise ValueError(f"zshard.moe: score = {score!r}; choose one of {SCORES}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"zshard.moe: capacity_factor = {capacity_factor!r} must be > 0, or None for dropless")
    if not callable(act) and act not in ACTS:
        raise ValueError(f"zshard.moe: act = {act!r}; choose one of {sorted(ACTS)} or pass a function")
    if router_bias is not None and tuple(router_bias.shape) != (E,):
        raise ValueError(f"zshard.moe: router_bias has shape {tuple(router_bias.shape)}; it must be [E] = [{E}]")
    if limit_groups is not None:
        G, top_g = limit_groups
        if not (E % G == 0 and 1 <= top_g <= G and top_k <= top_g * (E // G)):
            raise ValueError(f"zshard.moe: limit_groups = {tuple(limit_groups)} (n_group, topk_group) must split the "
                             f"E = {E} experts into n_group equal groups and keep topk_group in [1, n_group] groups "
                             f"holding at least top_k = {top_k} experts")
    gate_up, down, gate = shared
    if (gate_up is None) != (down is None):
        raise ValueError("zshard.moe: pass both shared_gate_up [D, 2Fs] and shared_down [Fs, D], or neither")
    if gate_up is not None and (gate_up.ndim != 2 or down.ndim != 2 or gate_up.shape[0] != D or down.shape[1] != D
                                or gate_up.shape[1] != 2 * down.shape[0]):
        raise ValueError(f"zshard.moe: shared_gate_up {tuple(gate_up.shape)} and shared_down {tuple(down.shape)} "
                         f"must be [D, 2Fs] and [Fs, D] with D = {D}")
    if gate is not None and (gate_up is None or tuple(gate.shape) != (D, 1)):
        raise ValueError(f"zshard.moe: shared_gate {tuple(gate.shape)} must be [D, 1] = [{D}, 1] and needs the "
                         "shared expert (shared_gate_up, shared_down)")
    return D, E, El, E // El, F


def _groups_bound(X: int, E: int, El: int) -> None:
    """``X > 1`` needs the mesh axis ``"expert"`` of size ``X`` bound (inside ``shard_map``)."""
    try:
        size = jax.lax.axis_size(EXPERT)
    except NameError:
        raise ValueError(f"zshard.moe: router names E = {E} experts and w_gate_up holds {El}, so the experts are "
                         f"split over X = {X} expert groups, but no mesh axis {EXPERT!r} is bound: call it inside "
                         f"zshard's step / eval / forward on a mesh with expert={X} (zshard.make_mesh(..., "
                         f"expert={X})) or a shard_map over an axis {EXPERT!r}, or pass all {E} experts' weights") from None
    if size != X:
        raise ValueError(f"zshard.moe: router names E = {E} experts and w_gate_up holds {El} (X = {X} expert groups), "
                         f"but the mesh axis {EXPERT!r} has {size} devices: each device must hold E/{size} = "
                         f"{E / size:g} experts")


def _experts(rows, w_gate_up, w_down, sizes, act):
    """Grouped gated MLP: ``rows`` ``[M, D]`` sorted by expert, ``sizes`` int32 ``[El]`` rows per
    expert (rows past ``sum(sizes)`` give 0) -> ``[M, D]``."""
    h = jax.lax.ragged_dot(rows, w_gate_up, sizes)  # [M, D] x [El, D, 2F] -> [M, 2F]
    gate, up = jnp.split(h, 2, axis=-1)  # 2 x [M, F]
    return jax.lax.ragged_dot(act(gate) * up, w_down, sizes)  # [M, F] x [El, F, D] -> [M, D]


def _keep(dest, groups: int, cap: int):
    """Capacity: ``dest`` int32 ``[N*k]`` (destination device of each slot) -> bool ``[N*k]``, True
    for the first ``cap`` slots (in slot order) of each destination."""
    o = jnp.argsort(dest, stable=True)  # [N*k] slots by destination, in slot order within one
    per = jnp.bincount(dest, length=groups)  # [X]
    start = jnp.cumsum(per) - per  # [X] first sorted position of each destination
    rank = jnp.zeros_like(dest).at[o].set(jnp.arange(dest.shape[0], dtype=dest.dtype) - start[dest[o]])  # [N*k]
    return rank < cap


def _dispatch(xf, flat_e, E: int, X: int, cap: int, keep, w_gate_up, w_down, act, k: int):
    """The ``X > 1`` path: ``xf`` ``[N, D]``, ``flat_e`` int32 ``[N*k]`` -> ``(order, rows)``: the
    slots sorted by expert (kept first) and each sorted slot's expert output ``[N*k, D]`` (0 if dropped)."""
    El, n_slots, D = E // X, flat_e.shape[0], xf.shape[-1]
    key = flat_e if keep is None else jnp.where(keep, flat_e, E)  # dropped slots sort last
    order = jnp.argsort(key, stable=True)  # [N*k] slots by expert, so by destination
    sent = jnp.bincount(key, length=E).astype(jnp.int32).reshape(X, El)  # [X, El] kept slots per (destination, expert)
    per_dest = sent.sum(axis=1)  # [X]
    start = jnp.cumsum(per_dest) - per_dest  # [X] first sorted position of each destination
    p = jnp.arange(cap, dtype=jnp.int32)
    valid = p[None, :] < per_dest[:, None]  # [X, cap]: buffer row (d, p) holds sorted slot start[d] + p
    src = order[jnp.where(valid, start[:, None] + p[None, :], 0)]  # [X, cap] slot of each buffer row
    buf = jnp.where(valid[..., None], xf[src // k], 0)  # [X, cap, D]
    with jax.named_scope(f"{EXPERT_SCOPE}.dispatch"):
        recv = jax.lax.all_to_all(buf, EXPERT, 0, 0)  # [X(dest), cap, D] --all_to_all(expert)--> [X(source), cap, D]
        counts = jax.lax.all_to_all(sent, EXPERT, 0, 0)  # [X(dest), El] --all_to_all(expert)--> [X(source), El]
    # received row (j, p) is for local expert e where cumsum(counts[j])[e-1] <= p < cumsum(counts[j])[e]; El: padding
    ends = jnp.cumsum(counts, axis=1)  # [X, El]
    local = jax.vmap(lambda c: jnp.searchsorted(c, p, side="right"))(ends)  # [X, cap]
    r_order = jnp.argsort(local.reshape(X * cap), stable=True)  # [X*cap] rows by local expert, padding last
    h = _experts(recv.reshape(X * cap, D)[r_order], w_gate_up, w_down, counts.sum(axis=0), act)  # [X*cap, D]
    back = jnp.zeros_like(h).at[r_order].set(h, unique_indices=True).reshape(X, cap, D)  # [X(source), cap, D]
    with jax.named_scope(f"{EXPERT_SCOPE}.combine"):
        ret = jax.lax.all_to_all(back, EXPERT, 0, 0)  # [X(source), cap, D] --all_to_all(expert)--> [X(dest), cap, D]
    i = jnp.arange(n_slots, dtype=jnp.int32)
    d = key[order] // El  # [N*k] destination of each sorted slot (X for a dropped one)
    kept = i < per_dest.sum()  # [N*k] the kept slots come first
    row = jnp.where(kept, jnp.minimum(d, X - 1) * cap + i - start[jnp.minimum(d, X - 1)], 0)  # [N*k] its buffer row
    return order, jnp.where(kept[:, None], ret.reshape(X * cap, D)[row], 0)  # [N*k, D]


def moe(x, router, w_gate_up, w_down, *, top_k: int, score: str = "softmax", norm_topk_prob: bool = True,
        router_bias=None, routed_scaling_factor: float = 1.0, capacity_factor: float | None = None,
        act: str | Callable = "silu", shared_gate_up=None, shared_down=None, shared_gate=None,
        limit_groups: tuple[int, int] | None = None):
    """Top-k routed gated experts over ``x``'s tokens, the experts split over ``expert`` when ``X > 1``.

    Args:
      x: ``[..., D]`` tokens (this device's, inside a step), any float dtype; the expert matmuls
        run in it.
      router: ``[D, E]`` router kernel over all ``E`` experts (replicated over ``expert``).
      w_gate_up: ``[E/X, D, 2F]`` this device's experts' gate and up columns (gate first).
      w_down: ``[E/X, F, D]`` the same experts' down projections. ``X = E // (E/X)``.
      top_k: experts per token, ``1 <= top_k <= E``.
      score: ``"softmax"`` or ``"sigmoid"`` router scores (module docstring, with sources).
      norm_topk_prob: renormalise the ``k`` chosen weights to sum to 1.
      router_bias: ``[E]`` float, added to the scores for the choice only (DeepSeek-V3).
      routed_scaling_factor: multiplies the routed weights (DeepSeek-V3; 1.0 elsewhere).
      limit_groups: ``(n_group, topk_group)``: group-limited routing (DeepSeek-V3's ``n_group`` /
        ``topk_group``): the ``E`` experts in ``n_group`` equal groups, each scored by the sum of its
        two best choice scores; only the best ``topk_group`` groups' experts can be chosen.
      capacity_factor: None (dropless, exact) or ``c > 0``: ``cap`` rows per destination
        (:func:`capacity`), slots past it dropped and counted.
      act: ``"silu"`` (SwiGLU), ``"gelu"``, ``"gelu_tanh"``, ``"relu"`` or a function.
      shared_gate_up, shared_down: ``[D, 2Fs]``, ``[Fs, D]`` shared expert on every token (or None).
      shared_gate: ``[D, 1]``: the shared expert's output scaled by ``sigmoid(x @ shared_gate)`` (Qwen2-MoE).

    Returns:
      ``(y, stats)``: ``y`` of ``x``'s shape and dtype, ``stats`` a :class:`MoEStats`.

    Raises:
      ValueError, before tracing the matmuls, naming the argument and the fix: shapes that do not
      match ``[D, E]`` / ``[E/X, D, 2F]`` / ``[E/X, F, D]``, ``E`` not a multiple of the local experts,
      ``top_k`` outside ``[1, E]``, an unknown ``score`` / ``act``, ``capacity_factor <= 0``, and
      ``X > 1`` without the mesh axis ``"expert"`` of size ``X`` bound.
    """
    D, E, El, X, F = _check(x, router, w_gate_up, w_down, top_k, score, capacity_factor, act, router_bias,
                            (shared_gate_up, shared_down, shared_gate), limit_groups)
    if X > 1:
        _groups_bound(X, E, El)
    act = act if callable(act) else ACTS[act]
    lead, k = x.shape[:-1], top_k
    xf = x.reshape(-1, D)  # [..., D] -> [N, D]
    N = xf.shape[0]
    logits, probs, top_e, weights = route(xf, router, k, score=score, norm_topk_prob=norm_topk_prob,
                                          router_bias=router_bias, routed_scaling_factor=routed_scaling_factor,
                                          limit_groups=limit_groups)
    cap = capacity(N, k, X, E, capacity_factor)
    calls = _RECORD.get()
    if calls is not None:
        calls.append(MoECall(E, X, El, k, N, cap, capacity_factor is None, D, jnp.dtype(x.dtype).name))
    flat_e = top_e.reshape(N * k)  # [N*k] slot s = n*k + j
    keep = None if capacity_factor is None or cap >= N * min(k, El) else _keep(flat_e // El, X, cap)  # [N*k] bool
    w = weights.astype(x.dtype).reshape(N * k)  # [N*k]
    if keep is not None:
        w = jnp.where(keep, w, 0)
    if X == 1:
        key = flat_e if keep is None else jnp.where(keep, flat_e, E)  # dropped slots sort last, past sum(sizes)
        order = jnp.argsort(key, stable=True)  # [N*k] slots grouped by expert
        sizes = jnp.bincount(key, length=E).astype(jnp.int32)  # [E] kept slots per expert
        rows = _experts(xf[order // k], w_gate_up, w_down, sizes, act)  # [N*k, D]
    else:
        order, rows = _dispatch(xf, flat_e, E, X, cap, keep, w_gate_up, w_down, act, k)
    y = jnp.zeros((N, D), rows.dtype).at[order // k].add(rows * w[order][:, None])  # [N*k, D] summed into [N, D]
    if shared_gate_up is not None:
        g, u = jnp.split(xf @ shared_gate_up, 2, axis=-1)  # [N, D] x [D, 2Fs] -> 2 x [N, Fs]
        s = (act(g) * u) @ shared_down  # [N, D]
        if shared_gate is not None:
            s = s * jax.nn.sigmoid(xf @ shared_gate)  # [N, D] x [D, 1] -> [N, 1]
        y = y + s
    dropped = jnp.float32(0) if keep is None else jnp.sum(~keep).astype(jnp.float32)
    load = jnp.bincount(flat_e, length=E).astype(jnp.float32)  # [E]
    stats = MoEStats(top_e.reshape(*lead, k), weights.reshape(*lead, k), probs.reshape(*lead, E),
                     logits.reshape(*lead, E), dropped, load)
    return y.reshape(x.shape).astype(x.dtype), stats

"""The peers of ``python -m train.bench``'s section 1, each one compiled train step behind one interface.

- :func:`plain_peer`: ``jax.jit`` over an NNX model's ``(graphdef, params)``: the
  single-device ``reference``, ``DDP`` (everything replicated, batch split; the compiler adds
  the gradient all-reduce) and ``FSDP-compiler`` (MaxText style: each parameter and its Adam
  moments sharded on their largest dimension divisible by the device count; the compiler adds
  all-gathers and reduce-scatters), each with every activation saved or each block under
  ``jax.checkpoint``;
- :func:`zshard_peer`: ``zshard.init`` / ``zshard.make_train_step`` in one strategy.

Every peer reports its per-device bytes (``memory_analysis()``), model-state bytes against
the formula, collective bytes per mesh axis (``zshard.parse_collectives`` on the compiled HLO),
compile time and XLA's FLOP count, and trains from the same initial weights
(:func:`initial_params`).
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

import zshard
from train.compiler_fsdp import fsdp_jit
from train.model import GPT, cross_entropy_loss

__all__ = ["Peer", "comm_by_axis", "initial_params", "plain_peer", "zshard_peer"]


def comm_by_axis(hlo: str, mesh) -> tuple[dict, dict]:
    """Collective bytes one device sends per step, per mesh axis, and ``(kind, axis) -> count``."""
    by_axis, counts = {}, {}
    for c in zshard.parse_collectives(hlo, mesh):
        if c.buffer_bytes <= 64 or c.axis == "none":  # scalar metrics; groups of one device (as zshard.report)
            continue
        by_axis[c.axis] = by_axis.get(c.axis, 0.0) + c.sent_bytes * c.trips
        key = f"{c.kind}/{c.axis}"
        counts[key] = counts.get(key, 0) + c.trips
    return by_axis, counts


def _local_bytes(tree) -> int:
    return sum(int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _flops(compiled) -> float | None:
    """XLA's FLOP count of one device's compiled step (``cost_analysis()``; recomputation
    included, so a ``remat="block"`` step counts each block's forward twice)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) if cost and "flops" in cost else None


class Peer:
    """A compiled train step with one uniform interface for checking and timing.

    Only one peer's state exists at a time (config P's replicated DDP state alone is
    8 x 612 MB on the 8 emulated devices of one process): ``fresh()`` builds the initial
    state (same weights for every peer), ``step(state, i)`` runs one step on batch ``i % 2``
    and returns ``(state, loss)``; the state is donated.

    Attributes:
      name: table label. kind: ``"reference"``, ``"peer"`` or ``"zshard"``.
      compile_s: trace + lower + compile of the step, seconds.
      losses: loss of the first two steps from the initial state. times: timed steps, seconds.
      info: memory and communication figures of the compiled step.
    """

    def __init__(self, name, kind):
        self.name, self.kind = name, kind
        self.losses, self.times = [], []
        self.info = {}


def initial_params(cfg):
    """``(graphdef, params)`` of the GPT with seed 0; params as host numpy (shared by all peers)."""
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))
    return graphdef, jax.tree.map(np.asarray, params)


def plain_peer(name, init, tx, batches, mesh, mode, remat="none"):
    """DDP / FSDP-compiler / single-device reference: ``jax.jit`` over ``(graphdef, params)``
    of an NNX model (:func:`fsdp_jit`); ``mode`` (``"reference"``, ``"ddp"``, ``"fsdp"``) picks the
    shardings; ``remat``: ``"none"`` (every activation saved) or ``"block"`` (each block under
    ``jax.checkpoint``, like zshard's default)."""
    graphdef, host = init
    jitted, (p_sh, o_sh, b_sh), abs_opt = fsdp_jit(graphdef, host, tx, mesh, mode, remat)
    shards = 1 if mode in ("reference", "ddp") else mesh.size
    abstract = lambda tree, sh: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)  # noqa: E731
    placed = [jax.device_put(b, (b_sh, b_sh)) for b in batches]
    peer = Peer(name, "reference" if mode == "reference" else "peer")
    peer.info["remat"] = remat
    t0 = time.perf_counter()
    compiled = jitted.lower(abstract(host, p_sh), abstract(abs_opt, o_sh), placed[0]).compile()
    peer.compile_s = time.perf_counter() - t0
    opt_init = jax.jit(tx.init, out_shardings=o_sh)

    def fresh():
        params = jax.device_put(host, p_sh)
        return params, opt_init(params)

    def run(state, i):
        params, opt_state, loss = compiled(*state, placed[i % len(placed)])
        return (params, opt_state), loss

    peer.fresh, peer.step = fresh, run
    peer.info["flops"] = _flops(compiled)
    ma = compiled.memory_analysis()
    peer.info["per_device_bytes"] = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    leaves = jax.tree.leaves((abstract(host, p_sh), abstract(abs_opt, o_sh)))
    full = sum(x.size * x.dtype.itemsize for x in leaves)
    measured = _local_bytes(leaves)
    peer.info["model_state"] = {"measured": measured, "formula": full / shards, "ratio": measured / (full / shards)}
    if mode != "reference":
        peer.info["comm_bytes"], peer.info["collectives"] = comm_by_axis(compiled.as_text(), mesh)
    else:
        peer.info["comm_bytes"], peer.info["collectives"] = {}, {}
    return peer


def zshard_peer(strategy, init, tx, batches, mesh, prefetch=None, remat="block", tensor_parallel=None):
    """zshard in ``strategy``; ``prefetch=None`` and ``remat="block"`` are the step's defaults
    (the label names only what differs from them). ``tensor_parallel``: the TP plan on a mesh
    with a ``tensor`` axis (label ``tensor=T``)."""
    graphdef, host = init
    build = lambda: nnx.merge(graphdef, jax.tree.map(jax.numpy.asarray, host))  # noqa: E731
    state = zshard.init(build(), tx, mesh, strategy=strategy, tensor_parallel=tensor_parallel)
    treedef = jax.tree.structure(state)

    def fresh():  # a new init's arrays under the first init's plan (its static pytree data), as compiled
        return jax.tree.unflatten(treedef, jax.tree.leaves(zshard.init(build(), tx, mesh, strategy=strategy,
                                                                       tensor_parallel=tensor_parallel)))

    step = zshard.make_train_step(cross_entropy_loss, prefetch=prefetch, remat=remat)
    placed = [step.put_batch(state, b) for b in batches]
    tensor = dict(mesh.shape).get("tensor", 1)
    label = f"zshard/{strategy}" + ("" if remat == "block" else f" remat={remat}") + ("" if prefetch is None else f" prefetch={prefetch}") + \
        ("" if tensor == 1 else f" tensor={tensor}")
    peer = Peer(label, "zshard")
    peer.info["remat"], peer.info["prefetch"] = remat, step.prefetch
    # one gathered block unit (bytes; the largest non-root unit, one layer): the unit of the P temp targets
    peer.info["unit_bytes"] = max((sum(f.padded_size * f.dtype.itemsize for f in u.flats) for u in state.plan.units
                                   if u.name != "root"), default=0)
    t0 = time.perf_counter()
    compiled = step.lower(state, placed[0]).compile()
    peer.compile_s = time.perf_counter() - t0
    rep = zshard.report(step, state, placed[0])  # the same program: jax's compile cache answers
    del state

    def run(state, i):
        state, metrics = compiled(state, placed[i % len(placed)])
        return state, metrics["loss"]

    peer.fresh, peer.step = fresh, run
    peer.info["flops"] = _flops(compiled)
    ms = rep.model_state_bytes
    peer.info["per_device_bytes"] = rep.per_device_bytes
    peer.info["model_state"] = {"measured": ms["measured"]["total"], "formula": ms["formula"]["total"], "ratio": ms["ratio"]}
    peer.info["comm_bytes"], peer.info["collectives"] = comm_by_axis(compiled.as_text(), mesh)
    peer.info["comm_formula"] = {a: v["formula"] for a, v in rep.comm_bytes_per_step.items()}
    return peer

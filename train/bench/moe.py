"""Section 6 of ``python -m train.bench``: expert parallelism against plain FSDP, on the same 8 devices.

A small Qwen3-MoE (:data:`MOE_BENCH`: 8 experts, top-2) trains with ``moe_loss`` two ways on 8
emulated CPU devices:

- ``EP``: mesh ``1 x 4 x 2`` (``zshard.make_mesh(1, 4, expert=2)``), the expert weights split over
  ``expert`` (``zshard.init(..., expert_parallel={"blocks*.moe.w_*": 0})``): each device holds 4 whole
  experts, FSDP-sharded over ``shard`` (S = 4) and gathered over it; tokens travel to their experts
  by all-to-all over ``expert``;
- ``no EP``: mesh ``1 x 8``, every parameter FSDP-sharded over the 8 devices, every block gathered
  with all 8 experts.

Per variant: the all-gather bytes per step (``zshard.report``'s HLO reading), of them the expert
weights' (the gathers whose buffer is a gathered expert weight, ``[E/X, D, 2F]`` or ``[E/X, F, D]``),
the all-to-all bytes over ``expert``, and the step time (interleaved rounds, the median of the
per-round ratios). The expert bytes' ratio is the formula's
(:func:`zshard.formulas.expert_gather_ratio`, ``3/7`` for ``N = 8, X = 2``): EP gathers at most half
of them (tests/test_bench_moe.py asserts it from the compiled HLO). The two first losses agree
(dropless: EP computes what one device does).

Needs the ``expert`` axis (``zshard.make_mesh(expert=)``, ``zshard.init(expert_parallel=)``) and the op
``zshard.moe``; without them :func:`moe_section` returns ``{"runnable": False, "why": ...}`` and the
table says so.
"""

from __future__ import annotations

import inspect
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import zshard
from train.model import MoEConfig, build_model, moe_loss

__all__ = ["EP_GLOB", "MOE_BENCH", "ep_missing", "expert_gathers", "moe_section", "moe_table", "moe_variant"]

MOE_BENCH = dict(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, n_experts=8,
                 top_k=2, d_expert=40, scan=True)  # MoEConfig fields: 8 experts of D 64, F 40 (sizes no dense weight has)
BATCH = 16  # sequences per step, 2 per device
EP_GLOB = {"blocks*.moe.w_*": 0}  # the expert dimension of w_gate_up [E, D, 2F] and w_down [E, F, D]
VARIANTS = (("EP (1x4x2)", 2), ("no EP (1x8)", 1))  # (label, X)


def ep_missing() -> str | None:
    """Why the section cannot run on this code (the expert axis or the op missing), or ``None``."""
    if "expert" not in inspect.signature(zshard.make_mesh).parameters:
        return "zshard.make_mesh has no expert= (the expert mesh axis is not in this build)"
    if "expert_parallel" not in inspect.signature(zshard.init).parameters:
        return "zshard.init has no expert_parallel= (expert placement is not in this build)"
    if not hasattr(zshard, "moe"):
        return "zshard.moe (the token dispatch op) is not in this build"
    return None


def expert_gathers(collectives, cfg: MoEConfig, expert: int, itemsize: int = 4) -> dict:
    """The all-gathers of the expert weights among ``collectives`` (``zshard.parse_collectives``): those
    whose full buffer is one layer's gathered ``w_gate_up`` ``[E/X, D, 2F]`` or ``w_down`` ``[E/X, F, D]``.

    Returns:
      ``{"bytes": sent x trips summed, "count": executions per step, "axes": the mesh axes they span}``.
    """
    local = cfg.n_experts // expert
    sizes = {local * cfg.d_model * 2 * cfg.d_expert * itemsize, local * cfg.d_expert * cfg.d_model * itemsize}
    ours = [c for c in collectives if c.kind == "all-gather" and c.buffer_bytes in sizes]
    return {"bytes": float(sum(c.sent_bytes * c.trips for c in ours)), "count": sum(c.trips for c in ours),
            "axes": sorted({c.axis for c in ours})}


def moe_variant(expert: int, batch, devices=None, with_report: bool = True) -> dict:
    """Build, compile and measure one variant: ``expert`` = X (1: no expert axis, mesh ``1 x 8``).

    Returns ``{"state", "fresh" (a new initial state), "step", "batch" (placed), "compile_s", "collectives", "gather_bytes", "expert_gathers",
    "a2a_bytes", "report"}`` (bytes per device per step; ``report``: ``zshard.report``'s, ``None`` without
    ``with_report``)."""
    devices = jax.devices("cpu")[:8] if devices is None else devices
    cfg = MoEConfig(**MOE_BENCH)
    if expert > 1:
        mesh = zshard.make_mesh(1, 8 // expert, expert=expert, devices=devices)
        kw = {"expert_parallel": EP_GLOB}
    else:
        mesh, kw = zshard.make_mesh(1, 8, devices=devices), {}
    make = lambda: zshard.init(lambda: build_model(cfg, nnx.Rngs(0)), optax.adamw(1e-3), mesh,  # noqa: E731
                               strategy="FULL_SHARD", **kw)
    state = make()
    treedef = jax.tree.structure(state)
    step = zshard.make_train_step(moe_loss, has_aux=True)
    batch = step.put_batch(state, batch)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    rep = zshard.report(step, state, batch) if with_report else None  # the same program: jax's compile cache answers
    colls = zshard.parse_collectives(compiled.as_text(), mesh)
    gathers = [c for c in colls if c.kind == "all-gather" and c.axis != "none"]
    fresh = lambda: jax.tree.unflatten(treedef, jax.tree.leaves(make()))  # noqa: E731  (as compiled: the first plan)
    return {"state": state, "fresh": fresh, "step": step, "batch": batch, "compile_s": compile_s, "collectives": colls,
            "gather_bytes": float(sum(c.sent_bytes * c.trips for c in gathers)),
            "expert_gathers": expert_gathers(colls, cfg, expert),
            "a2a_bytes": float(sum(c.sent_bytes * c.trips for c in colls if c.kind == "all-to-all" and c.axis == "expert")),
            "report": rep}


def moe_section(repeats: int, progress=None) -> dict:
    """Both variants compiled, two steps each (losses compared), then ``repeats`` interleaved timing
    rounds (each round one step of each from its initial state, the order alternating). Returns the
    rows and the EP / no-EP ratios of expert gather bytes, all gather bytes and step time."""
    why = ep_missing()
    if why is not None:
        return {"runnable": False, "why": why}
    cfg = MoEConfig(**MOE_BENCH)
    tok = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(BATCH, cfg.seq_len + 1), dtype=np.int32)
    batch = (tok[:, :-1], tok[:, 1:])
    runs = {}
    for label, x in VARIANTS:
        if progress is not None:
            progress.set_description(f"moe: compile {label}")
        v = moe_variant(x, batch)
        state, losses = v.pop("state"), []
        for _ in range(2):  # the first call also warms the executable up
            state, metrics = v["step"](state, v["batch"])
            losses.append(float(metrics["loss"]))
        del state
        v.update(losses=losses, times=[])
        runs[label] = v
        if progress is not None:
            progress.update(1)
    labels = [label for label, _ in VARIANTS]
    for r in range(repeats):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            v = runs[label]
            state = jax.block_until_ready(v["fresh"]())
            t0 = time.perf_counter()
            jax.block_until_ready(v["step"](state, v["batch"]))
            v["times"].append(time.perf_counter() - t0)
            del state
        if progress is not None:
            progress.update(1)
    ep, base = (runs[label] for label in labels)
    rows = [{"name": label, "step_s": statistics.median(v["times"]), "compile_s": v["compile_s"], "losses": v["losses"],
             "gather_bytes": v["gather_bytes"], "expert_gather_bytes": v["expert_gathers"]["bytes"],
             "expert_gather_axes": v["expert_gathers"]["axes"], "a2a_bytes": v["a2a_bytes"],
             "state_bytes": v["report"].model_state_bytes["measured"]["total"]} for label, v in runs.items()]
    return {"runnable": True, "config": MOE_BENCH, "batch": BATCH, "repeats": repeats, "rows": rows,
            "expert_gather_ratio": ep["expert_gathers"]["bytes"] / base["expert_gathers"]["bytes"],
            "expert_gather_ratio_formula": zshard.formulas.expert_gather_ratio(8, 2),
            "gather_ratio": ep["gather_bytes"] / base["gather_bytes"],
            "step_ratio": statistics.median(a / b for a, b in zip(ep["times"], base["times"])),
            "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(ep["losses"], base["losses"]))}


def moe_table(result: dict) -> str:
    """The section as Markdown (MiB per device per step)."""
    if not result.get("runnable"):
        return f"### MoE: expert parallelism\n\nnot runnable: {result.get('why')}"
    mib = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
    lines = ["### MoE: expert parallelism against plain FSDP on 8 emulated devices (FULL_SHARD, fp32, 8 experts, top-2)", "",
             "| variant | step s | all-gather MiB/step | expert weights' gathers MiB/step (axes) | all-to-all over expert MiB/step "
             "| model state MiB | first losses |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['step_s']:.4f} | {mib(r['gather_bytes'])} | {mib(r['expert_gather_bytes'])} "
                     f"({', '.join(r['expert_gather_axes'])}) | {mib(r['a2a_bytes'])} | {mib(r['state_bytes'])} | "
                     f"{', '.join(f'{x:.5f}' for x in r['losses'])} |")
    lines += ["", f"EP / no EP: expert weights gathered {result['expert_gather_ratio']:.4f} (formula "
              f"{result['expert_gather_ratio_formula']:.4f}; target <= 0.5), all gathers {result['gather_ratio']:.4f}, "
              f"step time {result['step_ratio']:.3f} (median of {result['repeats']} interleaved rounds); first losses "
              f"within {result['loss_rel_err']:.1e} relative"]
    return "\n".join(lines)

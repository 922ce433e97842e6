"""``python -m train.bench``: zshard against its peers, side by side, and at scale by simulation.

    python -m train.bench                      # everything below, ~10 min on 2 CPU cores
    python -m train.bench --quick              # tiny model, one config, no sweep / scale (smoke test)
    python -m train.bench --out runs/bench --repeats 10

Writes ``OUT/bench.json``, ``OUT/bench.md`` (the printed tables) and PNG plots into ``--out``
(default ``runs/bench/``).

Why one file of ~800 lines: it is one program whose sections share the peers, the timing
rounds and the report writer; each section is a few functions, in the order they run. The
scale section and the memory formulas, which grew on their own, are ``train/scale.py``.

Sections
--------
1. **Peers on 8 emulated CPU devices** (mesh 2x4), in one process, on the same GPT, the same
   data and the same devices:

   - ``reference``: a plain single-device ``jax.jit`` + Optax step (ground truth for the loss);
   - ``DDP``: parameters and optimizer state replicated (``PartitionSpec()``), batch split over
     every device, ``jax.jit`` with shardings; the compiler inserts the gradient all-reduce;
   - ``FSDP-compiler`` (how MaxText does it): every parameter and its Adam moments sharded on
     the largest dimension divisible by the device count over all devices
     (``NamedSharding(mesh, P(..., ("replica", "shard"), ...))``), batch split; the compiler
     inserts all-gathers and reduce-scatters;
   - ``zshard/<STRATEGY>``: ``zshard.init`` / ``zshard.make_train_step`` in each strategy, at
     the step's defaults (``remat="block"``, ``prefetch`` = the backend's default).

   Like with like: ``FSDP-compiler remat=block`` puts each block of the peer under
   ``jax.checkpoint`` (zshard's default policy) and ``zshard/FULL_SHARD remat=none`` saves every
   activation (the plain peers' policy); every row's step time is also divided by the compiler
   peer's at the *same* policy. ``zshard/FULL_SHARD prefetch=k`` is the other prefetch setting.

   Per peer: per-device argument / output / temp bytes (``memory_analysis()`` of the compiled
   step), model-state bytes (params + optimizer state, from the shard shapes) against the
   formula, collective bytes per step per mesh axis (``zshard.report.parse_collectives`` on the
   compiled HLO of every peer; ring algorithm bytes), compile time (trace + lower + compile,
   seconds), step time (the executable is warmed up by the two checked steps; then in each
   round every peer, in rotating order, runs one step from a fresh initial state, so that only
   one peer's state is in memory at a time; median over rounds; ratios are medians of
   per-round ratios, pair by pair), the loss of the first two steps (must agree with the
   reference within 1e-5 relative, fp32), XLA's FLOP count (``cost_analysis``: recomputation
   shows) and, for zshard, the bytes of one gathered block unit (the unit of the temp targets).
2. **Depth sweep**: the scanned GPT of config S at 2 / 8 / 32 layers, zshard FULL_SHARD and
   FSDP-compiler compile time (the fastest of two compiles, jax caches cleared before each).
3. **Scale by simulation** (``train/scale.py``, also ``python -m train.scale``): GPT-2 1.5B,
   Llama 7B and 70B shapes, seq 2048, one sequence per device, at 64 and 512 emulated devices,
   compiled ahead of time; per-device peak against :func:`train.scale.expected_peak`.
4. **GPU** (only when ``jax.default_backend() == "gpu"``): one-device overhead of zshard
   (FULL_SHARD on a 1x1 mesh) against a plain ``jax.jit`` step, and model FLOPs utilisation.

The targets of issues 8 and 17 are printed at the end (``### Targets``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from train.scale import (  # section 3 and the formulas live in train/scale.py
    DEVICE_GB,
    GB,
    SCALE_DEVICES,
    SCALE_MODELS,
    SCALE_STRATEGIES,
    activation_bytes,
    run_scale,
    scale_table,
    scale_worker,
    set_device_count,
)

PROG = "python -m train.bench"
NUM_DEVICES = 8  # emulated CPU devices of sections 1 and 2
MESH_8 = (2, 4)  # (replica, shard)
LOSS_RTOL = 1e-5
STRATEGIES = ("NO_SHARD", "SHARD_OPT", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "HYBRID_SHARD_OPT")
# XLA:GPU scheduling flags (xla/debug_options_flags.cc): the latency-hiding scheduler overlaps
# collectives with compute; collectives are asynchronous by default on GPU (nothing listed in
# --xla_gpu_disable_async_collectives); the pipelined flags let the scheduler move a scanned
# layer's all-gather / reduce-scatter into the neighbouring iteration. Harmless on CPU.
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One model / batch shape of section 1.

    Attributes:
      name: label in the tables.
      d_model: residual width; n_layers: blocks; n_heads: attention heads.
      seq_len: tokens per sequence; batch: global batch, sequences (split over 8 devices).
      vocab: tokens (bytes: 256).
      scan: stacked blocks run with ``nnx.scan`` (otherwise an ``nnx.List``).
      repeats: interleaved timing rounds by default (P: 3; one DDP step of its 51M
        parameters takes seconds on 2 cores).
    """

    name: str
    d_model: int
    n_layers: int
    seq_len: int
    batch: int
    vocab: int = 256
    n_heads: int = 4
    scan: bool = False
    repeats: int = 10  # interleaved timing rounds (``--repeats`` overrides)

    def gpt(self):
        from train.model import GPTConfig  # noqa: PLC0415

        return GPTConfig(vocab_size=self.vocab, seq_len=self.seq_len, d_model=self.d_model, n_layers=self.n_layers,
                         n_heads=self.n_heads, scan=self.scan)


CONFIGS = {
    "S": BenchConfig("S", d_model=256, n_layers=4, seq_len=128, batch=16, n_heads=4),  # activation-heavy
    "P": BenchConfig("P", d_model=1024, n_layers=4, seq_len=64, batch=8, n_heads=16, repeats=3),  # parameter-heavy
}
QUICK = BenchConfig("Q", d_model=64, n_layers=2, seq_len=32, batch=8, n_heads=2, repeats=3)
DEPTHS = (2, 8, 32)
COMPILE_REPEATS = 2  # depth sweep: compile time = the fastest of this many compiles (caches cleared)


# --------------------------------------------------------------------------------------
# Formulas (pure Python: no jax)
# --------------------------------------------------------------------------------------


def train_flops_per_token(n_params_nonembed: int, n_layers: int, d_model: int, seq: int) -> float:
    """Training FLOPs per token: ``6*N + 12*L*h*T`` (Kaplan et al. 2020 section 2.1: ``6N`` for
    forward + backward of the weights; PaLM, Chowdhery et al. 2022 appendix B: ``12*L*H*Q*T`` for
    attention, ``H*Q = h``). Remat recompute is not counted (model FLOPs, not hardware FLOPs)."""
    return 6.0 * n_params_nonembed + 12.0 * n_layers * d_model * seq


def median_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[i] / b[i]`` (pairs measured in the same interleaved round)."""
    return statistics.median(x / y for x, y in zip(a, b))


# --------------------------------------------------------------------------------------
# Section 1: peers on 8 emulated devices
# --------------------------------------------------------------------------------------


def _mib(b) -> str:
    return f"{b / 2**20:.2f}"


def _comm_by_axis(hlo: str, mesh) -> tuple[dict, dict]:
    """Collective bytes one device sends per step, per mesh axis, and ``(kind, axis) -> count``."""
    from zshard.report import parse_collectives  # noqa: PLC0415

    by_axis, counts = {}, {}
    for c in parse_collectives(hlo, mesh):
        if c.buffer_bytes <= 64 or c.axis == "none":  # scalar metrics; groups of one device (as zshard.report)
            continue
        by_axis[c.axis] = by_axis.get(c.axis, 0.0) + c.sent_bytes * c.trips
        key = f"{c.kind}/{c.axis}"
        counts[key] = counts.get(key, 0) + c.trips
    return by_axis, counts


def _local_bytes(tree) -> int:
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    return sum(int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _flops(compiled) -> float | None:
    """XLA's FLOP count of one device's compiled step (``cost_analysis()``; recomputation
    included, so a ``remat="block"`` step counts each block's forward twice)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) if cost and "flops" in cost else None


def _fsdp_spec(shape, world: int, axes):
    """MaxText-style FSDP: shard the largest dimension divisible by ``world`` over ``axes``."""
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    dims = sorted((d for d in range(len(shape)) if shape[d] % world == 0 and shape[d] > 0), key=lambda d: -shape[d])
    if not dims:
        return P()
    spec = [None] * len(shape)
    spec[dims[0]] = axes
    return P(*spec)


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


def _initial(cfg):
    """``(graphdef, params)`` of the GPT with seed 0; params as host numpy (shared by all peers)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from train.model import GPT  # noqa: PLC0415

    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))
    return graphdef, jax.tree.map(np.asarray, params)


class _Checkpointed:
    """A block under ``jax.checkpoint`` (``nnx.remat``): the plain peers' ``remat="block"``,
    the same policy as zshard's default (each block's input saved, the block recomputed in
    backward)."""

    def __init__(self, block):
        self.block = block

    def __call__(self, x):
        from flax import nnx  # noqa: PLC0415

        return nnx.remat(lambda blk, x: blk(x))(self.block, x)


def _plain_peer(name, init, tx, batches, mesh, mode, remat="none"):
    """DDP / FSDP-compiler / single-device reference: ``jax.jit`` over ``(graphdef, params)``
    of an NNX model; ``mode`` (``"reference"``, ``"ddp"``, ``"fsdp"``) picks the shardings;
    ``remat``: ``"none"`` (every activation saved) or ``"block"`` (each block under
    ``jax.checkpoint``, like zshard's default)."""
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from train.model import cross_entropy_loss  # noqa: PLC0415

    graphdef, host = init
    abs_opt = jax.eval_shape(tx.init, host)
    axes = ("replica", "shard")
    if mode == "reference":
        dev = SingleDeviceSharding(mesh.devices.flat[0])
        spec_of = lambda x: dev  # noqa: E731
        b_sh = out_sh = dev
        shards = 1
    else:
        world = mesh.size
        shards = 1 if mode == "ddp" else world
        spec_of = lambda x: NamedSharding(mesh, P() if mode == "ddp" else _fsdp_spec(x.shape, world, axes))  # noqa: E731
        b_sh, out_sh = NamedSharding(mesh, P(axes)), NamedSharding(mesh, P())
    p_sh, o_sh = jax.tree.map(spec_of, host), jax.tree.map(spec_of, abs_opt)

    def step(params, opt_state, batch):
        def loss_of(p):
            model = nnx.merge(graphdef, p)
            if remat == "block":  # the model's Python loop calls each block: wrap it in jax.checkpoint
                model.blocks = [_Checkpointed(b) for b in model.blocks]
            return cross_entropy_loss(model, batch)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, in_shardings=(p_sh, o_sh, (b_sh, b_sh)), out_shardings=(p_sh, o_sh, out_sh), donate_argnums=(0, 1))
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
        peer.info["comm_bytes"], peer.info["collectives"] = _comm_by_axis(compiled.as_text(), mesh)
    else:
        peer.info["comm_bytes"], peer.info["collectives"] = {}, {}
    return peer


def _zshard_peer(strategy, init, tx, batches, mesh, prefetch=None, remat="block"):
    """zshard in ``strategy``; ``prefetch=None`` and ``remat="block"`` are the step's defaults
    (the label names only what differs from them)."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train.model import cross_entropy_loss  # noqa: PLC0415

    graphdef, host = init
    build = lambda: nnx.merge(graphdef, jax.tree.map(jax.numpy.asarray, host))  # noqa: E731
    state = zshard.init(build(), tx, mesh, strategy=strategy)
    treedef = jax.tree.structure(state)

    def fresh():  # a new init's arrays under the first init's plan (its static pytree data), as compiled
        return jax.tree.unflatten(treedef, jax.tree.leaves(zshard.init(build(), tx, mesh, strategy=strategy)))

    step = zshard.make_train_step(cross_entropy_loss, prefetch=prefetch, remat=remat)
    placed = [step.put_batch(state, b) for b in batches]
    label = f"zshard/{strategy}" + ("" if remat == "block" else f" remat={remat}") + ("" if prefetch is None else f" prefetch={prefetch}")
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
    peer.info["comm_bytes"], peer.info["collectives"] = _comm_by_axis(compiled.as_text(), mesh)
    peer.info["comm_formula"] = {a: v["formula"] for a, v in rep.comm_bytes_per_step.items()}
    return peer


def bench_config(cfg: BenchConfig, strategies, repeats: int, progress) -> dict:
    """Section 1 for one configuration: compile every peer, check the first two losses, then
    time the peers in interleaved rounds (one step each per round, order rotating)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from zshard.step import default_prefetch  # noqa: PLC0415

    init = _initial(cfg.gpt())
    devices = jax.devices("cpu")[:NUM_DEVICES]
    zmesh = zshard.make_mesh(*MESH_8, devices=devices)
    mesh = jax.sharding.Mesh(zmesh.devices, zmesh.axis_names)  # Auto axes: the compiler shards
    tx = optax.adamw(1e-3, weight_decay=0.1)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        tok = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq_len + 1), dtype=np.int32)
        batches.append((tok[:, :-1], tok[:, 1:]))

    builders = [("reference", lambda: _plain_peer("reference (1 device)", init, tx, batches, mesh, "reference")),
                ("DDP", lambda: _plain_peer("DDP", init, tx, batches, mesh, "ddp")),
                ("FSDP-compiler", lambda: _plain_peer("FSDP-compiler", init, tx, batches, mesh, "fsdp")),
                # like with like: the compiler peer at zshard's default policy (each block recomputed)
                ("FSDP-compiler remat=block", lambda: _plain_peer("FSDP-compiler remat=block", init, tx, batches, mesh, "fsdp", "block"))]
    builders += [(s, (lambda s=s: _zshard_peer(s, init, tx, batches, zmesh))) for s in strategies]
    if "FULL_SHARD" in strategies:
        # like with like: FULL_SHARD at the compiler peer's policy (every activation saved) ...
        builders.append(("FULL_SHARD remat=none", lambda: _zshard_peer("FULL_SHARD", init, tx, batches, zmesh, remat="none")))
        # ... and prefetch on the other side of the backend default (what the extra gathered unit costs)
        pf = 1 - min(default_prefetch(), 1)  # CPU: 1 (the default is 0); GPU / TPU: 0
        builders.append((f"FULL_SHARD prefetch={pf}", lambda: _zshard_peer("FULL_SHARD", init, tx, batches, zmesh, prefetch=pf)))
    peers = []
    for label, build in builders:
        progress.set_description(f"{cfg.name}: compile, 2 steps {label}")
        p = build()
        state = p.fresh()
        for i in range(2):  # the first call is also the warm-up of the executable
            state, loss = p.step(state, i)
            p.losses.append(float(loss))
        del state
        peers.append(p)
        progress.update(1)
    timed = [p for p in peers if p.kind != "reference"]
    progress.set_description(f"{cfg.name}: time {repeats} rounds")
    for r in range(repeats):
        for p in timed[r % len(timed):] + timed[: r % len(timed)]:
            state = jax.block_until_ready(p.fresh())
            t0 = time.perf_counter()
            state, loss = p.step(state, 0)
            jax.block_until_ready((state, loss))
            p.times.append(time.perf_counter() - t0)
            del state
        progress.update(1)
    ref = peers[0].losses
    by = {p.name: p for p in peers}
    rows = []
    for p in peers:
        row = {"name": p.name, "compile_s": p.compile_s, "losses": p.losses,
               "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(p.losses, ref)), **p.info}
        if p.times:
            row["step_s"] = statistics.median(p.times)
            row["step_s_all"] = p.times
            row["step_ratio"] = {q: median_ratio(p.times, by[q].times) for q in ("DDP", "FSDP-compiler")}
            # like with like: against the compiler peer at the same recomputation policy
            same = "FSDP-compiler" + ("" if p.info.get("remat", "none") == "none" else f" remat={p.info['remat']}")
            if same in by:
                row["step_ratio"]["FSDP-compiler same remat"] = median_ratio(p.times, by[same].times)
                row["same_remat_peer"] = same
        rows.append(row)
    gpt = cfg.gpt()
    # activations per device with per-block recomputation (the P temp targets' allowance)
    act = activation_bytes(gpt.d_model, gpt.n_layers, gpt.n_heads, 4 * gpt.d_model, gpt.vocab_size, gpt.seq_len,
                           cfg.batch // NUM_DEVICES, glu=False)
    return {"config": dataclasses.asdict(cfg), "mesh": {"replica": MESH_8[0], "shard": MESH_8[1]}, "repeats": repeats,
            "activation_bytes": act, "default_prefetch": default_prefetch(), "rows": rows}


def _fmt(x, spec=".2f") -> str:
    return "" if x is None else format(x, spec)


def config_table(res: dict) -> str:
    c = res["config"]
    head = (f"### {c['name']}: d_model {c['d_model']}, {c['n_layers']} layers, seq {c['seq_len']}, global batch "
            f"{c['batch']}, vocab {c['vocab']}; mesh 2x4 (8 emulated CPU devices), AdamW fp32, "
            f"median of {res['repeats']} interleaved rounds; zshard rows: remat=block, prefetch={res.get('default_prefetch', '')} "
            "(the step's defaults here) unless the name says otherwise; DDP, FSDP-compiler: every activation saved "
            "(remat=none) unless the name says otherwise")
    lines = [head, "",
             "| peer | argument MiB | temp MiB | state / formula | shard MiB/step | replica MiB/step | world MiB/step "
             "| compile s | step ms | / DDP | / FSDP-compiler | / FSDP-compiler, same remat | loss step 1, 2 | rel. err |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in res["rows"]:
        pd, cb = r["per_device_bytes"], r["comm_bytes"]
        step = r.get("step_s")
        ratios = r.get("step_ratio", {})
        lines.append(
            f"| {r['name']} | {_mib(pd['argument'])} | {_mib(pd['temp'])} | {r['model_state']['ratio']:.4f} | "
            f"{_mib(cb.get('shard', 0))} | {_mib(cb.get('replica', 0))} | {_mib(cb.get('world', 0))} | "
            f"{r['compile_s']:.2f} | {_fmt(None if step is None else 1e3 * step, '.1f')} | "
            f"{_fmt(ratios.get('DDP'))} | {_fmt(ratios.get('FSDP-compiler'))} | {_fmt(ratios.get('FSDP-compiler same remat'))} | "
            f"{r['losses'][0]:.6f}, {r['losses'][1]:.6f} | {r['loss_rel_err']:.1e} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Section 2: depth sweep (compile time, scanned)
# --------------------------------------------------------------------------------------


def depth_sweep(depths, base: BenchConfig, progress) -> dict:
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import zshard  # noqa: PLC0415

    devices = jax.devices("cpu")[:NUM_DEVICES]
    zmesh = zshard.make_mesh(*MESH_8, devices=devices)
    mesh = jax.sharding.Mesh(zmesh.devices, zmesh.axis_names)
    tx = optax.adamw(1e-3)
    tok = np.zeros((base.batch, base.seq_len), np.int32)
    out = {"depths": list(depths), "zshard/FULL_SHARD": [], "FSDP-compiler": []}
    for L in depths:
        init = _initial(dataclasses.replace(base, n_layers=L, scan=True).gpt())
        for key, build in (("zshard/FULL_SHARD", lambda: _zshard_peer("FULL_SHARD", init, tx, [(tok, tok)], zmesh)),
                           ("FSDP-compiler", lambda: _plain_peer("FSDP-compiler", init, tx, [(tok, tok)], mesh, "fsdp"))):
            progress.set_description(f"depth {L}: {key}")
            times = []
            for _ in range(COMPILE_REPEATS):  # a compile is one sample of a loaded machine: keep the fastest
                jax.clear_caches()
                times.append(build().compile_s)
            out[key].append(min(times))
            progress.update(1)
    for k in ("zshard/FULL_SHARD", "FSDP-compiler"):
        out[f"{k} ratio"] = out[k][-1] / out[k][0]
    return out


def depth_table(d: dict) -> str:
    lines = [f"### Compile time (s) by depth, scanned GPT (d_model 256, seq 128, batch 16), 2x4, fastest of {COMPILE_REPEATS}", "",
             "| layers | " + " | ".join(str(L) for L in d["depths"]) + f" | {d['depths'][-1]} / {d['depths'][0]} |",
             "|---|" + "---:|" * (len(d["depths"]) + 1)]
    for k in ("zshard/FULL_SHARD", "FSDP-compiler"):
        lines.append(f"| {k} | " + " | ".join(f"{t:.2f}" for t in d[k]) + f" | {d[f'{k} ratio']:.2f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Section 4: GPU
# --------------------------------------------------------------------------------------

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}  # dense bf16, vendor sheets


def gpu_section(repeats: int) -> dict:
    """One-device overhead and MFU on the first GPU (bf16 compute, fp32 masters)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train.model import GPT, GPTConfig, cross_entropy_loss  # noqa: PLC0415

    dev = jax.devices("gpu")[0]
    cfg = GPTConfig(vocab_size=256, seq_len=1024, d_model=1024, n_layers=8, n_heads=16, scan=True)
    B = 16
    tx = optax.adamw(1e-4)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 256, size=(B, cfg.seq_len + 1), dtype=np.int32)
    batch = (tok[:, :-1], tok[:, 1:])

    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    params = jax.device_put(params, dev)
    opt_state = jax.device_put(tx.init(params), dev)

    def plain(params, opt_state, batch):  # bf16 compute, fp32 masters: as zshard's MixedPrecision
        def loss_of(p):
            return cross_entropy_loss(nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)), batch)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    plain_c = jax.jit(plain, donate_argnums=(0, 1)).lower(params, opt_state, jax.device_put(batch, dev)).compile()
    mesh = zshard.make_mesh(1, 1, devices=[dev])
    state = zshard.init(GPT(cfg, rngs=nnx.Rngs(0)), tx, mesh, strategy="FULL_SHARD",
                        mixed_precision=zshard.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32"))
    step = zshard.make_train_step(cross_entropy_loss)
    zb = step.put_batch(state, batch)
    z_c = step.lower(state, zb).compile()
    pb = jax.device_put(batch, dev)
    box = {"p": params, "o": opt_state, "s": state}

    def run_plain():
        box["p"], box["o"], loss = plain_c(box["p"], box["o"], pb)
        return loss

    def run_z():
        box["s"], m = z_c(box["s"], zb)
        return m["loss"]

    for f in (run_plain, run_z):
        jax.block_until_ready(f())
    tp, tz = [], []
    for _ in range(repeats):
        for f, ts in ((run_plain, tp), (run_z, tz)):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            ts.append(time.perf_counter() - t0)
    n_total = sum(x.size for x in jax.tree.leaves(params))
    n_embed = cfg.vocab_size * cfg.d_model + cfg.seq_len * cfg.d_model
    flops = train_flops_per_token(n_total - n_embed, cfg.n_layers, cfg.d_model, cfg.seq_len) * B * cfg.seq_len
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in dev.device_kind), None)
    t_z, t_p = statistics.median(tz), statistics.median(tp)
    return {"device": dev.device_kind, "config": dataclasses.asdict(cfg), "batch": B, "plain_step_s": t_p, "zshard_step_s": t_z,
            "overhead": median_ratio(tz, tp), "flops_per_step": flops,
            "mfu_zshard": flops / t_z / peak if peak else None, "mfu_plain": flops / t_p / peak if peak else None,
            "peak_flops": peak, "xla_flags": list(GPU_XLA_FLAGS)}


# --------------------------------------------------------------------------------------
# Targets, plots, main
# --------------------------------------------------------------------------------------


def targets(results: dict) -> list[dict]:
    """The targets of issue 8 as ``{name, value, limit, ok}`` (value <= limit passes)."""
    out = []

    def add(name, value, limit, note=""):
        out.append({"name": name, "value": value, "limit": limit, "ok": value is not None and value <= limit, "note": note})

    for cname, res in results["configs"].items():
        rows = {r["name"]: r for r in res["rows"]}
        for r in res["rows"]:
            if r["name"].startswith("zshard/"):
                add(f"{cname} {r['name']} model-state bytes / formula", r["model_state"]["ratio"], 1.01)
        err = max(r["loss_rel_err"] for r in res["rows"])
        add(f"{cname} max loss rel. error vs reference (steps 1, 2)", err, LOSS_RTOL)
        if cname in ("P", "Q"):
            # issue 17: FULL_SHARD temp (remat=block) within 2.2 gathered block units + activations
            # without prefetch, 3.2 with prefetch=1 (memory_analysis of the compiled step)
            act = res["activation_bytes"]["block"]  # the moment a block unit is gathered (activation_bytes)
            for r in res["rows"]:
                if r["name"].startswith("zshard/FULL_SHARD") and r.get("remat") == "block":
                    pf = r["prefetch"]
                    units = (r["per_device_bytes"]["temp"] - act) / r["unit_bytes"]
                    label = r["name"] + ("" if "prefetch=" in r["name"] else f" (prefetch={pf})")
                    add(f"{cname} {label} temp: gathered units beyond activations", units, 2.2 + pf)
        for r in res["rows"]:  # like with like: step time against the compiler peer at the same remat policy
            if cname in ("S", "Q") and r["name"] in ("zshard/FULL_SHARD", "zshard/FULL_SHARD remat=none"):
                add(f"{cname} {r['name']} step time / {r['same_remat_peer']}", r["step_ratio"]["FSDP-compiler same remat"], 1.0)
    if results.get("depth"):
        add(f"compile time {DEPTHS[-1]} / {DEPTHS[0]} layers (zshard FULL_SHARD)", results["depth"]["zshard/FULL_SHARD ratio"], 1.3)
    if "scale" in results:  # issue 17: every row's peak within 2% of the formula (train.scale.expected_peak)
        rows = {(r["model"], r["devices"], r["strategy"]): r for r in results["scale"]}
        for key in itertools.product(SCALE_MODELS, SCALE_DEVICES, SCALE_STRATEGIES):  # a failed worker: n/a, not met
            r = rows.get(key)
            add("scale {} {} devices {}: abs(peak / expected - 1)".format(*key), None if r is None else abs(r["ratio"] - 1),
                0.02, "did not compile (see the scale worker's error above)" if r is None else
                f"live / expected {r['live_ratio']:.3f}, peak / live (heap packing) {r['peak'] / r['live']:.3f}")
    return out


def targets_table(ts) -> str:
    lines = ["### Targets", "", "| target | value | limit | met | missed by (value - limit) | note |", "|---|---:|---:|---|---:|---|"]
    for t in ts:
        v = "n/a" if t["value"] is None else f"{t['value']:.4g}"
        miss = "" if t["ok"] or t["value"] is None else f"{t['value'] - t['limit']:+.4g}"
        lines.append(f"| {t['name']} | {v} | {t['limit']:g} | {'yes' if t['ok'] else 'NO'} | {miss} | {t['note']} |")
    return "\n".join(lines)


def _save(fig, path: Path, written: list[str]) -> None:
    """Lay out, write ``path`` (PNG, 100 dpi), close ``fig`` and record the path in ``written``."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(str(path))


def plots(results: dict, out: Path) -> list[str]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    written = []
    configs = results["configs"]
    if configs:
        fig, axes = plt.subplots(3, len(configs), figsize=(6.5 * len(configs), 11), squeeze=False)
        for j, (cname, res) in enumerate(configs.items()):
            rows = [r for r in res["rows"] if r["name"] != "reference (1 device)"]
            names = [r["name"].replace("zshard/", "").replace("_", "\n") for r in rows]
            x = range(len(rows))
            ax = axes[0][j]
            ax.bar([i - 0.2 for i in x], [r["per_device_bytes"]["argument"] / 2**20 for r in rows], 0.4, label="argument")
            ax.bar([i + 0.2 for i in x], [r["per_device_bytes"]["temp"] / 2**20 for r in rows], 0.4, label="temp")
            ax.set_ylabel("MiB per device")
            ax.set_title(f"config {cname}: memory per device (memory_analysis)")
            ax.legend(fontsize=8)
            ax = axes[1][j]
            bottom = [0.0] * len(rows)
            for axis in ("shard", "replica", "world"):
                vals = [r["comm_bytes"].get(axis, 0) / 2**20 for r in rows]
                ax.bar(list(x), vals, bottom=bottom, label=axis)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_ylabel("MiB sent per device per step")
            ax.set_title(f"config {cname}: collective bytes by mesh axis")
            ax.legend(fontsize=8)
            ax = axes[2][j]
            ax.bar([i - 0.2 for i in x], [1e3 * r["step_s"] for r in rows], 0.4, label="step (ms, median)")
            ax2 = ax.twinx()
            ax2.bar([i + 0.2 for i in x], [r["compile_s"] for r in rows], 0.4, color="tab:green", label="compile (s)")
            ax.set_ylabel("step ms")
            ax2.set_ylabel("compile s")
            ax.set_title(f"config {cname}: step and compile time (2 CPU cores)")
            ax.legend(loc="upper left", fontsize=8)
            ax2.legend(loc="upper right", fontsize=8)
            for a in axes[:, j]:
                a.set_xticks(list(x))
                a.set_xticklabels(names, fontsize=7)
        fig.suptitle("zshard vs DDP and compiler-sharded FSDP, 8 emulated devices (2x4)")
        _save(fig, out / "bench-peers.png", written)
    if results.get("depth"):
        d = results["depth"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for k in ("zshard/FULL_SHARD", "FSDP-compiler"):
            ax.plot(d["depths"], d[k], "o-", label=k)
        ax.set_xscale("log", base=2)
        ax.set_xticks(d["depths"], [str(L) for L in d["depths"]])
        ax.set_xlabel("layers (scanned)")
        ax.set_ylabel("compile s")
        ax.set_ylim(bottom=0)
        ax.set_title("compile time by depth (2x4, 2 CPU cores)")
        ax.legend()
        _save(fig, out / "bench-depth.png", written)
    if results.get("scale"):
        rows = results["scale"]
        fig, ax = plt.subplots(figsize=(10, 4.5))
        labels = [f"{r['model']}\n{r['devices']} {r['strategy'].replace('_SHARD', '')}" for r in rows]
        x = list(range(len(rows)))
        ax.bar([i - 0.2 for i in x], [r["peak"] / GB for r in rows], 0.4, label="measured peak (compiled)")
        ax.bar([i + 0.2 for i in x], [r["expected"] / GB for r in rows], 0.4, label="formula (expected_peak)")
        for g, ls in zip(DEVICE_GB, ("--", ":")):
            ax.axhline(g, color="k", ls=ls, lw=1, label=f"{g} GB device")
        ax.set_yscale("log")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("GB per device (log)")
        ax.set_title("scale by simulation: seq 2048, 1 sequence per device, AdamW fp32, 8 devices per host")
        ax.legend(fontsize=8)
        _save(fig, out / "bench-scale.png", written)
    return written


def _parse(argv):
    p = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench", help="output directory for bench.json, bench.md and the PNG plots")
    p.add_argument("--quick", action="store_true", help="smoke mode: tiny model (config Q), 3 strategies, 3 rounds, no sweep, no scale")
    p.add_argument("--repeats", type=int, default=None, metavar="N", help="interleaved timing rounds (default: S 10, P 3; --quick 3)")
    p.add_argument("--configs", default="S,P", help="section 1 configurations, comma-separated (S, P)")
    p.add_argument("--no-depth", action="store_true", help="skip the depth sweep")
    p.add_argument("--no-scale", action="store_true", help="skip scale by simulation")
    p.add_argument("--scale-timeout", type=float, default=900.0, metavar="S", help="seconds allowed to each scale subprocess")
    p.add_argument("--scale-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--models", default=",".join(SCALE_MODELS), help=argparse.SUPPRESS)
    p.add_argument("--strategies", default=",".join(SCALE_STRATEGIES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be a positive integer (timing rounds)")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            p.error(f"--configs: unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
    args.config_list = configs
    return p, args


def _set_flags(n_devices: int) -> None:
    """Before jax is imported: ``n`` emulated CPU devices and the GPU scheduling flags."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags += [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in " ".join(flags)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n_devices}"])


def main(argv=None) -> int:
    parser, args = _parse(sys.argv[1:] if argv is None else argv)
    if args.scale_worker is not None:  # kept for older scripts; run_scale spawns python -m train.scale --worker
        set_device_count(args.scale_worker)
        scale_worker(args.scale_worker, args.models.split(","), args.strategies.split(","))
        return 0
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out}: exists and is not a directory; give a directory path")
    _set_flags(NUM_DEVICES)
    t_start = time.perf_counter()

    import jax  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    if len(jax.devices("cpu")) < NUM_DEVICES:
        parser.error(f"needs {NUM_DEVICES} CPU devices, JAX sees {len(jax.devices('cpu'))}: XLA_FLAGS was overridden")
    configs = {"Q": QUICK} if args.quick else {c: CONFIGS[c] for c in args.config_list}
    strategies = ("NO_SHARD", "FULL_SHARD", "HYBRID_SHARD") if args.quick else STRATEGIES
    do_depth, do_scale = not (args.quick or args.no_depth), not (args.quick or args.no_scale)
    scale_strats = SCALE_STRATEGIES
    total = sum(4 + len(strategies) + 2 * ("FULL_SHARD" in strategies) + (args.repeats or c.repeats) for c in configs.values()) + (2 * len(DEPTHS) if do_depth else 0) + \
        (len(SCALE_DEVICES) * len(SCALE_MODELS) * len(scale_strats) if do_scale else 0)
    results = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
               f"{platform.system()} {platform.release()}", "jax": jax.__version__, "backend": jax.default_backend(),
               "command": " ".join([PROG] + (sys.argv[1:] if argv is None else list(argv))), "configs": {}}
    with tqdm(total=total, desc="bench", file=sys.stderr, dynamic_ncols=True) as progress:
        for name, cfg in configs.items():
            results["configs"][name] = bench_config(cfg, strategies, args.repeats or cfg.repeats, progress)
            progress.write(config_table(results["configs"][name]) + "\n", file=sys.stderr)  # early view; full report below
        if do_depth:
            results["depth"] = depth_sweep(DEPTHS, CONFIGS["S"], progress)
            progress.write(depth_table(results["depth"]) + "\n", file=sys.stderr)
        if do_scale:
            results["scale"] = run_scale(SCALE_DEVICES, SCALE_MODELS, scale_strats, progress, args.scale_timeout)
    if jax.default_backend() == "gpu":
        results["gpu"] = gpu_section(args.repeats or 10)
    results["targets"] = targets(results)
    results["wall_s"] = time.perf_counter() - t_start

    md = [f"## zshard benchmarks ({results['date']}; {results['machine']}; jax {results['jax']})", ""]
    md += [config_table(r) + "\n" for r in results["configs"].values()]
    if do_depth:
        md.append(depth_table(results["depth"]) + "\n")
    if do_scale:
        md.append(scale_table(results["scale"]) + "\n")
    if "gpu" in results:
        g = results["gpu"]
        mfu = "n/a (unknown peak)" if g["mfu_zshard"] is None else f"{g['mfu_zshard']:.1%} (plain jit {g['mfu_plain']:.1%})"
        md.append(f"### GPU ({g['device']})\n\nzshard FULL_SHARD 1x1 / plain jit step time: {g['overhead']:.3f}; "
                  f"MFU {mfu}, FLOPs = 6*N*T + 12*L*h*s*T (Kaplan 2020 s2.1, PaLM app. B); XLA_FLAGS {' '.join(g['xla_flags'])}\n")
    else:
        md.append(f"GPU section skipped: jax.default_backend() is {jax.default_backend()!r}, not 'gpu'.\n")
    md.append(targets_table(results["targets"]))
    text = "\n".join(md)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    written = plots(results, out)
    for name, content in (("bench.json", json.dumps(results, indent=1)), ("bench.md", text + "\n")):
        tmp = out / (name + ".tmp")
        tmp.write_text(content)
        os.replace(tmp, out / name)
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}, {', '.join(written)} in {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The sections of ``python -m train.bench`` that measure: configurations, peers side by side, depth, GPU.

1. :func:`bench_config`: for one :class:`BenchConfig`, every peer (``train/bench/peers.py``)
   compiled, its first two losses checked against the reference, then timed in interleaved
   rounds (one step each per round, the order rotating; ratios are medians of per-round
   ratios, pair by pair);
2. :func:`depth_sweep`: compile time of the scanned GPT at 2 / 8 / 32 layers, zshard
   FULL_SHARD and FSDP-compiler (the fastest of two compiles, caches cleared before each);
3. scale by simulation lives in ``train/scale.py`` (``python -m train.scale``);
4. the GPU section (only on a GPU backend) lives in ``train/bench/gpu.py``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np
import optax

import zshard
from train.bench.peers import initial_params, plain_peer, zshard_peer
from train.model import GPTConfig, cross_entropy_loss, tensor_plan
from train.scale import activation_bytes

__all__ = [
    "CONFIGS",
    "DEPTHS",
    "QUICK",
    "STRATEGIES",
    "BenchConfig",
    "bench_config",
    "depth_sweep",
    "median_ratio",
    "train_flops_per_token",
]

NUM_DEVICES = 8  # emulated CPU devices of sections 1 and 2
MESH_8 = (2, 4)  # (replica, shard)
TENSOR_SIZES = (2, 4)  # FULL_SHARD with a tensor axis: meshes 1x4x2 and 1x2x4
TENSOR_CONFIGS = ("P", "Q")  # the parameter-heavy config (and the quick one): where TP is the compiler's choice
LOSS_RTOL = 1e-5
STRATEGIES = ("NO_SHARD", "SHARD_OPT", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "HYBRID_SHARD_OPT")

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

    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab, seq_len=self.seq_len, d_model=self.d_model, n_layers=self.n_layers,
                         n_heads=self.n_heads, scan=self.scan)


CONFIGS = {
    "S": BenchConfig("S", d_model=256, n_layers=4, seq_len=128, batch=16, n_heads=4),  # activation-heavy
    "P": BenchConfig("P", d_model=1024, n_layers=4, seq_len=64, batch=8, n_heads=16, repeats=3),  # parameter-heavy
}
QUICK = BenchConfig("Q", d_model=64, n_layers=2, seq_len=32, batch=8, n_heads=2, repeats=3)
DEPTHS = (2, 8, 32)
COMPILE_REPEATS = 2  # depth sweep: compile time = the fastest of this many compiles (caches cleared)


def train_flops_per_token(n_params_nonembed: int, n_layers: int, d_model: int, seq: int) -> float:
    """Training FLOPs per token: ``6*N + 12*L*h*T`` (Kaplan et al. 2020 section 2.1: ``6N`` for
    forward + backward of the weights; PaLM, Chowdhery et al. 2022 appendix B: ``12*L*H*Q*T`` for
    attention, ``H*Q = h``). Remat recompute is not counted (model FLOPs, not hardware FLOPs)."""
    return 6.0 * n_params_nonembed + 12.0 * n_layers * d_model * seq


def median_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[i] / b[i]`` (pairs measured in the same interleaved round)."""
    return statistics.median(x / y for x, y in zip(a, b))


def bench_config(cfg: BenchConfig, strategies, repeats: int, progress) -> dict:
    """Section 1 for one configuration: compile every peer, check the first two losses, then
    time the peers in interleaved rounds (one step each per round, order rotating)."""
    init = initial_params(cfg.gpt())
    default_prefetch = zshard.make_train_step(cross_entropy_loss).prefetch  # the backend's (a built step knows it)
    devices = jax.devices("cpu")[:NUM_DEVICES]
    zmesh = zshard.make_mesh(*MESH_8, devices=devices)
    mesh = jax.sharding.Mesh(zmesh.devices, zmesh.axis_names)  # Auto axes: the compiler shards
    tx = optax.adamw(1e-3, weight_decay=0.1)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        tok = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq_len + 1), dtype=np.int32)
        batches.append((tok[:, :-1], tok[:, 1:]))

    builders = [("reference", lambda: plain_peer("reference (1 device)", init, tx, batches, mesh, "reference")),
                ("DDP", lambda: plain_peer("DDP", init, tx, batches, mesh, "ddp")),
                ("FSDP-compiler", lambda: plain_peer("FSDP-compiler", init, tx, batches, mesh, "fsdp")),
                # like with like: the compiler peer at zshard's default policy (each block recomputed)
                ("FSDP-compiler remat=block", lambda: plain_peer("FSDP-compiler remat=block", init, tx, batches, mesh, "fsdp", "block"))]
    builders += [(s, (lambda s=s: zshard_peer(s, init, tx, batches, zmesh))) for s in strategies]
    if "FULL_SHARD" in strategies:
        # like with like: FULL_SHARD at the compiler peer's policy (every activation saved) ...
        builders.append(("FULL_SHARD remat=none", lambda: zshard_peer("FULL_SHARD", init, tx, batches, zmesh, remat="none")))
        # ... and prefetch on the other side of the backend default (what the extra gathered unit costs)
        pf = 1 - min(default_prefetch, 1)  # CPU: 1 (the default is 0); GPU / TPU: 0
        builders.append((f"FULL_SHARD prefetch={pf}", lambda: zshard_peer("FULL_SHARD", init, tx, batches, zmesh, prefetch=pf)))
        # tensor parallelism inside FSDP (issue 25): 1 x 8/T x T, the reference GPT's TP plan
        for t in (t for t in TENSOR_SIZES if cfg.n_heads % t == 0 and cfg.name in TENSOR_CONFIGS):
            tmesh = zshard.make_mesh(1, NUM_DEVICES // t, tensor=t, devices=devices)
            builders.append((f"FULL_SHARD tensor={t}", lambda t=t, tmesh=tmesh: zshard_peer(
                "FULL_SHARD", init, tx, batches, tmesh, tensor_parallel=tensor_plan(cfg.gpt(), t))))
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
            row["step_ratio"] = {q: median_ratio(p.times, by[q].times) for q in ("DDP", "FSDP-compiler", "zshard/FULL_SHARD")
                                 if q in by}
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
            "activation_bytes": act, "default_prefetch": default_prefetch, "rows": rows}


def depth_sweep(depths, base: BenchConfig, progress) -> dict:
    devices = jax.devices("cpu")[:NUM_DEVICES]
    zmesh = zshard.make_mesh(*MESH_8, devices=devices)
    mesh = jax.sharding.Mesh(zmesh.devices, zmesh.axis_names)
    tx = optax.adamw(1e-3)
    tok = np.zeros((base.batch, base.seq_len), np.int32)
    out = {"depths": list(depths), "zshard/FULL_SHARD": [], "FSDP-compiler": []}
    for L in depths:
        init = initial_params(dataclasses.replace(base, n_layers=L, scan=True).gpt())
        for key, build in (("zshard/FULL_SHARD", lambda: zshard_peer("FULL_SHARD", init, tx, [(tok, tok)], zmesh)),
                           ("FSDP-compiler", lambda: plain_peer("FSDP-compiler", init, tx, [(tok, tok)], mesh, "fsdp"))):
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

"""``python -m train.bench --planned``: the plan search's predictions against measured step times, on this machine.

Runs the plan search (:func:`train.planning.search.search`) for a small GPT on the 8 emulated CPU
devices with the ``cpu`` profile (``python -m train.planning.calibrate``'s), takes ``K`` fitting
candidates spread over its ranking (the best first), compiles each (its prediction from the compiled
program's collectives), trains each for real and
times it: ``rounds`` interleaved rounds (every candidate once per round, so a load change on a
shared machine hits all of them alike) of ``steps`` steps each after a warm-up, the median step
of each round, the median over rounds. Prints, per candidate, the predicted and the measured step
time and their ratio, and the Spearman rank correlation between the two (``scipy.stats.spearmanr``
where installed, else numpy's ranks; Spearman 1904). A benchmark, not a test: a loaded machine moves
the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

__all__ = ["PLANNED_MODEL", "planned_main", "spearman"]

PLANNED_MODEL = ("small", 128, 16)
"""The benchmark's run: ``python -m train``'s ``small`` preset (d 256, 6 layers, 8 heads), sequences of 128
bytes, a global batch of 16 sequences."""


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equal-length sequences (ties get their mean rank)."""
    try:
        from scipy.stats import spearmanr
    except ImportError:  # numpy's ranks: the Pearson correlation of the (tie-averaged) ranks
        def ranks(x):
            x = np.asarray(x, float)
            r = np.empty(len(x))
            r[np.argsort(x, kind="stable")] = np.arange(len(x))
            for v in np.unique(x):
                r[x == v] = r[x == v].mean()
            return r
        return float(np.corrcoef(ranks(a), ranks(b))[0, 1])
    return float(spearmanr(a, b).statistic)


def _run_candidate(c: dict, cfg, seq: int, batch: int, devices):
    """The concrete state and step of a candidate; returns a function timing ``n`` steps (each step's seconds)."""
    import jax
    import optax
    from flax import nnx

    import zshard
    from train.model import build_model, cross_entropy_loss, tensor_plan

    m = c["mesh"]
    world = m["replica"] * m["shard"] * m["tensor"] * m["context"]
    mesh = zshard.make_mesh(m["replica"], m["shard"], tensor=m["tensor"], context=m["context"], devices=list(devices)[:world])
    state = zshard.init(lambda: build_model(cfg, nnx.Rngs(0)), optax.adamw(1e-4), mesh, strategy=c["strategy"],
                        tensor_parallel=tensor_plan(cfg, m["tensor"]) or None)
    step = zshard.make_train_step(cross_entropy_loss, sequence_axis=1 if m["context"] > 1 else None, remat=c["remat"],
                                  grad_accum=c["accumulation"])
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32)
    data = (tokens[:, :-1], tokens[:, 1:])  # [B, T] inputs and targets
    box = {"state": state}

    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            box["state"], metrics = step(box["state"], data)
            jax.block_until_ready(metrics["loss"])
            out.append(time.perf_counter() - t0)
        return out

    return timed


def planned_main(out: str, rounds: int = 5, top: int = 5, steps: int = 3) -> int:
    """Search, run the top ``top`` candidates ``rounds`` x ``steps`` steps, print the comparison, write
    ``OUT/planned.json``."""
    import jax

    from train.model import MODEL_PRESETS
    from train.planning.profiles import load_profile
    from train.planning.cost import Workload, predict, traffic_of_report
    from train.planning.search import compile_candidate, describe, search

    name, seq, batch = PLANNED_MODEL
    cfg = dataclasses.replace(MODEL_PRESETS[name], seq_len=seq)
    devices = jax.devices()[:8]
    profile = load_profile("cpu")
    t0 = time.perf_counter()
    res = search(cfg, model=name, devices=len(devices), seq=seq, batch=batch, profile=profile, budget=profile.hbm_bytes,
                 compile_devices=None, log=lambda *a: None)
    fit = [c for c in res["candidates"] if c["fits"]]
    # the best and candidates spread over the ranking (the top few predict within a few per cent of each other:
    # their order is noise on this machine), each compiled and predicted from its program's collectives
    picks = [fit[i] for i in sorted(set(np.linspace(0, len(fit) - 1, top).round().astype(int).tolist()))]
    base = Workload.of_config(cfg, global_batch=batch, seq_len=seq)
    for c in picks:
        rep, peak, _ = compile_candidate(c, cfg, seq, batch, devices)
        w = dataclasses.replace(base, remat=c["remat"], accumulation=c["accumulation"])
        c["step_s"] = predict(w, traffic_of_report(rep), profile, c["mesh"], strategy=c["strategy"],
                              state_bytes=rep.model_state_bytes["measured"]["total"]).step_s
    cands = picks
    print(f"plan search: {name} (seq {seq}, global batch {batch}) on {len(devices)} emulated devices, cpu profile: "
          f"{res['considered']} candidates, {len(fit)} fit; {len(cands)} of them across the ranking compiled and run for real "
          f"({rounds} rounds x {steps} steps, the order rotated each round)")
    runners = [_run_candidate(c, cfg, seq, batch, devices) for c in cands]
    for r in runners:
        r(2)  # warm-up: the compile and the first steps
    per_round = []
    for k in range(rounds):
        order = [(i + k) % len(runners) for i in range(len(runners))]
        got = {i: float(np.median(runners[i](steps))) for i in order}
        per_round.append([got[i] for i in range(len(runners))])
    measured = np.median(np.array(per_round), axis=0)
    predicted = [c["step_s"] for c in cands]
    rho = spearman(predicted, measured)
    lines = [f"{'candidate':<44} {'predicted s':>11} {'measured s':>10} {'ratio':>6}"]
    rows = []
    for c, p, m in zip(cands, predicted, measured):
        lines.append(f"{describe(c):<44} {p:>11.4f} {m:>10.4f} {m / p:>6.2f}")
        rows.append({"candidate": describe(c), "mesh": c["mesh"], "strategy": c["strategy"], "remat": c["remat"],
                     "accumulation": c["accumulation"], "predicted_s": p, "measured_s": float(m), "ratio": float(m / p)})
    lines.append(f"Spearman rank correlation (predicted vs measured step time): {rho:.2f}; measured / predicted median "
                 f"{np.median(measured / np.array(predicted)):.2f}")
    print("\n".join(lines))
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "planned.json").write_text(json.dumps({"model": name, "seq": seq, "batch": batch, "rounds": rounds, "steps": steps,
                                                   "rows": rows, "spearman": rho, "per_round_s": per_round,
                                                   "wall_s": time.perf_counter() - t0}, indent=1) + "\n")
    print(f"wrote {path / 'planned.json'} in {time.perf_counter() - t0:.0f} s")
    return 0

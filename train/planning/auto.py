"""``python -m train --auto``: train with the configuration the plan search finds best for the devices present.

:func:`take_auto` takes ``--auto`` out of the flags (refusing ``--mesh`` / ``--strategy`` / ``--expert`` ... beside it);
:func:`choose` runs :func:`train.planning.search.search` for the run's model, sequence length, global
batch and device count on the ``cpu`` profile (this machine, calibrated: its memory per device is the
budget), compiles the best finalists on the emulated devices and writes the choice into the
:class:`train.config.Config` (``mesh.shape``, ``mesh.context``, ``mesh.expert``, ``mesh.strategy``, ``training.remat``,
``training.grad_accum``): ``OUT/config.toml`` records it, and ``summary.json`` under ``auto`` the
predicted and the measured (median) ``step_s`` (:func:`auto_summary`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["REFUSED", "auto_summary", "choose", "take_auto"]

REFUSED = ("--mesh", "--mesh.shape", "--strategy", "--mesh.strategy", "--zero-stage", "--mesh.zero_stage", "--tensor",
           "--mesh.tensor", "--context", "--mesh.context", "--expert", "--mesh.expert", "--remat", "--training.remat", "--grad-accum",
           "--training.grad_accum")
"""Flags ``--auto`` chooses itself: given beside it, refused."""


def take_auto(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--auto``, and whether it was there.

    Raises:
      ValueError: ``--auto`` with a flag it chooses itself (:data:`REFUSED`), naming that flag."""
    if "--auto" not in argv:
        return argv, False
    given = [a.split("=")[0] for a in argv if a.split("=")[0] in REFUSED]
    if given:
        raise ValueError(f"{given[0]}: --auto chooses the mesh, strategy, remat and accumulation itself; leave {given[0]} out "
                         "(or leave --auto out to set them)")
    return [a for a in argv if a != "--auto"], True


def choose(run, devices, *, finalists: int = 2, log=print) -> dict:
    """Search the best configuration of ``run`` (a :class:`train.config.Config`) on ``devices`` (the run's
    devices) and set it in ``run``; returns what ``summary.json`` records under ``auto``.

    Raises:
      ValueError: a key ``--auto`` cannot search with (an unknown preset; ``mesh.shape`` / ``mesh.strategy``
        set by a config file), or no configuration fits (the message says what would)."""
    from train.model import MODEL_PRESETS, PLAN_PRESETS
    from train.planning.profiles import load_profile
    from train.planning.search import describe, search, what_would_fit

    if run.model.preset not in MODEL_PRESETS and run.model.preset not in PLAN_PRESETS:
        raise ValueError(f"model.preset {run.model.preset!r}: choose one of {', '.join([*MODEL_PRESETS, *PLAN_PRESETS])}")
    for key, value in (("mesh.shape", run.mesh.shape), ("mesh.strategy", run.mesh.strategy), ("mesh.zero_stage", run.mesh.zero_stage)):
        if value is not None:
            raise ValueError(f"{key} = {value!r} (from the config file): --auto chooses it; unset it or leave --auto out")
    cfg = run.model_config()  # the model python -m train builds (train.job.validate)
    profile = load_profile("cpu")
    n, seq, batch = len(devices), run.model.seq_len, run.training.batch_size
    result = search(cfg, model=run.model.preset, devices=n, seq=seq, batch=batch, profile=profile, budget=profile.hbm_bytes,
                    compile_devices=devices, finalists=finalists, log=lambda *a: None)
    best = result["candidates"][0]
    if not best["fits"]:
        from train.planning.cost import Workload

        psi = Workload.of_config(cfg, global_batch=1).psi
        raise ValueError(f"--auto: no configuration of {run.model.preset} fits {n} devices of {profile.hbm_bytes / 1e9:.2f} GB; "
                         "what would: " + "; ".join(what_would_fit(cfg, devices=n, seq=seq, batch=batch, budget=profile.hbm_bytes,
                                                                    psi=psi, activation_bytes=4)))
    m = best["mesh"]
    run.mesh.shape = f"{m['replica']}x{m['shard']}" + (f"x{m['tensor']}" if m["tensor"] > 1 else "")
    run.mesh.tensor = None
    run.mesh.context = m["context"] if m["context"] > 1 else None
    run.mesh.expert = m["expert"] if m.get("expert", 1) > 1 else None
    run.mesh.strategy = best["strategy"]
    run.training.remat = best["remat"]
    run.training.grad_accum = best["accumulation"]
    log(f"--auto: {describe(best)} (of {result['considered']} candidates, {result['pruned']} pruned by formula, "
        f"{result['compiled']} compiled): predicted {best['step_s']:.3g} s per step on the cpu profile, "
        f"{best['memory_bytes'] / 1e9:.3f} GB per device")
    keep = ("mesh", "strategy", "remat", "micro_batch", "accumulation", "memory_bytes", "compiled", "step_s",
            "tokens_per_s_per_device", "mfu", "bottleneck")
    return {"profile": profile.name, "choice": {k: best[k] for k in keep}, "predicted_step_s": best["step_s"],
            "considered": result["considered"], "pruned": result["pruned"], "compiled": result["compiled"]}


def auto_summary(auto: dict | None, records: list) -> dict:
    """``summary.json``'s ``auto``: the choice, ``predicted_step_s`` and ``measured_step_s`` (the median
    ``step_time_s`` of the steps after the first), ``ratio`` measured / predicted; ``{}`` without ``--auto``."""
    if not auto:
        return {}
    times = [r["step_time_s"] for r in records if "step_time_s" in r][1:]
    measured = float(np.median(times)) if times else None
    return {"auto": {**auto, "measured_step_s": measured,
                     "ratio": None if measured is None else measured / auto["predicted_step_s"]}}

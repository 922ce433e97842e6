"""The plan search: the fastest configuration that fits (``python -m train.plan --search``, ``python -m train --auto``).

Three stages (docs/planning.md, "The search"):

1. **enumerate** (:func:`enumerate_candidates`): every mesh ``R x S x T x C`` of the devices (tensor
   ``T`` dividing the heads and key/value heads, at most a node; context ``C`` with the sequence
   dividing by ``2 C``; ``R * S`` dividing the global batch), the strategies (``NO_SHARD``,
   ``SHARD_OPT``, ``SHARD_GRAD_OP``, ``FULL_SHARD`` on ``R = 1``; the ``HYBRID_*`` ones on ``R > 1``:
   FULL_SHARD over ``R x S`` is FULL_SHARD over ``R * S``), the remat policies and the gradient
   accumulation (micro-batches of ``1, 2, 4, ...`` sequences per data group); for a mixture of experts
   also the ``expert`` axis ``X`` (``R x S x X``: ``X`` dividing the experts and the devices per node, so
   that an expert group's all-to-all stays inside a node as ``zshard.make_mesh`` requires; never with
   ``T`` or ``C``; only FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2: what zshard supports); and the
   quantized wire formats asked for (``--formats``: ``gather_format`` x ``reduce_format``, with ``error_feedback``
   when asked), where zshard takes them (:func:`train.planning.formats.format_pairs`);
2. **prune by formula** (:func:`memory_floor`, :func:`memory_estimate`,
   :func:`train.planning.cost.formula_traffic`): a candidate whose *floor* (the model state, the
   gradient shards and the block inputs every remat policy keeps: bytes the compiled program
   cannot hold less of) exceeds the device memory is out; the rest are ranked by the predicted step
   time from the formulas' collective bytes (:func:`train.planning.cost.predict`);
3. **compile the finalists** (:func:`compile_candidate`): the best few whose *estimate* (the floor
   plus the activations Korthikanti et al. 2022, arXiv 2205.05198, section 4 count per remat
   policy) fits are compiled ahead of time (XLA:GPU for a GPU target when the ``cuda12`` extra is
   installed, else emulated CPU devices): their memory is the compiled program's ``argument +
   output - alias + temp``, their time predicted from the program's own collectives.

:func:`search` returns the candidates ranked: compiled and fitting first (by predicted step time),
then those estimated to fit (not compiled), then those that do not fit, each with ``reason``.
"""

from __future__ import annotations

import dataclasses
import math
import time

from train.planning.cost import RESHARD, Workload, formula_traffic, predict, traffic_of_report
from train.planning.formats import Matrices, element_bytes, format_pairs, quant_hbm_bytes, shard_devices
from train.planning.profiles import Profile
from train.planning.single import train_command

__all__ = ["REMATS", "SEARCHED", "compile_candidate", "enumerate_candidates", "memory_estimate", "memory_floor", "rank", "search",
           "search_table", "what_would_fit", "wire"]

REMATS = ("none", "block", "dots", "offload")
SEARCHED = ("none", "block", "dots")
"""The remat policies searched by default: ``offload`` (the matmul outputs to host memory) is searched only when
asked (``--remat offload``): the cost model does not count host transfers, so it would look as fast as ``none``."""
FLAT = ("NO_SHARD", "SHARD_OPT", "SHARD_GRAD_OP", "FULL_SHARD")  # R = 1
HYBRID = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "HYBRID_SHARD_OPT")  # R > 1
WITH_EXPERT = ("SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")  # zshard's strategies with expert > 1
GB = 1e9


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(devices: int, cfg, seq: int, batch: int, *, max_tensor: int = 8, max_context: int = 8,
           devices_per_node: int = 8) -> list[dict]:
    """Mesh shapes ``{replica, shard, tensor, context[, expert]}`` of ``devices`` for ``batch`` sequences of ``seq``
    tokens: ``T`` divides the heads and key/value heads (``train.models.tensor_plan``'s rule), ``seq % 2C == 0``,
    ``R * S`` divides ``batch``. A mixture of experts (a config with ``n_experts``) gets ``expert`` on every mesh,
    and the meshes ``R x S x X`` (``T = C = 1``, ``X > 1`` dividing ``n_experts`` and ``devices_per_node``,
    ``R * S * X`` dividing ``batch``: ``train.models.expert_plan`` and ``zshard.make_mesh``'s rules)."""
    heads, kv = cfg.n_heads, getattr(cfg, "n_kv_heads", cfg.n_heads)
    experts = getattr(cfg, "n_experts", 0)
    out = []
    for x in _divisors(devices) if experts else ():
        if x == 1 or experts % x or devices_per_node % x or batch % devices:
            continue
        for r in _divisors(devices // x):
            out.append({"replica": r, "shard": devices // x // r, "tensor": 1, "context": 1, "expert": x})
    for t in _divisors(devices):
        if t > max_tensor or heads % t or kv % t:
            continue
        for c in _divisors(devices // t):
            if c > max_context or seq % (2 * c):
                continue
            data = devices // (t * c)
            if batch % data:
                continue
            for r in _divisors(data):
                out.append({"replica": r, "shard": data // r, "tensor": t, "context": c, **({"expert": 1} if experts else {})})
    return out


def enumerate_candidates(devices: int, cfg, seq: int, batch: int, remats=SEARCHED, max_accumulation: int = 16,
                         devices_per_node: int = 8, formats=(None,), error_feedback: bool = False) -> list[dict]:
    """Every candidate of the search space (this module's docstring, stage 1): dicts with ``mesh``,
    ``strategy``, ``remat``, ``micro_batch`` (sequences per data group per micro-batch), ``accumulation``,
    ``gather_format``, ``reduce_format`` (a ``zshard.Quant`` name, or ``None``) and ``error_feedback``: every pair of
    ``formats`` zshard takes on the candidate (:func:`train.planning.formats.format_pairs`)."""
    out = []
    for m in meshes(devices, cfg, seq, batch, devices_per_node=devices_per_node):
        x = m.get("expert", 1)
        strategies = [s for s in (FLAT if m["replica"] == 1 else HYBRID) if x == 1 or s in WITH_EXPERT]
        per = batch // (m["replica"] * m["shard"] * x)
        for k in (a for a in _divisors(per) if a <= max_accumulation and a & (a - 1) == 0):
            for s in strategies:
                if m["replica"] * m["shard"] * m["context"] * x == 1 and s != "NO_SHARD":
                    continue  # one data device: every strategy is NO_SHARD
                pairs = format_pairs({"mesh": m, "strategy": s}, formats, scan=getattr(cfg, "scan", False),
                                     error_feedback=error_feedback)
                for r in remats:
                    for g, q, ef in pairs:
                        out.append({"mesh": dict(m), "strategy": s, "remat": r, "micro_batch": per // k, "accumulation": k,
                                    "gather_format": g, "reduce_format": q, "error_feedback": ef})
    return out


def _shards(c: dict) -> tuple[int, int, int]:
    """Devices sharing (parameters, optimizer state, gradients) of one tensor slice (with an expert axis: the dense
    parameters shared by ``N X`` devices, the experts split ``X`` ways and shared by ``N``: ``N X`` for both)."""
    m, s = c["mesh"], c["strategy"]
    world = m["replica"] * m["shard"] * m["context"] * m.get("expert", 1)
    inner = m["shard"] * m["context"] * m.get("expert", 1)
    return {"NO_SHARD": (1, 1, 1), "SHARD_OPT": (1, world, 1), "SHARD_GRAD_OP": (world, world, world),
            "FULL_SHARD": (world, world, world), "HYBRID_SHARD": (inner, inner, inner),
            "HYBRID_SHARD_ZERO2": (inner, inner, inner), "HYBRID_SHARD_OPT": (inner, world, world)}[s]


def memory_floor(c: dict, cfg, psi: int, seq: int, *, master_bytes: int = 4, activation_bytes: int = 4,
                 expert_params: int = 0, feedback_params: float = 0) -> dict:
    """Bytes per device a candidate's compiled step cannot hold less of (ZeRO, arXiv 1910.02054, section 5.2;
    zshard.formulas.memory_formula): ``state`` = masters ``m Psi'/N_p`` + Adam's two moments ``2 m Psi'/N_o``,
    ``grads`` = ``m Psi'/N_g`` (``Psi' = Psi / T``; ``N_p``, ``N_o``, ``N_g`` the devices sharing each),
    ``inputs`` = the ``L`` block inputs ``L s b h e`` every remat policy but ``offload`` keeps (Korthikanti
    et al. 2022 section 4.3; ``s`` = seq / C, ``b`` the micro-batch). ``SHARD_GRAD_OP`` / ``HYBRID_SHARD_ZERO2``
    keep the gathered parameters from forward to backward: ``+ Psi' e``. With an expert axis ``X`` (``expert_params``
    ``Psi_E`` of ``Psi``: the routed experts) the state is sharded ``N X`` ways (:func:`_shards`) and the gathered
    parameters are the dense ones and an expert group's share: ``(Psi - Psi_E + Psi_E / X) e``. With error feedback
    (``c["error_feedback"]``) every device keeps an fp32 residual of each quantized matrix, unsharded: ``feedback``
    = ``4 Psi_q`` (``feedback_params`` = ``Psi_q``, :meth:`train.planning.formats.Matrices.quantized`).

    Returns ``{"state", "grads", "inputs", "gathered", "feedback", "total"}`` (bytes, floats)."""
    m = c["mesh"]
    p = psi / m["tensor"]
    n_p, n_o, n_g = _shards(c)
    state = master_bytes * p / n_p + 2 * master_bytes * p / n_o
    grads = master_bytes * p / n_g
    inputs = 0.0 if c["remat"] == "offload" else cfg.n_layers * (seq / m["context"]) * c["micro_batch"] * cfg.d_model * activation_bytes
    x = m.get("expert", 1)
    gathered = (p - expert_params + expert_params / x) * activation_bytes if c["strategy"] in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2") else 0.0
    feedback = 4.0 * feedback_params if c.get("error_feedback") else 0.0
    return {"state": state, "grads": grads, "inputs": inputs, "gathered": gathered, "feedback": feedback,
            "total": state + grads + inputs + gathered + feedback}


def memory_estimate(c: dict, cfg, psi: int, seq: int, *, master_bytes: int = 4, activation_bytes: int = 4,
                    expert_params: int = 0, feedback_params: float = 0) -> float:
    """The floor (:func:`memory_floor`) plus the activations a remat policy keeps, per layer (Korthikanti et al.
    2022, section 4.2.1, tensor parallelism without sequence parallelism, at ``e`` bytes per element):
    ``s b h (5 + 12/T) e + 2.5 a s S b e / T`` (``S`` the whole sequence; the scores are left out with a context
    axis under ``block`` / ``offload``: the tiled kernel keeps none); ``none``: all ``L`` layers; ``dots``: the matmul outputs, half of it; ``block`` / ``offload``:
    one layer (recomputed in backward); plus the head's logits and their gradient ``3 s b V e``. A mixture of
    experts adds per layer the rows its experts receive, ``X cap`` (``zshard.moe.capacity``, dropless, of the ``s b``
    tokens), each with its input and output ``2 h`` and its SwiGLU's ``3 d_expert`` elements."""
    m = c["mesh"]
    t, s, b = m["tensor"], seq / m["context"], c["micro_batch"]
    a, h, v = cfg.n_heads, cfg.d_model, cfg.vocab_size
    # the scores [a/T, s/C, s] of every query against every key: with a context axis the tiled kernel keeps none under
    # block remat, but dots and none save its matmul outputs, the tiles' scores included
    scores = 0 if m["context"] > 1 and c["remat"] in ("block", "offload") else 2.5 * a * s * seq * b * activation_bytes / t
    layer = s * b * h * (5 + 12 / t) * activation_bytes + scores
    if getattr(cfg, "n_experts", 0):
        from zshard.moe import capacity

        x = m.get("expert", 1)
        layer += x * capacity(int(s * b), cfg.top_k, x, cfg.n_experts) * (2 * h + 3 * cfg.d_expert) * activation_bytes
    layers = {"none": cfg.n_layers, "dots": cfg.n_layers / 2}.get(c["remat"], 1.0)
    head = 3 * s * b * v * activation_bytes / (t if v % t == 0 else 1)
    return memory_floor(c, cfg, psi, seq, master_bytes=master_bytes, activation_bytes=activation_bytes,
                        expert_params=expert_params, feedback_params=feedback_params)["total"] + \
        layers * layer + head


def _workload(c: dict, base: Workload) -> Workload:
    return dataclasses.replace(base, remat=c["remat"], accumulation=c["accumulation"])


def _formats(c: dict, block: int | None = 256) -> dict:
    """The candidate's formats as ``train_command``'s ``formats`` (``{}`` unquantized)."""
    if not (c.get("gather_format") or c.get("reduce_format")):
        return {}
    return {"gather_format": c.get("gather_format"), "reduce_format": c.get("reduce_format"),
            "error_feedback": c.get("error_feedback", False), "block": block}


def _fill(c: dict, pred, model: str, batch: int, seq: int, block: int | None = 256, mixed_precision=None) -> dict:
    c.update(step_s=pred.step_s, tokens_per_s_per_device=pred.tokens_per_s_per_device, mfu=pred.mfu,
             bottleneck=pred.bottleneck,
             command=train_command(model, c["mesh"], c["strategy"], batch, seq, c["remat"], c["accumulation"],
                                   formats=_formats(c, block), mixed_precision=mixed_precision))
    return c


def _quantized(c: dict) -> int:
    return bool(c.get("gather_format")) + bool(c.get("reduce_format")) + bool(c.get("error_feedback"))


def rank(cands: list[dict]) -> list[dict]:
    """Best first: compiled and fitting, then estimated to fit (not compiled), then not fitting; each by step time
    (at equal time the fewer quantized formats first: they change the numerics, docs/quantized.md)."""
    order = lambda c: (0 if c["fits"] and c["compiled"] else 1 if c["fits"] else 2, c["step_s"], _quantized(c))  # noqa: E731
    return sorted(cands, key=order)


def _traffic(c: dict, w: Workload, psi_q: float, e: int, block: int | None) -> tuple[list, float]:
    """The formulas' collectives of candidate ``c`` with its formats (the quantized share ``psi_q / Psi`` of the
    gathers and reductions at :func:`train.planning.formats.element_bytes`) and its quantize / dequantize HBM bytes."""
    share = min(psi_q / w.psi, 1.0) if c.get("gather_format") or c.get("reduce_format") else 0.0
    g = share * element_bytes(c.get("gather_format"), block, e) + (1 - share) * e if c.get("gather_format") else e
    red = (share, element_bytes(c["reduce_format"], block, 4)) if c.get("reduce_format") else (0.0, 0.0)
    traffic = formula_traffic(w, c["mesh"], c["strategy"], gather_bytes=g, activation_bytes=e, quantized_reduce=red)
    hbm = quant_hbm_bytes(psi_q / c["mesh"]["tensor"], gather=c.get("gather_format"), reduce=c.get("reduce_format"),
                          feedback=c.get("error_feedback", False), block=block, passes=2 if c["strategy"] in RESHARD else 1,
                          accumulation=c["accumulation"], activation_bytes=e)
    return traffic, hbm


def compile_candidate(c: dict, cfg, seq: int, batch: int, devices, *, mixed_precision=None, block: int | None = 256):
    """Compile candidate ``c`` ahead of time on ``devices`` (the first ``R*S*T*C`` are used), with its formats
    (``zshard.Quant(name, block=block)``) added to ``mixed_precision``; returns
    ``(zshard.Report, peak bytes per device = argument + output - alias + temp, seconds)``.

    Raises:
      ValueError: zshard refuses the configuration (its message)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import zshard
    from train.model import build_model, expert_plan, loss_for, tensor_plan

    m = c["mesh"]
    x = m.get("expert", 1)
    world = m["replica"] * m["shard"] * m["tensor"] * m["context"] * x
    mesh = zshard.make_mesh(m["replica"], m["shard"], tensor=m["tensor"], context=m["context"], expert=x, devices=list(devices)[:world])
    loss, has_aux = loss_for(cfg)  # an MoE: cross-entropy + its router losses
    step = zshard.make_train_step(loss, has_aux=has_aux, sequence_axis=1 if m["context"] > 1 else None, remat=c["remat"],
                                  grad_accum=c["accumulation"])
    cfg = dataclasses.replace(cfg, seq_len=seq)
    if c.get("gather_format") or c.get("reduce_format"):
        q = {"gather_format": c.get("gather_format") and zshard.Quant(c["gather_format"], block=block),
             "reduce_format": c.get("reduce_format") and zshard.Quant(c["reduce_format"], block=block,
                                                                      error_feedback=c.get("error_feedback", False))}
        mixed_precision = dataclasses.replace(mixed_precision, **q) if mixed_precision else zshard.MixedPrecision(**q)
    state = zshard.init(lambda: build_model(cfg, nnx.Rngs(0)), optax.adamw(1e-4), mesh, strategy=c["strategy"], abstract=True,
                        mixed_precision=mixed_precision, tensor_parallel=tensor_plan(cfg, m["tensor"]) or None,
                        expert_parallel=expert_plan(cfg, x) or None)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    t0 = time.perf_counter()
    rep = zshard.report(step, state, (tokens, tokens))
    d = rep.per_device_bytes
    return rep, d["argument"] + d["output"] - d["alias"] + d["temp"], time.perf_counter() - t0


def search(cfg, *, model: str, devices: int, seq: int, batch: int, profile: Profile, budget: float, compile_devices=None,
           mixed_precision=None, remats=SEARCHED, finalists: int = 4, devices_per_node: int | None = None,
           formats=(None,), error_feedback: bool = False, block: int | None = 256, log=print) -> dict:
    """Search the configurations of ``model`` (config ``cfg``) on ``devices`` devices for a global ``batch`` of
    sequences of ``seq`` tokens; ``budget``: device memory, bytes; ``compile_devices``: the devices to compile the
    finalists for (``None``: compile nothing, formulas only); ``mixed_precision``: the
    ``zshard.MixedPrecision`` compiled (bf16 gathers and activations: 2 bytes in the formulas) and carried into
    each candidate's ``command`` (``--param-dtype`` ..., :func:`train.planning.single.train_command`); ``formats``: the
    wire formats searched (``None`` unquantized, ``"int8"``, ...: :func:`enumerate_candidates`), each quantized
    reduction with ``error_feedback`` when set, ``block`` elements per scale (``None``: tensorwise).

    Returns ``{"candidates": [...] ranked (:func:`rank`), "considered", "pruned", "compiled", "compile_s"}``.

    Raises:
      ValueError: no mesh of ``devices`` fits the model and batch (the message says why)."""
    dpn = devices_per_node or profile.devices_per_node
    cands = enumerate_candidates(devices, cfg, seq, batch, remats, devices_per_node=dpn, formats=formats,
                                 error_feedback=error_feedback)
    if not cands:
        raise ValueError(f"--devices {devices}: no mesh R x S x T x C of {devices} devices divides the global batch of {batch} "
                         f"sequences (R*S must divide it), the {cfg.n_heads} heads (T) and the sequence {seq} (2C)")
    base = Workload.of_config(cfg, global_batch=batch, seq_len=seq)
    psi, pe = base.psi, base.expert_params
    e = 2 if mixed_precision is not None else 4
    mats = Matrices.of_config(cfg) if any(formats) else Matrices(())
    psi_q = {}  # N x T -> elements quantized (a lower bound: Matrices.quantized)
    for c in cands:
        n = shard_devices(c) * c["mesh"]["tensor"]
        c["psi_q"] = psi_q.setdefault(n, mats.quantized(n, block)) if (c["gather_format"] or c["reduce_format"]) else 0
    # a format that would quantize no matrix (each under one block a device): zshard.init refuses it (check_plan)
    cands = [c for c in cands if c["psi_q"] or not (c["gather_format"] or c["reduce_format"])]
    for c in cands:
        q = c.pop("psi_q")
        floor = memory_floor(c, cfg, psi, seq, activation_bytes=e, expert_params=pe, feedback_params=q)
        est = memory_estimate(c, cfg, psi, seq, activation_bytes=e, expert_params=pe, feedback_params=q)
        w = _workload(c, base)
        traffic, hbm = _traffic(c, w, q, e, block)
        c["quant_bytes"] = hbm
        _fill(c, predict(w, traffic, profile, c["mesh"], strategy=c["strategy"], devices_per_node=devices_per_node,
                         quant_bytes=hbm), model, batch, seq, block, mixed_precision)
        c.update(floor_bytes=floor["total"], memory_bytes=int(est), compiled=False, fits=est <= budget,
                 pruned=floor["total"] > budget, reason=None)
        if c["pruned"]:
            c["reason"] = (f"formula floor {floor['total'] / GB:.1f} GB > {budget / GB:g} GB (state {floor['state'] / GB:.1f}, "
                           f"gradients {floor['grads'] / GB:.1f}, block inputs {floor['inputs'] / GB:.1f}"
                           + (f", gathered parameters {floor['gathered'] / GB:.1f}" if floor["gathered"] else "")
                           + (f", error-feedback residuals {floor['feedback'] / GB:.1f}" if floor["feedback"] else "") + " GB)")
        elif not c["fits"]:
            c["reason"] = f"estimated {est / GB:.1f} GB > {budget / GB:g} GB (not compiled)"
    alive = sorted((c for c in cands if not c["pruned"]), key=lambda c: (not c["fits"], c["step_s"], _quantized(c)))
    compile_s, compiled = 0.0, 0
    if compile_devices is not None:
        for c in alive[:finalists]:
            try:
                rep, peak, s = compile_candidate(c, cfg, seq, batch, compile_devices, mixed_precision=mixed_precision,
                                                 block=block)
            except ValueError as err:
                c.update(fits=False, compiled=False, reason=f"zshard refused it: {err}")
                continue
            compile_s += s
            compiled += 1
            w = _workload(c, base)
            pred = predict(w, traffic_of_report(rep), profile, c["mesh"], strategy=c["strategy"],
                           state_bytes=rep.model_state_bytes["measured"]["total"], devices_per_node=devices_per_node,
                           quant_bytes=c["quant_bytes"])
            _fill(c, pred, model, batch, seq, block, mixed_precision)
            fits = peak <= budget
            c.update(memory_bytes=int(peak), compiled=True, fits=fits,
                     reason=None if fits else f"compiled peak {peak / GB:.2f} GB > {budget / GB:g} GB")
            log(f"compiled {describe(c)} in {s:.0f} s: {peak / GB:.2f} GB, predicted {c['step_s']:.3g} s per step")
    return {"candidates": rank(cands), "considered": len(cands), "pruned": sum(c["pruned"] for c in cands),
            "compiled": compiled, "compile_s": compile_s}


def _shape(m: dict) -> str:
    """``RxSxTxC``, or ``RxSxTxC/eX`` with an expert axis ``X > 1``."""
    return f"{m['replica']}x{m['shard']}x{m['tensor']}x{m['context']}" + (f"/e{m['expert']}" if m.get("expert", 1) > 1 else "")


def describe(c: dict) -> str:
    """``RxSxTxC[/eX] STRATEGY remat=... b=... k=...[ wire=G/R]``: one candidate in a few characters."""
    m = c["mesh"]
    return (f"{_shape(m)} {c['strategy']} remat={c['remat']} "
            f"b={c['micro_batch']} k={c['accumulation']}" + (f" wire={wire(c)}" if _quantized(c) else ""))


def wire(c: dict) -> str:
    """The formats of gather and reduction, ``G/R`` (``-`` unquantized, ``e4m3`` / ``e5m2`` the fp8 ones,
    ``+ef`` error feedback): ``-/-``, ``int8/int4+ef``."""
    short = lambda f: {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}.get(f, f or "-")  # noqa: E731
    return f"{short(c.get('gather_format'))}/{short(c.get('reduce_format'))}" + ("+ef" if c.get("error_feedback") else "")


def search_table(result: dict, rows: int = 10) -> str:
    """The ranked table: configuration (mesh R x S x T x C, ``/eX`` with an expert axis; the wire formats
    gather/reduce, :func:`wire`), memory per device (compiled, or ``~`` the estimate), predicted step time,
    tokens/s per device, MFU, bottleneck, and why it does not fit."""
    head = f"{'#':>3} {'mesh RxSxTxC':<13} {'strategy':<19} {'remat':<7} {'b':>3} {'k':>3} {'wire g/r':<12} {'GB/dev':>8} {'step s':>9} " \
           f"{'tok/s/dev':>10} {'MFU':>6} {'bottleneck':<10} note"
    lines = [head, "-" * len(head)]
    for i, c in enumerate(result["candidates"][:rows], 1):
        m = c["mesh"]
        mem = f"{c['memory_bytes'] / GB:.2f}" if c["compiled"] else f"~{c['memory_bytes'] / GB:.1f}"
        note = c["reason"] or ("compiled, fits" if c["compiled"] else "estimate fits (not compiled)")
        lines.append(f"{i:>3} {_shape(m):<13} {c['strategy']:<19} {c['remat']:<7} "
                     f"{c['micro_batch']:>3} {c['accumulation']:>3} {wire(c):<12} {mem:>8} {c['step_s']:>9.3g} "
                     f"{c['tokens_per_s_per_device']:>10,.0f} {c['mfu']:>6.1%} {c['bottleneck']:<10} {note}")
    return "\n".join(lines)


def what_would_fit(cfg, *, devices: int, seq: int, batch: int, budget: float, psi: int, activation_bytes: int) -> list[str]:
    """When nothing fits: the smallest changes whose formula floor fits (more devices, a shorter sequence, the
    optimizer state offloaded to the host), each one line."""
    def best_floor(n, s, offload=False):
        cands = enumerate_candidates(n, cfg, s, batch, ("offload",) if offload else ("block",))
        vals = []
        for c in cands:
            f = memory_floor(c, cfg, psi, s, activation_bytes=activation_bytes)
            moments = 2 * 4 * psi / c["mesh"]["tensor"] / _shards(c)[1]  # Adam's two fp32 moments on the device
            vals.append(f["total"] - (moments if offload else 0))
        return min(vals, default=math.inf)

    out = []
    for n in (devices * 2 ** i for i in range(1, 7)):
        if best_floor(n, seq) <= budget:
            out.append(f"--devices {n} (a formula floor of {best_floor(n, seq) / GB:.1f} GB per device)")
            break
    s = seq // 2
    while s >= 256:
        if best_floor(devices, s) <= budget:
            out.append(f"--seq-len {s} (a formula floor of {best_floor(devices, s) / GB:.1f} GB per device)")
            break
        s //= 2
    off = best_floor(devices, seq, offload=True)
    if off <= budget:
        out.append(f"--offload optimizer with --remat offload (the Adam moments and the saved matmul outputs in host memory: "
                   f"{off / GB:.1f} GB per device on the device)")
    return out or [f"nothing simple: even {devices * 64} devices or a 256-token sequence leave the formula floor above "
                   f"{budget / GB:g} GB"]

"""The expert-parallel plan of the main job's models (``train.models.expert_plan``) and the MoE
plan presets (``PLAN_PRESETS["qwen3-30b-a3b"]``, ``["deepseek-v3"]``).

1. For the Qwen3-MoE and Mixtral configs of ``from_hf`` (tests/fixtures/hf/) and the MoE
   presets, scanned or not, the plan's globs match exactly the expert weights among the
   model's dotted parameter paths (``zshard.path_str``, matched with ``fnmatch`` as
   ``zshard.init(..., expert_parallel=)`` matches them), and their dimension 0 within one
   layer is the expert count; the router stays dense.
2. ``{}`` for ``X = 1`` (dense models too); a ValueError naming the experts when ``X`` does
   not divide them, and naming the fix for a model without experts.
3. The presets' parameter counts against the published totals (abstract models: nothing is
   allocated). Qwen3-30B-A3B is exact in shape: within 0.5% of 30.5e9 total and 2% of 3.3e9
   active (measured 30.53e9, 3.35e9: the published figures are rounded to 0.1e9, 0.2% and 1.5%,
   and whether the input embedding counts as active differs between reports). DeepSeek-V3 is approximated (its
   docstring lists how: MLA as GQA, dense first layers as MoE layers, no shared expert): within
   6% of 671e9 total / 37e9 active (measured +5.0% / +4.5%).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math

import pytest
from flax import nnx

import zshard
from test_hf import FIXTURES
from train.model import PLAN_PRESETS, LlamaConfig, build_model, expert_plan, from_hf, tensor_plan


def _params(cfg) -> dict[str, tuple]:
    """``{dotted path: shape}`` of the model of ``cfg``, built abstractly."""
    model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
    return {zshard.path_str(p): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _configs():
    out = {n: from_hf(FIXTURES / n)[0].config for n in ("qwen3_moe", "mixtral")}
    out.update({f"{n}-scan": dataclasses.replace(c, scan=True, layer_types=None) for n, c in list(out.items())
                if len(set(c.types())) == 1})
    small = {"qwen3-30b-a3b": dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_expert=32, vocab_size=256),
             "deepseek-v3": dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_expert=32, vocab_size=256)}
    out.update({n: dataclasses.replace(PLAN_PRESETS[n], **kw) for n, kw in small.items()})  # the presets' structure, small
    return out


CONFIGS = _configs()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_globs_match_the_expert_weights(name):
    cfg = CONFIGS[name]
    params = _params(cfg)
    plan = expert_plan(cfg, 2)
    assert expert_plan(cfg, 1) == {}
    hits = {glob: sorted(p for p in params if fnmatch.fnmatchcase(p, glob)) for glob in plan}
    layers = 1 if cfg.scan else cfg.n_layers
    for glob, dim in plan.items():
        assert len(hits[glob]) == layers, (glob, hits[glob])
        for p in hits[glob]:
            shape = params[p][1:] if cfg.scan else params[p]  # within one layer
            assert shape[dim] == cfg.n_experts, (p, params[p])
    matched = {p for ps in hits.values() for p in ps}
    assert matched == {p for p in params if p.rsplit(".", 1)[-1] in ("w_gate_up", "w_down")}
    assert not any("router" in p for p in matched)  # the router [C, E] is dense


def test_errors_name_the_experts_and_the_fix():
    moe = CONFIGS["qwen3_moe"]  # 4 experts
    assert expert_plan(moe, 4)
    with pytest.raises(ValueError, match=r"expert=3 does not divide the experts \(n_experts = 4\).*use expert = 2, 4"):
        expert_plan(moe, 3)
    with pytest.raises(ValueError, match=r"expert=8 does not divide the experts \(n_experts = 4\)"):
        expert_plan(moe, 8)
    dense = from_hf(FIXTURES / "llama")[0].config
    assert expert_plan(dense, 1) == {}
    with pytest.raises(ValueError, match=r"expert=2: LlamaConfig has no experts.*use expert=1"):
        expert_plan(dense, 2)
    with pytest.raises(ValueError, match="has no experts"):
        expert_plan(PLAN_PRESETS["gpt2-124m"], 2)
    with pytest.raises(ValueError, match=">= 1"):
        expert_plan(moe, 0)


@pytest.mark.parametrize("name,total,active,tol,tol_active", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.005, 0.02),
    ("deepseek-v3", 671e9, 37e9, 0.06, 0.06),
])
def test_preset_parameter_counts(name, total, active, tol, tol_active):
    cfg = PLAN_PRESETS[name]
    params = _params(cfg)
    n = sum(math.prod(s) for s in params.values())
    experts = sum(math.prod(s) for p, s in params.items() if p.endswith(("w_gate_up", "w_down")))
    n_active = n - experts * (cfg.n_experts - cfg.top_k) / cfg.n_experts  # per token: top_k of the n_experts
    assert abs(n / total - 1) < tol, (name, n / 1e9)
    assert abs(n_active / active - 1) < tol_active, (name, n_active / 1e9)
    assert isinstance(cfg, LlamaConfig) and cfg.scan
    assert expert_plan(cfg, 8) and tensor_plan(cfg, 4)  # both plans: 128 / 256 experts over 8, 4 / 8 kv heads over 4

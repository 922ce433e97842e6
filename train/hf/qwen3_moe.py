"""Hugging Face ``qwen3_moe`` <-> :class:`train.models.Qwen3Moe`.

Tensor map (ours <- Hugging Face, ``model.`` prefix): the attention, norms and ends as for
Qwen3 (train/hf/llama.py), and per layer the router and the experts, stacked ``[E, ...]``::

    layers.i.mlp.gate.weight [E, C]                          blocks.i.moe.router.kernel = .T  [C, E]
    layers.i.mlp.experts.e.{gate,up}_proj.weight [F, C]      blocks.i.moe.w_gate_up[e] = concat(gate.T, up.T, axis=1)  [E, C, 2F]
    layers.i.mlp.experts.e.down_proj.weight [C, F]           blocks.i.moe.w_down[e] = down.T  [E, F, C]

(per-expert tensors, as the Hub's checkpoints and ``save_pretrained`` store them; each is
read once and the layer's ``[E, ...]`` array is built on the host, one parameter at a time).
A checkpoint holding transformers' fused in-memory layout instead
(``layers.i.mlp.experts.gate_up_proj`` ``[E, 2F, C]``, ``...experts.down_proj`` ``[E, C, F]``)
loads too; :func:`train.hf.to_hf` writes the per-expert names.
"""

from __future__ import annotations

from train.hf.llama import block_tensors, decoder_config, decoder_fields, ends, hf_rope, parse_rope
from train.hf.files import ConfigReader, Map
from train.models.moe import MoEConfig

__all__ = ["MODEL_TYPES", "config", "tensors", "hf_config"]

MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM"}


def config(r: ConfigReader) -> MoEConfig:
    r.refuse(r.get("hidden_act", "silu") != "silu", f"hidden_act={r.get('hidden_act')!r}")
    r.refuse(r.get("attention_bias", False), "attention_bias=true")
    r.refuse(int(r.get("decoder_sparse_step", 1)) != 1, f"decoder_sparse_step={r.get('decoder_sparse_step')} (dense layers between MoE layers)")
    r.refuse(bool(r.get("mlp_only_layers", [])), f"mlp_only_layers={r.get('mlp_only_layers')} (dense layers)")
    experts = r.get("num_experts", r.get("num_local_experts"))
    if experts is None:
        r.need("num_experts")
    theta, scaling = parse_rope(r)
    window = r.get("sliding_window") if r.get("use_sliding_window", False) else None
    return MoEConfig(
        **decoder_fields(r), rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(r.get("tie_word_embeddings", False)),
        sliding_window=window, n_experts=int(experts), top_k=int(r.need("num_experts_per_tok")),
        d_expert=int(r.need("moe_intermediate_size")), norm_topk_prob=bool(r.get("norm_topk_prob", False)),
        router_aux_coef=float(r.get("router_aux_loss_coef", 0.001)), router_z_loss_coef=float(r.get("router_z_loss_coef", 0.0)),
    )


def tensors(mc: MoEConfig, names=None) -> dict[str, Map]:
    """``names``: the checkpoint's tensor names (``None`` when writing): the fused expert
    layout is used where the checkpoint has it."""
    out = ends(mc)
    for i in range(mc.n_layers):
        b, L = f"blocks.{i}.", f"model.layers.{i}."
        out.update(block_tensors(mc, i))
        x = L + "mlp.experts."
        if names is not None and x + "gate_up_proj" in names:  # fused: [E, 2F, C] and [E, C, F]
            out[b + "moe.router.kernel"] = Map((L + "mlp.gate.weight",), transpose=True)
            out[b + "moe.w_gate_up"] = Map((x + "gate_up_proj",), transpose=True)
            out[b + "moe.w_down"] = Map((x + "down_proj",), transpose=True)
            continue
        out.update(expert_tensors(mc, b, L + "mlp.gate.weight", lambda e, part: f"{x}{e}.{part}_proj.weight"))
    return out


def expert_tensors(mc: MoEConfig, b: str, router: str, expert) -> dict[str, Map]:
    """The MoE layer ``b`` (``"blocks.{i}."``) from one Hugging Face tensor per expert: the router
    ``[E, C]`` (``router``, transposed to ``[C, E]``), ``w_gate_up`` ``[E, C, 2F]`` (each expert's gate
    then up ``[F, C]``, transposed) and ``w_down`` ``[E, F, C]`` (each expert's down ``[C, F]``);
    ``expert(e, part)``: the name of expert ``e``'s ``part`` in ``("gate", "up", "down")``."""
    E = mc.n_experts
    return {
        b + "moe.router.kernel": Map((router,), transpose=True),
        b + "moe.w_gate_up": Map(tuple(expert(e, p) for e in range(E) for p in ("gate", "up")), transpose=True, experts=E),
        b + "moe.w_down": Map(tuple(expert(e, "down") for e in range(E)), transpose=True, experts=E),
    }


def hf_config(mc: MoEConfig) -> dict:
    out = decoder_config(mc)
    out.update({
        "architectures": [MODEL_TYPES["qwen3_moe"]],
        "rope_parameters": hf_rope(mc.rope_theta, mc.rope_scaling), "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": mc.sliding_window is not None, "sliding_window": mc.sliding_window,
        "num_experts": mc.n_experts, "num_experts_per_tok": mc.top_k, "moe_intermediate_size": mc.d_expert,
        "norm_topk_prob": mc.norm_topk_prob, "router_aux_loss_coef": mc.router_aux_coef, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "output_router_logits": False,
    })
    if mc.router_z_loss_coef:  # not a Qwen3-MoE key (transformers keeps it as an attribute); ours reads it back
        out["router_z_loss_coef"] = mc.router_z_loss_coef
    return out

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

from train.hf.llama import attention_tensors, decoder_config, decoder_fields, ends, hf_rope, parse_rope
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
        out[b + "attn_norm.scale"] = Map((L + "input_layernorm.weight",))
        out.update(attention_tensors(mc, i, b + "attn.", L + "self_attn."))
        out[b + "mlp_norm.scale"] = Map((L + "post_attention_layernorm.weight",))
        out[b + "moe.router.kernel"] = Map((L + "mlp.gate.weight",), transpose=True)
        x = L + "mlp.experts."
        if names is not None and x + "gate_up_proj" in names:  # fused: [E, 2F, C] and [E, C, F]
            out[b + "moe.w_gate_up"] = Map((x + "gate_up_proj",), transpose=True)
            out[b + "moe.w_down"] = Map((x + "down_proj",), transpose=True)
            continue
        gate_up = tuple(f"{x}{e}.{p}_proj.weight" for e in range(mc.n_experts) for p in ("gate", "up"))
        out[b + "moe.w_gate_up"] = Map(gate_up, transpose=True, experts=mc.n_experts)
        out[b + "moe.w_down"] = Map(tuple(f"{x}{e}.down_proj.weight" for e in range(mc.n_experts)), transpose=True,
                                    experts=mc.n_experts)
    return out


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

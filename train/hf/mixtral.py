"""Hugging Face ``mixtral`` <-> :class:`train.models.Qwen3Moe` (a :class:`~train.models.MoEConfig`
with ``family="mixtral"``: no q/k norm, normalised top-k softmax routing).

Mixtral (Jiang et al. 2024, arXiv 2401.04088 section 2.1) is the Mistral decoder whose MLP is
``n_experts`` SwiGLU experts, each token summed over its ``top_k`` experts with the softmax of
their router logits taken over the chosen ones (the same as the softmax over all experts
renormalised over the top k: ``norm_topk_prob=True``; Hugging Face's ``MixtralSparseMoeBlock``).

Tensor map (ours <- Hugging Face, ``model.`` prefix): attention, norms and ends as for Llama
(train/hf/llama.py); per layer the router and the experts, stacked ``[E, ...]``::

    layers.i.block_sparse_moe.gate.weight [E, C]            blocks.i.moe.router.kernel = .T  [C, E]
    layers.i.block_sparse_moe.experts.e.w1.weight [F, C]    blocks.i.moe.w_gate_up[e] = concat(w1.T, w3.T, axis=1)  [E, C, 2F]
    layers.i.block_sparse_moe.experts.e.w3.weight [F, C]    (w1: the gate, w3: the up projection)
    layers.i.block_sparse_moe.experts.e.w2.weight [C, F]    blocks.i.moe.w_down[e] = w2.T  [E, F, C]

Config (``config.json`` -> :class:`MoEConfig`): ``num_local_experts`` -> ``n_experts``,
``num_experts_per_tok`` -> ``top_k``, ``intermediate_size`` -> ``d_expert`` (each expert's
width; Mixtral has no dense MLP), ``router_aux_loss_coef`` -> ``router_aux_coef``,
``sliding_window`` (every layer, as Mistral; ``null``: none), ``rope_theta``; ``router_z_loss_coef``
(not a Mixtral key; default 0) -> ``router_z_loss_coef``.
``router_jitter_noise`` (multiplicative noise on the router input in training) must be 0.
"""

from __future__ import annotations

from train.hf.files import ConfigReader, Map
from train.hf.llama import block_tensors, decoder_config, decoder_fields, ends, hf_rope, parse_rope
from train.hf.qwen3_moe import expert_tensors
from train.models.moe import MoEConfig

__all__ = ["MODEL_TYPES", "config", "tensors", "hf_config"]

MODEL_TYPES = {"mixtral": "MixtralForCausalLM"}


def config(r: ConfigReader) -> MoEConfig:
    r.refuse(r.get("hidden_act", "silu") != "silu", f"hidden_act={r.get('hidden_act')!r}")
    r.refuse(float(r.get("router_jitter_noise", 0.0)) != 0.0,
             f"router_jitter_noise={r.get('router_jitter_noise')} (noise on the router's input in training)")
    theta, scaling = parse_rope(r)
    fields = decoder_fields(r)
    return MoEConfig(
        **fields, rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(r.get("tie_word_embeddings", False)),
        qk_norm=False, sliding_window=r.get("sliding_window"), n_experts=int(r.need("num_local_experts")),
        top_k=int(r.need("num_experts_per_tok")), d_expert=int(fields["d_ff"]), norm_topk_prob=True,
        router_aux_coef=float(r.get("router_aux_loss_coef", 0.001)), router_z_loss_coef=float(r.get("router_z_loss_coef", 0.0)),
    )


def tensors(mc: MoEConfig, names=None) -> dict[str, Map]:
    """``names`` (the checkpoint's tensor names) is not needed: one layout."""
    del names
    out = ends(mc)
    for i in range(mc.n_layers):
        x = f"model.layers.{i}.block_sparse_moe."
        out.update(block_tensors(mc, i))
        out.update(expert_tensors(mc, f"blocks.{i}.", x + "gate.weight", lambda e, part: f"{x}experts.{e}.{W[part]}.weight"))
    return out


W = {"gate": "w1", "up": "w3", "down": "w2"}  # Mixtral's names of each expert's SwiGLU weights


def hf_config(mc: MoEConfig) -> dict:
    """``config.json`` of ``mc``.

    Raises:
      ValueError: ``mc`` is not Mixtral's architecture (q/k norms, or top-k weights not renormalised).
    """
    if mc.qk_norm or not mc.norm_topk_prob:
        raise ValueError(f"to_hf: family 'mixtral' has no q/k norms and renormalises the top-k weights, but the config has "
                         f"qk_norm={mc.qk_norm}, norm_topk_prob={mc.norm_topk_prob}; set family='qwen3_moe' to export it")
    out = decoder_config(mc)
    out.update({
        "architectures": [MODEL_TYPES["mixtral"]],
        "intermediate_size": mc.d_expert, "rope_parameters": hf_rope(mc.rope_theta, mc.rope_scaling), "hidden_act": "silu",
        "sliding_window": mc.sliding_window, "num_local_experts": mc.n_experts, "num_experts_per_tok": mc.top_k,
        "router_aux_loss_coef": mc.router_aux_coef, "router_jitter_noise": 0.0, "output_router_logits": False,
    })
    if mc.router_z_loss_coef:  # not a Mixtral key (transformers keeps it as an attribute); ours reads it back
        out["router_z_loss_coef"] = mc.router_z_loss_coef
    return out

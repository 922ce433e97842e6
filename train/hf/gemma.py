"""Hugging Face ``gemma2`` and ``gemma3_text`` <-> :class:`train.models.Gemma`.

Tensor map (ours <- Hugging Face, ``model.`` prefix): the attention and MLP as for Llama
(train/hf/llama.py; ``q_norm`` / ``k_norm`` for Gemma 3), and the four norms of a block::

    layers.i.input_layernorm.weight              blocks.i.attn_norm.scale
    layers.i.post_attention_layernorm.weight     blocks.i.post_attn_norm.scale
    layers.i.pre_feedforward_layernorm.weight    blocks.i.mlp_norm.scale
    layers.i.post_feedforward_layernorm.weight   blocks.i.post_mlp_norm.scale
    embed_tokens.weight, norm.weight             embed.embedding, norm.scale

Every norm weight is stored as Gemma stores it (applied as ``1 + w``). The output head is the
embedding (``tie_word_embeddings``, Gemma's default); an untied ``lm_head.weight`` maps to
``head.kernel``. Gemma 3 as ``model_type: gemma3`` is the multimodal model (a vision tower and
``language_model.`` names): refused, only its text model ``gemma3_text`` (``Gemma3ForCausalLM``) loads.
"""

from __future__ import annotations

from train.hf.llama import attention_tensors, decoder_config, decoder_fields, ends, hf_layer_types, hf_rope, layer_types, parse_rope
from train.hf.files import ConfigReader, Map
from train.models.gemma import GemmaConfig

__all__ = ["MODEL_TYPES", "config", "tensors", "hf_config"]

MODEL_TYPES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def config(r: ConfigReader) -> GemmaConfig:
    gemma3 = r.family == "gemma3_text"
    act = r.get("hidden_activation", r.get("hidden_act", "gelu_pytorch_tanh"))
    r.refuse(act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"), f"hidden_activation={act!r}")
    r.refuse(r.get("attention_bias", False), "attention_bias=true")
    r.refuse(r.get("use_bidirectional_attention", False), "use_bidirectional_attention=true")
    fields = decoder_fields(r)
    params = r.get("rope_parameters") or {}
    if gemma3 and "full_attention" in params:  # transformers >= 5: one rope dict per layer type
        theta, scaling = parse_rope(r, params["full_attention"])
        local, local_scaling = parse_rope(r, params.get("sliding_attention") or {"rope_theta": 10000.0})
        r.refuse(local_scaling is not None, "RoPE scaling on the sliding layers")
    else:
        theta, scaling = parse_rope(r)
        local = float(r.get("rope_local_base_freq", 10000.0)) if gemma3 else None
    window = r.get("sliding_window")
    every = int(r.get("sliding_window_pattern", r.get("_sliding_window_pattern", 6))) if gemma3 else 2
    types = layer_types(r, fields["n_layers"], window, lambda i: "sliding" if (i + 1) % every else "full")
    return GemmaConfig(
        **fields, rope_theta=theta, rope_scaling=scaling, local_rope_theta=local if window is not None else None,
        tie_embeddings=bool(r.get("tie_word_embeddings", True)), qk_norm=gemma3, sliding_window=window, layer_types=types,
        attn_softcap=r.get("attn_logit_softcapping"), final_softcap=r.get("final_logit_softcapping"),
        query_pre_attn_scalar=r.get("query_pre_attn_scalar"),
    )


def tensors(mc: GemmaConfig, names=None) -> dict[str, Map]:
    out = ends(mc)
    for i in range(mc.n_layers):
        b, L = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in [("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
                             ("mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm")]:
            out[f"{b}{ours}.scale"] = Map((f"{L}{theirs}.weight",))
        out.update(attention_tensors(mc, i, b + "attn.", L + "self_attn."))
        out[b + "mlp.w_gate_up.kernel"] = Map((L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), transpose=True, stack=2)
        out[b + "mlp.w_down.kernel"] = Map((L + "mlp.down_proj.weight",), transpose=True)
    return out


def hf_config(mc: GemmaConfig) -> dict:
    out = decoder_config(mc)
    full = hf_rope(mc.rope_theta, mc.rope_scaling)
    if mc.family == "gemma3_text":
        local = mc.local_rope_theta if mc.local_rope_theta is not None else mc.rope_theta
        rope = {"full_attention": full, "sliding_attention": hf_rope(local, None)}
    else:
        rope = full
    out.update({
        "rope_parameters": rope, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
        "query_pre_attn_scalar": mc.query_pre_attn_scalar, "sliding_window": mc.sliding_window,
        "layer_types": hf_layer_types(mc), "attn_logit_softcapping": mc.attn_softcap,
        "final_logit_softcapping": mc.final_softcap,
    })
    return out

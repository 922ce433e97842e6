"""Hugging Face ``llama`` (Llama 2 and 3), ``mistral``, ``qwen2`` and ``qwen3`` <-> :class:`train.models.Llama`.

Tensor map (ours <- Hugging Face, ``model.`` prefix; ``.T``: torch ``nn.Linear`` stores
``[out, in]``, ours ``[in, out]``)::

    embed_tokens.weight [V, C]                   embed.embedding
    layers.i.input_layernorm.weight              blocks.i.attn_norm.scale
    layers.i.self_attn.{q,k,v}_proj.weight       blocks.i.attn.wqkv.kernel [C, nkv, rep + 2, hd]: per kv head g,
                                                 its rep query heads, its key, its value (q.T, k.T, v.T)
    layers.i.self_attn.{q,k,v}_proj.bias (qwen2) blocks.i.attn.wqkv.bias [nkv, rep + 2, hd], the same order
    layers.i.self_attn.{q,k}_norm.weight (qwen3) blocks.i.attn.{q,k}_norm.scale  [hd]
    layers.i.self_attn.o_proj.weight             blocks.i.attn.wo.kernel = .T
    layers.i.post_attention_layernorm.weight     blocks.i.mlp_norm.scale
    layers.i.mlp.{gate,up}_proj.weight           blocks.i.mlp.w_gate_up.kernel = stack(gate.T, up.T)  [C, 2, F]
    layers.i.mlp.down_proj.weight                blocks.i.mlp.w_down.kernel = .T
    norm.weight                                  norm.scale
    lm_head.weight (untied only, no prefix)      head.kernel = .T

The rotary layout needs no permutation: Hugging Face checkpoints of these families use the
half-split ``rotate_half`` layout, as ``train.models.core.rope`` does.
"""

from __future__ import annotations

from train.hf.files import ConfigReader, Map
from train.models.core import RopeScaling, head_size
from train.models.llama import LlamaConfig

__all__ = ["MODEL_TYPES", "config", "tensors", "hf_config"]

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def parse_rope(r: ConfigReader, params: dict | None = None, theta_key: str = "rope_theta") -> tuple[float, RopeScaling | None]:
    """``(theta, scaling)`` of ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``."""
    if params is None:
        params = r.get("rope_parameters") or dict(r.get("rope_scaling") or {}, rope_theta=r.get(theta_key, 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", r.get(theta_key, 10000.0)))
    r.refuse(float(params.get("partial_rotary_factor", 1.0)) != 1.0, f"partial_rotary_factor={params.get('partial_rotary_factor')}")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                                  float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    r.refuse(True, f"rope_type {kind!r} (supported: default, linear, llama3)")


def hf_rope(theta: float, scaling: RopeScaling | None) -> dict:
    """The inverse of :func:`parse_rope`: a ``rope_parameters`` dict."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if scaling.kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": scaling.factor}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor, "original_max_position_embeddings": scaling.original_max_position}


def layer_types(r: ConfigReader, n_layers: int, window, derive) -> tuple | None:
    """``layer_types`` of ``config.json`` (``"full_attention"`` / ``"sliding_attention"``) or
    ``derive(i)``, as ``"full"`` / ``"sliding"``; ``None`` where that is the config's default."""
    given = r.get("layer_types")
    if given is not None:
        unknown = sorted(set(given) - set(_TYPES))
        r.refuse(bool(unknown), f"layer_types {unknown}")
        r.refuse(len(given) != n_layers, f"layer_types of {len(given)} entries for {n_layers} layers")
        types = tuple(_TYPES[t] for t in given)
    else:
        types = tuple(derive(i) for i in range(n_layers))
    if window is None:
        r.refuse("sliding" in types, "sliding_attention layers without a sliding_window")
        return None
    return None if set(types) == {"sliding"} else types


def decoder_fields(r: ConfigReader) -> dict:
    """The :class:`LlamaConfig` fields every decoder family reads the same way."""
    c, heads = r.need("hidden_size"), r.need("num_attention_heads")
    hd = int(r.get("head_dim", c // heads))
    return dict(
        vocab_size=r.need("vocab_size"), seq_len=int(r.get("max_position_embeddings", 2048)), d_model=c,
        n_layers=r.need("num_hidden_layers"), n_heads=heads, n_kv_heads=int(r.get("num_key_value_heads", heads)),
        d_ff=r.need("intermediate_size"), norm_eps=float(r.get("rms_norm_eps", 1e-6)),
        head_dim=None if hd == c // heads else hd, family=r.family,
    )


def config(r: ConfigReader) -> LlamaConfig:
    kind = r.family
    r.refuse(r.get("hidden_act", "silu") != "silu", f"hidden_act={r.get('hidden_act')!r}")
    r.refuse(r.get("mlp_bias", False), "mlp_bias=true")
    r.refuse(kind != "qwen2" and r.get("attention_bias", False), "attention_bias=true (a bias on o_proj)")
    fields = decoder_fields(r)
    theta, scaling = parse_rope(r)
    window, types = None, None
    if kind == "mistral":
        window = r.get("sliding_window")
    elif kind in ("qwen2", "qwen3"):
        window = r.get("sliding_window") if r.get("use_sliding_window", False) else None
        first = int(r.get("max_window_layers", fields["n_layers"]))
        types = layer_types(r, fields["n_layers"], window, lambda i: "sliding" if window is not None and i >= first else "full")
    return LlamaConfig(**fields, rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(r.get("tie_word_embeddings", False)),
                       qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3", sliding_window=window, layer_types=types)


def attention_tensors(mc, i: int, ours: str, hf: str) -> dict[str, Map]:
    """Layer ``i``'s attention: ``ours`` (``blocks.i.attn.``) <- ``hf`` (``model.layers.i.self_attn.``)."""
    qkv = (hf + "q_proj.weight", hf + "k_proj.weight", hf + "v_proj.weight")
    grouped = (mc.n_kv_heads, head_size(mc))
    out = {
        ours + "wqkv.kernel": Map(qkv, transpose=True, grouped=grouped),
        ours + "wo.kernel": Map((hf + "o_proj.weight",), transpose=True),
    }
    if mc.qkv_bias:
        out[ours + "wqkv.bias"] = Map((hf + "q_proj.bias", hf + "k_proj.bias", hf + "v_proj.bias"), grouped=grouped)
    if mc.qk_norm:
        out[ours + "q_norm.scale"] = Map((hf + "q_norm.weight",))
        out[ours + "k_norm.scale"] = Map((hf + "k_norm.weight",))
    return out


def ends(mc) -> dict[str, Map]:
    """Embedding, final norm and (untied) head."""
    out = {"embed.embedding": Map(("model.embed_tokens.weight",)), "norm.scale": Map(("model.norm.weight",))}
    if not mc.tie_embeddings:
        out["head.kernel"] = Map(("lm_head.weight",), transpose=True)
    return out


def block_tensors(mc, i: int) -> dict[str, Map]:
    """Block ``i``'s two norms and its attention (every Llama-like decoder's, dense or MoE)."""
    b, L = f"blocks.{i}.", f"model.layers.{i}."
    out = {b + "attn_norm.scale": Map((L + "input_layernorm.weight",))}
    out.update(attention_tensors(mc, i, b + "attn.", L + "self_attn."))
    out[b + "mlp_norm.scale"] = Map((L + "post_attention_layernorm.weight",))
    return out


def tensors(mc: LlamaConfig, names=None) -> dict[str, Map]:
    out = ends(mc)
    for i in range(mc.n_layers):
        b, L = f"blocks.{i}.", f"model.layers.{i}."
        out.update(block_tensors(mc, i))
        out[b + "mlp.w_gate_up.kernel"] = Map((L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), transpose=True, stack=2)
        out[b + "mlp.w_down.kernel"] = Map((L + "mlp.down_proj.weight",), transpose=True)
    return out


def decoder_config(mc) -> dict:
    """The ``config.json`` keys every decoder family writes the same way."""
    return {
        "architectures": [MODEL_TYPES.get(mc.family) or mc.family], "model_type": mc.family, "vocab_size": mc.vocab_size,
        "hidden_size": mc.d_model, "intermediate_size": mc.d_ff, "num_hidden_layers": mc.n_layers,
        "num_attention_heads": mc.n_heads, "num_key_value_heads": mc.n_kv_heads, "head_dim": head_size(mc),
        "max_position_embeddings": mc.seq_len, "rms_norm_eps": mc.norm_eps, "tie_word_embeddings": mc.tie_embeddings,
        "attention_dropout": 0.0, "dtype": "float32",
    }


def hf_layer_types(mc) -> list[str]:
    return [{"full": "full_attention", "sliding": "sliding_attention"}[t] for t in mc.types()]


def hf_config(mc: LlamaConfig) -> dict:
    out = decoder_config(mc)
    out.update({"rope_parameters": hf_rope(mc.rope_theta, mc.rope_scaling), "hidden_act": "silu", "mlp_bias": False,
                "attention_bias": False})
    if mc.family == "mistral":
        out["sliding_window"] = mc.sliding_window
    elif mc.family in ("qwen2", "qwen3"):
        out.update({"use_sliding_window": mc.sliding_window is not None, "sliding_window": mc.sliding_window,
                    "max_window_layers": mc.n_layers, "layer_types": hf_layer_types(mc)})
    if mc.family == "qwen2":
        del out["attention_bias"]
    return out

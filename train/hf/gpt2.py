"""Hugging Face ``gpt2`` <-> :class:`train.models.GPT`.

Tensor map (ours <- Hugging Face, prefix ``transformer.`` optional on reading, written;
GPT-2's ``Conv1D`` already stores ``[in, out]`` as ours)::

    wte.weight [V, C]                            wte.embedding
    wpe.weight [P, C]                            wpe.embedding
    h.i.ln_1.weight / .bias                      blocks.i.ln1.scale / .bias
    h.i.attn.c_attn.weight [C, 3C] / .bias       blocks.i.attn.qkv.kernel [C, 3, C] / .bias [3, C]   (q | k | v)
    h.i.attn.c_proj.weight [C, C] / .bias        blocks.i.attn.proj.kernel / .bias
    h.i.ln_2.*                                   blocks.i.ln2.*
    h.i.mlp.c_fc.weight [C, 4C] / .bias          blocks.i.mlp.fc.kernel / .bias
    h.i.mlp.c_proj.weight [4C, C] / .bias        blocks.i.mlp.proj.kernel / .bias
    ln_f.weight / .bias                          ln_f.scale / .bias
    lm_head.weight [V, C] (untied only)          head.kernel = .T
"""

from __future__ import annotations

from train.hf.files import ConfigReader, Map
from train.models.gpt import GPTConfig

__all__ = ["MODEL_TYPES", "config", "tensors", "hf_config"]

MODEL_TYPES = {"gpt2": "GPT2LMHeadModel"}
_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def config(r: ConfigReader) -> GPTConfig:
    c = r.need("n_embd")
    r.refuse(r.get("n_inner") not in (None, 4 * c), f"n_inner={r.get('n_inner')} (the MLP is 4 x n_embd)")
    r.refuse(r.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx=true")
    r.refuse(r.get("reorder_and_upcast_attn", False), "reorder_and_upcast_attn=true")
    r.refuse(not r.get("scale_attn_weights", True), "scale_attn_weights=false")
    act = r.get("activation_function", "gelu_new")
    r.refuse(act not in _TANH + ("gelu",), f"activation_function={act!r}")
    return GPTConfig(
        vocab_size=r.need("vocab_size"), seq_len=r.need("n_positions"), d_model=c, n_layers=r.need("n_layer"),
        n_heads=r.need("n_head"), tie_embeddings=bool(r.get("tie_word_embeddings", True)), qkv_bias=True,
        norm_eps=float(r.get("layer_norm_epsilon", 1e-5)), gelu_approximate=act in _TANH,
    )


def tensors(mc: GPTConfig, names=None) -> dict[str, Map]:
    """``names``: the checkpoint's tensor names (``None`` when writing: with the prefix)."""
    p = "transformer." if names is None or any(k.startswith("transformer.") for k in names) else ""
    out = {"wte.embedding": Map((p + "wte.weight",)), "wpe.embedding": Map((p + "wpe.weight",)),
           "ln_f.scale": Map((p + "ln_f.weight",)), "ln_f.bias": Map((p + "ln_f.bias",))}
    for i in range(mc.n_layers):
        for ours, theirs in [("ln1", "ln_1"), ("ln2", "ln_2")]:
            out[f"blocks.{i}.{ours}.scale"] = Map((f"{p}h.{i}.{theirs}.weight",))
            out[f"blocks.{i}.{ours}.bias"] = Map((f"{p}h.{i}.{theirs}.bias",))
        for ours, theirs in [("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]:
            out[f"blocks.{i}.{ours}.kernel"] = Map((f"{p}h.{i}.{theirs}.weight",))  # Conv1D: [in, out] as ours
            out[f"blocks.{i}.{ours}.bias"] = Map((f"{p}h.{i}.{theirs}.bias",))
        # c_attn [C, 3C] (q | k | v columns) -> our fused [C, 3, C]; its bias [3C] -> [3, C]
        out[f"blocks.{i}.attn.qkv.kernel"] = Map((f"{p}h.{i}.attn.c_attn.weight",), stack=3)
        out[f"blocks.{i}.attn.qkv.bias"] = Map((f"{p}h.{i}.attn.c_attn.bias",), stack=3)
    if not mc.tie_embeddings:
        out["head.kernel"] = Map(("lm_head.weight",), transpose=True)
    return out


def hf_config(mc: GPTConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": mc.vocab_size,
        "n_positions": mc.seq_len, "n_embd": mc.d_model, "n_layer": mc.n_layers, "n_head": mc.n_heads, "n_inner": None,
        "activation_function": "gelu_new" if mc.gelu_approximate else "gelu", "layer_norm_epsilon": mc.norm_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": mc.tie_embeddings,
        "dtype": "float32",
    }

"""Hugging Face checkpoints <-> the GPT and Llama of ``train/model.py``.

:func:`from_hf` reads a model directory as ``transformers`` writes it (``config.json`` plus
``model.safetensors``, or sharded ``model-0000k-of-0000N.safetensors`` files listed in
``model.safetensors.index.json``) of ``model_type`` ``gpt2`` or ``llama``, lazily: it
returns a builder and, per parameter, a callable that reads (and converts) only that
tensor when called. :func:`to_hf` writes the inverse, one transformer layer per file.

Name and layout map (ours <- Hugging Face; ``.T``: torch ``nn.Linear`` stores ``[out, in]``,
ours ``[in, out]``; GPT-2's ``Conv1D`` already stores ``[in, out]``)::

    GPT-2 (prefix "transformer." optional)      GPT
    wte.weight [V, C]                            wte.embedding
    wpe.weight [P, C]                            wpe.embedding
    h.i.ln_1.weight / .bias                      blocks.i.ln1.scale / .bias
    h.i.attn.c_attn.weight [C, 3C] / .bias       blocks.i.attn.qkv.kernel / .bias   (q | k | v columns)
    h.i.attn.c_proj.weight [C, C] / .bias        blocks.i.attn.proj.kernel / .bias
    h.i.ln_2.*                                   blocks.i.ln2.*
    h.i.mlp.c_fc.weight [C, 4C] / .bias          blocks.i.mlp.fc.kernel / .bias
    h.i.mlp.c_proj.weight [4C, C] / .bias        blocks.i.mlp.proj.kernel / .bias
    ln_f.weight / .bias                          ln_f.scale / .bias
    lm_head.weight [V, C] (untied only)          head.kernel = .T

    Llama ("model." prefix)                      Llama
    embed_tokens.weight [V, C]                   embed.embedding
    layers.i.input_layernorm.weight              blocks.i.attn_norm.scale
    layers.i.self_attn.q_proj.weight             blocks.i.wq.kernel = .T
    layers.i.self_attn.{k,v}_proj.weight         blocks.i.wkv.kernel = concat(k.T, v.T, axis=1)  [C, 2 nkv hs]
    layers.i.self_attn.o_proj.weight             blocks.i.wo.kernel = .T
    layers.i.post_attention_layernorm.weight     blocks.i.mlp_norm.scale
    layers.i.mlp.{gate,up}_proj.weight           blocks.i.w_gate_up.kernel = concat(gate.T, up.T, axis=1)
    layers.i.mlp.down_proj.weight                blocks.i.w_down.kernel = .T
    norm.weight                                  norm.scale
    lm_head.weight (untied only)                 head.kernel = .T

The rotary layout needs no permutation: Hugging Face Llama checkpoints use the half-split
``rotate_half`` layout, as ``train.model._rope`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["from_hf", "to_hf", "Tensor"]

_GPT2_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


class Tensor:
    """A lazy tensor: ``t()`` reads it (numpy, logical shape ``t.shape``, dtype ``t.dtype``)."""

    def __init__(self, read: Callable[[], np.ndarray], shape: tuple, dtype):
        self._read, self.shape, self.dtype = read, tuple(shape), np.dtype(dtype)

    def __call__(self) -> np.ndarray:
        return self._read()

    def __repr__(self):
        return f"Tensor({self.shape}, {self.dtype})"


class _Files:
    """Tensor name -> file of a Hugging Face directory; reads one tensor per call."""

    def __init__(self, path: Path):
        from safetensors import safe_open  # noqa: PLC0415

        self._open = safe_open
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if index.is_file():
            self.where = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif single.is_file():
            with safe_open(single, framework="numpy") as f:
                self.where = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(f"from_hf: {str(path)!r} has neither model.safetensors nor model.safetensors.index.json")
        self.meta = {}
        for file in sorted(set(self.where.values())):
            with safe_open(file, framework="numpy") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    self.meta[k] = (tuple(sl.get_shape()), sl.get_dtype())

    def read(self, name: str) -> np.ndarray:
        # numpy has no bfloat16: such tensors are read through jax (ml_dtypes) and copied back
        framework = "flax" if self.meta[name][1] == "BF16" else "numpy"
        with self._open(self.where[name], framework=framework) as f:
            return np.asarray(f.get_tensor(name))

    def dtype(self, name: str) -> np.dtype:
        import ml_dtypes  # noqa: PLC0415

        codes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
        return np.dtype(codes.get(self.meta[name][1], np.float32))

    def shape(self, name: str) -> tuple:
        if name not in self.meta:
            raise ValueError(f"from_hf: tensor {name!r} is missing from the checkpoint (it has {len(self.meta)} tensors)")
        return self.meta[name][0]


def _need(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise ValueError(f"from_hf: {path / 'config.json'} has no {key!r}")
    return cfg[key]


def _refuse(cond: bool, what: str, path: Path):
    if cond:
        raise ValueError(f"from_hf: {path / 'config.json'}: {what} is not supported by train/model.py")


def _gpt2(cfg: dict, files: _Files, path: Path):
    from train.model import GPTConfig  # noqa: PLC0415

    c, n_layers = _need(cfg, "n_embd", path), _need(cfg, "n_layer", path)
    _refuse(cfg.get("n_inner") not in (None, 4 * c), f"n_inner={cfg.get('n_inner')} (the MLP is 4 x n_embd)", path)
    _refuse(cfg.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx=true", path)
    _refuse(cfg.get("reorder_and_upcast_attn", False), "reorder_and_upcast_attn=true", path)
    _refuse(not cfg.get("scale_attn_weights", True), "scale_attn_weights=false", path)
    act = cfg.get("activation_function", "gelu_new")
    _refuse(act not in _GPT2_TANH + ("gelu",), f"activation_function={act!r}", path)
    tied = cfg.get("tie_word_embeddings", True)
    mc = GPTConfig(
        vocab_size=_need(cfg, "vocab_size", path), seq_len=_need(cfg, "n_positions", path), d_model=c, n_layers=n_layers,
        n_heads=_need(cfg, "n_head", path), tie_embeddings=tied, qkv_bias=True,
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), gelu_approximate=act in _GPT2_TANH,
    )
    prefix = "transformer." if any(k.startswith("transformer.") for k in files.meta) else ""
    names = {"wte.embedding": "wte.weight", "wpe.embedding": "wpe.weight", "ln_f.scale": "ln_f.weight", "ln_f.bias": "ln_f.bias"}
    for i in range(n_layers):
        for ours, theirs in [("ln1", "ln_1"), ("ln2", "ln_2")]:
            names[f"blocks.{i}.{ours}.scale"] = f"h.{i}.{theirs}.weight"
            names[f"blocks.{i}.{ours}.bias"] = f"h.{i}.{theirs}.bias"
        for ours, theirs in [("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]:
            names[f"blocks.{i}.{ours}.kernel"] = f"h.{i}.{theirs}.weight"  # Conv1D: [in, out] as ours
            names[f"blocks.{i}.{ours}.bias"] = f"h.{i}.{theirs}.bias"
    names = {k: prefix + v for k, v in names.items()}
    plan = {k: ([v], None) for k, v in names.items()}
    if not tied:
        plan["head.kernel"] = (["lm_head.weight"], "T")
    return mc, plan


def _llama(cfg: dict, files: _Files, path: Path):
    from train.model import LlamaConfig  # noqa: PLC0415

    c, heads = _need(cfg, "hidden_size", path), _need(cfg, "num_attention_heads", path)
    _refuse(cfg.get("hidden_act", "silu") != "silu", f"hidden_act={cfg.get('hidden_act')!r}", path)
    _refuse(cfg.get("attention_bias", False) or cfg.get("mlp_bias", False), "attention_bias / mlp_bias", path)
    _refuse(cfg.get("head_dim") not in (None, c // heads), f"head_dim={cfg.get('head_dim')} != hidden_size / num_attention_heads", path)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    _refuse(rope.get("rope_type", rope.get("type", "default")) != "default", f"rope scaling {rope}", path)
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    tied = bool(cfg.get("tie_word_embeddings", False))
    n_layers = _need(cfg, "num_hidden_layers", path)
    mc = LlamaConfig(
        vocab_size=_need(cfg, "vocab_size", path), seq_len=int(cfg.get("max_position_embeddings", 2048)), d_model=c,
        n_layers=n_layers, n_heads=heads, n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        d_ff=_need(cfg, "intermediate_size", path), rope_theta=theta, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=tied,
    )
    m = "model."
    plan = {"embed.embedding": ([m + "embed_tokens.weight"], None), "norm.scale": ([m + "norm.weight"], None)}
    for i in range(n_layers):
        L = f"{m}layers.{i}."
        plan[f"blocks.{i}.attn_norm.scale"] = ([L + "input_layernorm.weight"], None)
        plan[f"blocks.{i}.mlp_norm.scale"] = ([L + "post_attention_layernorm.weight"], None)
        plan[f"blocks.{i}.wq.kernel"] = ([L + "self_attn.q_proj.weight"], "T")
        plan[f"blocks.{i}.wkv.kernel"] = ([L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"], "T")
        plan[f"blocks.{i}.wo.kernel"] = ([L + "self_attn.o_proj.weight"], "T")
        plan[f"blocks.{i}.w_gate_up.kernel"] = ([L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"], "T")
        plan[f"blocks.{i}.w_down.kernel"] = ([L + "mlp.down_proj.weight"], "T")
    if not tied:
        plan["head.kernel"] = (["lm_head.weight"], "T")
    return mc, plan


def _hf_shape(shapes: list[tuple], op) -> tuple:
    if op is None:
        return shapes[0]
    # [out_k, in] each --T, concat(axis=1)--> [in, sum out_k]
    return (shapes[0][1], sum(s[0] for s in shapes))


def from_hf(path) -> tuple[Callable, dict]:
    """Read a Hugging Face GPT-2 or Llama directory lazily.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` (or the sharded files
        and ``model.safetensors.index.json``), ``model_type`` ``"gpt2"`` or ``"llama"``.

    Returns:
      ``(builder, weights)``: ``builder()`` builds the matching ``train.model.GPT`` / ``Llama``
      (random values, to be replaced: pass both to ``zshard.init(builder, tx, mesh,
      params=weights)``); ``weights`` maps each dotted parameter path to a :class:`Tensor`,
      a zero-argument callable with ``.shape`` (logical) that reads its tensor(s) and
      returns the parameter as a numpy array (transposes and k/v, gate/up merges done there).
      ``builder.config`` is the model config.

    Raises:
      FileNotFoundError: no ``config.json`` / safetensors files.
      ValueError: another ``model_type``, an architecture detail ``train/model.py`` lacks
        (named), or a tensor the mapping needs that the files lack.
    """
    from flax import nnx  # noqa: PLC0415

    from train.model import build_model  # noqa: PLC0415

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"from_hf: {str(path)!r} has no config.json (give a Hugging Face model directory)")
    cfg = json.loads((path / "config.json").read_text())
    files = _Files(path)
    kind = cfg.get("model_type")
    if kind == "gpt2":
        mc, plan = _gpt2(cfg, files, path)
    elif kind == "llama":
        mc, plan = _llama(cfg, files, path)
    else:
        raise ValueError(f"from_hf: {path / 'config.json'}: model_type {kind!r}; supported: 'gpt2', 'llama'")

    def make(names, op):
        def read():
            arrays = [files.read(n) for n in names]
            return arrays[0] if op is None else np.concatenate([a.T for a in arrays], axis=1)

        return Tensor(read, _hf_shape([files.shape(n) for n in names], op), files.dtype(names[0]))

    weights = {k: make(names, op) for k, (names, op) in plan.items()}
    used = {n for names, _ in plan.values() for n in names}
    ignored = [k for k in files.meta if k not in used and not k.endswith(("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq"))]
    if ignored:
        raise ValueError(f"from_hf: {path}: tensors the {kind} mapping does not use: {ignored[:10]}; is this a {kind} checkpoint?")

    def builder():
        return build_model(mc, nnx.Rngs(0))

    builder.config = mc
    return builder, weights


def _hf_config(mc) -> dict:
    from train.model import GPTConfig  # noqa: PLC0415

    if isinstance(mc, GPTConfig):
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": mc.vocab_size,
            "n_positions": mc.seq_len, "n_embd": mc.d_model, "n_layer": mc.n_layers, "n_head": mc.n_heads, "n_inner": None,
            "activation_function": "gelu_new" if mc.gelu_approximate else "gelu", "layer_norm_epsilon": mc.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": mc.tie_embeddings,
            "dtype": "float32",
        }
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": mc.vocab_size,
        "hidden_size": mc.d_model, "intermediate_size": mc.d_ff, "num_hidden_layers": mc.n_layers,
        "num_attention_heads": mc.n_heads, "num_key_value_heads": mc.n_kv_heads, "head_dim": mc.d_model // mc.n_heads,
        "max_position_embeddings": mc.seq_len, "rms_norm_eps": mc.norm_eps, "rope_theta": mc.rope_theta,
        "rope_parameters": {"rope_theta": mc.rope_theta, "rope_type": "default"}, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": mc.tie_embeddings, "dtype": "float32",
    }


def to_hf(state_or_model, path) -> Path:
    """Write ``state_or_model`` as a Hugging Face directory that ``transformers`` loads.

    Args:
      state_or_model: a ``zshard.ShardedState`` of a ``train.model`` GPT / Llama (each
        parameter gathered to the host alone, ``zshard.weights.fetch_params``), or the
        ``nnx.Module`` itself. Scanned (stacked) models are not supported.
      path: the output directory (created).

    Writes ``config.json``, ``model-0000k-of-0000N.safetensors`` (the embeddings, final norm
    and head in the first file, then one file per transformer layer, so host memory holds
    one layer) and ``model.safetensors.index.json``. Names and layouts as in the module
    docstring (the inverse map); a GPT-2 is written with the ``transformer.`` prefix.

    Returns:
      ``path``.
    """
    from flax import nnx, traverse_util  # noqa: PLC0415
    from safetensors.numpy import save_file  # noqa: PLC0415

    from train.model import GPTConfig  # noqa: PLC0415
    from zshard import fetch_params, path_str  # noqa: PLC0415

    if isinstance(state_or_model, nnx.Module):
        mc = state_or_model.cfg
        flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(state_or_model, nnx.Param)))
        tensors = {path_str(p): (lambda v=v: np.asarray(v)) for p, v in flat.items()}
    else:
        plan = state_or_model.plan
        mc = nnx.merge(plan.graphdef, nnx.from_flat_state(list(plan.template) + list(plan.var_template))).cfg
        tensors = {name: fetch for name, _, _, fetch in fetch_params(state_or_model)}
    if mc.scan:
        raise ValueError("to_hf: a scanned (stacked-layer) model; build it with scan=False to export")
    gpt = isinstance(mc, GPTConfig)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    groups: list[dict] = [dict() for _ in range(mc.n_layers + 1)]  # root, layer 0, layer 1, ...
    for ours, read in tensors.items():
        parts = ours.split(".")
        g = int(parts[1]) + 1 if parts[0] == "blocks" else 0
        groups[g][ours] = read
    n = len(groups)
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        out = {}
        for ours, read in group.items():
            for name, value in (_to_hf_gpt2 if gpt else _to_hf_llama)(ours, read(), mc):
                out[name] = np.ascontiguousarray(value)
                total += value.nbytes
        file = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(out, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in out})
        del out  # one layer on the host at a time
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    (path / "config.json").write_text(json.dumps(_hf_config(mc), indent=1) + "\n")
    return path


def _to_hf_gpt2(ours: str, x: np.ndarray, mc):
    parts = ours.split(".")
    if ours == "head.kernel":
        return [("lm_head.weight", x.T)]
    if parts[0] == "blocks":
        i, rest = parts[1], ".".join(parts[2:])
        table = {"ln1.scale": "ln_1.weight", "ln1.bias": "ln_1.bias", "ln2.scale": "ln_2.weight", "ln2.bias": "ln_2.bias",
                 "attn.qkv.kernel": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
                 "attn.proj.kernel": "attn.c_proj.weight", "attn.proj.bias": "attn.c_proj.bias",
                 "mlp.fc.kernel": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
                 "mlp.proj.kernel": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias"}
        return [(f"transformer.h.{i}.{table[rest]}", x)]
    table = {"wte.embedding": "wte.weight", "wpe.embedding": "wpe.weight", "ln_f.scale": "ln_f.weight", "ln_f.bias": "ln_f.bias"}
    return [(f"transformer.{table[ours]}", x)]


def _to_hf_llama(ours: str, x: np.ndarray, mc):
    parts = ours.split(".")
    if ours == "head.kernel":
        return [("lm_head.weight", x.T)]
    if ours == "embed.embedding":
        return [("model.embed_tokens.weight", x)]
    if ours == "norm.scale":
        return [("model.norm.weight", x)]
    L, rest = f"model.layers.{parts[1]}.", ".".join(parts[2:])
    hs = mc.d_model // mc.n_heads
    if rest == "wkv.kernel":  # [C, 2 nkv hs] -> k, v [nkv hs, C]
        k, v = np.split(x, [mc.n_kv_heads * hs], axis=1)
        return [(L + "self_attn.k_proj.weight", k.T), (L + "self_attn.v_proj.weight", v.T)]
    if rest == "w_gate_up.kernel":
        gate, up = np.split(x, [mc.d_ff], axis=1)
        return [(L + "mlp.gate_proj.weight", gate.T), (L + "mlp.up_proj.weight", up.T)]
    table = {"attn_norm.scale": ("input_layernorm.weight", False), "mlp_norm.scale": ("post_attention_layernorm.weight", False),
             "wq.kernel": ("self_attn.q_proj.weight", True), "wo.kernel": ("self_attn.o_proj.weight", True),
             "w_down.kernel": ("mlp.down_proj.weight", True)}
    name, transpose = table[rest]
    return [(L + name, x.T if transpose else x)]

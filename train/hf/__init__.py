"""Hugging Face checkpoints <-> the models of ``train/models/``.

:func:`from_hf` reads a model directory as ``transformers`` writes it (``config.json`` plus
``model.safetensors``, or sharded ``model-0000k-of-0000N.safetensors`` files listed in
``model.safetensors.index.json``), lazily: it returns a builder and, per parameter, a callable
that reads (and converts) only that parameter's tensors when called. :func:`to_hf` writes
the inverse, one transformer layer per file. The family comes from ``config.json``'s
``model_type``; one module per family holds its config reader, tensor map and config writer:

| ``model_type`` | module | model |
|---|---|---|
| ``gpt2`` | ``train/hf/gpt2.py`` | ``GPT`` |
| ``llama``, ``mistral``, ``qwen2``, ``qwen3`` | ``train/hf/llama.py`` | ``Llama`` |
| ``gemma2``, ``gemma3_text`` | ``train/hf/gemma.py`` | ``Gemma`` |
| ``qwen3_moe`` | ``train/hf/qwen3_moe.py`` | ``Qwen3Moe`` |
| ``mixtral`` | ``train/hf/mixtral.py`` | ``Qwen3Moe`` (``family="mixtral"``: no q/k norm) |
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import numpy as np

from train.hf import gemma, gpt2, llama, mixtral, qwen3_moe
from train.hf.files import ConfigReader, Files, Map, Tensor, write_checkpoint

__all__ = ["from_hf", "to_hf", "Tensor", "FAMILIES", "tensor_map"]

FAMILIES = {kind: module for module in (gpt2, llama, gemma, qwen3_moe, mixtral) for kind in module.MODEL_TYPES}
# buffers some checkpoints hold that are not parameters (causal masks, RoPE tables)
_BUFFERS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")
_REFUSED = {
    "gemma3": "the multimodal Gemma 3 (Gemma3ForConditionalGeneration: a vision tower, language_model.* names); "
              "its text model, model_type 'gemma3_text' (Gemma3ForCausalLM, e.g. gemma-3-1b), is supported",
}


def _family_of(mc) -> str:
    return getattr(mc, "family", "gpt2")


def tensor_map(mc, names=None) -> dict[str, Map]:
    """``{our dotted parameter path: Map}`` of a model config (``names``: a checkpoint's tensor names)."""
    return FAMILIES[_family_of(mc)].tensors(mc, names)


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".{i}.", re.sub(r"experts\.\d+\.", "experts.{e}.", name))


def _check_names(path: Path, kind: str, files: Files, want: dict[str, tuple], tied: bool) -> None:
    """Every tensor the map needs is in the files with its shape, and every file tensor is used."""
    missing = [n for n in want if n not in files.meta]
    wrong = [f"  {n}: shape {files.meta[n][0]}, expected {s}" for n, s in want.items() if n in files.meta and files.meta[n][0] != s]
    skip = _BUFFERS + (("lm_head.weight",) if tied else ())  # a tied head some writers store twice
    extra = [n for n in files.meta if n not in want and not n.endswith(skip)]
    if missing or wrong or extra:
        lines = [f"  {n}: missing" for n in missing[:10]] + wrong[:10] + [f"  {n}: not a {kind} tensor" for n in extra[:10]]
        expected = sorted({_pattern(n) for n in want})
        raise ValueError(
            f"from_hf: {path}: the tensors do not match model_type {kind!r} ({len(missing)} missing, {len(wrong)} misshapen, "
            f"{len(extra)} extra); nothing was read:\n" + "\n".join(lines)
            + f"\nthe {kind} names this config needs ({len(want)} tensors): " + ", ".join(expected)
        )


def from_hf(path) -> tuple[Callable, dict]:
    """Read a Hugging Face model directory lazily.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` (or the sharded files
        and ``model.safetensors.index.json``); ``model_type`` one of :data:`FAMILIES`.

    Returns:
      ``(builder, weights)``: ``builder()`` builds the matching model of ``train.models``
      (random values, to be replaced: pass both to ``zshard.init(builder, tx, mesh,
      params=weights)``); ``weights`` maps each dotted parameter path to a :class:`Tensor`,
      a zero-argument callable with ``.shape`` (logical) that reads its tensor(s), each once,
      and returns the parameter as a numpy array (transposes, k/v and gate/up
      concatenations, expert stacking done there). ``builder.config`` is the model config.

    Raises:
      FileNotFoundError: no ``config.json`` / safetensors files.
      ValueError: an unknown ``model_type`` (the supported ones listed), an architecture
        detail ``train/models/`` lacks (named), or tensors missing, misshapen or left over
        (each named, with the family's expected names): before anything is read.
    """
    from flax import nnx  # noqa: PLC0415

    from train.models import build_model  # noqa: PLC0415

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"from_hf: {str(path)!r} has no config.json (give a Hugging Face model directory)")
    cfg = json.loads((path / "config.json").read_text())
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        why = _REFUSED.get(kind, f"architectures {cfg.get('architectures')}")
        raise ValueError(f"from_hf: {path / 'config.json'}: model_type {kind!r} ({why}); supported: "
                         + ", ".join(repr(k) for k in FAMILIES))
    family = FAMILIES[kind]
    mc = family.config(ConfigReader(cfg, path, kind))
    files = Files(path)
    plan = family.tensors(mc, set(files.meta))

    def builder():
        return build_model(mc, nnx.Rngs(0))

    abstract = nnx.eval_shape(builder)  # shapes only: nothing is initialised
    ours = {".".join(map(str, p)): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    unmapped = sorted(set(ours) ^ set(plan))
    if unmapped:  # a bug of the family module, not of the checkpoint
        raise AssertionError(f"from_hf: the {kind} map and the model's parameters differ: {unmapped[:10]}")
    want = {n: s for k, m in plan.items() for n, s in m.hf_shapes(ours[k]).items()}
    _check_names(path, kind, files, want, getattr(mc, "tie_embeddings", False))

    def make(key, m: Map):
        return Tensor(lambda: m.read(files.read), ours[key], files.dtype(m.names[0]))

    builder.config = mc
    return builder, {k: make(k, m) for k, m in plan.items()}


def to_hf(state_or_model, path) -> Path:
    """Write ``state_or_model`` as a Hugging Face directory that ``transformers`` loads.

    Args:
      state_or_model: a ``zshard.ShardedState`` of a model of ``train.models`` (each
        parameter gathered to the host alone, ``zshard.fetch_params``), or the
        ``nnx.Module`` itself. Scanned (stacked) models are not supported.
      path: the output directory (created).

    Writes ``config.json`` (``model_type`` = the config's ``family``),
    ``model-0000k-of-0000N.safetensors`` (the embeddings, final norm and head in the first
    file, then one file per transformer layer, so host memory holds one layer) and
    ``model.safetensors.index.json``, with the names and layouts of the family's map (the
    inverse of :func:`from_hf`'s).

    Returns:
      ``path``.

    Raises:
      ValueError: a scanned model, or parameters the family's map does not have (named).
    """
    from flax import nnx, traverse_util  # noqa: PLC0415

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
    kind = _family_of(mc)
    maps = tensor_map(mc)
    if set(maps) != set(tensors):
        raise ValueError(f"to_hf: the model's parameters and the {kind} map differ: the model has "
                         f"{sorted(set(tensors) - set(maps))[:10]} unmapped, lacks {sorted(set(maps) - set(tensors))[:10]}; "
                         f"is the config's family ({kind!r}) right?")
    groups: list[list[str]] = [[] for _ in range(mc.n_layers + 1)]  # root, layer 0, layer 1, ...
    for ours in tensors:
        parts = ours.split(".")
        groups[int(parts[1]) + 1 if parts[0] == "blocks" else 0].append(ours)

    def file(names):
        return lambda: {hf: t for ours in names for hf, t in maps[ours].write(tensors[ours]())}

    return write_checkpoint([file(g) for g in groups], Path(path), FAMILIES[kind].hf_config(mc))


"""The split plans: which dimension of which parameter is split over the ``tensor`` or ``expert`` axis.

The same three sources name both axes (``tensor_parallel=`` / ``expert_parallel=``, annotations
naming ``"tensor"`` / ``"expert"``, ``logical_rules`` mapping to either): :func:`split_dims` reads
them for one axis; :func:`tensor_dims` and :func:`expert_dims` are its two uses. The expert
dimension of an expert parameter is split over ``expert`` into ``E/X`` whole experts per device
(docs/expert-parallel.md). Below, the tensor axis's sources:

Three sources, as torchtitan's ``parallelize_module`` plans, MaxText's logical axis rules and
flax's ``nnx.with_partitioning`` annotations give them:

- ``zshard.init(..., tensor_parallel={"blocks.*.attn.qkv.kernel": -1, ...})``: a glob on the
  dotted parameter path (``fnmatch``) -> the dimension (negative counts from the end);
- the model's own annotations: a parameter made with ``nnx.with_partitioning(init, (None,
  "tensor"))`` (or ``sharding=`` / ``out_sharding`` metadata) naming the mesh axis ``tensor``;
- logical names in those annotations, mapped by ``zshard.init(..., logical_rules={"mlp":
  "tensor", "heads": "tensor", "vocab": "tensor"})``.

Annotations naming other names (``embed``, ``fsdp``, ``data``, or mesh axes zshard lays out
itself, ``replica`` / ``shard``) are ignored for the layout: zshard shards over the data axes
itself. A glob wins over an annotation of the same parameter. Column-parallel (split the
output dimension) and row-parallel (split the input dimension) layers are Megatron-LM's
(arXiv 1909.08053 section 3); the plan is data, the model code does not change.

Activations are not annotated: inside the step ``tensor`` is an Auto axis and the data axes are
manual, so an activation's ``out_sharding=`` / ``jax.sharding.reshard`` naming them (code written
for JAX's explicit sharding) is refused with the fix (:func:`activation_annotation_error`).
"""

from __future__ import annotations

import fnmatch
import linecache
import re
import warnings
from pathlib import Path
from typing import Mapping

from zshard.params.units import path_str

__all__ = ["MESH_AXES", "HeadSplitWarning", "activation_annotation_error", "check_logical_rules", "expert_dims", "split_dims", "tensor_dims",
           "warn_head_splits"]

MESH_AXES = ("replica", "shard", "expert", "context", "tensor")  # every axis name a zshard mesh may have
_META_KEYS = ("out_sharding", "sharding_names", "sharding")


def check_logical_rules(rules) -> dict:
    """``logical_rules`` -> ``{logical name: mesh axis or None}``.

    Raises:
      ValueError: not a mapping of names, or a rule naming an axis that no zshard mesh has.
    """
    if rules is None:
        return {}
    if not isinstance(rules, Mapping) and not (isinstance(rules, (list, tuple)) and all(len(r) == 2 for r in rules)):
        raise ValueError(f"logical_rules={rules!r}: give a mapping {{logical name: mesh axis}}, e.g. {{'mlp': 'tensor'}}")
    out = dict(rules)
    for name, axis in out.items():
        if axis is not None and axis not in MESH_AXES:
            raise ValueError(
                f"logical_rules[{name!r}] = {axis!r}: no zshard mesh has an axis {axis!r}; map logical names to "
                f"one of {', '.join(MESH_AXES)} (or None), e.g. {{'mlp': 'tensor'}}"
            )
    return out


def _annotation(var) -> tuple | None:
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    for key in _META_KEYS:
        names = meta.get(key)
        if names is not None and not hasattr(names, "mesh"):  # a PartitionSpec-like tuple of names
            return tuple(names)
    return None


def _names_axis(entry, rules: dict, axis: str) -> bool:
    entries = entry if isinstance(entry, (tuple, list)) else (entry,)
    return any(e == axis or (e is not None and rules.get(e) == axis) for e in entries)


# What each split axis asks of a divided dimension (the fix of its error).
_FIX = {
    "tensor": "use a tensor size that divides it (heads, kv heads, vocabulary and MLP width must all divide by T), or pad the model",
    "expert": "use an expert size that divides the number of experts (each device holds E/X whole experts), or give "
              "expert_parallel the expert dimension",
}


def split_dims(template, layers: Mapping, plan, rules: dict, size: int, axis: str = "tensor", option: str = "tensor_parallel") -> dict:
    """``{parameter path: dimension of one layer's shape}`` for every parameter split over the mesh
    axis ``axis`` (``"tensor"`` or ``"expert"``), from the ``option`` globs (``plan``), the model's
    annotations naming ``axis`` and the logical ``rules`` mapping names to it.

    Args:
      template: ``(path, Variable)`` pairs of the parameters (abstract values).
      layers: ``path -> L`` of stacked parameters (``None`` otherwise): an annotation of a
        stacked parameter may name its layer axis first (``nnx.vmap``'s ``transform_metadata``),
        and a glob's dimension counts within one layer, so scanned stacks match too.
      plan: ``{glob: dim}`` or ``None`` (``tensor_parallel`` / ``expert_parallel``).
      rules: checked ``logical_rules``.
      size: the axis's devices; with 1 the plan is only validated (nothing is split).
      axis, option: the mesh axis and the ``zshard.init`` argument named in the errors.

    Raises:
      ValueError (before anything is placed): a glob that matches no parameter; a dimension out
        of range; two globs giving one parameter different dimensions; an annotation naming
        ``axis`` on two dimensions; ``size`` not dividing a split dimension (the parameter, its
        shape, its dimension and the axis size named).
    """
    if plan is not None and not isinstance(plan, Mapping):
        raise ValueError(f"{option}={plan!r}: give a mapping {{glob on the dotted path: dimension}}")
    names = {path_str(p): (p, v) for p, v in template}
    dims: dict = {}
    for path, var in template:  # the model's annotations
        ann = _annotation(var)
        if ann is None:
            continue
        shape = var.get_value().shape
        if layers.get(path) is not None and len(ann) == len(shape):
            ann = ann[1:]  # the stacked layer axis
        hits = [i for i, e in enumerate(ann) if _names_axis(e, rules, axis)]
        if len(hits) > 1:
            raise ValueError(f"parameter {path_str(path)!r}: its annotation {ann} splits dimensions {hits} over {axis!r}; "
                             "split one dimension only")
        if hits:
            dims[path] = hits[0]
    chosen: dict = {}
    for glob, dim in (plan or {}).items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not matched:
            raise ValueError(
                f"{option}[{glob!r}] matches no parameter; parameter paths look like "
                f"{', '.join(list(names)[:4])}{', ...' if len(names) > 4 else ''}"
            )
        for n in matched:
            path, var = names[n]
            rank = len(var.get_value().shape) - (1 if layers.get(path) is not None else 0)
            if isinstance(dim, bool) or not isinstance(dim, int) or not -rank <= dim < rank:
                raise ValueError(f"{option}[{glob!r}] = {dim!r}: parameter {n!r} has {rank} dimension(s) per layer; "
                                 f"give a dimension in [{-rank}, {rank})")
            d = dim % rank
            if n in chosen and chosen[n][1] != d:
                raise ValueError(f"parameter {n!r}: {option} globs {chosen[n][0]!r} and {glob!r} split dimensions "
                                 f"{chosen[n][1]} and {d}; make them agree")
            chosen[n] = (glob, d)
            dims[path] = d
    for path, d in dims.items():
        shape = names[path_str(path)][1].get_value().shape[(1 if layers.get(path) is not None else 0):]
        if shape[d] % size:
            raise ValueError(
                f"parameter {path_str(path)!r} {list(shape)}: dimension {d} ({shape[d]}) is split over the {axis} axis but "
                f"does not divide by {axis}={size}; {_FIX.get(axis, 'use a size that divides it')}"
            )
    return dims if size > 1 else {}


def tensor_dims(template, layers: Mapping, tensor_parallel, rules: dict, tensor: int) -> dict:
    """:func:`split_dims` over the ``tensor`` axis (``tensor_parallel=``, annotations and rules naming ``tensor``)."""
    return split_dims(template, layers, tensor_parallel, rules, tensor, "tensor", "tensor_parallel")


def expert_dims(template, layers: Mapping, expert_parallel, rules: dict, expert: int) -> dict:
    """:func:`split_dims` over the ``expert`` axis: ``{path: the expert dimension of one layer}``
    (``expert_parallel=``, annotations and ``logical_rules`` naming ``expert``).

    Raises:
      ValueError: as :func:`split_dims`; and on a mesh with an expert axis (``expert > 1``), no
        parameter split over it (expert parallelism with nothing to split), with the fix.
    """
    dims = split_dims(template, layers, expert_parallel, rules, expert, "expert", "expert_parallel")
    if expert > 1 and not dims:
        raise ValueError(
            f"the mesh has an expert axis (expert={expert}) but no parameter is split over it: name the experts' weights "
            "with zshard.init(..., expert_parallel={'blocks*.moe.w_*': 0}) (glob -> the expert dimension of one layer), "
            "an nnx.with_partitioning annotation naming 'expert', or logical_rules={'<name>': 'expert'}; or build the "
            "mesh without expert= (docs/expert-parallel.md)"
        )
    return dims


_AUTO_OR_MANUAL = re.compile(r"PartitionSpec passed to (\w+) cannot contain axis names that are of type Auto or Manual\. "
                             r"Got PartitionSpec: (.*?) with axis name: (\w+) of type: AxisType\.(\w+)")
_NOT_IN_MESH = re.compile(r"Resource axis: (\w+) of (.*) is not found in mesh: (\(.*?\))")


def _user_line(tb) -> tuple[str, str]:
    """``("file:line (function)", source text)`` of the innermost frame outside the installed
    libraries and zshard (the model's line), or ``("the model", "")``."""
    library = ("site-packages", "dist-packages", str(Path(__file__).parent.parent))
    found = ("the model", "")
    while tb is not None:
        code, line = tb.tb_frame.f_code, tb.tb_lineno
        if not any(x in code.co_filename for x in library):
            found = (f"{code.co_filename}:{line} ({code.co_name})", linecache.getline(code.co_filename, line).strip())
        tb = tb.tb_next
    return found


def activation_annotation_error(e: ValueError, mesh) -> ValueError | None:
    """The explained error for JAX's refusal of an activation sharding that names a mesh axis the
    step cannot honour, or ``None`` for any other error.

    Code written for explicit sharding (jax-ml/bonsai, new JAX code) names mesh axes in its
    activations: ``nnx.Linear.__call__(x, out_sharding=P(None, "tensor"))`` (a ``dot_general``'s
    ``out_sharding``), ``jax.sharding.reshard(x, P(...))``, or logical names (``"fsdp"``,
    ``"tp"``). Inside zshard's step the data axes are manual (each device holds its rows) and
    ``tensor`` is an Auto axis (the model runs in its global view over it); JAX accepts neither
    in an activation's sharding, and names it no mesh has are unknown."""
    text = str(e)
    auto, missing = _AUTO_OR_MANUAL.search(text), _NOT_IN_MESH.search(text)
    if auto is None and missing is None:
        return None
    where, source = _user_line(e.__traceback__)
    if auto is not None:
        api, spec, axis, kind = auto.groups()
        what = f"names the {kind} mesh axis {axis!r}"
    else:
        axis, spec, axes = missing.groups()
        api, what = "", f"names {axis!r}, an axis the step's mesh {axes} does not have"
    if api == "reshard" or (not api and "reshard" in source):
        call = f"jax.sharding.reshard(x, {spec})"
    else:  # a dot_general's out_sharding, as nnx.Linear / nnx.Einsum pass it
        call = f"out_sharding={spec}"
    return ValueError(
        f"zshard: the activation annotation {call} at {where} {what}: the model is written for JAX's explicit sharding. "
        f"Inside zshard's step the data axes {tuple(a for a in mesh.axis_names if a != 'tensor')} are manual (each device "
        "already holds its own rows) and the axis `tensor` is Auto (the model runs in its global view over it; the "
        "compiler places the activations from how the parameters are split), so no activation may be annotated with "
        "them, with out_sharding= or jax.sharding.reshard. Fix: drop the annotation (out_sharding=None, no reshard): "
        "zshard splits the rows itself, and zshard.init(..., tensor_parallel={glob: dim}) or logical_rules= split "
        "the parameters over `tensor`; to keep a placement hint over the tensor axis, write "
        "jax.lax.with_sharding_constraint(x, P(None, 'tensor')) (with only `tensor` or None in it, which an Auto axis "
        "accepts). Logical names of your own ('fsdp', 'tp', 'data') map to no axis here; docs/your-model.md, "
        "'Sharding annotations'"
    )


# --- a split that cuts across attention heads ---------------------------------------------------------------

_HEADS = ("num_heads", "n_heads", "num_attention_heads", "n_head")  # how modules declare their heads
_KV_HEADS = ("num_kv_heads", "n_kv_heads", "num_key_value_heads")
_HEAD_DIM = ("head_dim", "hs", "head_size", "d_head")
_warned: set = set()


class HeadSplitWarning(UserWarning):
    """A tensor-parallel split that cuts across attention heads (:func:`warn_head_splits`)."""


def _declared(module, names) -> int | None:
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def warn_head_splits(model, template, dims: Mapping, layers: Mapping, tensor: int) -> list[str]:
    """Warn (:class:`HeadSplitWarning`, once per message) for each split parameter whose attention
    module cuts heads over ``tensor``; returns the messages.

    zshard cannot know a head structure in general; it reads the one the model declares: the
    nearest module on the parameter's path with a head count (``num_heads`` / ``n_heads``, and
    ``num_kv_heads`` / ``n_kv_heads``, as ``nnx.MultiHeadAttention`` and the ``train.models``
    attention hold them) and maybe a head size (``head_dim`` / ``hs``). A split cuts heads when
    ``T`` does not divide the heads or the key/value heads (a device would hold part of a
    key/value group), when the split dimension is the head size itself, or when it holds whole
    heads (a multiple of the head size) but its ``1/T`` pieces do not. The numbers stay right
    (``tensor`` is an Auto axis: the compiler moves the activations a head needs), so this is a
    warning about communication, not a refusal (Megatron-LM, arXiv 1909.08053 section 3: each
    device computes whole heads).

    Args:
      model: the abstract model. template: ``(path, Variable)`` pairs. dims: :func:`tensor_dims`.
      layers: ``path -> L`` of stacked parameters. tensor: ``T``.
    """
    shapes = {p: v.get_value().shape for p, v in template}
    out = []
    for path, d in dims.items():
        owner, node, where = None, model, []
        for key in path[:-1]:  # the nearest module on the path that declares heads
            node = node[key] if isinstance(key, int) else getattr(node, key, None)
            where.append(key)
            if node is not None and _declared(node, _HEADS):
                owner, at = node, tuple(where)
        if owner is None:
            continue
        heads, kv, hd = _declared(owner, _HEADS), _declared(owner, _KV_HEADS) or _declared(owner, _HEADS), _declared(owner, _HEAD_DIM)
        shape = shapes[path][(1 if layers.get(path) is not None else 0):]
        size, why = shape[d], None
        if heads % tensor or kv % tensor:
            why = f"tensor={tensor} does not divide its {heads} heads and {kv} key/value heads"
        elif hd and size not in (heads, kv) and (size == hd or (size % hd == 0 and (size // tensor) % hd)):
            why = (f"its dimension {d} ({size}) is {'the head size' if size == hd else f'{size // hd} heads of {hd}'}, "
                   f"cut into pieces of {size // tensor}")
        if why:
            msg = (f"zshard: tensor_parallel splits parameter {path_str(path)!r} {list(shape)} on dimension {d} over "
                   f"tensor={tensor}, but its attention module {path_str(at)!r} ({type(owner).__name__}) declares "
                   f"{heads} heads{f' of size {hd}' if hd else ''}: {why}, so a device holds parts of a head and the "
                   "compiler moves activations inside attention (the numbers stay right; the communication grows). Fix: "
                   "split the heads dimension, with a tensor size dividing the heads and the key/value heads (Megatron: "
                   "each device computes whole heads and whole key/value groups); docs/tensor-parallel.md")
            out.append(msg)
            if msg not in _warned:
                _warned.add(msg)
                warnings.warn(msg, HeadSplitWarning, stacklevel=3)
    return out

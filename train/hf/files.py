"""Safetensors files of a Hugging Face directory, lazy tensors, and the tensor map.

A family's checkpoint map is a dict ``{our dotted parameter path: Map}``: which Hugging Face
tensors make each parameter and how (:class:`Map`). The same map reads (:meth:`Map.read`)
and writes (:meth:`Map.write`), so loading and saving are inverse by construction.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["Tensor", "Files", "Map", "ConfigReader", "write_checkpoint"]


class Tensor:
    """A lazy tensor: ``t()`` reads it (numpy, logical shape ``t.shape``, dtype ``t.dtype``)."""

    def __init__(self, read: Callable[[], np.ndarray], shape: tuple, dtype):
        self._read, self.shape, self.dtype = read, tuple(shape), np.dtype(dtype)

    def __call__(self) -> np.ndarray:
        return self._read()

    def __repr__(self):
        return f"Tensor({self.shape}, {self.dtype})"


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


class Files:
    """Tensor name -> file of a Hugging Face directory (``model.safetensors``, or the files of
    ``model.safetensors.index.json``); headers only are read here, one tensor per :meth:`read`.

    Raises:
      FileNotFoundError: neither file exists.
    """

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
        self.meta = {}  # name -> (shape, safetensors dtype code)
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

        return np.dtype(dict(_DTYPES, BF16=ml_dtypes.bfloat16).get(self.meta[name][1], np.float32))


@dataclasses.dataclass(frozen=True)
class Map:
    """How Hugging Face tensors make one of our parameters.

    Attributes:
      names: the Hugging Face tensors, in order. With ``experts = E``: ``E`` groups of
        ``len(names) / E`` names, expert-major (``experts.0.gate``, ``experts.0.up``, ...).
      transpose: each tensor is a torch ``nn.Linear`` weight ``[..., out, in]``; ours is
        ``[..., in, out]`` (the last two axes swapped).
      experts: ``0``: one group; ``E > 0``: the groups are stacked on a new leading axis ``[E, ...]``.
      stack: the tensors of a group (transposed first) are stacked on a new axis before their
        last, ``[..., parts, out]`` (gate, up: :class:`train.models.core.GatedMLP`); a single
        tensor is split into ``stack`` equal parts of its last axis that way (GPT-2's
        ``c_attn`` ``[C, 3C]`` -> ``[C, 3, C]``). ``0``: concatenated along the last axis.
      grouped: ``(n_kv_heads, head_dim)``: q, k, v (transposed first) interleaved per
        key/value head, ``[..., nkv, rep + 2, hd]`` (:class:`train.models.core.Attention`:
        each kv head's ``rep`` query heads, its key, its value).

    Otherwise the tensors of a group are concatenated along their last axis, in equal parts.
    """

    names: tuple[str, ...]
    transpose: bool = False
    experts: int = 0
    stack: int = 0
    grouped: tuple[int, int] | None = None

    def groups(self) -> list[tuple[str, ...]]:
        g = len(self.names) // max(self.experts, 1)
        return [self.names[i:i + g] for i in range(0, len(self.names), g)]

    def hf_shapes(self, ours: tuple) -> dict[str, tuple]:
        """The shape each Hugging Face tensor must have for our parameter of shape ``ours``."""
        piece = tuple(ours[1:] if self.experts else ours)
        n = len(self.groups()[0])
        if self.grouped is not None:  # [..., nkv, rep + 2, hd] -> q [..., nkv rep hd], k, v [..., nkv hd]
            nkv, hd = self.grouped
            lead, rep = piece[:-3], piece[-2] - 2
            outs = [lead + (nkv * rep * hd,), lead + (nkv * hd,), lead + (nkv * hd,)]
        elif self.stack:  # [..., parts, out] -> parts x [..., out] (or one [..., parts * out])
            lead, parts, out = piece[:-2], piece[-2], piece[-1]
            outs = [lead + ((parts * out,) if n == 1 else (out,))] * n
        else:
            outs = [piece[:-1] + (piece[-1] // n,)] * n
        flip = lambda s: s[:-2] + (s[-1], s[-2]) if self.transpose else s  # noqa: E731
        return {name: flip(outs[i % n]) for i, name in enumerate(self.names)}

    def read(self, read: Callable[[str], np.ndarray]) -> np.ndarray:
        """Our parameter from ``read(name)`` of each tensor (each read once)."""
        parts = []
        for group in self.groups():
            arrays = [_t(read(n)) if self.transpose else read(n) for n in group]  # [.., out, in] -> [.., in, out]
            parts.append(self._fuse(arrays))
        return np.stack(parts) if self.experts else parts[0]  # [E, ...] or [...]

    def _fuse(self, arrays: list[np.ndarray]) -> np.ndarray:
        if self.grouped is not None:
            nkv, hd = self.grouped
            q, k, v = (a.reshape(a.shape[:-1] + (nkv, -1, hd)) for a in arrays)  # [.., nkv, rep | 1 | 1, hd]
            return np.concatenate([q, k, v], axis=-2)  # [.., nkv, rep + 2, hd]
        if self.stack and len(arrays) == 1:
            a = arrays[0]
            return a.reshape(a.shape[:-1] + (self.stack, -1))  # [.., parts * out] -> [.., parts, out]
        if self.stack:
            return np.stack(arrays, axis=-2)  # [.., parts, out]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-1)  # [.., sum out]

    def _split(self, x: np.ndarray, n: int) -> list[np.ndarray]:
        if self.grouped is not None:
            rep = x.shape[-2] - 2
            flat = lambda a: a.reshape(a.shape[:-3] + (-1,))  # noqa: E731  [.., nkv, j, hd] -> [.., nkv j hd]
            return [flat(x[..., :rep, :]), flat(x[..., rep : rep + 1, :]), flat(x[..., rep + 1 :, :])]
        if self.stack and n == 1:
            return [x.reshape(x.shape[:-2] + (-1,))]
        if self.stack:
            return [x[..., i, :] for i in range(x.shape[-2])]
        return np.split(x, n, axis=-1)  # equal parts of the last axis

    def write(self, x: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """The inverse of :meth:`read`: ``[(name, tensor)]`` from our parameter ``x``."""
        groups = self.groups()
        parts = list(x) if self.experts else [x]  # [E, ...] -> E x [...]
        out = []
        for group, part in zip(groups, parts):
            for name, piece in zip(group, self._split(part, len(group))):
                out.append((name, np.ascontiguousarray(_t(piece) if self.transpose else piece)))
        return out


def _t(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, -1, -2)


class ConfigReader:
    """``config.json`` with errors that name the file and the key."""

    def __init__(self, cfg: dict, path: Path, family: str):
        self.cfg, self.path, self.family = cfg, path, family

    def need(self, key: str):
        if self.cfg.get(key) is None:
            raise ValueError(f"from_hf: {self.path / 'config.json'} has no {key!r} (needed for model_type {self.family!r})")
        return self.cfg[key]

    def get(self, key: str, default=None):
        value = self.cfg.get(key)
        return default if value is None else value

    def refuse(self, cond: bool, what: str):
        if cond:
            raise ValueError(f"from_hf: {self.path / 'config.json'}: {what} is not supported for model_type "
                             f"{self.family!r} by train/models/")


def write_checkpoint(files: list[Callable[[], dict]], path: Path, config: dict) -> Path:
    """Write ``model-0000k-of-0000N.safetensors`` (file ``k``: the tensors ``files[k]()``
    returns, name -> array), ``model.safetensors.index.json`` and ``config.json`` in ``path``
    (created). One file's tensors are on the host at a time."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    path.mkdir(parents=True, exist_ok=True)
    n, weight_map, total = len(files), {}, 0
    for k, make in enumerate(files):
        file = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        out = make()
        save_file(out, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in out})
        total += sum(v.nbytes for v in out.values())
        del out  # one file's tensors on the host at a time
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return path

"""Wrap policy -> units: the groups of parameters that are all-gathered together.

A unit is a submodule whose ``__call__`` is run with its parameters gathered just in time
(FSDP's wrapped module, arXiv 2304.11277 section 3.1). By default each element of a
repeated-block container (an ``nnx.List`` of modules of one class) is a unit; everything
not inside a unit (embeddings, final norm, head) forms the root unit.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from flax import nnx

__all__ = ["find_units", "path_str", "stacked_layers"]


def path_str(path: tuple) -> str:
    """``("blocks", 0, "attn")`` -> ``"blocks.0.attn"``; the root is ``"root"``."""
    return ".".join(str(p) for p in path) if path else "root"


def _modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    return [(tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and p]


def stacked_layers(module: nnx.Module) -> int | None:
    """``L`` when ``module`` holds ``L`` stacked layers (built with ``nnx.vmap``), else ``None``.

    Stacked means: every parameter has a leading dimension of the same size ``L >= 2`` and at
    least one parameter has 3 or more dimensions (a stacked matrix ``[L, d_in, d_out]``);
    plain modules have differing leading dimensions or only matrices and vectors.
    """
    shapes = [v.get_value().shape for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
    if not shapes or min(len(s) for s in shapes) < 1 or max(len(s) for s in shapes) < 3:
        return None
    layers = shapes[0][0]
    return layers if layers >= 2 and all(s[0] == layers for s in shapes) else None


def _repeated_blocks(model: nnx.Module) -> list[tuple]:
    # Elements of an nnx.List whose members are all modules of one class, at least two.
    lists = {tuple(p) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.List)}
    groups: dict[tuple, list] = defaultdict(list)
    for path, mod in _modules(model):
        if path[:-1] in lists and isinstance(path[-1], int):
            groups[path[:-1]].append((path, type(mod)))
    found = []
    for members in groups.values():
        if len(members) >= 2 and len({cls for _, cls in members}) == 1:
            found.extend(p for p, _ in members)
    # Stacked blocks (nnx.vmap-built, run with nnx.scan): one module holding L layers.
    found.extend(p for p, m in _modules(model) if stacked_layers(m) is not None)
    return found


def _outermost(paths: list[tuple]) -> list[tuple]:
    paths = sorted(set(paths), key=len)
    keep: list[tuple] = []
    for p in paths:
        if not any(p[: len(k)] == k for k in keep):
            keep.append(p)
    return keep


def find_units(model: nnx.Module, unit: Any = None) -> list[tuple]:
    """Module paths of the units of ``model`` (the root unit is implicit), in graph order.

    Args:
      model: the (possibly abstract) model.
      unit: ``None`` (repeated blocks: elements of an ``nnx.List`` of one module class, and
        modules of stacked layers, see :func:`stacked_layers`),
        a module class or a tuple of classes (every outermost submodule of that class).

    Returns:
      Paths like ``("blocks", 0)``. Nested matches keep the outermost module.

    Raises:
      ValueError: ``unit`` names a class that does not occur in the model, or is not a
        class / tuple of classes.
    """
    if unit is None:
        found = _repeated_blocks(model)
    else:
        classes = unit if isinstance(unit, tuple) else (unit,)
        if not classes or not all(isinstance(c, type) and issubclass(c, nnx.Module) for c in classes):
            raise ValueError(
                f"unit={unit!r}: expected an nnx.Module subclass or a tuple of them (e.g. unit=Block)"
            )
        found = [p for p, m in _modules(model) if isinstance(m, classes)]
        if not found:
            present = sorted({type(m).__name__ for _, m in _modules(model)})
            names = ", ".join(c.__name__ for c in classes)
            raise ValueError(
                f"unit={names}: no submodule of the model is an instance of it; "
                f"submodule classes present: {', '.join(present)}"
            )
    order = {p: i for i, (p, _) in enumerate(_modules(model))}
    return sorted(_outermost(found), key=lambda p: order[p])

"""The sharding plan: everything static about a sharded model, built from an abstract model.

:func:`make_plan` is the planning step of ``zshard.init`` (checks -> plan -> placement ->
optimizer init): the model's parameters and other variables, the units (wrap policy), one
:class:`~zshard.params.flat.ParamLayout` per parameter (its storage format), the FlatParameters
built from those records, and the PartitionSpecs of the optimizer state. It reads shapes
and dtypes only, never values. An internal function: users get a :class:`Plan` from
``zshard.init(...).plan``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zshard.params.flat import FlatParameter, ParamLayout
from zshard.mesh.axes import MeshAxes
from zshard.mesh.mesh import manual_specs
from zshard.optim.optim import needs_global_view
from zshard.optim.optim_global import build_view
from zshard.wire.precision import FULL_PRECISION, MixedPrecision
from zshard.wire.quant import check_plan, pad_multiple
from zshard.mesh.strategy import Strategy
from zshard.params.tp import expert_dims, tensor_dims, warn_head_splits
from zshard.params.units import find_units, path_str, stacked_layers
from zshard.wire.wire import ParamWire, resolve_wires

__all__ = ["Plan", "Unit", "make_plan"]


def _abstract(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


@dataclasses.dataclass(eq=False, frozen=True)
class Unit:
    """One group of parameters gathered together.

    Attributes:
      name: dotted module path (``"blocks.3"``), or ``"root"`` for everything outside units.
      path: module path in the model, ``()`` for the root.
      flats: one FlatParameter per dtype, split over the strategy's shard axes.
      opt_flats: the same parameters laid out over the optimizer's axes; differs from
        ``flats`` only for SHARD_OPT (ZeRO-1), whose updated slices are all-gathered over
        the world, and HYBRID_SHARD_OPT, whose shards are split again over ``replica``
        (:meth:`FlatParameter.over_replicas`: reduce-scatter and all-gather over ``replica``).
      template: ``(relative path, abstract Variable)`` pairs of the unit module's state,
        shapes of one layer.
      layers: ``L`` for a stacked unit (``nnx.vmap``-built, run with ``nnx.scan``): its
        parameters are ``[L, *shape]``, stored ``[L, n_pad]`` with the layer axis never
        sharded, and each scan iteration gathers only its own layer. ``None`` otherwise.
      shared: ``(relative path, model path)`` of the parameters this unit's module reads but
        does not own: a variable shared with another unit (a tied weight) belongs to the
        root unit, as FSDP puts it in the common parent; the unit call receives its gathered
        value as an input, so its gradient is the sum over every use, reduce-scattered once.
    """

    name: str
    path: tuple
    flats: tuple[FlatParameter, ...]
    opt_flats: tuple[FlatParameter, ...]
    template: tuple = ()
    layers: int | None = None
    shared: tuple = ()

    @property
    def slots(self):
        return [s for f in self.flats for s in f.slots]

    def num_params(self) -> int:
        """Logical parameters of the unit, all layers."""
        return (self.layers or 1) * sum(f.size for f in self.flats)


@dataclasses.dataclass(eq=False, frozen=True)
class Plan:
    """Everything static about a sharded model: mesh, strategy, units, FlatParameters, optimizer.

    Hashed by identity: it is the static part of :class:`~zshard.ShardedState`, so one ``jit``
    cache entry per plan.

    Attributes:
      mesh: the ``(replica, shard)`` mesh.
      strategy: the :class:`~zshard.Strategy`.
      tx: the Optax transformation, applied to local shards.
      graphdef: the model's graph.
      template: ``(path, abstract Variable)`` pairs of the whole model state.
      units: the root unit first, then the block units in call order; their FlatParameters
        hold one :class:`~zshard.params.flat.ParamLayout` per parameter (:attr:`layouts`), from
        which ``param_specs`` and ``trainable`` are read.
      opt_specs: PartitionSpecs of the Optax state (parameter-like leaves as the parameter,
        scalars such as step counts ``P()``).
      mp: the :class:`~zshard.MixedPrecision` policy.
      var_template: ``(path, abstract Variable)`` pairs of the model's non-parameter
        variables (BatchNorm statistics, RNG keys and counts, counters), replicated.
      opt_view: ``None`` when ``tx`` is elementwise (it runs on the local slices as they
        are); else the :class:`zshard.optim.optim_global.OptView` that runs it exactly on shards.
      offload: ``None``, ``"optimizer"`` or ``"optimizer+master"``: what lives in pinned host
        memory (:mod:`zshard.optim.offload`, ``zshard.init(..., offload=...)``).
    """

    mesh: Mesh
    strategy: Strategy
    tx: optax.GradientTransformation
    graphdef: Any
    template: tuple
    units: tuple[Unit, ...]
    opt_specs: Any = None
    mp: MixedPrecision = FULL_PRECISION
    var_template: tuple = ()
    opt_view: Any = None
    offload: str | None = None

    @functools.cached_property
    def layouts(self) -> dict[tuple, ParamLayout]:
        """Parameter path -> its :class:`~zshard.params.flat.ParamLayout` (the storage format), in
        the order of :attr:`template`."""
        records = {s.path: s.param for u in self.units for f in u.flats for s in f.slots}
        return {p: records[p] for p, _ in self.template}

    @functools.cached_property
    def wires(self) -> dict[tuple, ParamWire]:
        """Parameter path -> its :class:`~zshard.wire.ParamWire`: how its bytes travel (axes, dtypes,
        the formats that quantize it, tensor pieces, error feedback), resolved once here from the
        strategy, the mesh axes and the mixed precision ([Note: the wire record], zshard/wire/wire.py)."""
        return resolve_wires(self)

    @functools.cached_property
    def param_specs(self) -> dict:
        """Nested dict like ``params``: each parameter's PartitionSpec at rest (``tensor``
        included for a parameter split over it; :func:`zshard.mesh.manual_specs` for a
        ``shard_map``'s specs)."""
        return traverse_util.unflatten_dict({p: rec.spec for p, rec in self.layouts.items()})

    @functools.cached_property
    def axes(self) -> MeshAxes:
        """The mesh's axes, validated once (:class:`~zshard.mesh.axes.MeshAxes`): every axis question
        below is answered from it."""
        return MeshAxes.of(self.mesh)

    @property
    def tensor(self) -> int:
        """``T``: devices of the mesh's ``tensor`` axis (1 without one)."""
        return self.axes.tensor

    @property
    def expert(self) -> int:
        """``X``: devices of the mesh's ``expert`` axis (1 without one)."""
        return self.axes.expert

    @functools.cached_property
    def expert_split(self) -> frozenset:
        """Paths of the expert parameters (split over the ``expert`` axis: ``E/X`` whole experts per device)."""
        return frozenset(p for p, rec in self.layouts.items() if rec.expert)

    @functools.cached_property
    def tensor_split(self) -> frozenset:
        """Paths of the parameters split over the ``tensor`` axis."""
        return frozenset(p for p, rec in self.layouts.items() if rec.split)

    def manual(self, specs):
        """``specs`` as a ``shard_map`` over the data axes takes them (``tensor`` removed)."""
        return manual_specs(specs)

    @functools.cached_property
    def trainable(self) -> frozenset:
        """Paths of the trainable parameters."""
        return frozenset(p for p, rec in self.layouts.items() if rec.trainable)

    @property
    def variable_paths(self) -> tuple:
        """Paths of the non-parameter variables (``ShardedState.variables``)."""
        return tuple(p for p, _ in self.var_template)

    def split_trainable(self, params: dict) -> tuple[dict, dict]:
        """``params`` -> (trainable, frozen) nested dicts."""
        flat = traverse_util.flatten_dict(params)
        train = {p: v for p, v in flat.items() if p in self.trainable}
        frozen = {p: v for p, v in flat.items() if p not in self.trainable}
        return traverse_util.unflatten_dict(train), traverse_util.unflatten_dict(frozen)

    @staticmethod
    def merge_params(train: dict, frozen: dict) -> dict:
        return traverse_util.unflatten_dict({**traverse_util.flatten_dict(frozen), **traverse_util.flatten_dict(train)})

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """Mesh axes a dense parameter is split over at rest (``Strategy.shard_axes``, with ``expert`` or
        ``context`` after ``shard`` on a mesh with one: :meth:`zshard.mesh.axes.MeshAxes.with_context`). An
        expert parameter lies over ``("expert", *these without expert)`` and is gathered over these
        without ``expert`` (its :class:`~zshard.wire.ParamWire`)."""
        return self.axes.with_context(self.strategy.shard_axes)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Mesh axes the parameters are replicated over (``Strategy.replica_axes`` on this mesh)."""
        return self.axes.with_context(self.strategy.replica_axes)

    @property
    def opt_axes(self) -> tuple[str, ...]:
        """Mesh axes the optimizer state is split over, major first (``Strategy.opt_axes`` on this mesh)."""
        return self.axes.with_context(self.strategy.opt_axes)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the data is split over: ``("replica", "shard"[, "expert"][, "context"])``
        (:attr:`zshard.mesh.axes.MeshAxes.data_axes`); the loss and metrics are reduced over them."""
        return self.axes.data_axes

    @property
    def context(self) -> int:
        """``C``: devices of the mesh's ``context`` axis (1 without one)."""
        return self.axes.context

    @property
    def num_shards(self) -> int:
        """``N``: devices one parameter is split over at rest (1 when replicated)."""
        return self.axes.size(self.shard_axes)

    @property
    def grad_axes(self) -> tuple[str, ...]:
        """Mesh axes the reduced gradient handed to the optimizer is split over: the
        optimizer's for HYBRID_SHARD_OPT (``(shard, replica)``), else the parameters'."""
        return self.opt_axes if self.strategy.scatters_replica else self.shard_axes

    @property
    def opt_shards(self) -> int:
        """Devices the optimizer state of one parameter is split over."""
        return self.axes.size(self.opt_axes)

    @property
    def world(self) -> int:
        """Devices of the data axes (``replica x shard x expert x context``): the global batch's rows are
        split over ``replica x shard`` and its sequences over ``context`` (or its rows over all
        three), never over ``tensor``; every device holds the same number of tokens, so the loss
        scale is ``1 / world`` (the gradient of the global mean loss, docs/long-sequences.md)."""
        return self.axes.world

    def num_params(self) -> int:
        """Logical parameter count, no padding."""
        return sum(u.num_params() for u in self.units)

    def layers_of(self) -> dict[tuple, int | None]:
        """Parameter path -> ``L`` of its stacked unit (``None`` when not stacked)."""
        return {p: rec.layers for p, rec in self.layouts.items()}


def _submodule(model, path):
    for key in path:
        model = model[key] if isinstance(key, int) else getattr(model, key)
    return model


def _shared_reads(model, unit_paths) -> dict[tuple, list]:
    """``unit path -> [(relative path, model path)]`` of variables the unit reads but another
    unit (or the root) also reaches: tied weights. Model paths are nnx's (first occurrence)."""
    canonical = {id(v): tuple(p) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    reach = {
        u: [(tuple(p), canonical[id(v)]) for p, v in nnx.iter_graph(_submodule(model, u)) if isinstance(v, nnx.Variable)]
        for u in unit_paths
    }
    readers: dict[tuple, set] = defaultdict(set)
    for u, pairs in reach.items():
        for _, c in pairs:
            readers[c].add(u)
    owner = lambda c: max((u for u in unit_paths if c[: len(u)] == u), key=len, default=())  # noqa: E731
    shared = {c for c, us in readers.items() if len(us | {owner(c)}) > 1}
    return {u: [(r, c) for r, c in pairs if c in shared] for u, pairs in reach.items()}


def _plan_units(abstract_model, flat_state, strategy: Strategy, num_shards: int, opt_shards: int, unit, trainable,
                            tp: tuple = (None, {}, 1), mesh=None, mp: MixedPrecision = FULL_PRECISION,
                            world: int = 1, ep: tuple = (None, {}, 1)) -> tuple[Unit, ...]:
    """The units, each with its parameters' records laid out in FlatParameters (one per
    dtype, trainability and tensor split) over the shard axes, and over the optimizer's axes.
    ``tp``: ``(tensor_parallel, logical rules, T)`` (:func:`zshard.params.tp.tensor_dims`); ``ep``:
    ``(expert_parallel, logical rules, X)`` (:func:`zshard.params.tp.expert_dims`). A parameter
    that a quantized format of ``mp`` applies to is padded so that no block straddles two
    shards (:func:`zshard.wire.quant.pad_multiple`; ``world``: the data devices)."""
    unit_paths = find_units(abstract_model, unit)
    param_paths = {p for p, _ in flat_state}
    # Tied parameters; shared non-parameter variables (one Rngs for every block) are simply
    # read and written by each unit call in turn.
    shared = {u: [(r, c) for r, c in pairs if c in param_paths] for u, pairs in _shared_reads(abstract_model, unit_paths).items()}
    tied = {c for pairs in shared.values() for _, c in pairs}
    members: dict[tuple, list] = defaultdict(list)
    for path, var in flat_state:
        owner = () if path in tied else max((u for u in unit_paths if path[: len(u)] == u), key=len, default=())
        members[owner].append((path, var))
    stacked = {upath: stacked_layers(_submodule(abstract_model, upath)) if upath else None for upath in [()] + unit_paths}
    layers_of = {path: stacked[u] for u, params in members.items() for path, _ in params}
    tp_dims = tensor_dims(flat_state, layers_of, tp[0], tp[1], tp[2])
    ep_dims = expert_dims(flat_state, layers_of, ep[0], ep[1], ep[2])
    warn_head_splits(abstract_model, flat_state, tp_dims, layers_of, tp[2])  # a split that cuts heads: warned
    shard_axes = strategy.shard_axes if mesh is None else MeshAxes.of(mesh).with_context(strategy.shard_axes)
    units = []
    for upath in [()] + unit_paths:
        params = members.get(upath, [])
        if not params:
            continue
        sub = _submodule(abstract_model, upath)
        layers = stacked[upath]
        if layers is not None and shared.get(upath):
            raise ValueError(
                f"stacked unit {path_str(upath)!r} shares {path_str(shared[upath][0][1])!r} with another part of the "
                "model; a weight tied across scanned layers is not supported: keep it outside the stacked module"
            )
        drop = 0 if layers is None else 1  # stacked: lay out one layer's shape
        name = path_str(upath)
        groups: dict = defaultdict(list)  # (dtype, trainable, split) -> records: one FlatParameter each
        for path, var in params:
            value = var.get_value()
            build = lambda multiple: ParamLayout.build(  # noqa: E731
                path, value.shape[drop:], value.dtype, multiple, layers, shard_axes, path in trainable, name,
                tp_dims.get(path), tp[2], ep_dims.get(path), ep[2],
            )
            rec = build(opt_shards)
            if mp.quantized:  # pad to a multiple of N * block where a format quantizes it
                rec = build(pad_multiple(mp, rec, num_shards, opt_shards, world))
            groups[rec.dtype, rec.trainable, rec.split].append(rec)
        flats = tuple(FlatParameter.build(name, g, num_shards, trainable=t) for (_, t, _), g in groups.items())
        if strategy.scatters_replica:  # HYBRID_SHARD_OPT: each shard split again over replica
            opt_flats = tuple(f.over_replicas(opt_shards // num_shards) for f in flats if f.trainable)
        else:
            opt_flats = tuple(FlatParameter.build(name, g, opt_shards) for (_, t, _), g in groups.items() if t)
        template = ()
        if upath:  # the unit call merges these with the module's current graph (intercept.UnitBinding)
            _, sub_state = nnx.split(sub)
            one_layer = lambda x: jax.ShapeDtypeStruct(np.shape(x)[drop:], jnp.result_type(x))  # noqa: E731
            template = tuple(nnx.to_flat_state(jax.tree.map(one_layer, sub_state)))
        units.append(Unit(name, upath, flats, opt_flats, template, layers, tuple(shared.get(upath, ()))))
    return tuple(units)


def _optimizer_specs(tx, layouts: dict, opt_axes: tuple[str, ...], opt_shards: int):
    """``(opt_specs, opt_view)``: PartitionSpecs of the Optax state of the trainable
    parameters, and the global view (``None`` for an elementwise chain).

    The optimizer runs on per-parameter slices over ``opt_axes`` (``Plan.opt_axes``), viewed with the
    parameter's logical rank (:meth:`ParamLayout.view_shape`, ``[.., 1, ..., 1, n_pad/opt_shards]``).
    """
    train = {p: rec for p, rec in layouts.items() if rec.trainable}
    view_specs = {p: rec.view_spec(opt_axes) for p, rec in train.items()}
    local = traverse_util.unflatten_dict({p: jax.ShapeDtypeStruct(rec.view_shape(opt_shards), rec.dtype) for p, rec in train.items()})
    # Elementwise chains run on the local slices as they are; anything else (a norm, a
    # matmul, random numbers) through the global view (zshard.optim.optim_global).
    why = needs_global_view(tx, local)
    if why is not None:
        logical = {p: jax.ShapeDtypeStruct(rec.logical_shape, rec.dtype) for p, rec in train.items()}
        layers = {p: rec.layers for p, rec in train.items()}
        tp = {p: (rec.tp_dim, rec.tp) for p, rec in train.items() if rec.split}
        view = build_view(tx, logical, layers, opt_shards, view_specs, why, tp, {p: rec.padded for p, rec in train.items()})
        return view.specs, view
    masked = optax.MaskedNode
    specs = optax.tree_map_params(
        tx,
        lambda leaf, s: leaf if isinstance(leaf, masked) else s,  # masked-out slots hold no array
        jax.eval_shape(tx.init, local),
        traverse_util.unflatten_dict(view_specs),
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, (P, masked)),
    )
    return specs, None


def make_plan(
    abstract_model: nnx.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    strategy: Strategy,
    unit: Any = None,
    mixed_precision: MixedPrecision | None = None,
    trainable: Any = nnx.Param,
    tensor_parallel=None,
    logical_rules: dict | None = None,
    expert_parallel=None,
) -> Plan:
    """The :class:`Plan` of a model (shapes and dtypes only are read).

    Args:
      abstract_model: the model, built or from ``nnx.eval_shape``.
      tx, mesh, strategy, unit, mixed_precision, trainable, tensor_parallel, logical_rules,
        expert_parallel: as :func:`zshard.init` takes them, already checked (``strategy`` parsed,
        rules checked).

    Raises:
      ValueError: a sow-ed intermediate in the model; a ``trainable`` filter that selects a
        non-parameter or nothing; a ``unit`` class not in the model; a tied weight inside a
        stacked unit (each named by path); expert parameters under an option expert
        parallelism does not support (:func:`_check_experts`).
    """
    graphdef, state = nnx.split(abstract_model)
    all_state = list(nnx.to_flat_state(state))
    flat_state = [(p, v) for p, v in all_state if isinstance(v, nnx.Param)]
    var_state = [(p, v) for p, v in all_state if not isinstance(v, nnx.Param)]
    for path, var in var_state:
        if isinstance(var, nnx.Intermediate):
            raise ValueError(
                f"zshard.init: the model holds a sow-ed intermediate {path_str(path)!r} ({type(var).__name__}); "
                "pop it before sharding (nnx.pop(model, nnx.Intermediate)): intermediates belong to one forward pass"
            )
    template = tuple((p, v.replace(_abstract(v.get_raw_value()))) for p, v in flat_state)
    var_template = tuple((p, v.replace(_abstract(v.get_raw_value()))) for p, v in var_state)
    axes = MeshAxes.of(mesh)  # the mesh's degrees, validated once
    num_shards = axes.size(axes.with_context(strategy.shard_axes))
    opt_shards = axes.size(axes.with_context(strategy.opt_axes))
    selected = frozenset(p for p, _ in nnx.to_flat_state(nnx.state(abstract_model, trainable)))
    # Integer and boolean parameters (index tables, masks) have no gradient: always frozen.
    inexact = {p for p, v in template if jnp.issubdtype(v.get_value().dtype, jnp.inexact)}
    train_paths = selected & inexact
    for path in sorted(selected - {p for p, _ in template}, key=str)[:1]:
        raise ValueError(f"trainable= selects {path_str(path)!r}, which is not an nnx.Param; the filter must select parameters")
    if not train_paths:
        raise ValueError("trainable= selects no parameter: nothing would train; check the filter (default nnx.Param)")
    tp = (tensor_parallel, logical_rules or {}, axes.tensor)
    mp = mixed_precision or FULL_PRECISION
    world = axes.world
    ep = (expert_parallel, logical_rules or {}, axes.expert)
    if axes.expert > 1:
        _check_experts(strategy, mp, axes.expert)
    units = _plan_units(abstract_model, template, strategy, num_shards, opt_shards, unit, train_paths, tp, mesh, mp, world, ep)
    plan = Plan(mesh, strategy, tx, graphdef, template, units, mp=mp, var_template=var_template)
    check_plan(plan)  # a quantized format that applies to nothing, refused before compiling
    opt_specs, opt_view = _optimizer_specs(tx, plan.layouts, plan.opt_axes, opt_shards)
    if plan.expert_split and opt_view is not None:
        raise ValueError(
            f"zshard.init: expert parallelism (expert parameters such as {path_str(sorted(plan.expert_split, key=str)[0])!r}) "
            "is not supported with an optimizer that needs the global view of the parameters (not elementwise): use an "
            "elementwise Optax chain (adam, adamw, sgd, lion; clipping is the step's clip_norm=), or build the mesh without "
            "expert= (docs/expert-parallel.md)"
        )
    return dataclasses.replace(plan, opt_specs=opt_specs, opt_view=opt_view)


def _check_experts(strategy: Strategy, mp: MixedPrecision, expert: int) -> None:
    """Refuse, before anything is placed, what a mesh with an expert axis does not support
    (docs/expert-parallel.md). Supported: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD,
    HYBRID_SHARD_ZERO2 (the expert parameters sharded over the strategy's shard axes inside each
    expert group, never reduced over ``expert``), unquantized collectives; an elementwise Optax
    chain (checked in :func:`make_plan`).

    Raises:
      ValueError: NO_SHARD / SHARD_OPT / HYBRID_SHARD_OPT, or a quantized format, with the fix.
    """
    what = None
    if strategy.name not in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        what = (f"strategy {strategy.name}", "use FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or HYBRID_SHARD_ZERO2")
    elif mp.quantized:
        what = ("quantized collectives (MixedPrecision gather/reduce/replica formats)", "drop the formats")
    if what is not None:
        raise ValueError(
            f"zshard.init: expert parallelism (the mesh's expert={expert}) is not supported with {what[0]}: {what[1]}, "
            "or build the mesh without expert= (docs/expert-parallel.md)"
        )

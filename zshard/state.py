"""The sharding plan and the sharded train state: ``init`` and ``unshard``.

``init`` turns an ordinary NNX model and an Optax transformation into a
:class:`ShardedState`: each parameter padded, flattened and split over the shard axes of
the strategy, grouped into units (FlatParameters), and the Optax state initialised on the
local shards with the same PartitionSpecs. ``unshard`` goes back to a plain ``nnx.Module``.

Over 400 lines for now: ``init`` (checks -> plan -> placement -> optimizer init) is to be
split into a plan builder and ``init`` (issue 13); that split waits while several changes
to this file are in flight.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.flat import FlatParameter, pad_flat, padded_size
from zshard.mesh import AXES
from zshard.optim import init_optimizer, needs_global_view, view_rank
from zshard.optim_global import build_view
from zshard.precision import FULL_PRECISION, MixedPrecision
from zshard.strategy import Strategy
from zshard.units import find_units, path_str, stacked_layers
from zshard.weights import check_weights, place_weights

__all__ = ["Plan", "Unit", "ShardedState", "init", "unshard"]


def _abstract(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def _fill(template: tuple, values: dict) -> nnx.State:
    """A state from ``template`` (``(path, Variable)`` pairs) with values where ``values`` has them."""
    return nnx.from_flat_state([(p, v.replace(values[p]) if p in values else v) for p, v in template])


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

    Hashed by identity: it is the static part of :class:`ShardedState`, so one ``jit``
    cache entry per plan.

    Attributes:
      mesh: the ``(replica, shard)`` mesh.
      strategy: the :class:`~zshard.Strategy`.
      tx: the Optax transformation, applied to local shards.
      graphdef: the model's graph.
      template: ``(path, abstract Variable)`` pairs of the whole model state.
      units: the root unit first, then the block units in call order.
      param_specs: nested dict like ``params``: ``PartitionSpec(shard_axes)`` per parameter
        (``PartitionSpec()`` when replicated).
      opt_specs: PartitionSpecs of the Optax state (parameter-like leaves as the parameter,
        scalars such as step counts ``P()``).
      mp: the :class:`~zshard.MixedPrecision` policy.
      trainable: paths of the trainable parameters (the rest are frozen: gathered, never
        reduce-scattered, no optimizer state, unchanged by the step).
      var_template: ``(path, abstract Variable)`` pairs of the model's non-parameter
        variables (BatchNorm statistics, RNG keys and counts, counters), replicated.
      opt_view: ``None`` when ``tx`` is elementwise (it runs on the local slices as they
        are); else the :class:`zshard.optim_global.OptView` that runs it exactly on shards.
    """

    mesh: Mesh
    strategy: Strategy
    tx: optax.GradientTransformation
    graphdef: Any
    template: tuple
    units: tuple[Unit, ...]
    param_specs: dict
    opt_specs: Any = None
    mp: MixedPrecision = FULL_PRECISION
    trainable: frozenset = frozenset()
    var_template: tuple = ()
    opt_view: Any = None

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
        return self.strategy.shard_axes

    @property
    def replica_axes(self) -> tuple[str, ...]:
        return self.strategy.replica_axes

    @property
    def num_shards(self) -> int:
        """``N``: devices one parameter is split over at rest (1 when replicated)."""
        return int(np.prod([self.mesh.shape[a] for a in self.shard_axes]))

    @property
    def grad_axes(self) -> tuple[str, ...]:
        """Mesh axes the reduced gradient handed to the optimizer is split over: the
        optimizer's for HYBRID_SHARD_OPT (``(shard, replica)``), else the parameters'."""
        return self.strategy.opt_axes if self.strategy.scatters_replica else self.shard_axes

    @property
    def opt_shards(self) -> int:
        """Devices the optimizer state of one parameter is split over."""
        return int(np.prod([self.mesh.shape[a] for a in self.strategy.opt_axes]))

    @property
    def world(self) -> int:
        """Devices in the mesh; the global batch is split over all of them."""
        return int(self.mesh.size)


    def num_params(self) -> int:
        """Logical parameter count, no padding."""
        return sum(u.num_params() for u in self.units)

    def layers_of(self) -> dict[tuple, int | None]:
        """Parameter path -> ``L`` of its stacked unit (``None`` when not stacked)."""
        return {s.path: u.layers for u in self.units for s in u.slots}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedState:
    """The train state, every array sharded over the mesh.

    Attributes:
      params: nested dict mirroring the model state (``params["blocks"][0]["attn"]["kernel"]``);
        each leaf is the padded flat parameter, global shape ``[n_pad]``, dtype of the
        parameter, sharding ``PartitionSpec(shard_axes)`` (local ``[n_pad / N]``).
      opt_state: the Optax state of the local shards, partitioned like ``params``;
        scalar leaves (counts) replicated, ``PartitionSpec()``.
      step: int32 scalar, optimizer steps taken (a step skipped by ``skip_nonfinite`` is
        not counted, like the optimizer's own counts), replicated.
      plan: the static :class:`Plan`.
      variables: nested dict of the model's non-parameter variables (BatchNorm statistics,
        RNG keys and counts, counters) in their own shapes and dtypes, replicated
        (``PartitionSpec()``), identical on every device after each step.
    """

    params: dict
    opt_state: Any
    step: jax.Array
    plan: Plan = dataclasses.field(metadata=dict(static=True))
    variables: dict = dataclasses.field(default_factory=dict)

    def specs(self) -> "ShardedState":
        """The PartitionSpec tree of this state (for ``shard_map`` in/out specs)."""
        var_specs = traverse_util.unflatten_dict({p: P() for p in self.plan.variable_paths}) if self.plan.var_template else {}
        return ShardedState(self.plan.param_specs, self.plan.opt_specs, P(), self.plan, var_specs)


def _spec(axes: tuple[str, ...], layers: int | None = None) -> P:
    """PartitionSpec of a padded flat parameter ``[n_pad]`` (or ``[L, n_pad]``) over ``axes``."""
    lead = () if layers is None else (None,)
    return P(*lead, axes) if axes else P()


def _check_mesh(mesh):
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
        names = getattr(mesh, "axis_names", None)
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {AXES} (use zshard.make_mesh); got axes {names}")


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


def _plan_units(abstract_model, flat_state, num_shards, opt_shards, unit, trainable=None, split_shards=False) -> tuple[Unit, ...]:
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
    units = []
    for upath in [()] + unit_paths:
        params = members.get(upath, [])
        if not params:
            continue
        sub = _submodule(abstract_model, upath)
        layers = stacked_layers(sub) if upath else None
        if layers is not None and shared.get(upath):
            raise ValueError(
                f"stacked unit {path_str(upath)!r} shares {path_str(shared[upath][0][1])!r} with another part of the "
                "model; a weight tied across scanned layers is not supported: keep it outside the stacked module"
            )
        drop = 0 if layers is None else 1  # stacked: lay out one layer's shape
        groups: dict = defaultdict(list)  # (dtype, trainable) -> parameters: one FlatParameter each
        for path, var in params:
            value = var.get_value()
            train = trainable is None or path in trainable
            groups[np.dtype(value.dtype), train].append((path, value.shape[drop:], value.dtype))
        name = path_str(upath)
        flats = tuple(FlatParameter.build(name, g, num_shards, opt_shards, trainable=t) for (_, t), g in groups.items())
        if split_shards:  # HYBRID_SHARD_OPT: each shard split again over replica
            opt_flats = tuple(f.over_replicas(opt_shards // num_shards) for f in flats if f.trainable)
        else:
            opt_flats = tuple(FlatParameter.build(name, g, opt_shards) for (_, t), g in groups.items() if t)
        template = ()
        if upath:  # the unit call merges these with the module's current graph (intercept.UnitBinding)
            _, sub_state = nnx.split(sub)
            one_layer = lambda x: jax.ShapeDtypeStruct(np.shape(x)[drop:], jnp.result_type(x))  # noqa: E731
            template = tuple(nnx.to_flat_state(jax.tree.map(one_layer, sub_state)))
        units.append(Unit(name, upath, flats, opt_flats, template, layers, tuple(shared.get(upath, ()))))
    return tuple(units)


def _initial_variables(model, concrete: bool, var_state, var_paths, replicated) -> list:
    """The model's non-parameter variables (RNG state, statistics), replicated; ``params=`` only
    replaces parameters. A callable ``model`` runs under ``jit`` (its parameters are dead code)."""
    if not var_paths:
        return []
    if concrete:
        return [jax.device_put(v.get_raw_value(), replicated) for _, v in var_state]

    def build():
        with nnx.use_eager_sharding(False):
            _, st = nnx.split(model())
        flat = dict(nnx.to_flat_state(st))
        return [flat[p].get_raw_value() for p in var_paths]

    return jax.jit(build, out_shardings=[replicated] * len(var_paths))()


def init(
    model: nnx.Module | Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    strategy: Strategy | str | None = None,
    unit: Any = None,
    zero_stage: int | None = None,
    mixed_precision: MixedPrecision | None = None,
    trainable: Any = nnx.Param,
    abstract: bool = False,
    params: Any = None,
) -> ShardedState:
    """Shard a model and initialise the optimizer on the shards.

    Args:
      model: an ``nnx.Module`` (copied to the shards from host memory), or a zero-argument
        callable that builds one (run under ``jit`` with output shardings: the whole model
        never exists on one device).
      tx: an Optax transformation; it runs on the local shards (elementwise transforms).
      mesh: from :func:`zshard.make_mesh`, axes ``("replica", "shard")``.
      strategy: a :class:`Strategy` or its name (default ``"FULL_SHARD"``): ``NO_SHARD``,
        ``SHARD_OPT``, ``SHARD_GRAD_OP``, ``FULL_SHARD``, ``HYBRID_SHARD``,
        ``HYBRID_SHARD_ZERO2`` (docs/design.md section 3), ``HYBRID_SHARD_OPT`` (docs/memory.md).
      unit: the wrap policy, what is gathered together: ``None`` (each element of an
        ``nnx.List`` of repeated blocks, and stacked modules), a module class / tuple of
        classes, a callable ``(path, module) -> bool``, or a minimum parameter count
        (size-based); see :func:`zshard.units.find_units`. Everything outside the units is
        the root unit.
      zero_stage: DeepSpeed's ZeRO stage 0/1/2/3, an alias of NO_SHARD / SHARD_OPT /
        SHARD_GRAD_OP / FULL_SHARD.
      mixed_precision: :class:`~zshard.MixedPrecision` (FSDP's meaning): fp32 masters and
        optimizer state in the shards, all-gather and compute in ``param_dtype``, gradient
        reduction in ``reduce_dtype``. Default: everything in the parameters' own dtype.
      trainable: an ``nnx`` filter selecting the trainable parameters (default ``nnx.Param``:
        all floating ones; integer and boolean parameters are always frozen). The other
        parameters are frozen: gathered like the rest, but they get no gradient, no
        reduce-scatter, no optimizer state, and stay bitwise unchanged.
      abstract: allocate nothing: every leaf is a ``jax.ShapeDtypeStruct`` carrying its
        sharding (pass a callable ``model``; it is only traced with ``nnx.eval_shape``), for
        ``step.lower`` / :func:`zshard.report` of models larger than the machine.
      params: pretrained weights instead of the model's own initial values: a mapping from
        each dotted parameter path (``"blocks.0.attn.qkv.kernel"``) to a zero-argument
        callable returning that parameter in its logical shape (e.g. from
        ``train.model.from_hf``). Names, and shapes of callables with a ``.shape``
        attribute, are checked before anything is read; each callable is called once and its
        array written straight into its shards (``zshard.weights``), so host memory holds
        about the largest tensor. Values are cast to the parameter's dtype. The model (a
        callable is then only traced with ``nnx.eval_shape``) gives structure and dtypes.

    Returns:
      :class:`ShardedState`; every parameter ``[n_pad]`` with ``PartitionSpec(shard_axes)``
      (``n_pad``: the size rounded up to a multiple of the devices it is split over; the
      optimizer state is split over ``strategy.opt_axes``).

    Raises:
      ValueError: bad mesh, unknown strategy, a ``unit`` class not in the model, or a
        model variable that is not an ``nnx.Param`` (named by path).
      TypeError: ``model`` is neither a module nor a callable.
      ValueError (``params``): every missing, extra or misshapen tensor, named with both
        shapes, before anything is placed.
    """
    _check_mesh(mesh)
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"zshard.init: tx must be an optax.GradientTransformation (e.g. optax.adamw(3e-4)), got {type(tx).__name__}")
    strategy = Strategy.parse(strategy if strategy is not None or zero_stage is not None else "FULL_SHARD", zero_stage=zero_stage)
    if isinstance(model, nnx.Module):
        abstract_model, concrete = model, True
    elif callable(model):
        # Sharding annotations (nnx.with_partitioning, out_sharding metadata) are kept as
        # metadata and not applied: zshard lays the parameters out itself.
        with nnx.use_eager_sharding(False):
            abstract_model, concrete = nnx.eval_shape(model), False
        if not isinstance(abstract_model, nnx.Module):
            what = type(abstract_model).__name__ if not isinstance(abstract_model, jax.ShapeDtypeStruct) else f"an array {abstract_model}"
            raise TypeError(f"zshard.init: the model callable must return an nnx.Module, it returned {what}")
    else:
        raise TypeError(f"zshard.init: model must be an nnx.Module or a callable building one, got {type(model).__name__}")

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
    num_shards = int(np.prod([mesh.shape[a] for a in strategy.shard_axes]))
    opt_shards = int(np.prod([mesh.shape[a] for a in strategy.opt_axes]))
    selected = frozenset(p for p, _ in nnx.to_flat_state(nnx.state(abstract_model, trainable)))
    # Integer and boolean parameters (index tables, masks) have no gradient: always frozen.
    inexact = {p for p, v in template if jnp.issubdtype(v.get_value().dtype, jnp.inexact)}
    train_paths = selected & inexact
    for path in sorted(selected - {p for p, _ in template}, key=str)[:1]:
        raise ValueError(f"trainable= selects {path_str(path)!r}, which is not an nnx.Param; the filter must select parameters")
    if not train_paths:
        raise ValueError("trainable= selects no parameter: nothing would train; check the filter (default nnx.Param)")
    units = _plan_units(abstract_model, template, num_shards, opt_shards, unit, train_paths, strategy.scatters_replica)

    layers = {s.path: u.layers for u in units for s in u.slots}
    paths = [p for p, _ in template]
    specs = {p: _spec(strategy.shard_axes, layers[p]) for p in paths}
    shardings = [NamedSharding(mesh, specs[p]) for p in paths]
    param_specs = traverse_util.unflatten_dict(specs)

    def padded_shape(path, shape, shards=1):  # [n_pad / shards] or [L, n_pad / shards]
        lead = () if layers[path] is None else (layers[path],)
        return lead + (padded_size(int(np.prod(shape[len(lead):])), opt_shards) // shards,)

    replicated = NamedSharding(mesh, P())
    var_paths = [p for p, _ in var_template]
    if params is not None:
        check_weights(template, params)
    if abstract:
        values = [
            jax.ShapeDtypeStruct(padded_shape(p, v.get_value().shape), v.get_value().dtype, sharding=sh)
            for (p, v), sh in zip(template, shardings)
        ]
        var_values = [jax.ShapeDtypeStruct(v.get_raw_value().shape, v.get_raw_value().dtype, sharding=replicated) for _, v in var_template]
    elif params is not None:
        values = place_weights(template, params, shardings, layers, opt_shards)
        var_values = _initial_variables(model, concrete, var_state, var_paths, replicated)
    elif concrete:
        values = [
            jax.device_put(pad_flat(np.asarray(v.get_raw_value()), opt_shards, layers[p]), sh)
            for (p, v), sh in zip(flat_state, shardings)
        ]
        var_values = [jax.device_put(v.get_raw_value(), replicated) for _, v in var_state]
    else:

        def build():
            with nnx.use_eager_sharding(False):
                _, st = nnx.split(model())
            flat = dict(nnx.to_flat_state(st))
            return (
                [pad_flat(flat[p].get_raw_value(), opt_shards, layers[p]) for p in paths],
                [flat[p].get_raw_value() for p in var_paths],
            )

        values, var_values = jax.jit(build, out_shardings=(shardings, [replicated] * len(var_paths)))()
    variables = traverse_util.unflatten_dict(dict(zip(var_paths, var_values))) if var_paths else {}
    params = traverse_util.unflatten_dict(dict(zip(paths, values)))

    # The optimizer runs on per-parameter slices over strategy.opt_axes, viewed with the
    # parameter's logical rank: [.., 1, ..., 1, n_pad / opt_shards] (see optim._to_view).
    ones = {p: view_rank(len(v.shape) - (layers[p] is not None)) - 1 for p, v in template}
    opt_axes = strategy.opt_axes
    opt_param_specs = traverse_util.unflatten_dict(
        {p: P(*([None] * ((layers[p] is not None) + ones[p])), opt_axes) if opt_axes else P() for p in paths if p in train_paths}
    )
    local = traverse_util.unflatten_dict(
        {
            p: jax.ShapeDtypeStruct(
                (lambda sh: sh[:-1] + (1,) * ones[p] + sh[-1:])(padded_shape(p, v.shape, opt_shards)), v.get_value().dtype
            )
            for p, v in template
            if p in train_paths
        }
    )
    # Elementwise chains run on the local slices as they are; anything else (a norm, a
    # matmul, random numbers) through the global view (zshard.optim_global).
    why, opt_view = needs_global_view(tx, local), None
    if why is not None:
        logical = {p: v.get_value() for p, v in template if p in train_paths}
        opt_view = build_view(tx, logical, layers, opt_shards, traverse_util.flatten_dict(opt_param_specs), why)
        opt_specs = opt_view.specs
    else:
        masked = optax.MaskedNode
        opt_specs = optax.tree_map_params(
            tx,
            lambda leaf, s: leaf if isinstance(leaf, masked) else s,  # masked-out slots hold no array
            jax.eval_shape(tx.init, local),
            opt_param_specs,
            transform_non_params=lambda _: P(),
            is_leaf=lambda x: isinstance(x, (P, masked)),
        )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision must be a zshard.MixedPrecision, got {type(mixed_precision).__name__}")
    plan = Plan(
        mesh, strategy, tx, graphdef, template, units, param_specs, opt_specs, mixed_precision or FULL_PRECISION, train_paths,
        var_template, opt_view,
    )
    init_opt = jax.shard_map(
        lambda p: init_optimizer(plan, plan.split_trainable(p)[0]), mesh=mesh, in_specs=(param_specs,), out_specs=opt_specs
    )
    if abstract:
        opt_state = jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
            jax.eval_shape(jax.jit(init_opt), params),
            opt_specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        return ShardedState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), plan, variables)
    opt_state = jax.jit(init_opt)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    return ShardedState(params, opt_state, step, plan, variables)


def unshard(state: ShardedState) -> nnx.Module:
    """The full model as a plain ``nnx.Module`` (parameters on the default device).

    Every parameter gets back its logical shape and dtype; padding is dropped. Host memory
    holds one parameter at a time. With several processes, every process must call it (the
    parameters are all-gathered across processes) and each gets the whole model.
    """
    plan = state.plan
    flat = traverse_util.flatten_dict(state.params)
    layers = plan.layers_of()
    values = {}
    for path, var in plan.template:
        shape = var.get_value().shape
        x = flat[path]
        if not x.is_fully_addressable:  # several processes: every process gets the whole array
            from jax.experimental import multihost_utils  # noqa: PLC0415

            x = multihost_utils.process_allgather(x, tiled=True)
        host = np.asarray(jax.device_get(x))  # [n_pad] or [L, n_pad]
        if layers[path] is None:
            values[path] = jnp.asarray(host[: int(np.prod(shape))].reshape(shape))
        else:
            values[path] = jnp.asarray(host[:, : int(np.prod(shape[1:]))].reshape(shape))
    for path, value in traverse_util.flatten_dict(state.variables).items() if state.variables else ():
        is_key = jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
        data = jax.random.key_data(value) if is_key else value
        if not data.is_fully_addressable:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            data = multihost_utils.process_allgather(data, tiled=True)
        host = jnp.asarray(np.asarray(jax.device_get(data)))  # off the mesh: a plain single-device array
        values[path] = jax.random.wrap_key_data(host, impl=jax.random.key_impl(value)) if is_key else host
    with nnx.use_eager_sharding(False):
        return nnx.merge(plan.graphdef, _fill(plan.template + plan.var_template, values))

"""The NNX interception: the user's model, inside ``shard_map``, with units gathered just in time.

:func:`materialize` rebuilds the model on each device for one forward pass:

- the root unit (everything outside the block units) is all-gathered once and holds its
  logical values;
- every block unit's parameters hold this device's padded shards (``[n_pad/N]``, or
  ``[L, n_pad/N]`` for stacked layers), so the module passes through ``nnx.remat``,
  ``nnx.scan``, ``nnx.vmap`` and plain JAX transforms like any module;
- each block unit's class is swapped for a subclass whose methods (``__call__``, and every
  other method its classes define: ``attend``, ``decode``, helpers) gather the unit's
  FlatParameter, run the original method on a plain copy of the module, and drop the
  gathered copy (:func:`zshard.programs.unit_call.run_unit`); the backward reduce-scatters;
- a unit parameter read anywhere else (the root reading ``blocks[0].bias``, a loss term)
  is gathered where it is read (:func:`zshard.wire.collectives.gather_param`, a Flax
  ``on_get_value`` hook), so its value and gradient are exact;
- non-parameter variables (BatchNorm statistics, RNG counts, counters) hold their
  replicated values; RNG keys are folded with the device's index, so every device draws
  its own stream; a unit's method gets them as inputs and hands back their new values.

docs/design.md, "Data flow of one step", describes where this sits in the step. This module
owns the rebuilt model: the intercepted classes, the binding of a unit call
(:meth:`UnitBinding.call`), gather on read, the RNG folding and :func:`materialize`.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zshard.wire.collectives import gather, gather_param
from zshard.wire.wire import UnitComm
from zshard.params.flat import ParamLayout
from zshard.inspection.jaxprs import ROOT_GATHER_SCOPE, read_scope, unit_scope
from zshard.mesh.mesh import AXES
from zshard.context.sequence import active, in_unit
from zshard.programs.unit_call import PrefetchLink, run_unit
from zshard.params.units import path_str

__all__ = ["materialize", "device_index", "device_key", "read_variables", "unit_methods"]


def device_index() -> jax.Array:
    """Inside the step: this device's linear index over the data axes ``("replica", "shard"[,
    "context"])``, int32 in ``[0, R*S*C)`` (row-major: ``(replica * S + shard) * C + context``;
    without a ``context`` axis ``replica * S + shard``). Not over ``tensor``: a tensor group is one
    device of the data."""
    record = active()
    return jax.lax.axis_index(AXES if record is None else record.data_axes)


def device_key(key: jax.Array) -> jax.Array:
    """Inside the step: ``key`` folded with :func:`device_index` (``jax.random.fold_in``).

    A key a ``loss_fn`` makes itself (``jax.random.key(0)``) is the same on every device,
    as in any SPMD program; ``zshard.device_key(key)`` gives each device its own stream
    (dropout masks, noise), reproducible for a given key and mesh. Model ``nnx.Rngs``
    streams are folded this way already.
    """
    return jax.random.fold_in(key, device_index())


# --- methods of a unit -----------------------------------------------------------------------------------

_FLAX_BASES = ("flax.nnx.module", "flax.nnx.object", "flax.nnx.pytree", "flax.nnx.graph", "flax.nnx.helpers")


def unit_methods(cls: type) -> tuple[str, ...]:
    """The methods of ``cls`` that run with the unit gathered: ``__call__`` and every plain
    method defined by ``cls`` or a base class below ``nnx.Module`` (``attend``, ``decode``,
    helpers); not properties, static or class methods, nor ``nnx.Module``'s own API."""
    names = {"__call__"} if callable(getattr(cls, "__call__", None)) else set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith(_FLAX_BASES) or not issubclass(klass, nnx.Module):
            continue
        for name, attr in vars(klass).items():
            if name.startswith("_") or not inspect.isfunction(attr):
                continue
            names.add(name)
    return tuple(sorted(names))


_INTERCEPTING: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _intercepting_class(cls: type) -> type:
    """A subclass of ``cls`` whose unit methods gather the unit around the original method.

    Cached per class (weakly): what a call needs is on the instance (``_zshard_unit``)."""
    if cls not in _INTERCEPTING:

        def method(name):
            def intercepted(self, *args, **kwargs):
                return vars(self)["_zshard_unit"].call(self, name, args, kwargs)

            intercepted.__name__ = intercepted.__qualname__ = name
            return intercepted

        attrs = {name: method(name) for name in unit_methods(cls)}
        _INTERCEPTING[cls] = type(cls.__name__, (cls,), {**attrs, "__module__": cls.__module__})
    return _INTERCEPTING[cls]


# --- one unit call --------------------------------------------------------------------------------------


def _in_unit(apply: Callable, name: str, layers: int | None) -> Callable:
    """``apply`` that records its ``zshard.attention`` calls as unit ``name``'s whenever it is traced:
    inside a scanned unit JAX traces the custom VJP's forward again when it differentiates the scan,
    after the unit call has returned (its ``in_unit`` context gone)."""

    def traced(*args):
        with in_unit(name, layers):
            return apply(*args)

    return traced


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ShardWithExit:
    """What a block-unit parameter holds inside a step whose gradients leave through exit values
    (HYBRID_SHARD_OPT's optimizer slices, error feedback's residuals; see :func:`materialize`).

    A pytree of two leaves, so ``nnx.scan`` / ``nnx.vmap`` / ``jax.lax.scan`` slice both per layer.

    Attributes:
      shard: the parameter shard, ``[n_pad/S]`` (``[L, n_pad/S]`` stacked).
      exit_value: its gradient exit value ([Note: gradient exit], zshard/wire/grad_exit.py): the
        optimizer slice ``[n_pad/(R*S)]`` (``[L, n_pad/(R*S)]``, its value never read), or the residual.
    """

    shard: Any
    exit_value: Any

    def __getitem__(self, index):
        # Flax's Variable.get_value(index=...) indexes the raw value before the gather-on-read
        # hook: a whole read (...) keeps the pair; any other index reaches the hook with the
        # shard's shape changed, and the hook refuses it with its usual message.
        return self if index is Ellipsis else ShardWithExit(self.shard[index], None)


def _is_param(var) -> bool:
    return isinstance(var, nnx.Param)


@dataclasses.dataclass(eq=False, frozen=True)
class UnitBinding:
    """What a block unit's intercepted methods need, stored on the module (``_zshard_unit``).

    Static (hashable by identity) so that nnx transforms carry it in the graph definition.

    Attributes:
      plan: the sharding plan.
      unit: the :class:`~zshard.plan.planner.Unit`.
      comm: its communication settings.
      prefetch: prefetch depth (0: off; stacked units are never prefetched).
      chain: the block-unit calls of this forward pass, in call order (prefetch links).
    """

    plan: Any
    unit: Any
    comm: UnitComm
    prefetch: int
    chain: list

    def call(self, module: nnx.Module, name: str, args: tuple, kwargs: dict):
        """``module.<name>(*args, **kwargs)`` with the unit's parameters gathered just in time.

        Steps: read this device's shards from the module (:meth:`_shards`), split the
        call's arguments into traced inputs and static leaves (:class:`_CallArgs`), build the
        function of the gathered parameters that runs the original method on a plain copy of
        the module (:meth:`_apply`), pick the prefetch link to wait on (:meth:`_after`), run
        it through :func:`~zshard.programs.unit_call.run_unit`, and write the non-parameter
        variables it changed or created back into the module.
        """
        unit = self.unit
        cls = type(module).__mro__[1]  # the user's class under the intercepting subclass
        variables = dict(nnx.to_flat_state(nnx.state(module)))  # relative path -> Variable
        bufs, exits = self._shards(variables, cls, name)
        # Tied weights (the root's gathered values) and non-parameter variables enter as inputs.
        shared = dict(unit.shared)  # relative path -> the root's model path (tied weights)
        tied_rel = [r for r, _ in unit.shared]
        other_rel = [p for p, v in variables.items() if not _is_param(v) and p not in shared]
        call_args = _CallArgs.of(args, kwargs)
        apply = _in_unit(self._apply(module, cls, name, variables, call_args, tied_rel, other_rel), unit.name, unit.layers)
        link = PrefetchLink(trace=_trace())
        tied = [variables[r].get_raw_value() for r in tied_rel]
        others = [variables[p].get_raw_value() for p in other_rel]
        with jax.named_scope(unit_scope(unit.name, name)), in_unit(unit.name, unit.layers):
            out, new_others, created = run_unit(
                apply, unit.flats, bufs, call_args.inputs + tied + others, self.comm,
                after=self._after(link), link=link, name=unit.name, exits=exits,
            )
        if unit.layers is None:
            self.chain.append(link)
        for p, v in zip(other_rel, new_others):
            variables[p].set_raw_value(v)
        for p, var in created.items():
            _attach(module, p, var)
        return out

    def _shards(self, variables: dict, cls: type, name: str) -> tuple[list[tuple], list[tuple] | None]:
        """Per FlatParameter of the unit, this device's per-parameter shards as the module
        holds them (``[n_pad/N]``; one layer's inside a scan); the collectives concatenate
        them (no saved copy). Second: the gradient exit values per FlatParameter (optimizer
        slices ``[n_pad/(R*S)]`` or residuals, ``()`` for a frozen one), ``None`` where there are none.

        Raises:
          ValueError: a stacked unit called with all its layers at once (``[L, n_pad/N]``).
        """
        unit = self.unit
        raw, exit_of = {}, {}
        for s in unit.slots:
            rel = s.path[len(unit.path) :]
            value = variables[rel].get_raw_value()
            if isinstance(value, ShardWithExit):  # gradient exit values, see materialize
                value, exit_of[rel] = value.shard, value.exit_value
            if unit.layers is not None and value.ndim == 2 + (s.param.tp_dim is not None):  # [L, (T,) n_pad/N]
                raise ValueError(
                    f"zshard: the stacked unit {unit.name!r} ({cls.__name__}, {unit.layers} layers) was called with all its "
                    f"layers at once ({name}); run it one layer at a time under nnx.scan (or jax.lax.scan over "
                    f"nnx.split state), as the model that built it with nnx.vmap intends"
                )
            raw[rel] = value
        bufs = [tuple(raw[s.path[len(unit.path) :]] for s in f.slots) for f in unit.flats]
        exits = None  # per flat, the per-parameter gradient exit values (() when frozen)
        if exit_of:
            exits = [tuple(exit_of[s.path[len(unit.path) :]] for s in f.slots) if f.trainable else () for f in unit.flats]
        return bufs, exits

    def _apply(self, module, cls: type, name: str, variables: dict, call_args: "_CallArgs", tied_rel: list, other_rel: list):
        """``apply(params, all_inputs) -> (out, new other variables, created variables)``: the
        original method on a plain module rebuilt from the gathered ``params`` (in slot order,
        then the tied weights) and ``all_inputs`` (the call's traced inputs, the tied weights'
        values, the other variables' values)."""
        unit, mp = self.unit, self.plan.mp
        rel_params = [s.path[len(unit.path) :] for s in unit.slots] + tied_rel
        template = dict(unit.template)
        n_in, n_tied = len(call_args.inputs), len(tied_rel)
        in_dtypes = [x.dtype for x in call_args.inputs if jnp.issubdtype(x.dtype, jnp.floating)]
        # The module as it is now (flags set by model.eval() / model.train(), attributes the
        # user changed), with the template's variables: no gather-on-read hooks inside.
        graphdef = nnx.graphdef(module)

        def apply(params, all_inputs):
            xs = mp.cast_inputs(list(all_inputs[:n_in]))  # compute in param_dtype (FSDP cast_forward_inputs)
            values = dict(zip(rel_params, list(params) + list(all_inputs[n_in : n_in + n_tied])))
            values.update(zip(other_rel, all_inputs[n_in + n_tied :]))
            with nnx.use_eager_sharding(False):
                pairs = [(p, v.replace(values[p]) if p in values else v) for p, v in template.items()]
                pairs += [(p, variables[p].replace(values[p])) for p in other_rel if p not in template]  # earlier sow-s
                inner = nnx.merge(graphdef, nnx.from_flat_state(pairs))
            object.__setattr__(inner, "__class__", cls)  # a plain module: its own calls are not intercepted
            vars(inner).pop("_zshard_unit", None)
            a, kw = call_args.rebuild(xs)
            out = getattr(cls, name)(inner, *a, **kw)
            # Floating outputs leave the unit in the dtype its floating inputs came in (the
            # residual stream stays fp32 under bf16 compute; an nnx.scan carry keeps its type).
            if mp.param_dtype is not None and in_dtypes:
                out = jax.tree.map(lambda y: y.astype(in_dtypes[0]) if jnp.issubdtype(y.dtype, jnp.floating) else y, out)
            after = dict(nnx.to_flat_state(nnx.state(inner)))
            new_others = [after[p].get_raw_value() for p in other_rel]
            created = {p: v for p, v in after.items() if p not in template and not _is_param(v)}  # sow-ed intermediates
            return out, new_others, created

        return apply

    def _after(self, link: PrefetchLink) -> PrefetchLink | None:
        """The earlier call's link this call's forward gather waits on (docs/design.md
        section 8.2), marked taken; ``None``: wait on this call's own inputs."""
        if not self.prefetch or self.unit.layers is not None or len(self.chain) < self.prefetch:
            return None
        candidate = self.chain[-self.prefetch]
        if candidate.trace != link.trace or candidate.token is None:
            return None  # made in another trace (a model's own checkpoint / scan / vmap): not linked
        candidate.taken = True
        return candidate


@dataclasses.dataclass(frozen=True)
class _CallArgs:
    """A unit call's ``(args, kwargs)`` split into traced inputs (arrays) and static leaves."""

    treedef: Any
    static: list  # the leaves, ``None`` where an input goes
    dynamic: list  # leaf indices of the inputs
    inputs: list  # the arrays

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "_CallArgs":
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
        static = [None if i in dynamic else x for i, x in enumerate(leaves)]
        return cls(treedef, static, dynamic, [leaves[i] for i in dynamic])

    def rebuild(self, inputs: list) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``inputs`` in place of the arrays."""
        full = list(self.static)
        for i, x in zip(self.dynamic, inputs):
            full[i] = x
        return jax.tree.unflatten(self.treedef, full)


def _attach(module: nnx.Module, path: tuple, var) -> None:
    """Put a variable the unit created (``sow``) at ``path`` under the intercepted module."""
    node = module
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    setattr(node, path[-1], var)


def _fold(key: jax.Array, index: jax.Array) -> jax.Array:
    """``jax.random.fold_in`` of every key of a key array (stacked layers hold ``[L]`` keys)."""
    flat = key.reshape(-1)
    return jax.vmap(lambda k: jax.random.fold_in(k, index))(flat).reshape(key.shape)


def _trace():
    return jax.extend.core.get_opaque_trace_state(convention="nnx")


# --- parameters read outside their unit ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _GatherOnRead:
    """Flax ``on_get_value`` hook of a block-unit parameter: its value, read outside the
    unit's methods, is the parameter all-gathered where it is read (gradient reduce-scattered)."""

    slot: ParamLayout
    comm: UnitComm

    def __call__(self, var, value):
        raw, exit_value = var.get_raw_value(), None
        if isinstance(raw, ShardWithExit):  # a gradient exit value rides with the shard
            raw, value, exit_value = raw.shard, value.shard, value.exit_value
        if np.shape(value) != np.shape(raw):
            raise ValueError(
                f"zshard: parameter {path_str(self.slot.path)!r} is read with an index outside its unit; zshard gathers a "
                f"unit's parameter read elsewhere as a whole: read it whole first (p = var[...]; p[i]), or read it "
                f"inside a method of the unit"
            )
        with jax.named_scope(read_scope(path_str(self.slot.path))):
            return gather_param(self.slot, value, self.comm, exit_value)


_READING: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _gather_on_read_class(cls: type) -> type:
    """A subclass of the Variable class ``cls`` whose array attributes (``v.sum()``, ``v.T``,
    ``v.astype``) come from the gathered parameter too: Flax's ``Variable.__getattr__`` reads
    them from the raw value, which here is this device's shard."""
    if cls not in _READING:

        def __getattr__(self, name):
            metadata = object.__getattribute__(self, "_var_metadata")
            if name in metadata:
                return metadata[name]
            return getattr(self.get_value(), name)

        _READING[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__})
    return _READING[cls]


def _reading(var, value, hook):
    """``var`` holding the shard ``value``, gathered wherever it is read (hook and class)."""
    new = var.replace(value, on_get_value=hook)
    object.__setattr__(new, "__class__", _gather_on_read_class(type(var)))
    return new


# --- the model on one device -----------------------------------------------------------------------------


def materialize(plan, shards: dict, variables: dict, comm: UnitComm, prefetch: int = 0, exits: dict | None = None) -> nnx.Module:
    """Inside ``shard_map``: the model for one forward pass (see the module docstring).

    Args:
      plan: the sharding plan.
      shards: flat dict ``path -> local shard`` (``[n_pad/N]``, ``[L, n_pad/N]`` stacked).
      variables: flat dict ``path -> value`` of the non-parameter variables (replicated).
      comm: the step's :class:`~zshard.wire.collectives.UnitComm` (axes, replica reduction, remat).
      prefetch: block-unit calls a forward all-gather may be issued ahead (0: off).
      exits: flat dict ``path -> gradient exit value`` of the trainable parameters
        ([Note: gradient exit], zshard/wire/grad_exit.py): HYBRID_SHARD_OPT's optimizer slices
        (``[n_pad/(R*S)]``, ``[L, n_pad/(R*S)]`` stacked; values never read; ``comm.exit`` then
        reduces ``TO_SLICES``) or error feedback's residuals. A block unit's parameter then holds
        the pair ``(shard, exit value)``, so ``nnx.scan`` / ``nnx.vmap`` slice both per layer; each
        unit's backward returns the slice (or the new residual) as the exit value's cotangent
        (:func:`zshard.programs.unit_call.run_unit`). The caller differentiates w.r.t. ``exits``.

    Returns:
      An ``nnx.Module`` of the user's classes (block units' classes subclassed) to hand to
      the user's function.
    """
    root, blocks = (plan.units[0], plan.units[1:]) if plan.units[0].path == () else (None, plan.units)
    comm.exit.check(exits, True, "materialize")  # HYBRID_SHARD_OPT train step: every unit call passes exit values
    values = dict(variables)
    for path, var in plan.var_template:
        if isinstance(var, nnx.RngKey):
            values[path] = _fold(values[path], device_index())  # every device its own stream
    if root is not None:
        with jax.named_scope(ROOT_GATHER_SCOPE):
            root_exits = None if exits is None else [tuple(exits[s.path] for s in f.slots) if f.trainable else () for f in root.flats]
            gathered = gather(root.flats, [tuple(shards[s.path] for s in f.slots) for f in root.flats], comm, root_exits)
        values.update({s.path: v for s, v in zip(root.slots, gathered)})
    hooks = {}
    for unit in blocks:
        for s in unit.slots:
            values[s.path] = shards[s.path] if exits is None or s.path not in exits else ShardWithExit(shards[s.path], exits[s.path])
            hooks[s.path] = _GatherOnRead(s.param, comm)
    with nnx.use_eager_sharding(False):  # zshard's layout, not the model's sharding annotations
        state = nnx.from_flat_state(
            [
                (p, _reading(v, values[p], hooks[p]) if p in hooks else v.replace(values[p]) if p in values else v)
                for p, v in plan.template + plan.var_template
            ]
        )
        model = nnx.merge(plan.graphdef, state)
    chain: list = []  # the block-unit calls of this forward pass, in call order (prefetch)
    for unit in blocks:
        sub = model
        for key in unit.path:
            sub = sub[key] if isinstance(key, int) else getattr(sub, key)
        binding = UnitBinding(plan, unit, comm, prefetch, chain)
        object.__setattr__(sub, "_zshard_unit", binding)
        object.__setattr__(sub, "__class__", _intercepting_class(type(sub)))
    return model


def read_variables(plan, model: nnx.Module, before: dict) -> dict:
    """After the forward pass: flat ``path -> value`` of the model's non-parameter variables
    that the plan carries. RNG keys are the ones of ``before`` (the keys the model holds
    were folded for this device; the stored keys never change, only counts advance)."""
    current = dict(nnx.to_flat_state(nnx.state(model)))
    return {p: before[p] if isinstance(v, nnx.RngKey) else current[p].get_raw_value() for p, v in plan.var_template}


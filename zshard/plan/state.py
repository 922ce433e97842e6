"""The sharded train state: ``init`` and ``unshard``.

``init`` turns an ordinary NNX model and an Optax transformation into a
:class:`ShardedState` in four steps: checks of the arguments, the plan
(:func:`zshard.plan.planner.make_plan`: units, one :class:`~zshard.params.flat.ParamLayout` per
parameter, FlatParameters, optimizer specs), placement (each parameter in its stored form
``[n_pad]``, split over the strategy's shard axes) and the Optax state initialised on the
local shards. ``unshard`` goes back to a plain ``nnx.Module``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.mesh.axes import ALLOWED
from zshard.mesh.mesh import sharded_map
from zshard.optim.offload import (
    check_backend, check_masters, device_param_specs, opt_shardings, parse_offload, state_shardings, with_device_params,
)
from zshard.optim.optim import init_optimizer
from zshard.plan.planner import Plan, Unit, make_plan
from zshard.wire.precision import MixedPrecision
from zshard.wire.feedback import init_feedback
from zshard.wire.quant import feedback_layout
from zshard.mesh.strategy import Strategy
from zshard.params.tp import check_logical_rules
from zshard.plan.weights import check_weights, place_weights

__all__ = ["Plan", "Unit", "ShardedState", "init", "unshard"]


def _fill(template: tuple, values: dict) -> nnx.State:
    """A state from ``template`` (``(path, Variable)`` pairs) with values where ``values`` has them."""
    return nnx.from_flat_state([(p, v.replace(values[p]) if p in values else v) for p, v in template])


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
      device_params: with ``offload="optimizer+master"``, the ``param_dtype`` copy in device
        memory of each master that lives on the host (nested like ``params``, those paths only;
        ``[n_pad]`` with the parameter's PartitionSpec): what the all-gathers read. Else ``{}``.
      feedback: with ``reduce_format=zshard.Quant(..., error_feedback=True)``, per trainable
        parameter the format quantizes (nested like ``params``, those paths only), every
        device's residual of what quantizing its gradient dropped: float32, global
        ``[..., W * n_pad]`` with ``PartitionSpec(..., data_axes)`` (local ``[..., n_pad]``, ``W``
        the data devices; :func:`zshard.wire.quant.feedback_layout`), zeros at ``init``. Checkpoints
        store it. Else ``{}``.

    With ``offload`` (:mod:`zshard.optim.offload`) the optimizer-state leaves with a dimension (and
    the masters) are in ``pinned_host`` memory (``leaf.sharding.memory_kind``).
    """

    params: dict
    opt_state: Any
    step: jax.Array
    plan: Plan = dataclasses.field(metadata=dict(static=True))
    variables: dict = dataclasses.field(default_factory=dict)
    device_params: dict = dataclasses.field(default_factory=dict)
    feedback: dict = dataclasses.field(default_factory=dict)

    def specs(self) -> "ShardedState":
        """The PartitionSpec tree of this state (``tensor`` included where a parameter is split
        over it: :func:`zshard.mesh.sharded_map` takes these as its in/out specs)."""
        var_specs = traverse_util.unflatten_dict({p: P() for p in self.plan.variable_paths}) if self.plan.var_template else {}
        fb_specs = traverse_util.unflatten_dict({p: spec for p, (_, spec) in feedback_layout(self.plan).items()}) if self.feedback else {}
        return ShardedState(self.plan.param_specs, self.plan.opt_specs, P(), self.plan, var_specs, device_param_specs(self.plan), fb_specs)

    def shardings(self) -> "ShardedState":
        """Every leaf's ``NamedSharding`` (:meth:`specs` on the plan's mesh): the sharding each
        array of the state carries, and the ``out_shardings`` of programs that produce a state,
        so that a state split over ``tensor`` always carries the same sharding object (one
        compile per step, donation in place)."""
        mesh = self.plan.mesh
        base = jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.specs(), is_leaf=lambda x: isinstance(x, P))
        return state_shardings(self, base)  # offload: the host leaves in pinned_host memory


def _check_arguments(model, tx, mesh, mixed_precision):
    """``(abstract model, concrete)`` after the checks of :func:`init`'s arguments."""
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) not in ALLOWED:
        names = getattr(mesh, "axis_names", None)
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh with axes {', '.join(map(str, ALLOWED[:-1]))} or {ALLOWED[-1]} "
            f"(use zshard.make_mesh); got axes {names}"
        )
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"zshard.init: tx must be an optax.GradientTransformation (e.g. optax.adamw(3e-4)), got {type(tx).__name__}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision must be a zshard.MixedPrecision, got {type(mixed_precision).__name__}")
    if isinstance(model, nnx.Module):
        return model, True
    if not callable(model):
        raise TypeError(f"zshard.init: model must be an nnx.Module or a callable building one, got {type(model).__name__}")
    # Sharding annotations (nnx.with_partitioning, out_sharding metadata) are kept as
    # metadata and not applied: zshard lays the parameters out itself.
    with nnx.use_eager_sharding(False):
        abstract_model = nnx.eval_shape(model)
    if not isinstance(abstract_model, nnx.Module):
        what = type(abstract_model).__name__ if not isinstance(abstract_model, jax.ShapeDtypeStruct) else f"an array {abstract_model}"
        raise TypeError(f"zshard.init: the model callable must return an nnx.Module, it returned {what}")
    return abstract_model, False


def _host_copy(x):
    """A host copy of a model variable's value (an RNG key stays a key, of the same impl).

    ``jax.device_put`` onto a replicated sharding reuses the buffer already on the first
    device (``may_alias=False`` does not stop it on CPU), so the train step, which donates its
    state, would delete the user's module's own arrays (an ``nnx.Rngs`` count or key)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(np.array(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    return np.array(x)


def _place(plan: Plan, model, concrete: bool, weights, abstract: bool) -> tuple[dict, dict]:
    """``(params, variables)``: every parameter in its stored form on the mesh
    (:meth:`ParamLayout.to_storage`, ``[n_pad]`` / ``[L, n_pad]`` with its PartitionSpec), the
    non-parameter variables replicated. ``weights`` (``init(params=...)``) replaces the
    model's parameter values; a callable ``model`` runs under ``jit`` with output shardings."""
    mesh, layouts = plan.mesh, list(plan.layouts.values())
    shardings = [NamedSharding(mesh, rec.spec) for rec in layouts]
    replicated = NamedSharding(mesh, P())
    var_paths = plan.variable_paths
    if abstract:
        values = [jax.ShapeDtypeStruct(rec.storage_shape, rec.dtype, sharding=sh) for rec, sh in zip(layouts, shardings)]
        var_values = [jax.ShapeDtypeStruct(v.get_raw_value().shape, v.get_raw_value().dtype, sharding=replicated) for _, v in plan.var_template]
    elif concrete:
        flat = dict(nnx.to_flat_state(nnx.state(model)))
        if weights is None:
            values = [jax.device_put(rec.to_storage(np.asarray(flat[rec.path].get_raw_value())), sh) for rec, sh in zip(layouts, shardings)]
        else:
            values = place_weights(layouts, weights, shardings)
        var_values = [jax.device_put(_host_copy(flat[p].get_raw_value()), replicated) for p in var_paths]
    else:
        own = weights is None  # with weights=, the model's own parameters are dead code under jit
        values = [] if own else place_weights(layouts, weights, shardings)

        def build():
            with nnx.use_eager_sharding(False):
                _, st = nnx.split(model())
            flat = dict(nnx.to_flat_state(st))
            stored = [_strong(rec.to_storage(flat[rec.path].get_raw_value())) for rec in layouts] if own else []
            return stored, [_strong(flat[p].get_raw_value()) for p in var_paths]

        var_values = []
        if own or var_paths:
            stored, var_values = jax.jit(build, out_shardings=(shardings if own else [], [replicated] * len(var_paths)))()
            values = stored if own else values
    params = traverse_util.unflatten_dict({rec.path: v for rec, v in zip(layouts, values)})
    variables = traverse_util.unflatten_dict(dict(zip(var_paths, var_values))) if var_paths else {}
    return params, variables


def _strong(x):
    """``x`` without JAX's weak type. A variable the model makes from a Python scalar
    (``nnx.Param(jnp.full((), 1.5))``) is weakly typed; the step returns the state strongly typed
    (the optimizer's update), so a weakly typed input would make the second step trace and compile
    again: two compiles of the same program (jax's "weak types",
    https://docs.jax.dev/en/latest/type_promotion.html#weak-types). The values are unchanged; a
    key array is left as it is."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) or not jax.typeof(x).weak_type:
        return x
    return jax.lax.convert_element_type(x, x.dtype)  # weak_type=False, the same dtype and values


def _init_opt_state(plan: Plan, params: dict, abstract: bool):
    """The Optax state of the local shards, split over ``strategy.opt_axes`` (abstract: its
    ``jax.ShapeDtypeStruct`` with shardings)."""
    init_opt = sharded_map(
        lambda p: init_optimizer(plan, plan.split_trainable(p)[0]), plan.mesh, in_specs=(plan.param_specs,), out_specs=plan.opt_specs
    )
    shapes = jax.eval_shape(jax.jit(init_opt), params)
    out = opt_shardings(plan, shapes)  # offload: the leaves with a dimension written straight to pinned_host
    if not abstract:
        return jax.jit(init_opt, out_shardings=out if plan.tensor > 1 or plan.offload else None)(params)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, out)


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
    tensor_parallel: dict | None = None,
    logical_rules: dict | None = None,
    offload: str | None = None,
    expert_parallel: dict | None = None,
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
        (size-based); see :func:`zshard.params.units.find_units`. Everything outside the units is
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
        array written straight into its shards (``zshard.plan.weights``), so host memory holds
        about the largest tensor. Values are cast to the parameter's dtype. The model (a
        callable is then only traced with ``nnx.eval_shape``) gives structure and dtypes.
      tensor_parallel: on a mesh with a ``tensor`` axis (``make_mesh(..., tensor=T)``), which
        dimension of which parameter is split over it: ``{glob on the dotted path: dim}``
        (``{"blocks.*.attn.qkv.kernel": -1, "blocks.*.attn.out.kernel": 0}``: column- and
        row-parallel, Megatron-LM arXiv 1909.08053 section 3). The model's own annotations
        naming ``tensor`` (``nnx.with_partitioning(init, (None, "tensor"))``) count too; a glob
        wins over an annotation. Each split parameter is stored ``[T, n_pad]``
        (``PartitionSpec("tensor", shard_axes)``): cut along that dimension first, each piece
        flattened, padded and sharded over the data axes (:class:`zshard.params.flat.ParamLayout`).
        docs/tensor-parallel.md.
      logical_rules: ``{logical axis name: mesh axis}`` for the model's annotations
        (MaxText's logical axis rules, ``{"mlp": "tensor", "heads": "tensor", "vocab": "tensor"}``,
        ``{"ep": "expert"}``).
      expert_parallel: on a mesh with an ``expert`` axis (``make_mesh(..., expert=X)``), the expert
        dimension of each expert parameter: ``{glob on the dotted path: dim}`` (``{"blocks*.moe.w_*":
        0}``; the dimension counts within one layer, so scanned stacks match too). Annotations
        naming ``"expert"`` count too. Each expert parameter is cut into ``X`` groups of ``E/X``
        whole experts, stored ``[X * n_pad/X]`` with ``PartitionSpec(("expert", *shard_axes))``,
        gathered over the shard axes only (the unit sees ``[E/X, ...]``), its gradient never
        reduced over ``expert``; dense parameters are FSDP-sharded over ``shard x expert``. Without
        an expert axis it is checked and ignored (as ``tensor_parallel``). docs/expert-parallel.md.
      offload: host offload (ZeRO-Offload, arXiv 2101.06840; :mod:`zshard.optim.offload`, docs/offload.md):
        ``None`` (default: everything in device memory); ``"optimizer"``: every Optax state leaf
        with a dimension in ``pinned_host`` memory (``8 Psi / N`` bytes per device for Adam in
        fp32), moved to the device for its update inside the step and back; gradients and
        scalar leaves (counts) stay on the device; ``"optimizer+master"``: with
        ``mixed_precision`` of a lower ``param_dtype``, the fp32 masters on the host too and a
        ``param_dtype`` copy on the device for the gathers (``ShardedState.device_params``).
        The numbers are bitwise those of the same run without offload.

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
      ValueError (tensor parallelism): a glob that matches no parameter, a dimension that ``T``
        does not divide, a rule naming a mesh axis that does not exist (each named).
      ValueError (expert parallelism): a glob that matches no parameter, an expert dimension that
        ``X`` does not divide (path, shape and ``X`` named), an expert axis with no expert
        parameter, a strategy or option it does not support (the fix named).
      ValueError (offload): an unknown mode; a device without ``pinned_host`` memory;
        ``"optimizer+master"`` without a ``param_dtype`` lower than the trainable parameters'.
    """
    abstract_model, concrete = _check_arguments(model, tx, mesh, mixed_precision)
    offload = parse_offload(offload)
    if offload is not None:
        check_backend(mesh, offload)
    strategy = Strategy.parse(strategy if strategy is not None or zero_stage is not None else "FULL_SHARD", zero_stage=zero_stage)
    rules = check_logical_rules(logical_rules)
    plan = make_plan(abstract_model, tx, mesh, strategy, unit, mixed_precision, trainable, tensor_parallel, rules, expert_parallel)
    if offload is not None:
        plan = dataclasses.replace(plan, offload=offload)
        check_masters(plan)
    if params is not None:
        check_weights(list(plan.layouts.values()), params)
    values, variables = _place(plan, model, concrete, params, abstract)
    opt_state = _init_opt_state(plan, values, abstract)
    replicated = NamedSharding(mesh, P())
    if abstract:
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    else:
        step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    state = ShardedState(values, opt_state, step, plan, variables, feedback=init_feedback(plan, abstract))
    return _offload_masters(state) if plan.offload == "optimizer+master" else state


def _offload_masters(state: ShardedState) -> ShardedState:
    """``"optimizer+master"``: the ``param_dtype`` copies cut on the device, then the masters
    moved to ``pinned_host`` (abstract: their shardings only)."""
    state = with_device_params(state)
    kinds = state.shardings().params
    flat, shardings = traverse_util.flatten_dict(state.params), traverse_util.flatten_dict(kinds)
    moved = {
        p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[p]) if isinstance(x, jax.ShapeDtypeStruct)
        else jax.device_put(x, shardings[p]) if shardings[p].memory_kind != x.sharding.memory_kind else x
        for p, x in flat.items()
    }  # fmt: skip
    return dataclasses.replace(state, params=traverse_util.unflatten_dict(moved))


def unshard(state: ShardedState) -> nnx.Module:
    """The full model as a plain ``nnx.Module`` (parameters on the default device).

    Every parameter gets back its logical shape and dtype; padding is dropped. Host memory
    holds one parameter at a time. With several processes, every process must call it (the
    parameters are all-gathered across processes) and each gets the whole model.
    """
    plan = state.plan
    flat = traverse_util.flatten_dict(state.params)
    values = {}
    for path, rec in plan.layouts.items():
        x = flat[path]
        if not x.is_fully_addressable:  # several processes: every process gets the whole array
            from jax.experimental import multihost_utils  # noqa: PLC0415

            x = multihost_utils.process_allgather(x, tiled=True)
        values[path] = jnp.asarray(rec.from_storage(np.asarray(jax.device_get(x))))  # [n_pad] / [L, n_pad] -> logical
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

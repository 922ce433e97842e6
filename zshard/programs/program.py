"""The program shell: what the train step, the eval step and the forward program share.

A zshard program is ``jax.jit(shard_map(body))`` over the whole mesh, run on a
:class:`~zshard.ShardedState` and one input pytree (a batch, or :func:`zshard.make_forward`'s
arguments). :class:`ShardedProgram` is that shell, written once:

- the jit: one per set of compiler options (:func:`zshard.gpu.mesh_jit`: XLA's defaults, or
  :data:`zshard.gpu.GPU_COMPILER_OPTIONS` on a CUDA mesh), or, where the program returns the state
  and the plan keeps leaves split over ``tensor`` or on the host, one per plan compiled with the
  state's own shardings as ``out_shardings``;
- ``__call__`` / :meth:`~ShardedProgram.trace` / :meth:`~ShardedProgram.lower` /
  :meth:`~ShardedProgram.export`, each placing the input first (:mod:`zshard.programs.batch`) and
  refusing, before any compile, a state in the wrong memory, a donated state, and (traced once
  per :func:`zshard.programs.batch.trace_key`) a traced body that :func:`zshard.inspection.checks.check_traced` refuses;
- the body's result: every program's body returns ``(outputs, TraceInfo)``. The
  :class:`TraceInfo` (what the trace found out: the sequence split, the ``zshard.attention`` calls
  per unit) is a pytree without leaves (``jax.tree_util.register_static``), so it leaves the
  ``shard_map`` and a jit as part of the output structure and comes back with every trace, cached
  or not: :meth:`~ShardedProgram.trace` returns it. The program users run, lower and export
  (``__call__``, :meth:`~ShardedProgram.lower`, :meth:`~ShardedProgram.export`) returns the
  outputs only.

Each program supplies its body and specs (``_program``: a method whose name is the jitted
program's, ``jit__step`` for the train step), its input placement (``_place``), and what its
state must satisfy (``_check_state``): :class:`zshard.TrainStep` (zshard/programs/step.py),
:class:`zshard.EvalStep` and :class:`zshard.programs.evaluate.Forward` (zshard/programs/evaluate.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from zshard.programs.batch import trace_key
from zshard.inspection.checks import check_traced, traced
from zshard.gpu import compiler_options, export_checks, mesh_jit
from zshard.mesh.mesh import sharded_map
from zshard.optim.offload import traced_naming_host_leaf
from zshard.context.sequence import SequenceSplit, SequenceTrace, tracing
from zshard.moe import recording
from zshard.params.units import path_str
from zshard.programs.step_config import StepConfig

__all__ = ["BodyTrace", "ShardedProgram", "TraceInfo", "body_tracing", "check_expert_calls", "run_sharded", "trace_key"]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class TraceInfo:
    """What tracing a program's body found out (static: no arrays), returned with its outputs.

    Attributes:
      split: the :class:`~zshard.context.sequence.SequenceSplit` the body traced under, or ``None``
        (no leaf split along its sequence).
      calls: ``(unit name or None, its layers or None, AttentionCall)`` of each distinct
        ``zshard.attention`` call on a split sequence, in the order traced (the context formula
        of :func:`zshard.report` counts them).
      asked: the model or the loss asked for :func:`zshard.positions`.
      experts: the :class:`zshard.moe.MoECall` of each ``zshard.moe`` call, in the order traced
        (the dispatch formula of :func:`zshard.report` reads them). Returned with the trace, so a
        trace jax answers from its cache still says what it found.
    """

    split: SequenceSplit | None = None
    calls: tuple = ()
    asked: bool = False
    experts: tuple = ()

    @classmethod
    def of(cls, body: "BodyTrace") -> "TraceInfo":
        """The frozen summary of what :func:`body_tracing` recorded."""
        record = body.sequence
        if record is None:
            return cls(experts=tuple(body.experts))
        return cls(record.split, tuple(record.calls), bool(record.asked), tuple(body.experts))


@dataclasses.dataclass
class BodyTrace:
    """What :func:`body_tracing` records: the sequence split's record and the ``zshard.moe`` calls."""

    sequence: SequenceTrace | None
    experts: list


@contextlib.contextmanager
def body_tracing(plan, split: SequenceSplit | None):
    """What every program body traces under, yielded as a :class:`BodyTrace`: the sequence split's
    record (:func:`zshard.context.sequence.tracing`) and the :func:`zshard.moe.recording` of the
    ``zshard.moe`` calls, checked on leaving (:func:`check_expert_calls`), before any compile."""
    with tracing(split, plan.data_axes) as record, recording() as calls:
        yield BodyTrace(record, calls)
    check_expert_calls(plan, calls)


def check_expert_calls(plan, calls) -> None:
    """Refuse a program whose expert parameters were not computed through ``zshard.moe``.

    Inside the step a unit sees only its device's ``E/X`` experts (``[E/X, ...]``); a model that
    computes its experts its own way (a dense formula over all ``E``, a loop over experts) would
    compute with the wrong experts or none of the other devices' tokens. ``zshard.moe`` records each
    traced call (:class:`zshard.moe.MoECall`, ``groups`` = ``X``); a plan with expert parameters and
    no call over ``X`` groups is refused while tracing, before compiling.

    Raises:
      ValueError: naming an expert parameter, ``X`` and the two fixes.
    """
    if not plan.expert_split or any(c.groups == plan.expert for c in calls):
        return
    first = path_str(sorted(plan.expert_split, key=str)[0])
    raise ValueError(
        f"zshard: the model's expert parameters (e.g. {first!r}, split over expert={plan.expert}: each device holds E/X of "
        "the experts, [E/X, ...]) were not computed through zshard.moe in this program: a model that computes its "
        "experts its own way would see only its device's experts and train wrong. Fix: compute each MoE layer with "
        "zshard.moe(x, router, w_gate_up, w_down, top_k=...) (it sends the tokens to their experts over the expert "
        "axis), or drop expert_parallel / the annotations naming 'expert' and build the mesh without expert= "
        "(docs/expert-parallel.md)"
    )


def run_sharded(plan, local, operands: tuple, in_specs: tuple, out_specs):
    """``local(*operands)`` on every device (``shard_map`` over ``plan``'s mesh, ``tensor`` left to the
    compiler: :func:`zshard.mesh.sharded_map`) -> ``(outputs, TraceInfo)``.

    ``local`` returns ``(outputs, TraceInfo)``; ``out_specs`` are the outputs' PartitionSpecs (the
    :class:`TraceInfo` has no leaves, so it needs none: ``P()`` stands for it)."""
    return sharded_map(local, plan.mesh, in_specs=in_specs, out_specs=(out_specs, P()))(*operands)


class ShardedProgram:
    """The shell of a zshard program: ``program(state, inputs) -> outputs``.

    Subclasses set ``_program`` (a method ``(state, inputs) -> (outputs, TraceInfo)``, traced
    under jit; its ``__name__`` names the jitted program, which returns the outputs only) and
    ``_place`` (the input placement), and may override ``_check_state`` and ``_out_shardings``.
    Class attributes: ``factory`` (the
    function that builds it, named in errors), ``donate`` (the state is donated), ``check_trace``
    (the traced body is checked by :func:`zshard.inspection.checks.check_traced`), ``donated_error`` (the
    message when the state's buffers are deleted).

    Raises:
      TypeError: ``config`` is not a :class:`~zshard.programs.step_config.StepConfig`.
    """

    factory = "zshard.make_train_step"
    donate = False
    check_trace = True
    donated_error = "this state was donated to a train step (its buffers are deleted); use the state that step returned"

    def __init__(self, config: StepConfig):
        if not isinstance(config, StepConfig):
            raise TypeError(f"{type(self).__name__} takes a zshard.programs.step_config.StepConfig (use {self.factory}), "
                            f"got {type(config).__name__}")
        self.config = config
        program = self._program

        def outputs(state, inputs):  # the program users run: its outputs, without the TraceInfo
            return program(state, inputs)[0]

        outputs.__name__ = outputs.__qualname__ = program.__name__  # jit__step, jit__eval, jit__run
        self._outputs = outputs
        self._jitted = jax.jit(outputs, donate_argnums=self._donated)
        self._jits: dict = {None: self._jitted}  # compiler options -> the program jitted with them (zshard.gpu.mesh_jit)
        self._placed_jits: dict = {}  # plan -> the program jitted with the state's out_shardings
        self._info_jits: dict = {}  # plan -> the body jitted as it is, returning (outputs, TraceInfo): traced only
        self._checked: set = set()  # trace keys (zshard.programs.batch.trace_key) whose traced body passed the checks

    _donated = property(lambda self: (0,) if self.donate else ())

    # --- what each program supplies -------------------------------------------------------------

    def _program(self, state, inputs):  # pragma: no cover - every program sets its own
        """``(state, inputs) -> (outputs, TraceInfo)``, traced under jit (usually via :func:`run_sharded`)."""
        raise NotImplementedError

    def _place(self, state, inputs):  # pragma: no cover - every program sets its own
        """``inputs`` checked and placed on ``state``'s mesh (:mod:`zshard.programs.batch`), before any compile."""
        raise NotImplementedError

    def _check_state(self, state) -> None:
        """Refuse, before tracing, a state this program cannot run on (the train step: a leaf in the wrong memory)."""

    def _out_shardings(self, state):
        """The outputs' shardings the jit must be given, or ``None`` (the compiler's)."""
        return None

    # --- the shell ------------------------------------------------------------------------------

    def _jit_for(self, state, *, with_info: bool = False):
        """The jitted program for ``state``'s plan: with :meth:`_out_shardings`, one per plan (and
        :func:`zshard.gpu.compiler_options`); else one per set of compiler options (:attr:`_jitted`
        for XLA's defaults). ``with_info``: the same program returning ``(outputs, TraceInfo)``
        (for :meth:`trace`; never compiled by zshard)."""
        plan = state.plan
        out = self._out_shardings(state)
        if with_info:
            if plan not in self._info_jits:
                kw = {} if out is None else {"out_shardings": (out, None)}  # the TraceInfo has no leaves
                self._info_jits[plan] = jax.jit(self._program, donate_argnums=self._donated,
                                                compiler_options=compiler_options(plan.mesh), **kw)
            return self._info_jits[plan]
        if out is None:
            return mesh_jit(self._jits, self._outputs, plan.mesh, donate_argnums=self._donated)  # + XLA:GPU's options on a CUDA mesh
        if plan not in self._placed_jits:
            self._placed_jits[plan] = jax.jit(self._outputs, donate_argnums=self._donated, out_shardings=out,
                                              compiler_options=compiler_options(plan.mesh))
        return self._placed_jits[plan]

    def _traced(self, state, inputs, *, with_info: bool = False) -> jax.stages.Traced:
        """Trace (no compile) on placed ``inputs``; refuse what :func:`zshard.inspection.checks.check_traced` refuses."""
        jitted = self._jit_for(state, with_info=with_info)
        t = traced(lambda: traced_naming_host_leaf(jitted.trace, state, inputs), state.plan.mesh)
        if self.check_trace:
            check_traced(t.jaxpr.jaxpr, state, inputs)  # a raw shard used as a value, divergent collectives, a host leaf
        return t

    def trace(self, state, inputs) -> tuple[jax.stages.Traced, TraceInfo]:
        """``(traced, info)``: the program traced for ``(state, inputs)`` with its :class:`TraceInfo`
        as a second output (``traced.jaxpr``, ``traced.out_info``), and that :class:`TraceInfo`: what
        the trace found out. Traced only; the same checks as :meth:`lower`."""
        self._check_state(state)
        t = self._traced(state, self._place(state, inputs), with_info=True)
        return t, t.out_info[1]

    def lower(self, state, inputs) -> jax.stages.Lowered:
        """The lowered program (``.compile().memory_analysis()``, ``.compile().as_text()``; the
        compiled program is the one ``__call__`` runs). The state is not consumed."""
        self._check_state(state)
        return self._traced(state, self._place(state, inputs)).lower()

    def export(self, state, inputs, platforms=("cuda",)) -> "jax.export.Exported":
        """The program for ``platforms`` (``jax.export.export``; the GPU program can be exported on
        a CPU-only machine): ``.mlir_module()`` is its StableHLO text, where host offload shows as
        ``annotate_device_placement`` calls (:func:`zshard.optim.offload.exported_placements`)."""
        self._check_state(state)
        inputs = self._place(state, inputs)
        return jax.export.export(self._jit_for(state), platforms=list(platforms),
                                 disabled_checks=export_checks())(state, inputs)  # cuDNN's calls

    def __call__(self, state, inputs):
        leaves = jax.tree.leaves(state if self.donate else state.params)
        if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
            raise ValueError(self.donated_error)
        self._check_state(state)  # e.g. a leaf in the wrong memory, named before JAX refuses it unnamed
        inputs = self._place(state, inputs)
        key = trace_key(state, inputs)
        if self.check_trace and key not in self._checked:  # trace (no compile) once per plan and input shapes
            self._traced(state, inputs)
            self._checked.add(key)
        return self._jit_for(state)(state, inputs)

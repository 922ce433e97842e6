"""The sequence split over the ``context`` axis: the head-tail token order, each device's global
token positions, and the record a step keeps while it traces.

Context parallelism (docs/long-sequences.md) splits each sequence of ``L`` tokens over the ``C``
devices of the mesh's ``context`` axis. Under a causal mask a contiguous split would give the last
device ``2C - 1`` times the attention work of the first; so the sequence is cut into ``2C`` chunks
of ``c = L / (2C)`` tokens and device ``i`` holds chunks ``i`` and ``2C - 1 - i`` (the head-tail,
or zigzag, order of torchtitan's context parallelism and MaxText PR 1445)::

    global   [ 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 ]            C = 4, 2C = 8 chunks of c tokens
    placed   [ 0 7 | 1 6 | 2 5 | 3 4 ]                     device i: chunks (i, 2C-1-i), [2c] tokens
              ctx 0  ctx 1  ctx 2  ctx 3

The batch placement (:func:`zshard.programs.batch.put_batch`) permutes every sequence leaf into the
placed order (:func:`head_tail_order`) before splitting it over ``context``, so ``loss_fn`` sees
``[B_local, 2c]`` per leaf; a per-token loss does not care about the order, and
:func:`positions` gives each local token its global position (RoPE, learned position
embeddings, masks). ``zshard.attention`` (:mod:`zshard.attention`) uses the same positions.

While a step traces, :func:`tracing` holds a :class:`SequenceTrace`: the split of this step (or
``None``: no sequence axis), whether ``loss_fn`` asked for positions, and the attention calls
(for ``zshard.report``'s context row).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from zshard.mesh.mesh import CONTEXT

__all__ = ["AttentionCall", "SequenceSplit", "SequenceTrace", "active", "check_split", "head_tail_order", "in_backward",
           "in_unit", "positions", "tracing", "warn_positions"]


def head_tail_order(length: int, context: int) -> np.ndarray:
    """The placed order of a sequence of ``length`` tokens over ``context`` devices: int64
    ``[length]``, entry ``k`` the global index of the token placed at ``k``. Device ``i`` holds
    placed tokens ``[2c i, 2c (i+1))``: global chunks ``i`` then ``2C - 1 - i`` (``c = length /
    (2C)``). ``context == 1``: the identity.

    Raises:
      ValueError: ``length`` does not divide by ``2 * context``.
    """
    if context == 1:
        return np.arange(length)
    if length % (2 * context):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x context = {2 * context} chunks")
    c = length // (2 * context)
    chunks = np.arange(2 * context).reshape(2, context)  # [[0 .. C-1], [2C-1 .. C]] after the flip below
    chunks[1] = chunks[1][::-1]
    order = chunks.T.reshape(-1)  # [0, 2C-1, 1, 2C-2, ...]
    return (order[:, None] * c + np.arange(c)[None, :]).reshape(-1)


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """How one step splits its sequences.

    Attributes:
      context: ``C``, devices of the ``context`` axis (1: nothing split, positions are ``arange``).
      length: ``L``, tokens of one global sequence (the placed sequence leaves' length).
    """

    context: int
    length: int

    @property
    def local(self) -> int:
        """``2c = L / C``: tokens of one sequence on one device."""
        return self.length // self.context

    @property
    def chunk(self) -> int:
        """``c = L / (2C)``: tokens of one head-tail chunk."""
        return self.length // (2 * self.context)

    def chunk_positions(self, index) -> jax.Array:
        """int32 ``[2c]``: the global positions of the tokens of context device ``index`` (a
        Python int or a traced int32 scalar): ``[i c, (i+1) c)`` then ``[(2C-1-i) c, (2C-i) c)``."""
        c, C = self.chunk, self.context
        if isinstance(index, numbers.Integral):
            return jnp.asarray(head_tail_order(self.length, C)[index * 2 * c : (index + 1) * 2 * c], jnp.int32)
        r = jnp.arange(c, dtype=jnp.int32)
        return jnp.concatenate([index * c + r, (2 * C - 1 - index) * c + r])


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One ``zshard.attention`` call as traced on a split sequence (shapes of one device).

    Attributes:
      batch: ``b``, rows on this device. length: ``s``, the global sequence length.
      kv_heads: ``n_kv``. head_dim: ``d`` (of the keys; values have ``value_dim``).
      itemsize: ``e``, bytes per element of the keys and values.
      segments: segment ids were given (their ``[b, s]`` int32 are gathered too). impl: ``"allgather"`` / ``"ring"``.
    """

    batch: int
    length: int
    kv_heads: int
    head_dim: int
    value_dim: int
    itemsize: int
    segments: bool
    impl: str


@dataclasses.dataclass
class SequenceTrace:
    """What a step records while it traces (:func:`tracing`).

    Attributes:
      split: the step's :class:`SequenceSplit`, or ``None`` (no sequence axis: nothing split).
      data_axes: the mesh axes the data is split over (``zshard.device_index`` counts over them).
      asked: :func:`positions` was called by the model or ``loss_fn``.
      calls: ``(unit name or None, its layers or None, AttentionCall)`` of each distinct call made
        in a unit's forward (or outside any unit), each once however often it was traced.
      unit: ``(name, layers)`` of the unit whose forward is tracing now (:func:`in_unit`), or ``None``.
      backward: a unit's backward is tracing (its recompute's calls are not new calls).
    """

    split: SequenceSplit | None
    data_axes: tuple = ("replica", "shard")
    asked: bool = False
    calls: list = dataclasses.field(default_factory=list)
    unit: tuple | None = None
    backward: bool = False

    def record(self, call: AttentionCall) -> None:
        if self.backward:
            return
        entry = (None, None, call) if self.unit is None else (*self.unit, call)
        if entry not in self.calls:
            self.calls.append(entry)


_ACTIVE: contextvars.ContextVar[SequenceTrace | None] = contextvars.ContextVar("zshard_sequence", default=None)


def active() -> SequenceTrace | None:
    """The :class:`SequenceTrace` of the step being traced, or ``None`` outside zshard's steps."""
    return _ACTIVE.get()


@contextlib.contextmanager
def tracing(split: SequenceSplit | None, data_axes: tuple = ("replica", "shard")):
    """Inside: :func:`active` is a new :class:`SequenceTrace` of ``split`` (yielded). The whole
    step body runs inside it, so the backward pass (traced during ``jax.value_and_grad``) and the
    recompute of a block (``remat``) see the same split as the forward."""
    record = SequenceTrace(split, tuple(data_axes))
    token = _ACTIVE.set(record)
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def in_unit(name: str, layers: int | None):
    """Inside: attention calls are recorded as made by unit ``name`` (of ``layers`` stacked layers)."""
    record = _ACTIVE.get()
    if record is None:
        yield
        return
    before, record.unit = record.unit, (name, layers)
    try:
        yield
    finally:
        record.unit = before


@contextlib.contextmanager
def in_backward():
    """Inside: a unit's backward traces (a recomputed forward's attention calls are not recorded)."""
    record = _ACTIVE.get()
    if record is None:
        yield
        return
    before, record.backward = record.backward, True
    try:
        yield
    finally:
        record.backward = before


def positions(length: int | None = None) -> jax.Array:
    """This device's global token positions along the sequence: int32 ``[length]``.

    Inside a zshard step whose batch has a sequence axis (``make_train_step(loss_fn,
    sequence_axis=1)``) on a mesh with a ``context`` axis of ``C`` devices, this device holds
    ``2c = L / C`` tokens of each sequence, global chunks ``i`` and ``2C - 1 - i`` (module
    docstring): positions ``[i c, (i+1) c) ++ [(2C-1-i) c, (2C-i) c)``. Use them for RoPE angles,
    learned position embeddings and masks in place of ``jnp.arange(T)``. Elsewhere (one device,
    ``C = 1``, an eval or forward without a split, plain JAX): ``jnp.arange(length)``.

    Args:
      length: the local sequence length the model sees (``x.shape[1]``); required outside a split
        step, checked against ``L / C`` inside one.

    Raises:
      ValueError: ``length`` missing outside a split step, or not ``L / C`` inside one (named with
        both lengths: a model that slices its input before asking gets positions of the wrong tokens).
    """
    record = _ACTIVE.get()
    split = None if record is None else record.split
    if split is None:
        if length is None:
            raise ValueError("zshard.positions(): outside a step whose sequence is split over context, give the length "
                             "(zshard.positions(x.shape[1]))")
        return jnp.arange(length, dtype=jnp.int32)
    record.asked = True
    if length is not None and int(length) != split.local:
        raise ValueError(
            f"zshard.positions({length}): this device holds {split.local} tokens of each sequence (L={split.length} over "
            f"context={split.context}); ask for the positions of the sequence as the step placed it "
            f"(zshard.positions(x.shape[1]) with x the batch leaf), then slice them as you slice the tokens"
        )
    if split.context == 1:
        return jnp.arange(split.local, dtype=jnp.int32)
    return split.chunk_positions(jax.lax.axis_index(CONTEXT))


def warn_positions(split: SequenceSplit | None, record) -> None:
    """Warn when a step split its sequences over ``context`` but the model never asked for
    :func:`zshard.positions`: a model that numbers its tokens ``jnp.arange(T)`` (RoPE, learned
    position embeddings, its own causal mask) then computes with the wrong positions."""
    if split is not None and split.context > 1 and not record.asked:
        warnings.warn(
            f"zshard: the sequences are split over context={split.context} (each device holds 2 of {2 * split.context} "
            f"chunks of every sequence of {split.length} tokens, zshard.context.sequence), but loss_fn never called "
            "zshard.positions(): a model that builds positions from its local length (jnp.arange(x.shape[1]) for RoPE, a "
            "position embedding or a causal mask) computes with the wrong ones. Fix: positions = "
            "zshard.positions(x.shape[1]) (the global position of each local token), and zshard.attention for attention",
            stacklevel=2,
        )


def check_split(split: SequenceSplit | None, record: SequenceTrace, context: int = 1, sequence_axis_given: bool = True) -> None:
    """After a step traced (before compiling): refuse a ``context`` axis the model never reads,
    then :func:`warn_positions`.

    Args:
      split: the step's split (``None``: no leaf has a sequence axis).
      record: what the trace recorded (:func:`tracing`).
      context: ``C``, the mesh's ``context`` size (the train step passes it; 1 skips the first check).
      sequence_axis_given: ``make_train_step(..., sequence_axis=...)`` was given (a pytree of
        ``None`` says on purpose that no leaf has a sequence: the rows are then split over
        ``context`` too, as data parallelism).

    Raises:
      ValueError: ``C > 1`` and no ``sequence_axis`` (each device would get whole sequences and
        the ``context`` axis would only split rows: data parallelism, with none of the memory a
        sequence split saves); or the sequences are split over ``C > 1`` devices and the model
        never called ``zshard.attention`` (attention written by hand sees only this device's
        ``2c`` tokens of each sequence: a silently wrong model). Both name ``sequence_axis`` and
        ``zshard.attention`` and the fix.
    """
    if context > 1 and split is None and not sequence_axis_given:
        raise ValueError(
            f"zshard: the mesh has a context axis of {context} devices but make_train_step(...) got no sequence_axis, so "
            "nothing reads the sequence split: each device would hold whole sequences and the context axis would only "
            "split rows (data parallelism), without the activation memory a sequence split saves. Fix: "
            "make_train_step(loss_fn, sequence_axis=1) (the batch's sequence dimension; a pytree with None for leaves "
            "without one) and zshard.attention for attention, zshard.positions for positions in the model "
            "(docs/long-sequences.md); or a mesh without context (zshard.make_mesh(R, S * C)); or, to split rows over "
            "context on purpose, sequence_axis with None for every leaf"
        )
    if split is not None and split.context > 1 and not record.calls:
        raise ValueError(
            f"zshard: the sequences are split over context={split.context} (sequence_axis given: each device holds 2 of "
            f"{2 * split.context} chunks of every sequence of {split.length} tokens), but the model never called "
            "zshard.attention: attention computed any other way (jax.nn.dot_product_attention, a softmax of q @ k.T) "
            "sees only this device's tokens, a silently wrong model. Fix: compute attention with "
            "zshard.attention(q, k, v, ...) ([B, L, H, D], causal by default; it gathers or rings the keys and values "
            "over context) and positions with zshard.positions; a model without attention gains nothing from a context "
            "axis: drop sequence_axis and use a mesh without context (docs/long-sequences.md)"
        )
    warn_positions(split, record)

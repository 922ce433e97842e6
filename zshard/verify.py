"""``python -m zshard.verify MODULE:FUNCTION --strategy S --mesh RxS [--steps K]``: check a
model's sharded training against a plain single-device Optax step.

``MODULE:FUNCTION`` names a zero-argument function (``MODULE`` is a dotted module path,
importable from the current directory, or a ``.py`` file) returning
``(model_or_builder, tx, loss_fn, batch)``:

- ``model_or_builder``: an ``nnx.Module``, or a zero-argument callable building one;
- ``tx``: an ``optax.GradientTransformation``;
- ``loss_fn(model, batch)``: written for one device, returns the scalar mean loss (or
  ``zshard.TokenMean(sum, count)``, as ``zshard.make_train_step`` accepts);
- ``batch``: a pytree of arrays whose leading dimension is the global batch (divisible by
  the device count), used for every step.

Both runs start from the same parameters and take the same ``K`` steps on the same batch:
zshard (``zshard.init`` + ``zshard.make_train_step`` on the mesh) and the reference
(``nnx.Optimizer`` with the same ``tx``, ``loss_fn`` on the whole batch, one device). A built
module is copied for each run (the train step donates its state); the user's module is left as
it was. The report prints each step's loss from both, the largest loss difference (relative,
``|a - b| / |b|``), the largest initial and final parameter differences (relative L2 norm
``||a - b|| / ||b||`` per parameter, the worst one named) and the limits they are judged by:

- the tolerance, set by the dtype: float32 1e-5 (docs/design.md section 6), float16 1e-3, bfloat16
  2e-2 (the least precise float dtype, or ``--param-dtype``; ``--tolerance`` overrides); initial
  parameters must be within it;
- the rounding floor: the reference trained again from initial parameters one ulp apart (same
  batch, same RNG state) differs from itself by rounding alone, amplified by the same steps.
  Losses and final parameters pass up to ``max(tolerance, FLOOR_FACTOR x floor)`` (docs/verify.md);
- a parameter without gradient signal (:data:`NO_SIGNAL`): zshard's gradient there must be rounding
  too (:data:`PROBE_LR`), its final value within :meth:`VerifyResult.no_signal_limit`.

Exit status: 0 when every difference is within its limit, 1 when not, 2 on bad input
(an unimportable module, a function that does not return the 4-tuple, a mesh that does not
fit the devices, ...). A failure names its likely causes from what differs: a step-1 loss
difference means the forward pass differs on a device's slice (per-device randomness such as
dropout masks, whole-batch statistics in ``loss_fn`` or BatchNorm), a later one that the
gradients or updates differ, parameters alone (losses agreeing) rounding beyond the floor or a
gradient that differs only when sharded. Worked examples: docs/verify.md (tests/verify_cases.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util

from zshard.programs.reference import reference_step

__all__ = ["FLOOR_FACTOR", "TOLERANCE", "VerifyResult", "load_function", "main", "reference_step", "rel_l2", "verify"]

TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-3, "bfloat16": 2e-2}
"""Largest relative difference that passes, by dtype (loss: ``|a-b|/|b|``; parameters:
relative L2). float32: docs/design.md section 6; the 16-bit ones allow for the rounding of
mixed-precision compute over a few steps (the project's bf16 tests use 2e-2)."""

NO_SIGNAL = 1e-5
"""A parameter whose reference gradient RMS per element stays at most this times the whole gradient's
at every step has no signal: its true gradient is zero (an attention key bias), and Adam turns its
rounding into lr-sized steps. It is judged on its own scale (:meth:`VerifyResult.no_signal_limit`)."""

PROBE_LR = 1e6
"""One zshard ``optax.sgd(PROBE_LR)`` step from the initial parameters reads its gradient, ``(initial - after) / PROBE_LR``."""

FLOOR_FACTOR = 4.0
"""How far above the measured rounding floor a difference may be. The floor is the difference
between the reference and a twin of it whose initial parameters are one ulp apart (each element
times ``1 ± eps``, random signs), amplified by the same steps; passing runs sit at 0.3-0.9 of it,
a sharding bug at 1e-2 or more (the measurements: docs/verify.md)."""


@dataclasses.dataclass
class VerifyResult:
    """The comparison.

    Attributes:
      strategy: the zshard strategy's name.
      mesh: ``(replica, shard)``.
      dtype: the dtype that set the tolerance.
      tolerance: the largest relative difference that passes.
      losses: ``[(sharded, reference)]`` per step, the global mean loss of each.
      loss_diffs: ``|sharded - reference| / |reference|`` per step.
      param_diffs: ``{path: relative L2 difference}`` after the last step.
      initial_diffs: ``{path: relative L2 difference}`` before the first step.
      no_signal: parameters whose reference gradient is at rounding level at every step
        (:data:`NO_SIGNAL`); each is judged by :meth:`no_signal_limit`, not the tolerance.
      floor_losses: ``|twin - reference| / |reference|`` per step, the rounding twin's loss
        (:data:`FLOOR_FACTOR`).
      floor_params: ``{path: relative L2 difference}`` of the twin's final parameters.
      rng_state: paths of the model's ``nnx.RngState`` variables (``nnx.Rngs`` keys and counts,
        e.g. a ``Dropout``'s), named among the causes of a failure.
      moved: ``{path: ||final - initial|| / ||final||}``: how far the reference's steps moved each.
      probe_signal: ``{path: RMS / whole RMS}`` of zshard's gradient of each no-signal one (:data:`PROBE_LR`).
    """

    strategy: str
    mesh: tuple[int, int]
    dtype: str
    tolerance: float
    losses: list[tuple[float, float]]
    loss_diffs: list[float]
    param_diffs: dict[str, float]
    initial_diffs: dict[str, float]
    no_signal: tuple[str, ...] = ()
    floor_losses: list[float] = dataclasses.field(default_factory=list)
    floor_params: dict[str, float] = dataclasses.field(default_factory=dict)
    rng_state: tuple[str, ...] = ()
    moved: dict[str, float] = dataclasses.field(default_factory=dict)
    probe_signal: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def max_loss_diff(self) -> float:
        return float(np.max(self.loss_diffs))  # NaN if any step's is

    @property
    def worst_param(self) -> tuple[str, float]:
        """``(path, difference)`` of the parameter with signal furthest from the reference (``("", 0.0)``: none)."""
        return _worst({p: d for p, d in self.param_diffs.items() if p not in self.no_signal})

    def no_signal_limit(self, path: str) -> float:
        """A no-signal parameter's largest passing difference: ``FLOOR_FACTOR * max(twin's difference, the reference's
        movement)`` there, at least the tolerance (noise moves both runs; a real or corrupted update ends outside)."""
        return max(self.tolerance, FLOOR_FACTOR * max(self.floor_params.get(path, 0.0), self.moved.get(path, 0.0)))

    def _ratio(self, p: str) -> float:  # a no-signal parameter's difference and zshard's gradient over their limits
        return max(self.param_diffs.get(p, 0.0) / self.no_signal_limit(p), self.probe_signal.get(p, 0.0) / (FLOOR_FACTOR * NO_SIGNAL))

    worst_no_signal = property(lambda self: _worst({p: self._ratio(p) for p in self.no_signal}), doc="``(path, ratio)``, passes <= 1")

    @property
    def worst_initial(self) -> tuple[str, float]:
        """``(path, difference)`` of the parameter furthest from the reference before the first step."""
        return _worst(self.initial_diffs)

    @property
    def loss_floor(self) -> float:
        """The rounding twin's largest loss difference (0.0 without a twin)."""
        return float(np.max(self.floor_losses)) if self.floor_losses else 0.0

    @property
    def param_floor(self) -> tuple[str, float]:
        """``(path, difference)``: the rounding twin's largest judged parameter difference."""
        return _worst({p: d for p, d in self.floor_params.items() if p not in self.no_signal})

    @property
    def loss_limit(self) -> float:
        """``max(tolerance, FLOOR_FACTOR * loss_floor)``: the largest loss difference that passes."""
        return max(self.tolerance, FLOOR_FACTOR * self.loss_floor)

    @property
    def param_limit(self) -> float:
        """``max(tolerance, FLOOR_FACTOR * param_floor)``: the largest passing final difference (initial: ``tolerance``)."""
        return max(self.tolerance, FLOOR_FACTOR * self.param_floor[1])

    @property
    def passed(self) -> bool:
        return (self.max_loss_diff <= self.loss_limit and self.worst_param[1] <= self.param_limit
                and self.worst_initial[1] <= self.tolerance and self.worst_no_signal[1] <= 1.0)

    def causes(self) -> list[str]:
        """The likely causes of a failure, from what differs (empty when it passed)."""
        if self.passed:
            return []
        out = []
        ipath, idiff = self.worst_initial
        if not idiff <= self.tolerance:
            out.append(f"the initial parameters differ ({idiff:.1e} at {ipath}): the runs did not start from the same "
                       "model (a builder that is not deterministic, e.g. seeded from the clock)")
        first = self.loss_diffs[0]
        later = [i for i, d in enumerate(self.loss_diffs[1:], 2) if not d <= self.loss_limit]
        rng = (f"the model holds RNG state ({', '.join(self.rng_state[:3])}{', ...' if len(self.rng_state) > 3 else ''}): "
               "per-device randomness, e.g. dropout masks drawn on each device's slice, differs from the single-device "
               "run's")
        stats = "whole-batch statistics in loss_fn or BatchNorm (a mean over the batch sees only the device's slice)"
        if not first <= self.loss_limit:
            out.append(f"the step-1 loss differs already ({first:.1e}, {first / max(self.loss_floor, 1e-30):.0f}x the "
                       f"rounding floor {self.loss_floor:.1e}, before any update), so the forward pass differs on a "
                       f"device's slice: " + (f"{rng}; or {stats}" if self.rng_state else stats))
        elif later:
            out.append(f"the losses agree at step 1 and differ from step {later[0]} ({self.loss_diffs[later[0] - 1]:.1e}): "
                       "the gradients or updates differ (randomness drawn after the first step, a gradient that reads "
                       "whole-batch statistics, or an optimizer transform computed differently on the shards)")
        npath, ratio = self.worst_no_signal
        if not ratio <= 1.0:
            g = self.probe_signal.get(npath, 0.0)
            out.append(f"parameter {npath} has no gradient signal in the reference (its true gradient is zero) but " + (
                f"zshard's gradient there is {g:.1e} of the RMS" if g > FLOOR_FACTOR * NO_SIGNAL else f"ended "
                f"{self.param_diffs[npath]:.1e} from it, {ratio:.1f}x its limit") + ": zshard updates it otherwise")
        path, diff = self.worst_param
        if not diff <= self.param_limit and not out:
            fpath, floor = self.param_floor
            out.append(f"only parameters differ ({diff:.1e} at {path}, {diff / max(floor, 1e-30):.0f}x the rounding floor "
                       f"{floor:.1e} at {fpath}) while the losses agree to {self.max_loss_diff:.1e}: rounding amplified "
                       "more than the floor shows (Adam turns a gradient near zero into an lr-sized step), or a gradient "
                       "that differs only on the sharded side; more --steps tell them apart (a real difference grows)")
        return out

    def table(self) -> str:
        """The report printed by ``python -m zshard.verify``."""
        r, s = self.mesh
        lines = [f"{self.strategy} on {r}x{s} (replica x shard) against one device, {len(self.losses)} steps, "
                 f"{self.dtype}: tolerance {self.tolerance:g}",
                 f"{'step':>4}  {'loss zshard':>14}  {'loss reference':>14}  {'rel. diff':>9}"]
        for i, ((a, b), d) in enumerate(zip(self.losses, self.loss_diffs), 1):
            lines.append(f"{i:>4}  {a:>14.8f}  {b:>14.8f}  {d:>9.2e}")
        step = int(np.argmax(self.loss_diffs)) + 1
        path, pd = self.worst_param
        ipath, idiff = self.worst_initial
        fpath, pfloor = self.param_floor
        ok = lambda d, limit: "ok" if d <= limit else "MISMATCH"  # noqa: E731
        lines += [
            f"rounding floor (the reference against itself from initial parameters 1 ulp apart): loss "
            f"{self.loss_floor:.1e}, parameters {pfloor:.1e} ({fpath}); limits max(tolerance, {FLOOR_FACTOR:g} x floor): "
            f"loss {self.loss_limit:.1e}, parameters {self.param_limit:.1e}",
            f"largest loss difference:      {self.max_loss_diff:.3e} (step {step}, relative)  "
            f"{ok(self.max_loss_diff, self.loss_limit)}",
            f"largest initial difference:   {idiff:.3e} ({ipath}, relative L2)  {ok(idiff, self.tolerance)}",
            f"largest parameter difference: {pd:.3e} ({path}, relative L2)  {ok(pd, self.param_limit)}",
            *([f"no gradient signal (reference gradient at rounding level), limits {FLOOR_FACTOR:g} x max(twin's difference, "
               f"reference's movement) and zshard's gradient {FLOOR_FACTOR * NO_SIGNAL:.0e} of the RMS: " + ", ".join(
                   f"{p} {self.param_diffs[p]:.1e} (limit {self.no_signal_limit(p):.1e}; gradient {self.probe_signal.get(p, 0.0):.1e}) "
                   f"{ok(self._ratio(p), 1.0)}" for p in self.no_signal)] if self.no_signal else []),
            "PASS" if self.passed else f"FAIL: zshard's {self.strategy} training differs from the single-device "
            "reference by more than the limits; likely: " + "; ".join(self.causes()),
        ]
        return "\n".join(lines)


def _worst(diffs: dict[str, float]) -> tuple[str, float]:
    if not diffs:
        return "", 0.0
    path = max(diffs, key=lambda p: (bool(np.isnan(diffs[p])), diffs[p]))  # NaN counts as worst
    return path, diffs[path]


def rel_l2(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 (``||a - b||`` where ``b`` is exactly zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / nb) if nb else float(np.linalg.norm(a - b))


def _flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {"/".join(map(str, p)): np.asarray(v) for p, v in traverse_util.flatten_dict(state).items()}


def _fresh(x):
    """A copy of one array in new buffers (an RNG key stays a key of the same impl)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jnp.array(jax.random.key_data(x), copy=True), impl=jax.random.key_impl(x))
    return jnp.array(x, copy=True)


def _copy_module(model: nnx.Module) -> nnx.Module:
    """``model`` with every array (parameters, ``nnx.Rngs`` keys and counts, ...) copied."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(_fresh, state))


def _perturbed(model: nnx.Module, seed: int = 0) -> nnx.Module:
    """``model`` (changed in place and returned) with every floating parameter element times
    ``1 ± eps`` of its dtype, random signs: the rounding twin of :data:`FLOOR_FACTOR`."""
    rng = np.random.default_rng(seed)

    def one(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        sign = jnp.asarray(rng.choice(np.array([-1.0, 1.0], np.float32), size=x.shape), x.dtype)
        return x * (1 + sign * jnp.finfo(x.dtype).eps)

    nnx.update(model, jax.tree.map(one, nnx.state(model, nnx.Param)))
    return model


def _dtype(params: dict[str, np.ndarray], param_dtype: str | None) -> str:
    if param_dtype is not None:
        return str(jnp.dtype(param_dtype))
    floats = [jnp.dtype(v.dtype) for v in params.values() if jnp.issubdtype(v.dtype, jnp.floating)]
    return str(max(floats, key=lambda d: jnp.finfo(d).eps)) if floats else "float32"  # the least precise


def verify(model_or_builder, tx: optax.GradientTransformation, loss_fn: Callable, batch: Any, *,
           strategy: str = "FULL_SHARD", mesh=None, steps: int = 5, param_dtype: str | None = None,
           tolerance: float | None = None) -> VerifyResult:
    """Train ``steps`` steps with zshard on ``mesh`` and with plain Optax on one device (twice: the
    second run, from initial parameters one ulp apart, measures the rounding floor); compare.

    Args:
      model_or_builder: an ``nnx.Module`` (each run trains its own copy of every array, RNG
        state included; the module is not modified) or a zero-argument callable building one.
      tx: the optimizer (used, unchanged, by every run).
      loss_fn: ``loss_fn(model, batch) -> scalar`` mean loss (or ``zshard.TokenMean(sum, count)``).
      batch: pytree of arrays, leading dimension = global batch, divisible by the mesh's devices.
      strategy: a ``zshard.Strategy`` name.
      mesh: a ``(replica, shard)`` ``jax.sharding.Mesh`` (``zshard.make_mesh``), or ``(R, S)``.
      steps: optimizer steps, >= 1.
      param_dtype: mixed precision (``zshard.MixedPrecision(param_dtype=...)``, reduce in
        float32) on the zshard side; also sets the tolerance.
      tolerance: overrides :data:`TOLERANCE` (the rounding floor still applies).

    Returns:
      :class:`VerifyResult`: losses as Python floats, differences as relative float64 norms.

    Raises:
      ValueError: bad ``steps``, strategy, mesh or batch (from ``zshard.init`` /
        the step, before compiling).
    """
    import zshard  # noqa: PLC0415

    if steps < 1:
        raise ValueError(f"steps={steps}; give at least 1")
    if mesh is None or isinstance(mesh, tuple):
        mesh = zshard.make_mesh(*(mesh or ()))
    strategy = zshard.Strategy.parse(strategy).value
    mp = zshard.MixedPrecision(param_dtype=param_dtype, reduce_dtype="float32") if param_dtype else None

    # Each run gets its own copy of a built module's arrays (parameters and RNG state alike):
    # the train step donates its state and the reference's nnx.Optimizer updates its model in
    # place, so no run may share a buffer with another or with the user's module.
    built = isinstance(model_or_builder, nnx.Module)
    ref = _copy_module(model_or_builder) if built else model_or_builder()
    if not isinstance(ref, nnx.Module):
        raise ValueError(f"the model builder returned {type(ref).__name__}, not an nnx.Module")
    init_ref = _flat_params(ref)
    rng_state = tuple("/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(ref, nnx.RngState)))
    twin = _perturbed(_copy_module(ref))  # the rounding twin, from the same RNG state

    state = zshard.init(_copy_module(model_or_builder) if built else model_or_builder, tx, mesh, strategy=strategy,
                        mixed_precision=mp)
    init_got = _flat_params(zshard.unshard(state))
    step = zshard.make_train_step(loss_fn)
    got_losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        got_losses.append(float(metrics["loss"]))
    got = _flat_params(zshard.unshard(state))

    opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    ref_step = reference_step(loss_fn)
    ref_batch = jax.tree.map(jnp.asarray, batch)
    ref_losses, signal = [], {}
    for _ in range(steps):
        loss, _, rms = ref_step(ref, opt, ref_batch)
        ref_losses.append(float(loss))
        signal = {"/".join(map(str, p)): max(float(r), signal.get("/".join(map(str, p)), 0.0)) for p, r in rms.items()}
    want = _flat_params(ref)

    twin_opt = nnx.Optimizer(twin, tx, wrt=nnx.Param)
    twin_losses = [float(ref_step(twin, twin_opt, ref_batch)[0]) for _ in range(steps)]
    twin_params = _flat_params(twin)

    no_signal, probe_signal = tuple(sorted(p for p, r in signal.items() if r <= NO_SIGNAL)), {}
    if no_signal:  # zshard's own gradient of those parameters (one SGD step, a second compile)
        probe = zshard.init(_copy_module(model_or_builder) if built else model_or_builder, optax.sgd(PROBE_LR), mesh,
                            strategy=strategy, mixed_precision=mp)
        before, (probe, _) = _flat_params(zshard.unshard(probe)), zshard.make_train_step(loss_fn)(probe, batch)
        grads = {p: (before[p].astype(np.float64) - v) / PROBE_LR for p, v in _flat_params(zshard.unshard(probe)).items()}
        total = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()) / sum(g.size for g in grads.values()))
        probe_signal = {p: float(np.sqrt(np.mean(grads[p] ** 2)) / total) if total else 0.0 for p in no_signal}

    dtype = _dtype(init_ref, param_dtype)
    tol = TOLERANCE.get(dtype, 1e-5) if tolerance is None else tolerance
    return VerifyResult(
        strategy=strategy,
        mesh=(int(mesh.shape["replica"]), int(mesh.shape["shard"])),
        dtype=dtype,
        tolerance=tol,
        losses=list(zip(got_losses, ref_losses)),
        loss_diffs=[abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got_losses, ref_losses)],
        param_diffs={p: rel_l2(got[p], b) for p, b in want.items()},
        initial_diffs={p: rel_l2(init_got[p], b) for p, b in init_ref.items()},
        no_signal=no_signal,
        floor_losses=[abs(a - b) / max(abs(b), 1e-30) for a, b in zip(twin_losses, ref_losses)],
        floor_params={p: rel_l2(twin_params[p], b) for p, b in want.items()},
        rng_state=rng_state,
        moved={p: rel_l2(init_ref[p], b) for p, b in want.items()},
        probe_signal=probe_signal,
    )


def load_function(spec: str) -> Callable:
    """``"pkg.module:function"`` or ``"path/file.py:function"`` -> the function.

    Raises:
      ValueError: no ``:``, the module cannot be imported (its error quoted), or it has no
        such callable.
    """
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{spec!r}: expected MODULE:FUNCTION, e.g. mypkg.checks:gpt or checks.py:gpt")
    module_name, fn_name = spec.split(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no such file {str(path)!r}")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (any import-time error is the user's to see)
        raise ValueError(f"{spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"{spec!r}: {module_name!r} has no function {fn_name!r}; callables there: {', '.join(names)}")
    return fn


def main(argv: list[str] | None = None) -> int:
    """The command line; returns 0 (pass), 1 (mismatch) or 2 (bad input)."""
    from zshard.mesh.mesh import parse_mesh  # noqa: PLC0415
    from zshard.mesh.strategy import Strategy  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="python -m zshard.verify", allow_abbrev=False, description="Train K steps with zshard "
                                "and with a plain single-device Optax step; compare losses and parameters.")
    p.add_argument("function", metavar="MODULE:FUNCTION",
                   help="a function returning (model_or_builder, tx, loss_fn, batch); MODULE dotted or a .py file")
    p.add_argument("--strategy", default="FULL_SHARD", help=f"one of {', '.join(s.value for s in Strategy)} (default FULL_SHARD)")
    p.add_argument("--mesh", default="1x8", metavar="RxS", help="replica x shard, or a meshes/*.toml preset (default 1x8)")
    p.add_argument("--steps", type=int, default=5, metavar="K", help="optimizer steps (default 5)")
    p.add_argument("--param-dtype", choices=["bfloat16", "float16"], default=None,
                   help="mixed precision on the zshard side (reduce in float32); sets the tolerance")
    p.add_argument("--tolerance", type=float, default=None, help="largest relative difference that passes (default: by dtype; "
                   f"a difference within {FLOOR_FACTOR:g}x the measured rounding floor passes too)")
    args = p.parse_args(argv)
    try:
        strategy = Strategy.parse(args.strategy).value
        r, s = parse_mesh(args.mesh)
    except ValueError as e:
        p.error(str(e))
    if args.steps < 1:
        p.error(f"--steps {args.steps}: give at least 1")
    try:
        jax.config.update("jax_num_cpu_devices", r * s)  # emulated CPU devices; only before jax starts
    except RuntimeError:
        pass  # the backend is up already (in-process use): keep its devices
    n = len(jax.devices())
    if r * s > n:
        p.error(f"--mesh {args.mesh} needs {r * s} devices, {jax.devices()[0].platform} has {n}")
    fn = None
    try:
        fn = load_function(args.function)
        out = fn()
        if not (isinstance(out, tuple) and len(out) == 4):
            raise ValueError(f"{args.function!r} returned {type(out).__name__}"
                             f"{f' of length {len(out)}' if isinstance(out, tuple) else ''}; "
                             "expected the 4-tuple (model_or_builder, tx, loss_fn, batch)")
        import zshard  # noqa: PLC0415

        mesh = zshard.make_mesh(r, s, devices=jax.devices()[: r * s])
        result = verify(*out, strategy=strategy, mesh=mesh, steps=args.steps, param_dtype=args.param_dtype,
                        tolerance=args.tolerance)
    except ValueError as e:
        p.error(str(e))
    except Exception as e:  # noqa: BLE001  (the user's model or loss failed: show where, exit 2, not 1)
        import traceback  # noqa: PLC0415

        traceback.print_exc()
        p.error(f"{args.function}: {type(e).__name__}: {e}")
    print(f"python -m zshard.verify {args.function}: {result.table()}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())

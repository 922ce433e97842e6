"""Full parameters to and from a safetensors file: :func:`export` and :func:`load_params`.

``export`` reads from a live :class:`~zshard.ShardedState` (one parameter gathered at a time)
or from a checkpoint directory (one stored array read at a time, through the
:class:`~zshard.checkpoint.Checkpointer`'s public methods), and writes through the
``safetensors`` library from memory-mapped staging files.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx, traverse_util

from zshard.checkpoint.checkpointer import Checkpointer
from zshard.checkpoint.layout import FORMAT, checksums, differences, short_error
from zshard.plan.state import ShardedState
from zshard.params.units import path_str
from zshard.plan.weights import fetch_params

__all__ = ["export", "load_params"]

_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip


def _export_tensors(source):
    """``(name, shape, dtype, fetch)`` per parameter; ``fetch()`` -> one numpy array."""
    if isinstance(source, ShardedState):
        plan = source.plan
        yield from fetch_params(source)  # one parameter at a time: [n_pad] shards -> logical array, replicated, then host
        kinds = dict(plan.var_template)
        for path, value in traverse_util.flatten_dict(source.variables).items() if source.variables else ():
            if not isinstance(kinds[path], nnx.RngState):  # statistics and counters; not RNG state
                yield path_str(path), tuple(value.shape), np.dtype(value.dtype), lambda v=value: np.asarray(v.addressable_data(0))
        return
    with Checkpointer(source) as ckpt:
        step = ckpt.resolve_step()
        meta = ckpt.read_meta(step)["zshard"]
        sums = meta.get("checksums", {})
        stored = ckpt.stored_arrays(step)
    rng_state = {name for name, kind in meta.get("variables", {}).items() if kind in _RNG_KINDS}
    where = ckpt.directory / str(step) / "state"
    reader = ocp.PyTreeCheckpointer()
    for key, m in stored.items():
        if key[0] not in ("params", "variables") or (key[0] == "variables" and ".".join(key[1:]) in rng_state):
            continue
        item = traverse_util.unflatten_dict({key: jax.ShapeDtypeStruct(m.shape, m.dtype)})
        args = traverse_util.unflatten_dict({key: ocp.RestoreArgs(restore_type=np.ndarray)})

        def fetch(item=item, args=args, key=key):
            try:
                out = reader.restore(where, args=ocp.args.PyTreeRestore(item, restore_args=args, partial_restore=True))
            except Exception as e:
                raise ValueError(f"checkpoint {str(where)!r}: {'.'.join(key)} cannot be read ({short_error(e)})") from e
            value = np.asarray(traverse_util.flatten_dict(out)[key])
            if checksums([jnp.asarray(value)])[0] != sums.get(".".join(key)):
                raise ValueError(f"checkpoint {str(where)!r} is corrupt: {'.'.join(key)} reads back with other contents than were saved (checksum mismatch)")
            return value

        yield ".".join(key[1:]), tuple(m.shape), np.dtype(m.dtype), fetch


_RNG_KINDS = {"RngKey", "RngCount", "RngState"}


def export(source: ShardedState | str | os.PathLike, file: str | os.PathLike) -> Path:
    """Write the full parameters to a safetensors ``file``, one tensor at a time.

    Each parameter is stored under its path (``"blocks.0.lin.kernel"``) in its logical
    shape and dtype; so are the model's other variables that inference needs (BatchNorm
    statistics, counters), not its RNG state. Tensors are gathered one at a time (each replicated on the mesh for a
    moment, then copied to host) and staged in memory-mapped files beside ``file``, from
    which the ``safetensors`` library writes the file: anonymous host memory holds about
    one tensor, never the model (the staged pages are file-backed; the OS can evict them).
    The file is written under a temporary name and renamed: never half-written. With several
    processes, every one must call it (the gathers are collective); process 0 writes.

    Args:
      source: a :class:`~zshard.ShardedState`, or a checkpoint directory (its latest step).
      file: the output path, e.g. ``model.safetensors`` (its directory must exist).

    Returns:
      The path written.

    Raises:
      FileNotFoundError: the checkpoint directory or the output's directory is missing.
      ValueError: the checkpoint is truncated or corrupt; a dtype safetensors cannot hold.
    """
    from safetensors import TensorSpec, serialize_file  # noqa: PLC0415

    file = Path(file)
    if not file.parent.is_dir():
        raise FileNotFoundError(f"export: directory {str(file.parent)!r} of {str(file)!r} does not exist; create it first")
    if file.is_dir():
        raise ValueError(f"export: {str(file)!r} is a directory; give a file path such as model.safetensors")
    writer = jax.process_index() == 0  # every process takes part in the gathers; one writes
    with tempfile.TemporaryDirectory(dir=file.parent, prefix=f".{file.name}.") as tmp:
        specs, maps = {}, []
        for i, (name, shape, dtype, fetch) in enumerate(_export_tensors(source)):
            if dtype.name not in _ST_DTYPES:
                raise ValueError(f"export: parameter {name} has dtype {dtype.name}, which safetensors cannot store")
            value = np.ascontiguousarray(fetch(), dtype=dtype)  # one tensor in host memory
            if not writer:
                continue
            staged = np.lib.format.open_memmap(os.path.join(tmp, f"{i}.npy"), mode="w+", dtype=dtype, shape=value.shape or (1,))
            staged[...] = value.reshape(staged.shape)
            staged.flush()
            del value
            maps.append(staged)
            specs[name] = TensorSpec(dtype=dtype.name, shape=list(shape), data_ptr=staged.ctypes.data, data_len=staged.nbytes if shape else dtype.itemsize)
        if not writer:
            return file
        partial = os.path.join(tmp, "out.safetensors")
        serialize_file(specs, partial, metadata={"format": "zshard", "zshard_format": str(FORMAT)})
        del maps
        umask = os.umask(0)  # the library creates the file 0600; give it the usual mode, 0666 & ~umask
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)
        os.replace(partial, file)
    return file


def load_params(file: str | os.PathLike, model: nnx.Module) -> nnx.Module:
    """Fill ``model``'s parameters (and BatchNorm statistics and other non-RNG variables)
    from a safetensors file written by :func:`export`.

    Reads one tensor at a time. ``model`` is an ordinary ``nnx.Module`` of the same
    structure (e.g. ``GPT(cfg, rngs=nnx.Rngs(0))``); it is updated in place and returned.

    Raises:
      FileNotFoundError: ``file`` does not exist.
      ValueError: the file is not a readable safetensors file (truncated, corrupt), or its
        tensors do not match the model's parameters (each path missing, extra, or with a
        differing shape / dtype named); the model is then left unchanged.
    """
    from safetensors import safe_open  # noqa: PLC0415

    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"load_params: no file {str(file)!r}")
    flat = [(p, v) for p, v in nnx.to_flat_state(nnx.state(model)) if not isinstance(v, (nnx.RngState, nnx.Intermediate))]
    want = {path_str(p): (tuple(v.get_value().shape), np.dtype(v.get_value().dtype)) for p, v in flat}
    try:
        with safe_open(file, framework="flax") as f:
            have = {}
            for name in f.keys():
                sl = f.get_slice(name)
                have[name] = (tuple(sl.get_shape()), _from_st_dtype(sl.get_dtype()))
            problems = differences(want, have, "file", "model")
            if problems:
                raise ValueError(
                    f"load_params: {str(file)!r} does not match the model; {len(problems)} difference(s):\n"
                    + "\n".join(problems[:20]) + "\nthe model was left unchanged"
                )
            values = {p: f.get_tensor(path_str(p)) for p, _ in flat}
    except ValueError:
        raise
    except Exception as e:  # safetensors raises SafetensorError / OSError on a damaged file
        raise ValueError(f"load_params: {str(file)!r} is not a readable safetensors file ({short_error(e)})") from e
    nnx.update(model, nnx.from_flat_state([(p, v.replace(values[p])) for p, v in flat]))
    return model


def _from_st_dtype(code: str) -> np.dtype:
    names = {v: k for k, v in _ST_DTYPES.items()}
    return np.dtype(jnp.dtype(names.get(code.upper(), code.lower())))

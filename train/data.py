"""Byte-level data for the GPT: a corpus of bytes, a held-out split, and batches of windows.

Tokens are bytes (vocabulary 256): a file's raw bytes, ``uint8`` on disk and in memory,
``int32`` in a batch. No tokenizer, no download.

The default corpus is the Python standard library's own ``.py`` sources, found with
``sysconfig.get_paths()["stdlib"]``: every ``*.py`` file below it, recursively, except
those under ``site-packages`` and test directories (``test``, ``tests``, ``idle_test``),
read in sorted path order and concatenated until :data:`DEFAULT_CORPUS_BYTES` (8 MiB) are
collected (the whole filtered stdlib is ~12 MB; the cap keeps start-up under a second). It
therefore depends on the Python version; ``--data FILE`` gives a fixed corpus instead.

The last :data:`EVAL_FRACTION` (10%) of the bytes are held out for evaluation.

Example::

    corpus = load_corpus(None)                       # 8 MiB of stdlib sources
    train, held_out = split_corpus(corpus)           # uint8 [0.9 n], uint8 [0.1 n]
    check_split(train, held_out, seq_len=128, source="stdlib")
    for inputs, targets in train_batches(train, batch_size=16, seq_len=128, seed=0):
        ...                                          # int32 [16, 128] each
    # process p of P reads only its rows of each global batch: int32 [16 / P, 128]
    train_batches(train, 16, 128, seed=0, process_index=p, process_count=P)
"""

from __future__ import annotations

import itertools
import os
import sysconfig
from pathlib import Path
from typing import Iterator

import grain
import numpy as np

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "EVAL_FRACTION",
    "VOCAB_SIZE",
    "Batch",
    "check_split",
    "describe_source",
    "eval_batches",
    "load_corpus",
    "num_examples",
    "split_corpus",
    "stdlib_sources",
    "train_batches",
    "train_dataset",
]

VOCAB_SIZE = 256
"""Tokens are bytes."""

DEFAULT_CORPUS_BYTES = 8 * 2**20
"""Cap of the default (stdlib) corpus, bytes: the first 8 MiB in sorted path order."""

EVAL_FRACTION = 0.1
"""Fraction of the corpus (its last bytes) held out for evaluation."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

Batch = tuple[np.ndarray, np.ndarray]
"""``(inputs, targets)``: int32 ``[B, T]`` each; ``targets[:, t] == inputs[:, t + 1]`` within a window."""


def stdlib_sources() -> list[Path]:
    """The standard library's ``*.py`` files, sorted by path; no site-packages, no tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )


def describe_source(path: str | os.PathLike | None) -> str:
    """One line naming the corpus: ``--data 'FILE'`` or the stdlib directory."""
    if path is not None:
        return f"--data {str(path)!r}"
    return f"stdlib .py sources under {sysconfig.get_paths()['stdlib']} (first {DEFAULT_CORPUS_BYTES // 2**20} MiB)"


def load_corpus(path: str | os.PathLike | None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """The corpus as bytes.

    Args:
      path: a file to read whole; a folder, whose files (every regular file below it, in
        sorted path order, hidden files and folders left out) are read whole and
        concatenated; or ``None`` for the standard-library sources.
      max_bytes: cap of the stdlib corpus, bytes (a ``path`` is never truncated).

    Returns:
      uint8 ``[n]``.

    Raises:
      ValueError: ``path`` is missing, not a regular file, unreadable or empty; or no stdlib
        source was found. The message names the path and the fix.
    """
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"--data {str(p)!r}: no such file; give an existing text file, or omit --data for the stdlib corpus")
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
            raw = b"".join(f.read_bytes() for f in files)
            if not raw:
                raise ValueError(f"--data {str(p)!r}: the folder holds no file with text in it; give a folder of text files, or a file")
            return np.frombuffer(raw, dtype=np.uint8)
        if not p.is_file():
            raise ValueError(f"--data {str(p)!r}: not a regular file; give a text file, or omit --data for the stdlib corpus")
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise ValueError(f"--data {str(p)!r}: cannot be read ({e.strerror}); check its permissions") from e
        if not raw:
            raise ValueError(f"--data {str(p)!r}: the file is empty; give a file with text in it, or omit --data")
        return np.frombuffer(raw, dtype=np.uint8)

    chunks, total = [], 0
    for src in stdlib_sources():
        if total >= max_bytes:
            break
        raw = src.read_bytes()
        chunks.append(raw)
        total += len(raw)
    if not chunks:
        raise ValueError(
            f"no .py sources found under the stdlib directory {sysconfig.get_paths()['stdlib']!r}; "
            "give a corpus with --data FILE"
        )
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def split_corpus(corpus: np.ndarray, eval_fraction: float = EVAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """``corpus[:n - k], corpus[n - k:]`` with ``k = floor(eval_fraction * n)`` (the last bytes are held out)."""
    k = int(len(corpus) * eval_fraction)
    return corpus[: len(corpus) - k], corpus[len(corpus) - k :]


def check_split(train: np.ndarray, held_out: np.ndarray, seq_len: int, source: str) -> None:
    """Both splits must hold at least one window of ``seq_len + 1`` bytes.

    Raises:
      ValueError: naming ``source``, the sizes and the fix.
    """
    need = seq_len + 1
    for name, part in (("training", train), ("held-out", held_out)):
        if len(part) < need:
            n = len(train) + len(held_out)
            raise ValueError(
                f"{source}: {n} bytes give a {name} split of {len(part)} bytes (last {EVAL_FRACTION:.0%} held out), "
                f"shorter than one window of seq_len+1 = {need} bytes; use a file of at least "
                f"{int(np.ceil(need / EVAL_FRACTION))} bytes or a smaller --seq-len"
            )


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [B, T+1]
    w = data[idx].astype(np.int32)  # [B, T+1] uint8 -> int32
    return w[:, :-1], w[:, 1:]  # inputs [B, T], targets [B, T]


def num_examples(data: np.ndarray, seq_len: int) -> int:
    """Training examples in ``data``: disjoint windows ``data[k T : k T + T + 1]``, ``k = 0 .. K-1``.

    ``K = (n - 1) // T`` (window ``k``'s targets end at byte ``k T + T``, so neighbours share one byte).
    """
    return (len(data) - 1) // seq_len


def train_dataset(
    data: np.ndarray, batch_size: int, seq_len: int, seed: int, *, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
    """This process's batches as an endless ``grain.MapDataset``: element ``i`` is its rows of global batch ``i``.

    The examples are the ``K`` disjoint windows of :func:`num_examples`. Grain's
    ``MapDataset.range(K).shuffle(seed).repeat()`` orders them: each epoch a permutation of
    ``0 .. K-1``, a different one each epoch (Grain's index shuffle, seeded by ``seed`` and the
    epoch); the epochs follow each other as one stream, and global batch ``i`` is the
    stream's positions ``[i B, (i + 1) B)`` (a batch may straddle two epochs). So over each
    epoch every example is seen exactly once, and the global batches do not depend on the
    number of processes. Process ``p`` of ``P`` takes every ``P``-th block of ``B/P``
    positions (``[p::P]``), i.e. its rows ``[p B/P, (p + 1) B/P)`` of each global batch (the
    slice ``TrainStep.put_batch`` expects from it), and reads only those windows. Use
    ``grain.sharding.ShardByJaxProcess()`` for ``(process_index, process_count)``.

    Args:
      data: uint8 ``[n]`` (bytes) or uint16/uint32 ``[n]`` (tokens), ``n >= seq_len + 1``.
      batch_size: ``B``, sequences per global batch; must divide by ``process_count``.
      seq_len: ``T``, tokens per sequence.
      seed: seed of the epoch permutations.
      process_index: this process, ``0 .. process_count - 1`` (``jax.process_index()``).
      process_count: ``P`` (``jax.process_count()``).

    Returns:
      a ``grain.MapDataset`` of ``(inputs, targets)``, int32 ``[B / P, T]`` each; random
      access (``ds[i]``), and ``ds.to_iter_dataset()`` gives an iterator whose
      ``get_state()`` / ``set_state()`` a checkpoint holds (:class:`train.checkpointing.BatchStream`).

    Raises:
      ValueError: ``batch_size`` does not divide by ``process_count``, ``process_index`` is
        out of range, or ``data`` holds no window.
    """
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in 0..process_count-1 (process_count={process_count})")
    if batch_size % process_count:
        raise ValueError(
            f"--batch-size {batch_size} does not divide by the {process_count} processes; "
            f"use a multiple of {process_count} (each process reads batch_size / processes sequences)"
        )
    k = num_examples(data, seq_len)
    if k < 1:
        raise ValueError(f"{len(data)} tokens hold no window of seq_len+1 = {seq_len + 1} tokens; use a smaller --seq-len")
    rows = batch_size // process_count
    stream = grain.MapDataset.range(k).shuffle(seed=seed).repeat()  # stream position -> example index
    blocks = stream.batch(rows)  # block j: int64 [B/P] example indices at positions [j B/P, (j + 1) B/P)
    mine = blocks[process_index::process_count]  # global batch i, rows [p B/P, (p + 1) B/P)
    return mine.map(lambda examples: _windows(data, np.asarray(examples, np.int64) * seq_len, seq_len))


def train_batches(
    data: np.ndarray, batch_size: int, seq_len: int, seed: int, *, process_index: int = 0, process_count: int = 1, start: int = 0
) -> Iterator[Batch]:
    """Endless batches of :func:`train_dataset` from global batch ``start`` on (same arguments).

    Yields:
      ``(inputs, targets)``, int32 ``[B / P, T]`` each.
    """
    ds = train_dataset(data, batch_size, seq_len, seed, process_index=process_index, process_count=process_count)
    for i in itertools.count(start):
        yield ds[i]


def eval_batches(data: np.ndarray, batch_size: int, seq_len: int, num_batches: int = 8) -> list[Batch]:
    """A fixed set of ``num_batches`` batches from the held-out split, independent of any seed.

    Window starts are evenly spaced over ``data`` (``num_batches * batch_size`` of them,
    overlapping if the split is short), so the eval loss covers the whole split.

    Returns:
      ``num_batches`` pairs ``(inputs, targets)``, int32 ``[batch_size, seq_len]`` each.
    """
    starts = np.linspace(0, len(data) - seq_len - 1, num_batches * batch_size).astype(np.int64)
    return [_windows(data, s, seq_len) for s in starts.reshape(num_batches, batch_size)]

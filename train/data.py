"""Data for the GPT: a corpus of bytes or of pre-tokenised tokens, a held-out split, and batches of windows.

Two kinds of corpus:

- **bytes** (vocabulary 256): a text file's raw bytes, or a folder's files concatenated,
  ``uint8`` on disk and in memory, ``int32`` in a batch. No tokenizer, no download.
- **token files** (nanoGPT's layout), read with a numpy memory map, never loaded whole: a
  ``.bin`` of raw ``uint16`` (nanoGPT's default) or ``uint32`` tokens, no header
  (``--token-dtype``), or a ``.npy`` of a 1-D ``uint16`` / ``uint32`` array (its header
  carries the dtype). ``--vocab-size N`` is then required and becomes the model's
  vocabulary; :func:`load_tokens` checks every token is ``< N`` (the whole file, in chunks
  of :data:`CHECK_CHUNK` tokens) before anything compiles.

The default corpus is the Python standard library's own ``.py`` sources, found with
``sysconfig.get_paths()["stdlib"]``: every ``*.py`` file below it, recursively, except
those under ``site-packages`` and test directories (``test``, ``tests``, ``idle_test``),
read in sorted path order and concatenated until :data:`DEFAULT_CORPUS_BYTES` (8 MiB) are
collected (the whole filtered stdlib is ~12 MB; the cap keeps start-up under a second). It
therefore depends on the Python version; ``--data FILE`` gives a fixed corpus instead.

The last :data:`EVAL_FRACTION` (10%) of the bytes are held out for evaluation.

Example::

    tokens = load_data("train.bin", vocab_size=50257)  # memmap uint16 [n] (load_tokens)
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
    "CHECK_CHUNK",
    "TOKEN_DTYPES",
    "TOKEN_SUFFIXES",
    "Batch",
    "check_split",
    "describe_source",
    "eval_batches",
    "is_token_file",
    "load_corpus",
    "load_data",
    "load_tokens",
    "num_examples",
    "parse_token_prompt",
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

TOKEN_SUFFIXES = (".bin", ".npy")
"""File name endings read as pre-tokenised token files (anything else is bytes)."""

TOKEN_DTYPES = ("uint16", "uint32")
"""Token dtypes of a token file; a ``.bin`` is ``uint16`` unless ``--token-dtype uint32``."""

CHECK_CHUNK = 2**24
"""Tokens read at a time (32 MiB of uint16) when checking a token file against the vocabulary."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

Batch = tuple[np.ndarray, np.ndarray]
"""``(inputs, targets)``: int32 ``[B, T]`` each; ``targets[:, t] == inputs[:, t + 1]`` within a window."""


def stdlib_sources() -> Iterator[Path]:
    """The standard library's ``*.py`` files in sorted path order; no site-packages, no tests.

    Lazy: each folder is listed when the walk reaches it, and the skipped folders (the
    site-packages and test trees, most of the ~50 000 files below the stdlib directory) are
    never entered, so the default corpus reads only the folders its first 8 MiB come from.
    The order is ``sorted()`` of the paths: names sorted within each folder, a folder's files
    where its name sorts (``a/x.py`` before ``a.py``). Symlinked folders are not entered.
    """
    yield from _sorted_py(Path(sysconfig.get_paths()["stdlib"]))


def _sorted_py(folder: Path) -> Iterator[Path]:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            if e.name not in _SKIP_DIRS:
                yield from _sorted_py(Path(e.path))
        elif e.name.endswith(".py") and e.is_file():
            yield Path(e.path)


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


def is_token_file(path: str | os.PathLike | None) -> bool:
    """Is ``--data path`` a pre-tokenised token file (its name ends in ``.bin`` or ``.npy``)?"""
    return path is not None and Path(path).suffix.lower() in TOKEN_SUFFIXES


def load_tokens(path: str | os.PathLike, vocab_size: int | None, token_dtype: str | None = None) -> np.ndarray:
    """A pre-tokenised token file as a read-only memory map (nothing is loaded whole).

    Args:
      path: a ``.bin`` (raw tokens, no header, native byte order as nanoGPT's
        ``np.memmap(..., mode="w+")`` writes them) or a ``.npy`` (``np.save`` of a 1-D array).
      vocab_size: ``N`` (``--vocab-size``): every token must lie in ``[0, N)``; required.
      token_dtype: ``"uint16"`` or ``"uint32"`` (``--token-dtype``), the dtype of a ``.bin``
        (``None``: ``uint16``, as nanoGPT). For a ``.npy`` it may be left unset; if given it
        must equal the file's dtype.

    Returns:
      ``np.memmap`` uint16 or uint32 ``[n]``, ``n >= 1``.

    Raises:
      ValueError: naming the file and the flag, with the fix, when ``vocab_size`` is missing
        or < 2; ``token_dtype`` is not uint16/uint32; ``vocab_size > 65536`` with uint16
        tokens; the file is missing, empty, a ``.bin`` whose size is not a multiple of the
        dtype's size, a ``.npy`` that is not a 1-D uint16/uint32 array; or a token is
        ``>= vocab_size`` (the first such token and its index are named). The whole file is
        scanned, :data:`CHECK_CHUNK` tokens at a time (0.3 s for 1 GB of uint16 in the page cache,
        measured on the 2-core development machine; a cold disk adds its read time).
    """
    p = Path(path)
    where = f"--data {str(p)!r}"
    if vocab_size is None:
        raise ValueError(
            f"{where} is a token file ({p.suffix}): give its vocabulary with --vocab-size N "
            f"(e.g. 50257 for GPT-2's tokenizer); every token must be < N"
        )
    if not 2 <= vocab_size <= 2**31 - 1:
        raise ValueError(f"--vocab-size {vocab_size}: give 2 .. 2**31 - 1 tokens (a batch holds them as int32)")
    if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"--token-dtype {token_dtype!r}: choose uint16 or uint32")
    if not p.is_file():
        what = "no such file" if not p.exists() else "not a regular file"
        raise ValueError(f"{where}: {what}; give an existing .bin or .npy token file")
    try:
        if p.suffix.lower() == ".npy":
            tokens = np.load(p, mmap_mode="r")  # header read; the array stays on disk
            if tokens.ndim != 1 or tokens.dtype.kind != "u" or tokens.dtype.itemsize not in (2, 4):
                raise ValueError(
                    f"{where}: holds an array of dtype {tokens.dtype} and shape {tokens.shape}; a .npy token file is a 1-D "
                    f"uint16 or uint32 array: np.save(path, tokens.reshape(-1).astype(np.uint16)) (np.uint32 for a "
                    f"vocabulary above 65536)"
                )
            dtype = f"uint{tokens.dtype.itemsize * 8}"
            if token_dtype is not None and token_dtype != dtype:
                raise ValueError(f"--token-dtype {token_dtype}: {where} holds {dtype} tokens (its header says so); drop --token-dtype")
        else:
            dtype = token_dtype or "uint16"
            size, item = p.stat().st_size, np.dtype(dtype).itemsize
            if size % item:
                other = "uint32" if dtype == "uint16" else "uint16"
                raise ValueError(
                    f"{where}: {size} bytes is not a multiple of {item} (--token-dtype {dtype}); the file is cut short "
                    f"or holds other tokens: write whole {dtype} tokens, or pass --token-dtype {other} if it holds those"
                )
            tokens = np.memmap(p, dtype=dtype, mode="r") if size else np.zeros(0, dtype)  # [size / item]
    except OSError as e:
        raise ValueError(f"{where}: cannot be read ({e.strerror or e}); check the file and its permissions") from e
    if dtype == "uint16" and vocab_size > 2**16:
        raise ValueError(
            f"--vocab-size {vocab_size}: {where} holds uint16 tokens (0..65535), too narrow for that vocabulary; write "
            f"the tokens as uint32 (and pass --token-dtype uint32 for a .bin), or check --vocab-size"
        )
    if len(tokens) == 0:
        raise ValueError(f"{where}: the file holds no token; give a file with tokens in it")
    # A uint32 .bin read as the default uint16 (little-endian): every second uint16 is a high half,
    # 0 for any vocabulary <= 65536, and every id would still pass the vocabulary check below.
    guess_dtype = p.suffix.lower() == ".bin" and token_dtype is None and len(tokens) >= 2
    high_halves_zero, any_token = guess_dtype, False
    for lo in range(0, len(tokens), CHECK_CHUNK):
        chunk = tokens[lo : lo + CHECK_CHUNK]  # a window of the memmap: read, checked, dropped
        if high_halves_zero:  # CHECK_CHUNK is even: chunk[1::2] are the odd indices of the file
            high_halves_zero = not chunk[1::2].any()
        top = int(chunk.max())
        any_token = any_token or top > 0
        if top >= vocab_size:
            at = lo + int(np.argmax(chunk >= vocab_size))
            raise ValueError(
                f"{where}: token {int(tokens[at])} at index {at} is >= --vocab-size {vocab_size}; pass the tokenizer's "
                f"vocabulary size (at least {top + 1}){', or --token-dtype uint32 if the file holds uint32 tokens' if p.suffix.lower() == '.bin' and dtype == 'uint16' else ''}"
            )
    if high_halves_zero and any_token:
        raise ValueError(
            f"{where}: read as uint16 (the default), every second token is 0, as in uint32 tokens below 65536; "
            f"pass --token-dtype uint32 if it holds uint32 tokens, or --token-dtype uint16 if these are its tokens"
        )
    return tokens


def load_data(path: str | os.PathLike | None, vocab_size: int | None = None, token_dtype: str | None = None) -> np.ndarray:
    """``--data``: a token file (:func:`load_tokens`, a memmap) or bytes (:func:`load_corpus`).

    Returns:
      uint16 / uint32 ``[n]`` tokens, or uint8 ``[n]`` bytes.

    Raises:
      ValueError: as :func:`load_tokens` / :func:`load_corpus`; or ``vocab_size`` /
        ``token_dtype`` given for bytes (text is always vocabulary 256).
    """
    if is_token_file(path):
        return load_tokens(path, vocab_size, token_dtype)
    what = f"--data {str(path)!r} is" if path is not None else "without --data the corpus is"
    for flag, value in (("--vocab-size", vocab_size), ("--token-dtype", token_dtype)):
        if value is not None:
            raise ValueError(
                f"{flag} {value}: {what} read as bytes (vocabulary 256); {flag} is for token files "
                f"({' or '.join(TOKEN_SUFFIXES)}): drop {flag}, or give a token file"
            )
    return load_corpus(path)


def parse_token_prompt(text: str, vocab_size: int) -> list[int]:
    """``--prompt`` for a token file: token ids separated by spaces or commas (``"464 2068 7586"``).

    Raises:
      ValueError: a part is not an integer, or an id is outside ``[0, vocab_size)``; naming
        ``--prompt`` and the fix (a token file has no tokenizer here to encode text with).
    """
    parts = text.replace(",", " ").split()
    try:
        ids = [int(x) for x in parts]
    except ValueError:
        ids = None
    if not ids or any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(
            f"--prompt {text!r}: with a token file the prompt is token ids separated by spaces, each in "
            f"0..{vocab_size - 1} (--vocab-size {vocab_size}), e.g. --prompt '464 2068'; there is no tokenizer to encode text"
        )
    return ids


def split_corpus(corpus: np.ndarray, eval_fraction: float = EVAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """``corpus[:n - k], corpus[n - k:]`` with ``k = floor(eval_fraction * n)`` (the last bytes or tokens are held out;
    views: a memmap stays a memmap)."""
    k = int(len(corpus) * eval_fraction)
    return corpus[: len(corpus) - k], corpus[len(corpus) - k :]


def check_split(train: np.ndarray, held_out: np.ndarray, seq_len: int, source: str) -> None:
    """Both splits must hold at least one window of ``seq_len + 1`` tokens (bytes for uint8 data).

    Raises:
      ValueError: naming ``source``, the sizes and the fix.
    """
    need = seq_len + 1
    unit = "bytes" if train.dtype == np.uint8 else "tokens"
    for name, part in (("training", train), ("held-out", held_out)):
        if len(part) < need:
            n = len(train) + len(held_out)
            raise ValueError(
                f"{source}: {n} {unit} give a {name} split of {len(part)} {unit} (last {EVAL_FRACTION:.0%} held out), "
                f"shorter than one window of seq_len+1 = {need} {unit}; use a file of at least "
                f"{int(np.ceil(need / EVAL_FRACTION))} {unit} or a smaller --seq-len"
            )


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [B, T+1]
    w = np.asarray(data[idx], dtype=np.int32)  # [B, T+1] uint8/uint16/uint32 -> int32 (a memmap reads only these)
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

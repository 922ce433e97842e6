"""``pytest --compile-log DIR``: where the suite's time goes, program by program.

Each test process (both xdist workers) writes ``DIR/compiles.<worker>.tsv``: one row per XLA
compilation or persistent-cache load (``jax_log_compiles``), with the test that caused it, the
phase and the program name and seconds. At the end the controller prints the programs and files
that took longest. Off unless asked: the log costs a few percent, and nothing asserts on it.

Used for issue 24 (the suite's time): a fresh-clone run showed about half of the per-test seconds
in XLA:CPU compiles, most of them zshard steps (one per test), init programs and reference steps.
"""

from __future__ import annotations

import collections
import logging
import os
import re
from pathlib import Path

import jax

# jax's own messages under jax_log_compiles: a compile (or a cache load: the same message) and a hit
_FINISHED = re.compile(r"Finished (XLA compilation|jaxpr to MLIR module conversion) of (.*?) in ([0-9.e-]+) sec")
_HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
_LOGGERS = ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler")


class _Rows(logging.Handler):
    def __init__(self, path: Path):
        super().__init__(logging.DEBUG)
        self.out = path.open("w", buffering=1)
        self.test = "<collection>"

    def emit(self, record):
        msg = record.getMessage()
        if m := _FINISHED.search(msg):
            phase = "compile" if m.group(1).startswith("XLA") else "to_mlir"
            self.out.write(f"{self.test}\t{phase}\t{m.group(2)}\t{m.group(3)}\n")
        elif m := _HIT.search(msg):
            self.out.write(f"{self.test}\tcache_hit\t{m.group(1)}\t0\n")


def pytest_addoption(parser):
    parser.addoption("--compile-log", metavar="DIR", help="write each XLA compile (test, phase, program, seconds) to DIR/compiles.*.tsv")


def pytest_configure(config):
    folder = config.getoption("--compile-log")
    controller = config.getoption("numprocesses", None) and not hasattr(config, "workerinput")  # xdist's: it runs no test
    if not folder or controller:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    handler = _Rows(Path(folder) / f"compiles.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.tsv")
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # not into the captured output of each test
    jax.config.update("jax_log_compiles", True)
    config._compile_log = handler


def pytest_unconfigure(config):
    handler = getattr(config, "_compile_log", None)
    if handler is not None:
        handler.out.close()


def pytest_runtest_setup(item):
    handler = getattr(item.config, "_compile_log", None)
    if handler is not None:
        handler.test = item.nodeid


def pytest_terminal_summary(terminalreporter, config):
    folder = config.getoption("--compile-log")
    if not folder:
        return
    seconds, count, per_file = collections.Counter(), collections.Counter(), collections.Counter()
    for path in Path(folder).glob("compiles.*.tsv"):
        for line in path.read_text().splitlines():
            test, phase, program, sec = line.split("\t")
            if phase == "compile":
                seconds[program] += float(sec)
                count[program] += 1
                per_file[test.split("::")[0]] += float(sec)
    tr = terminalreporter
    tr.write_sep("-", f"XLA compiles: {sum(count.values())}, {sum(seconds.values()):.1f} s (rows in {folder})")
    for program, sec in seconds.most_common(10):
        tr.write_line(f"{sec:8.1f} s {count[program]:5d} x {program}")
    for name, sec in per_file.most_common(10):
        tr.write_line(f"{sec:8.1f} s  {name}")

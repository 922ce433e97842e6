"""``python -m train.sample`` and the ``--help`` of every program.

1. A Hugging Face fixture directory, sharded on 2x4: greedy (``--temperature 0``) continues the
   prompt with the argmax tokens of a plain single-device forward (no KV cache); a tiny nucleus
   (``--top-p``) at any temperature is greedy; the same ``--seed`` gives the same tokens, another
   seed others. (A run folder of ``python -m train``: tests/test_cli.py, on its finished run.)
2. Nucleus filtering keeps the most likely tokens up to the mass asked for.
3. Bad input is one line and exit 2, before jax compiles anything.
4. ``--help`` prints the usage and exits 0 for every program; ``python -m train.generate``
   points to ``python -m train.sample``.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from test_hf import FIXTURES, forward, plain_model
from train import sample
from train.generate import nucleus
from train.model import from_hf

RATE = re.compile(r"^\d+(\.\d+)? tokens/s \(\d+ tokens in [\d.]+ s; compiled before, apart: \d+ programs? in [\d.]+ s\)$")


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` argmax tokens after ``prompt`` from full forwards of a plain model (no KV cache):
    the sequence padded to its final length, the logits at position ``t - 1`` read for token
    ``t`` (causal attention: the padding after ``t`` does not reach them)."""
    ids = np.zeros((1, len(prompt) + n), np.int32)
    ids[0, : len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        ids[0, t] = int(np.argmax(np.asarray(forward(model, jnp.asarray(ids)))[0, t - 1]))  # [1, L, V] -> [V]
    return ids[0, len(prompt):].tolist()


def run_sample(capsys, *argv) -> tuple[str, str]:
    """``python -m train.sample ARGV`` in this process: ``(the prompt and its continuation, the rate
    line)``; the text loses one final newline (the program ends it with one before the rate line)."""
    assert sample.main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    body, _, rate = out[:-1].rpartition("\n")
    assert RATE.match(rate), rate
    return body, rate


PROMPT = [3, 10, 17]


def test_hugging_face_directory_greedy_and_seeded(capsys):
    d = FIXTURES / "llama"
    n = 6
    want = greedy(plain_model(*from_hf(d)), PROMPT, n)
    text, _ = run_sample(capsys, d, "--prompt", "3 10 17", "--tokens", n, "--temperature", 0, "--mesh", "2x4")
    assert text == " ".join(map(str, PROMPT + want))  # ids, as python -m train --prompt takes them
    common = [d, "--prompt", "3 10 17", "--tokens", n, "--mesh", "2x4", "--temperature", "1.5"]
    nucleus_of_one, _ = run_sample(capsys, *common, "--top-p", "1e-6", "--seed", 5)
    assert nucleus_of_one == text
    first, _ = run_sample(capsys, *common, "--seed", 3)
    again, _ = run_sample(capsys, *common, "--seed", 3)
    other, _ = run_sample(capsys, *common, "--seed", 4)
    assert first == again and first != other and first != text


def test_nucleus_keeps_the_most_likely_tokens_up_to_the_mass():
    probs = np.array([[0.5, 0.05, 0.3, 0.15], [0.25, 0.25, 0.25, 0.25]], np.float32)
    logits = jnp.log(jnp.asarray(probs))
    kept = lambda p: np.isfinite(np.asarray(nucleus(logits, jnp.float32(p))))  # noqa: E731
    np.testing.assert_array_equal(kept(0.5), [[True, False, False, False], [True, True, True, True]])  # ties kept
    np.testing.assert_array_equal(kept(0.7)[0], [True, False, True, False])  # 0.5 < 0.7 <= 0.8
    np.testing.assert_array_equal(kept(0.81)[0], [True, False, True, True])
    np.testing.assert_array_equal(np.asarray(nucleus(logits, jnp.float32(1.0))), np.asarray(logits))  # 1: unchanged


@pytest.mark.parametrize("argv,says", [
    (["no/such/run", "--prompt", "x"], "does not exist"),
    ([ROOT / "docs", "--prompt", "x"], "neither config.toml"),
    ([FIXTURES / "llama", "--prompt", "3 10", "--top-p", "0"], "--top-p 0.0"),
    ([FIXTURES / "llama", "--prompt", "3 10", "--temperature", "-1"], "--temperature -1.0"),
    ([FIXTURES / "llama", "--prompt", "3 10", "--mesh", "3x3"], "--mesh '3x3' has 9 devices"),
    ([FIXTURES / "llama", "--prompt", "3 10", "--strategy", "ZERO9"], "--strategy 'ZERO9'"),
    ([FIXTURES / "llama", "--prompt", "hello"], "token ids"),
], ids=["missing", "neither", "top-p", "temperature", "mesh", "strategy", "text-prompt-for-ids"])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        sample.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("python -m train.sample: error:") and says in err[0], err


PROGRAMS = ["train", "train.plan", "train.bench", "train.plot", "train.scale", "train.sample", "zshard.verify", "zshard.launch"]

_HELP = """
import os, runpy, sys, tempfile, traceback
import jax  # noqa: F401  (what every program imports first, once: each program runs in a fork of this process)
for module in sys.argv[1:]:
    out, err = (tempfile.TemporaryFile() for _ in range(2))
    sys.stdout.flush()  # else the child's stdout would start with this process's unwritten lines
    pid = os.fork()
    if pid == 0:  # the child: ``python -m MODULE --help``, its stdout and stderr to the files
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = [module, "--help"]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:  # as the interpreter ends: None is 0, a message is printed and 1
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out.seek(0)
    err.seek(0)
    print(repr((module, status, out.read().decode(), err.read().decode())))
"""


@functools.cache
def _helps() -> dict:
    """``python -m MODULE --help`` of every program, each in a process of its own: ``{module: (exit status,
    stdout, stderr)}``. One interpreter imports jax, then forks a child per program that runs it as
    ``python -m`` does (``runpy``, ``__main__``); a fresh interpreter per program spent ~2 s of CPU
    on importing jax each."""
    res = subprocess.run([sys.executable, "-c", _HELP, *PROGRAMS, "train.generate"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    helps = {m: (status, out, err) for m, status, out, err in map(ast.literal_eval, res.stdout.splitlines())}
    assert list(helps) == [*PROGRAMS, "train.generate"], res.stdout[-3000:]
    return helps


@pytest.mark.parametrize("module", [*PROGRAMS, "train.generate"])
def test_help_prints_the_usage_and_exits_0(module):
    returncode, stdout, stderr = _helps()[module]
    res = types.SimpleNamespace(returncode=returncode, stdout=stdout, stderr=stderr)
    if module == "train.generate":  # the library: no command line of its own, it names the one to use
        assert res.returncode == 2 and "python -m train.sample" in res.stderr and not res.stdout, res
        return
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(f"usage: python -m {module} "), res.stdout[:500]

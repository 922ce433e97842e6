"""``python -m zshard.launch`` output: whole lines with a rank prefix, library chatter hidden
unless ``--verbose``, progress-bar redraws thinned (plain Python children, no jax)."""

from __future__ import annotations

import io
import sys

from zshard.launch import launch

CHILD = r"""
import os, sys, time
rank = os.environ["ZSHARD_PROCESS_ID"]
out = sys.stdout
out.write(f"[Gloo] Rank {rank} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n")
out.write("I0000 00:00:1764540000.123456   4242 coordination_service_agent.cc:300] Coordination agent has successfully connected.\n")
out.write("W0000 00:00:1764540000.123456   4242 something.cc:1] a warning stays\n")
out.write(f"[Gloo] Rank {rank}[Gloo] Rank 9 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n")  # glued, cut short
out.write("kept text[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n")
for i in range(50):
    out.write(f"\rtrain: {i}/50 step/s")  # a progress bar redraw, no newline
    out.flush()
out.write("\rtrain: 50/50 done\n")
out.write(f"half a line from {rank} ")  # a line written in pieces
out.flush()
time.sleep(0.2)
out.write("and its end\n")
out.flush()
"""


def run(verbose: bool) -> list[str]:
    buf = io.BytesIO()
    assert launch([sys.executable, "-c", CHILD], 2, out=buf, verbose=verbose) == 0
    return buf.getvalue().decode().splitlines()


def test_lines_are_whole_prefixed_and_quiet():
    lines = run(verbose=False)
    assert all(line.startswith(("[rank 0] ", "[rank 1] ", "[zshard.launch] ")) for line in lines), lines
    for rank in (0, 1):
        mine = [line[len(f"[rank {rank}] "):] for line in lines if line.startswith(f"[rank {rank}] ")]
        assert f"half a line from {rank} and its end" in mine  # pieces joined, no other rank's text inside
        assert "train: 50/50 done" in mine  # the bar's last state (ended by a newline)
        assert sum(line.startswith("train:") for line in mine) <= 2  # 50 redraws: the first and the last
        assert not any("[Gloo]" in line or "coordination_service_agent" in line for line in mine)
        assert any("a warning stays" in line for line in mine) and "kept text" in mine
    assert "[zshard.launch] hid 10 line(s) of library output (--verbose shows them)" in lines


def test_verbose_shows_everything():
    everything = run(verbose=True)
    assert not any(line.startswith("[zshard.launch] hid") for line in everything)
    lines = [line for line in everything if line.startswith("[rank")]
    assert sum(line.count("[Gloo] Rank") for line in lines) == 8
    assert sum("coordination_service_agent" in line for line in lines) == 2
    assert sum(line.startswith("[rank 0] train:") for line in lines) == 51


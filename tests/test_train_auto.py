"""``python -m train --auto`` end to end, in this process: a few steps of the nano model on the 8 emulated devices;
``config.toml`` records the search's choice and ``summary.json`` its predicted and measured ``step_s``."""

import json
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runs import NANO  # noqa: E402


def test_auto_trains_with_the_choice_and_records_it(tmp_path, corpus, capsys):
    from train.__main__ import main

    out = tmp_path / "run"
    assert main(["--auto", *NANO, "--steps", "3", "--data", str(corpus), "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert "--auto: " in said.out + said.err
    summary = json.loads((out / "summary.json").read_text())
    auto = summary["auto"]
    choice = auto["choice"]
    assert auto["predicted_step_s"] == choice["step_s"] > 0 and auto["measured_step_s"] > 0 and choice["compiled"]
    assert auto["ratio"] == auto["measured_step_s"] / auto["predicted_step_s"]
    cfg = tomllib.loads((out / "config.toml").read_text())
    m = choice["mesh"]
    assert cfg["mesh"]["shape"] == f"{m['replica']}x{m['shard']}" + (f"x{m['tensor']}" if m["tensor"] > 1 else "")
    assert cfg["mesh"]["strategy"] == choice["strategy"]
    assert cfg["training"]["remat"] == choice["remat"] and cfg["training"]["grad_accum"] == choice["accumulation"]

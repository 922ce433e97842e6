"""train/config.py: TOML files, flag overrides, FSDP / DeepSpeed names, errors naming the key."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

import zshard
from train import config as C
from train.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "train" / "configs").glob("*.toml"))


def parse(argv: list[str]) -> C.Config:
    """Flags (``--config FILE`` among them) -> Config, as ``python -m train`` does."""
    return build_parser().parse_args(argv).run


def write(tmp_path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(raw: dict, n_devices: int | None = None) -> str:
    with pytest.raises(C.ConfigError) as e:
        C.Config.from_dict(raw).validate(n_devices)
    return str(e.value)


# ---- files and overrides ----------------------------------------------------------------


def test_default_preset_is_the_default_run():
    from_file = C.Config.from_dict(C.load_file(ROOT / "train" / "configs" / "default.toml"))
    assert from_file.resolved() == C.Config().resolved()


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_parses_and_validates(path):
    cfg = C.Config.from_dict(C.load_file(path), str(path)).validate()
    assert cfg.strategy() in [s.value for s in zshard.Strategy]


def test_flags_override_the_file_and_both_flag_spellings_work(tmp_path):
    path = write(tmp_path, '[training]\nsteps = 50\nseed = 4\n[model]\npreset = "nano"\n[logging]\ntensorboard = true\n')
    cfg = parse(["--config", str(path), "--steps", "7", "--optimizer.lr", "0.01", "--no-tensorboard",
                 "--clip-norm", "1.5", "--warmup", "none"])
    assert (cfg.training.steps, cfg.training.seed, cfg.model.preset) == (7, 4, "nano")  # flag, file, file
    assert cfg.optimizer.lr == 0.01 and cfg.optimizer.clip_norm == 1.5 and cfg.optimizer.warmup is None
    assert cfg.logging.tensorboard is False
    assert cfg.mesh.devices == C.MeshConfig().devices  # untouched: the default


def test_every_field_has_a_documented_flag():
    parser = build_parser()
    text = parser.format_help()
    given = {bool: ([], True), int: (["7"], 7), float: (["0.5"], 0.5), str: (["x"], "x")}
    for section, cls in C.SECTIONS.items():
        docs = C.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{section}.{f.name} has no docstring"
            assert f"--{section}.{f.name}" in text
            value_args, want = given[C.field_type(cls, f.name)[0]]
            flag = f"--{section}.{f.name}"
            if f.default is True:
                flag, want = f"--no-{section}.{f.name}", False
            cfg = parser.parse_args([flag, *value_args]).run
            assert getattr(getattr(cfg, section), f.name) == want != getattr(getattr(C.Config(), section), f.name)


def test_existing_flag_names_still_work():
    cfg = parse(["--devices", "4", "--mesh", "2x2", "--strategy", "hybrid_shard", "--model", "nano", "--scan",
                 "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--lr", "0.1", "--warmup", "1",
                 "--weight-decay", "0", "--param-dtype", "bfloat16", "--reduce-dtype", "float32", "--grad-accum", "2",
                 "--clip-norm", "1", "--skip-nonfinite", "--seed", "1", "--data", "x.txt", "--eval-every", "0",
                 "--eval-batches", "2", "--out", "o", "--report"])
    assert (cfg.mesh.devices, cfg.mesh.shape, cfg.model.scan, cfg.training.grad_accum) == (4, "2x2", True, 2)
    assert cfg.training.skip_nonfinite and cfg.logging.report and cfg.data.path == "x.txt"
    assert cfg.validate().strategy() == "HYBRID_SHARD"


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = parse(["--zero-stage", "2", "--mesh", "cpu-2x4", "--model", "medium", "--data", "some.txt", "--init-from", "runs/a"])
    resolved = cfg.resolved()
    assert resolved.mesh.strategy == "SHARD_GRAD_OP" and resolved.mesh.zero_stage is None
    assert resolved.mesh.shape == "2x4" and resolved.model.scan is True  # the medium preset scans
    assert resolved.optimizer.warmup == 30 and Path(resolved.data.path).is_absolute()
    # --init-from as a path from this folder: --resume and --config OUT/config.toml then work from any folder
    assert resolved.model.init_from == str(Path("runs/a").resolve())
    path = write(tmp_path, C.dumps_toml(resolved, "a header\nof two lines"), "config.toml")
    assert path.read_text().startswith("# a header\n# of two lines\n")
    again = C.Config.from_dict(C.load_file(path))
    assert again == resolved and again.resolved() == resolved


# ---- FSDP and DeepSpeed names -------------------------------------------------------------


@pytest.mark.parametrize("name,want", [("FULL_SHARD", "FULL_SHARD"), ("SHARD_GRAD_OP", "SHARD_GRAD_OP"),
                                       ("NO_SHARD", "NO_SHARD"), ("HYBRID_SHARD", "HYBRID_SHARD"),
                                       ("_HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ZERO2"), (1, "FULL_SHARD"),
                                       (2, "SHARD_GRAD_OP"), (3, "NO_SHARD"), (4, "HYBRID_SHARD"),
                                       (5, "HYBRID_SHARD_ZERO2")])
def test_fsdp_sharding_strategy(name, want):
    assert C.Config.from_dict({"mesh": {"sharding_strategy": name}}).validate().strategy() == want


@pytest.mark.parametrize("stage,want", [(0, "NO_SHARD"), (1, "SHARD_OPT"), (2, "SHARD_GRAD_OP"), (3, "FULL_SHARD")])
def test_deepspeed_zero_optimization_stage(tmp_path, stage, want):
    toml_path = write(tmp_path, f"[zero_optimization]\nstage = {stage}\n")
    json_path = write(tmp_path, json.dumps({"zero_optimization": {"stage": stage}}), "ds.json")
    for path in (toml_path, json_path):
        assert C.Config.from_dict(C.load_file(path)).validate().strategy() == want


def test_command_line_strategy_replaces_a_files_zero_stage(tmp_path):
    stage = write(tmp_path, "[zero_optimization]\nstage = 2\n", "stage.toml")
    strategy = write(tmp_path, '[mesh]\nstrategy = "NO_SHARD"\n', "strategy.toml")
    assert parse(["--config", str(stage)]).validate().strategy() == "SHARD_GRAD_OP"
    assert parse(["--config", str(stage), "--strategy", "HYBRID_SHARD"]).validate().strategy() == "HYBRID_SHARD"
    assert parse(["--config", str(strategy), "--zero-stage", "3"]).validate().strategy() == "FULL_SHARD"


@pytest.mark.parametrize(
    "raw,needles",
    [
        ({"mesh": {"sharding_strategy": "ZERO_INFINITY"}}, ["mesh.strategy (--strategy)", "unknown strategy 'ZERO_INFINITY'", "HYBRID_SHARD_ZERO2"]),
        ({"mesh": {"sharding_strategy": 6}}, ["mesh.sharding_strategy", "invalid choice: 6", "5 HYBRID_SHARD_ZERO2"]),
        ({"mesh": {"sharding_strategy": "FULL_SHARD", "strategy": "NO_SHARD"}}, ["mesh.sharding_strategy", "keep one"]),
        ({"zero_optimization": {"stage": 4}}, ["mesh.zero_stage (--zero-stage)", "zero_stage=4", "0, 1, 2 or 3"]),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {}}}, ["zero_optimization.offload_optimizer", "allows: stage"]),
        ({"zero_optimization": {"stage": 2}, "mesh": {"strategy": "FULL_SHARD"}}, ["mesh.zero_stage", "SHARD_GRAD_OP", "'FULL_SHARD'"]),
    ],
)
def test_bad_fsdp_and_deepspeed_names(raw, needles):
    msg = error_of(raw)
    assert all(n in msg for n in needles), msg


# ---- errors name the key and the allowed values ------------------------------------------


@pytest.mark.parametrize(
    "raw,needles",
    [
        ({"trainig": {"steps": 3}}, ["trainig", "unknown section", "training", "logging"]),
        ({"training": {"stepz": 3}}, ["training.stepz", "unknown key", "steps, batch_size"]),
        ({"training": {"steps": "ten"}}, ["training.steps (--steps)", "expected an integer", "'ten'"]),
        ({"training": {"steps": 2.5}}, ["training.steps", "expected an integer", "2.5"]),
        ({"training": {"steps": True}}, ["training.steps", "expected an integer", "True"]),
        ({"logging": {"report": 1}}, ["logging.report (--report)", "expected true or false"]),
        ({"model": {"preset": "huge"}}, ["model.preset (--model)", "invalid choice: 'huge'", "nano, tiny, small, medium"]),
        ({"training": {"param_dtype": "float64"}}, ["training.param_dtype (--param-dtype)", "float32, bfloat16"]),
        ({"training": {"steps": 0}}, ["training.steps (--steps)", ">= 1", "0"]),
        ({"optimizer": {"lr": -1.0}}, ["optimizer.lr (--lr)", "> 0"]),
        ({"training": {"batch_size": 12}}, ["training.batch_size (--batch-size)", "12 does not divide by the 8 devices",
                                            "multiple of 8, e.g. 8 or 16"]),
        ({"training": {"batch_size": 8, "grad_accum": 2}}, ["training.batch_size", "x training.grad_accum 2",
                                                            "multiple of 16"]),
        ({"mesh": {"shape": "3x3"}}, ["mesh.shape (--mesh)", "'3x3' is 3x3 = 9 devices", "1x8, 2x4, 4x2, 8x1"]),
        ({"mesh": {"shape": "big"}}, ["mesh.shape (--mesh)", "unknown mesh preset 'big'", "cpu-2x4"]),
        ({"mesh": {"unit": "all"}}, ["mesh.unit", "invalid choice: 'all'", "blocks, ends"]),
        ({"checkpoint": {"keep": 0}}, ["checkpoint.keep (--keep)", ">= 1"]),
        ({"distributed": {"num_processes": "two"}}, ["distributed.num_processes (--num-processes)", "expected an integer"]),
        ({"logging": {"temperature": -0.5}}, ["logging.temperature (--temperature)", ">= 0"]),
        ({"precision": {"gather_format": "fp8"}}, ["precision.gather_format (--gather-format)", "unknown format",
                                                  "'int8', 'int4', 'float8_e4m3fn', 'float8_e5m2'"]),
        ({"precision": {"reduce_format": "int4", "block": 33}}, ["precision.block (--quant-block)", "must be even"]),
        ({"precision": {"block": -1}}, ["precision.block (--quant-block)", ">= 0"]),
        ({"precision": {"gather_format": "int8"}, "mesh": {"strategy": "NO_SHARD"}},
         ["precision.gather_format", "NO_SHARD keeps every parameter whole", "precision.replica_format"]),
        ({"precision": {"replica_format": "int8"}}, ["precision.replica_format", "FULL_SHARD reduces no gradient across replicas",
                                                     "precision.reduce_format"]),
    ],
)
def test_errors_name_the_key_and_what_is_allowed(raw, needles):
    msg = error_of(raw)
    assert all(n in msg for n in needles), msg


def test_precision_section_becomes_the_mixed_precision_of_the_run():
    assert C.Config().validate().mixed_precision() is None  # nothing set: full precision, as before
    cfg = parse(["--gather-format", "int8", "--replica-format", "int4", "--quant-block", "64", "--mesh", "2x4",
                 "--strategy", "HYBRID_SHARD", "--param-dtype", "bfloat16"]).validate()
    assert cfg.mixed_precision() == zshard.MixedPrecision(param_dtype="bfloat16", gather_format=zshard.Quant("int8", 64),
                                                          replica_format=zshard.Quant("int4", 64))
    tensorwise = C.Config.from_dict({"precision": {"gather_format": "float8_e4m3fn", "block": 0}}).validate()
    assert tensorwise.mixed_precision().gather_format == zshard.Quant("float8_e4m3fn", block=None)


def test_mesh_is_checked_against_the_devices_actually_there():
    msg = error_of({"mesh": {"devices": 8, "shape": "2x4"}}, n_devices=4)
    assert "'2x4' is 2x4 = 8 devices, but there are 4" in msg


def test_bad_toml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "[training]\nsteps = = 3\n")
    with pytest.raises(C.ConfigError, match=r"run.toml.*cannot be read as TOML.*line 2"):
        C.load_file(path)
    with pytest.raises(C.ConfigError, match="no such file"):
        C.load_file(tmp_path / "missing.toml")


def test_distributed_section_complete_is_accepted():
    cfg = C.Config.from_dict({"distributed": {"coordinator": "127.0.0.1:4321", "num_processes": 2, "process_id": 1}})
    assert cfg.validate().distributed.process_id == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--config", "{bad}"], "training.stepz: unknown key"),
        (["--steps", "ten"], "argument --steps/--training.steps: expected an integer, got 'ten'"),
        (["--config", "{missing}"], "no such file"),
    ],
)
def test_main_refuses_bad_config_with_status_2_and_writes_nothing(tmp_path, capsys, args, needle):
    """python -m train's checks in this process (tests/test_train.py's ``refused``: exit 2, one line)."""
    from test_train import refused  # noqa: PLC0415

    bad = write(tmp_path, "[training]\nstepz = 3\n")
    out = tmp_path / "run"
    argv = [a.replace("{bad}", str(bad)).replace("{missing}", str(tmp_path / "missing.toml")) for a in args]
    err = refused([*argv, "--out", str(out), "--model", "nano"], capsys)
    assert needle in err, err[-2000:]
    assert not out.exists()


def test_written_toml_is_plain_toml():
    text = C.dumps_toml(C.Config().resolved())
    assert set(tomllib.loads(text)) <= set(C.SECTIONS)

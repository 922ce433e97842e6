"""zshard.make_mesh / parse_mesh / mesh_presets on 8 emulated CPU devices."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import zshard
from zshard.mesh.mesh import mesh_presets, parse_mesh


def _ids(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.id)(mesh.devices)


def _check_axes(mesh: Mesh):
    assert isinstance(mesh, Mesh)
    assert tuple(mesh.axis_names) == ("replica", "shard")
    assert tuple(mesh.axis_types) == (AxisType.Explicit, AxisType.Explicit)


def test_default_is_one_host_by_eight():
    mesh = zshard.make_mesh()
    _check_axes(mesh)
    assert jax.process_count() == 1
    assert dict(mesh.shape) == {"replica": 1, "shard": 8}
    # devices of the one process in id order along the shard axis
    np.testing.assert_array_equal(_ids(mesh), np.arange(8).reshape(1, 8))


@pytest.mark.parametrize("replica,shard", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_explicit_shapes(replica, shard):
    mesh = zshard.make_mesh(replica, shard)
    _check_axes(mesh)
    assert dict(mesh.shape) == {"replica": replica, "shard": shard}
    # row r = replica group r; one group's devices adjacent on the shard axis
    np.testing.assert_array_equal(_ids(mesh), np.arange(8).reshape(replica, shard))


def test_keyword_form_and_inference():
    mesh = zshard.make_mesh(replica=2, shard=4)
    assert dict(mesh.shape) == {"replica": 2, "shard": 4}
    mesh = zshard.make_mesh(replica=4)
    _check_axes(mesh)
    assert dict(mesh.shape) == {"replica": 4, "shard": 2}
    mesh = zshard.make_mesh(shard=2)
    assert dict(mesh.shape) == {"replica": 4, "shard": 2}


def test_devices_argument_order():
    # devices given in reverse order are still laid out by id
    mesh = zshard.make_mesh(2, 4, devices=list(reversed(jax.devices())))
    np.testing.assert_array_equal(_ids(mesh), np.arange(8).reshape(2, 4))
    mesh = zshard.make_mesh(1, 4, devices=jax.devices()[:4])
    assert dict(mesh.shape) == {"replica": 1, "shard": 4}


@pytest.mark.parametrize("kwargs", [dict(replica=3, shard=3), dict(replica=3), dict(shard=3), dict(replica=2, shard=2)])
def test_bad_shape_lists_factorizations(kwargs):
    with pytest.raises(ValueError) as e:
        zshard.make_mesh(**kwargs)
    assert "1x8, 2x4, 4x2, 8x1" in str(e.value)


@pytest.mark.parametrize("kwargs", [dict(replica=0, shard=8), dict(replica=-1), dict(shard=0)])
def test_non_positive_sizes(kwargs):
    with pytest.raises(ValueError):
        zshard.make_mesh(**kwargs)


def test_parse_mesh_shape():
    assert parse_mesh("2x4") == (2, 4)
    assert parse_mesh("1x8") == (1, 8)
    assert parse_mesh(" 4X2 ") == (4, 2)


def test_parse_mesh_presets():
    assert parse_mesh("cpu-2x4") == (2, 4)
    assert parse_mesh("cpu-8") == (1, 8)


def test_parse_mesh_with_a_tensor_axis():
    assert parse_mesh("1x4x2") == (1, 4, 2)
    assert parse_mesh("2x4x1") == (2, 4)  # T = 1: the 2D mesh
    assert parse_mesh("cpu-2x2x2") == (2, 2, 2)
    assert dict(zshard.make_mesh(*parse_mesh("1x4x2")).shape) == {"replica": 1, "shard": 4, "tensor": 2}
    assert mesh_presets()["h100-8x8-tp8"].devices == 64
    with pytest.raises(ValueError, match="every size must be >= 1"):
        parse_mesh("1x0x2")


def test_parse_mesh_unknown_preset_lists_known():
    with pytest.raises(ValueError) as e:
        parse_mesh("tpu-v9-4096")
    msg = str(e.value)
    assert "tpu-v9-4096" in msg
    for name in mesh_presets():
        assert name in msg
    assert "cpu-8" in msg and "cpu-2x4" in msg


def test_mesh_presets():
    presets = mesh_presets()
    assert {"cpu-8", "cpu-2x4"} <= set(presets)
    assert (presets["cpu-8"].replica, presets["cpu-8"].shard) == (1, 8)
    assert (presets["cpu-2x4"].replica, presets["cpu-2x4"].shard) == (2, 4)
    assert presets["cpu-8"].platform == "cpu"
    gpu8 = [p for p in presets.values() if p.platform == "gpu" and p.devices == 8]
    assert gpu8, f"no 8-GPU preset among {sorted(presets)}"
    for p in presets.values():
        assert p.replica >= 1 and p.shard >= 1 and p.name


def test_presets_build_meshes_here():
    for name, p in mesh_presets().items():
        if p.platform == "cpu" and p.devices == 8:
            mesh = zshard.make_mesh(*parse_mesh(name))
            assert dict(mesh.shape) == {"replica": p.replica, "shard": p.shard, **({"tensor": p.tensor} if p.tensor > 1 else {})}


def test_presets_are_found_after_a_non_editable_install(tmp_path):
    # `pip install .` (not -e) copies only the packages and their package data: the presets of
    # the top-level meshes/ must travel as zshard.meshes (pyproject.toml's package-dir). Built
    # from a copy of the sources (nothing written in the checkout), installed with --target, and
    # imported from a folder outside the checkout.
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"
    for name in ("zshard", "train", "meshes"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(site), str(src)]
    res = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    probe = (
        "import zshard, zshard.checkpoint, zshard.mesh.mesh as m, train.plan\n"
        "assert zshard.__file__.startswith(SITE), zshard.__file__\n"
        "assert str(m.preset_dir()).startswith(SITE), m.preset_dir()\n"
        "mesh = zshard.make_mesh(*m.parse_mesh('cpu-2x4'))\n"
        "print(sorted(m.mesh_presets()), dict(mesh.shape))\n"
    ).replace("SITE", repr(str(site)))
    env = {**os.environ, "PYTHONPATH": str(site), "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "'cpu-2x4'" in res.stdout and "{'replica': 2, 'shard': 4}" in res.stdout
    assert not (root / "zshard" / "meshes").exists()  # one copy of the presets: the top-level meshes/

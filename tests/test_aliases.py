"""The flat module paths of zshard 0.1 still import (zshard/aliases.py), with a DeprecationWarning naming the new path."""

import importlib
import sys

import pytest

import zshard
from zshard import aliases


@pytest.mark.parametrize("old,new", sorted(aliases.MOVED.items()))
def test_old_module_path_is_the_new_module(old, new):
    sys.modules.pop(old, None)  # a previous import of the old path: import it afresh
    with pytest.deprecated_call(match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new  # the alias leaves the module's own spec


def test_old_names_are_the_same_objects():
    sys.modules.pop("zshard.units", None)
    with pytest.deprecated_call():
        from zshard.units import UnitWarning
    from zshard.params.units import UnitWarning as new

    assert UnitWarning is new


@pytest.mark.parametrize("package,name", [("zshard.mesh", "parse_mesh"), ("zshard.optim", "global_norm"),
                                          ("zshard.wire", "ParamWire")])
def test_old_module_named_like_its_package(package, name):
    module = importlib.import_module(package)
    module.__dict__.pop(name, None)  # resolved by an earlier test: resolve it again
    with pytest.deprecated_call(match=f"{package}.{name} moved to {aliases.PACKAGE_MOVED[package]}.{name}"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(aliases.PACKAGE_MOVED[package]), name)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        getattr(module, "not_a_name")


def test_every_alias_names_a_module_that_exists():
    for new in [*aliases.MOVED.values(), *aliases.PACKAGE_MOVED.values()]:
        assert importlib.util.find_spec(new) is not None, new
    assert zshard.make_mesh  # the package itself imports no old path

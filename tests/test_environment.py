"""nvfp4_dist.environment: every NVFP4_* variable reads its default when unset or empty and refuses bad values."""
import re

import pytest

from nvfp4_dist import environment

BAD_VALUES = {"0 or 1": "yes", "an integer >= 0": "-1"}


@pytest.mark.parametrize("variable", environment.VARIABLES, ids=lambda v: v.name)
def test_unset_and_empty_give_the_default(monkeypatch, variable):
    monkeypatch.delenv(variable.name, raising=False)
    assert variable.read() == variable.default
    monkeypatch.setenv(variable.name, "")
    assert variable.read() == variable.default


@pytest.mark.parametrize("variable", [v for v in environment.VARIABLES if v is not environment.BUILD_DIR],
                         ids=lambda v: v.name)
def test_bad_value_names_variable_value_and_allowed(monkeypatch, variable):
    monkeypatch.setenv(variable.name, BAD_VALUES.get(variable.allowed, "bogus"))
    with pytest.raises(ValueError, match=f"{variable.name}=.*allowed values are {re.escape(variable.allowed)}"):
        variable.read()


def test_values_parse(monkeypatch):
    monkeypatch.setenv("NVFP4_FORCE_REFERENCE", "1")
    assert environment.FORCE_REFERENCE.read() is True
    monkeypatch.setenv("NVFP4_BF16_LAST_LAYERS", "3")
    assert environment.BF16_LAST_LAYERS.read() == 3
    monkeypatch.setenv("NVFP4_SYMMETRIC_MEMORY", " OFF ")
    assert environment.SYMMETRIC_MEMORY.read() is False
    monkeypatch.setenv("NVFP4_SYMMETRIC_MEMORY", "on")
    assert environment.SYMMETRIC_MEMORY.read() is True
    monkeypatch.setenv("NVFP4_HOPPER_GEMM", "fused")
    assert environment.HOPPER_GEMM.read() == "fused"
    monkeypatch.setenv("NVFP4_BUILD_DIR", "/tmp/nvfp4-build")
    assert environment.BUILD_DIR.read() == "/tmp/nvfp4-build"


def test_every_variable_is_listed_once():
    names = [variable.name for variable in environment.VARIABLES]
    assert len(names) == len(set(names)) and all(name.startswith("NVFP4_") for name in names)

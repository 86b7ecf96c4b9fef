import pytest
import torch

from megatron_int8 import Int8Recipe
from megatron_int8.dispatch import ENV_BACKEND, resolve_backend_name
from megatron_int8.ops.backend import get_backend
from megatron_int8.reference import ReferenceBackend


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(granularity="channel"), "granularity"),
        (dict(grad_rounding="up"), "grad_rounding"),
        (dict(backend="cuda"), "backend"),
        (dict(granularity="block", block_size=100), "block_size"),
        (dict(granularity="block", block_size=0), "block_size"),
        (dict(check_finite=True), "check_finite"),  # a mode name, not a bool
    ],
)
def test_recipe_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Int8Recipe(**kwargs)


def test_recipe_rejects_non_bool_switch():
    with pytest.raises(TypeError, match="wgrad"):
        Int8Recipe(wgrad="no")


def test_recipe_describe_names_high_precision_gemms():
    assert Int8Recipe().describe() == "int8[row,fprop/dgrad/wgrad]"  # the default: row scales, nearest
    assert Int8Recipe(granularity="tensor", grad_rounding="stochastic").describe() == "int8[tensor,fprop/dgrad/wgrad,sr]"
    r = Int8Recipe(granularity="block", block_size=64, wgrad=False, grad_rounding="stochastic")
    assert r.describe() == "int8[block64,fprop/dgrad/wgrad:hp,sr]"


def test_auto_backend_on_cpu_is_reference(monkeypatch):
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert isinstance(get_backend(torch.device("cpu"), Int8Recipe()), ReferenceBackend)


def test_env_overrides_recipe_backend(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "reference")
    assert resolve_backend_name(torch.device("cpu"), Int8Recipe(backend="triton")) == "reference"
    monkeypatch.setenv(ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match=ENV_BACKEND):
        resolve_backend_name(torch.device("cpu"), Int8Recipe())


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises((ValueError, ImportError), match="triton"):
        resolve_backend_name(torch.device("cpu"), Int8Recipe(backend="triton"))

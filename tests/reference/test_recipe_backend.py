import dataclasses

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
        (dict(granularity="row", block_size=0), "block_size"),  # the health probes sample in blocks of it
        (dict(check_finite=True), "check_finite"),  # a mode name, not a bool
    ],
)
def test_recipe_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Int8Recipe(**kwargs)


def test_recipe_rejects_non_bool_switch():
    with pytest.raises(TypeError, match="wgrad"):
        Int8Recipe(wgrad="no")


@pytest.mark.parametrize("block_size", [128.0, "128", True])
def test_recipe_rejects_a_block_size_that_is_not_an_int(block_size):
    with pytest.raises(TypeError, match="block_size must be an int"):  # 128.0 failed in a reshape inside the GEMM
        Int8Recipe(granularity="block", block_size=block_size)


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


def test_recipe_splits_into_numerics_and_execution():
    from megatron_int8.recipe import EXECUTION_FIELDS, NUMERICS_FIELDS, Int8Execution, Int8Numerics

    recipe = Int8Recipe(granularity="block", block_size=64, wgrad=False, grad_rounding="stochastic",
                        backend="reference", autotune=False, cache_weights=False)
    assert set(NUMERICS_FIELDS) | set(EXECUTION_FIELDS) == {f.name for f in dataclasses.fields(Int8Recipe)}
    assert not set(NUMERICS_FIELDS) & set(EXECUTION_FIELDS)
    assert recipe.numerics == Int8Numerics(granularity="block", block_size=64, wgrad=False, grad_rounding="stochastic")
    assert recipe.execution == Int8Execution(backend="reference", autotune=False, cache_weights=False)
    # the description follows from the numerics alone
    assert recipe.describe() == dataclasses.replace(recipe, backend="auto", autotune=True).describe()
    assert recipe.describe() != dataclasses.replace(recipe, block_size=128).describe()


def test_weight_cache_is_shared_by_recipes_that_differ_only_in_execution():
    from megatron_int8.ops.weight_cache import quantized_weight

    backend = ReferenceBackend()
    w = torch.randn(16, 32)
    tuned = Int8Recipe(backend="reference")
    row, _ = quantized_weight(w, backend, tuned, rowwise=True, columnwise=False)
    same, _ = quantized_weight(w, backend, dataclasses.replace(tuned, autotune=False, int8_all_gather=True),
                               rowwise=True, columnwise=False)
    assert same is row
    other, _ = quantized_weight(w, backend, dataclasses.replace(tuned, granularity="tensor"),
                                rowwise=True, columnwise=False)
    assert other is not row and other.granularity == "tensor"


def test_triton_requested_where_the_kernels_do_not_import_says_why(monkeypatch):
    """The kernels' import error (e.g. a triton too old for them) and the way to the reference, not 'triton is not
    importable' where triton itself imports."""
    import megatron_int8.ops.backend as backend

    problem = "megatron_int8.kernels does not import with triton 0.0: cannot import name 'x'"
    monkeypatch.setattr(backend, "kernels_import_problem", lambda: problem)
    monkeypatch.setenv(ENV_BACKEND, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ImportError) as err:
        get_backend(torch.device("cpu"), Int8Recipe())
    assert problem in str(err.value) and f"{ENV_BACKEND}=reference" in str(err.value)
    monkeypatch.setenv(ENV_BACKEND, "auto")  # auto takes the reference on a GPU where the kernels do not import
    assert isinstance(get_backend(torch.device("cuda"), Int8Recipe()), ReferenceBackend)

"""Every MEGATRON_INT8_* variable is checked when the package is imported (dispatch.validate_environment): a bad
value, a removed or misspelt name fails `import megatron_int8` with one ValueError naming the variable, its value
and what is accepted, on CPU too, before any model is built."""
import os
import subprocess
import sys

import pytest

from megatron_int8 import dispatch
from repo_paths import ROOT


def _import_with(**env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(dispatch.PREFIX)}
    return subprocess.run([sys.executable, "-c", "import megatron_int8"], env=dict(clean, **env), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_a_bad_value_fails_the_import_on_cpu():
    proc = _import_with(MEGATRON_INT8_GEMM_KERNEL="bogus", MEGATRON_INT8_BACKEND="triton")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("ValueError: megatron_int8: MEGATRON_INT8_GEMM_KERNEL='bogus': "
                    "expected one of auto, hopper, portable")


def test_accepted_values_import():
    proc = _import_with(MEGATRON_INT8_GEMM_KERNEL="portable", MEGATRON_INT8_NORM_KERNEL="torch",
                        MEGATRON_INT8_GEMM_AUTOTUNE="0", MEGATRON_INT8_SHAPE_POLICY="auto")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(dispatch.CHOICES))
def test_each_variable_names_itself_its_value_and_its_choices(name):
    problems = dispatch.environment_problems({name: "no-such-value"})
    assert problems == [f"{name}='no-such-value': expected one of {', '.join(dispatch.CHOICES[name])}"]
    for value in dispatch.CHOICES[name]:
        assert dispatch.environment_problems({name: value}) == []
    assert dispatch.environment_problems({name: ""}) == []  # empty: the default


def test_all_problems_in_one_error_and_unknown_names():
    env = {"MEGATRON_INT8_BACKEDN": "triton", "MEGATRON_INT8_NORM_KERNEL": "apex", "MEGATRON_INT8_GEMM_KERNEL": "tma",
           "MEGATRON_INT8_GEMM_TMA_VARIANT": "duo", "OTHER": "x"}
    with pytest.raises(ValueError) as err:
        dispatch.validate_environment(env)
    message = str(err.value)
    assert "MEGATRON_INT8_BACKEDN='triton': not a variable of megatron_int8" in message
    assert "MEGATRON_INT8_NORM_KERNEL='apex': expected one of auto, torch, triton" in message
    assert "MEGATRON_INT8_GEMM_KERNEL='tma': expected one of auto, hopper, portable ('tma' is now 'hopper')" in message
    assert "MEGATRON_INT8_GEMM_TMA_VARIANT='duo': no longer read" in message
    assert "OTHER" not in message


def test_the_build_cache_must_be_a_directory(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert dispatch.environment_problems({dispatch.ENV_BUILD_CACHE: str(tmp_path / "new")}) == []
    assert dispatch.environment_problems({dispatch.ENV_BUILD_CACHE: str(tmp_path)}) == []
    assert dispatch.environment_problems({dispatch.ENV_BUILD_CACHE: str(a_file)}) == [
        f"{dispatch.ENV_BUILD_CACHE}={str(a_file)!r}: expected a directory (nvcc's build cache), found a file"]

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_nonfinite_record():
    """Each test starts with an empty deferred Inf/NaN record (an earlier test may leave flags set)."""
    from megatron_int8 import NonFiniteError, raise_if_nonfinite

    try:
        raise_if_nonfinite()
    except NonFiniteError:
        pass

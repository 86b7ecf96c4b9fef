import os

import pytest
import torch
from interpreter import SHARD_VARIABLE


def pytest_collection_modifyitems(config, items):
    if os.environ.get(SHARD_VARIABLE):  # a shard of an interpreted file (tests/interpreter.py)
        index, count = map(int, os.environ[SHARD_VARIABLE].split("/"))
        kept = [item for k, item in enumerate(items) if k % count == index]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
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

import os

# One intra-op thread per process (set before torch loads): the suite runs in two xdist workers on a 2-core machine,
# and its trainer subprocesses beside them, so a pool of one thread per core in each process only oversubscribes the
# cores (23% longer for the single-process trainer tests). OMP_NUM_THREADS set by the caller stays.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


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

"""The checkpoint allowlist's unpickler (training.safe_load) on crafted `.metadata` pickles: what some Python 3.11
releases write for an enum member loads, and nothing else that `builtins.getattr` could reach does."""
import pickle

import pytest
from torch.distributed.checkpoint import metadata

from megatron_int8.training.safe_load import UnsafeCheckpointError, check_dcp_metadata

MEMBER = metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT


class _ByGetattr:
    """Pickles as `getattr(owner, name)`, as Python 3.11.2 pickles an enum member."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def _write(tmp_path, value):
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump({"memory_format": value}, f)
    return str(tmp_path)


def test_an_enum_member_pickled_through_getattr_loads(tmp_path):
    """A resume of any checkpoint saved under Debian 12's python3.11 (3.11.2) was refused."""
    directory = _write(tmp_path, _ByGetattr(type(MEMBER), MEMBER.name))
    check_dcp_metadata(directory)
    with open(tmp_path / ".metadata", "rb") as f:
        assert pickle.load(f)["memory_format"] is MEMBER


@pytest.mark.parametrize("owner, name", [
    (type(MEMBER), "__class__"),  # an attribute of a record enum that is not a member
    (metadata.Metadata, "__init__"),  # a record class that is no enum
])
def test_getattr_reaches_nothing_else(tmp_path, owner, name):
    with pytest.raises(UnsafeCheckpointError, match=r"refers to builtins.getattr\("):
        check_dcp_metadata(_write(tmp_path, _ByGetattr(owner, name)))

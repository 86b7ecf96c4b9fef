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


def _build_on_the_enum(state: bytes) -> bytes:
    """A pickle that BUILDs `state` (a pickled dict of attributes) onto the record enum class, then returns None."""
    enum_class = b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
    return b"\x80\x02" + enum_class + b"N" + state + b"\x86b0N."  # (None, state) as BUILD's slot state


def test_a_build_on_a_class_is_refused_and_changes_nothing(tmp_path):
    """A BUILD on a class sets attributes on it in this process: a pickle could forge an enum's members for this
    check and hand torch's own load that follows other objects (e.g. a method that writes files)."""
    members = dict(type(MEMBER).__members__)
    forged = pickle.dumps({"_member_map_": {}}, protocol=2)[2:-1]  # the dict's opcodes alone
    (tmp_path / ".metadata").write_bytes(_build_on_the_enum(forged))
    with pytest.raises(UnsafeCheckpointError, match="a BUILD that sets attributes on '_MEM_FORMAT_ENCODING'"):
        check_dcp_metadata(str(tmp_path))
    assert dict(type(MEMBER).__members__) == members


def test_a_class_a_record_module_imports_is_refused(tmp_path):
    """Only the record types defined in torch.distributed.checkpoint's modules: pathlib.Path, which its filesystem
    module imports, is none of them."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x02ctorch.distributed.checkpoint.filesystem\nPath\n.")
    with pytest.raises(UnsafeCheckpointError, match="refers to torch.distributed.checkpoint.filesystem.Path"):
        check_dcp_metadata(str(tmp_path))

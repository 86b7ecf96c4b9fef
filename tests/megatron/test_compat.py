"""The supported megatron-core range: refused outside it with the pin that setup.py installs."""
import os
import re

import pytest
from repo_paths import ROOT

from megatron_int8.megatron.compat import check_supported


def test_versions_outside_the_range_are_refused_with_setup_pys_pin():
    with open(os.path.join(ROOT, "setup.py")) as f:
        pin = re.search(r'"megatron-core([^"]+)"', f.read()).group(1)
    for version in ((0, 16, 1), (0, 17, 1), (0, 19, 2)):
        check_supported(version)
    for version in ((0, 15, 3), (0, 16, 0), (0, 20, 0)):
        with pytest.raises(ImportError) as err:
            check_supported(version)
        found = ".".join(map(str, version))
        assert str(err.value) == (f"megatron-int8 supports megatron-core {pin}; found {found}: "
                                  f"pip install 'megatron-core{pin}'")

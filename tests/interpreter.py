"""Running a test file's Triton kernel tests under TRITON_INTERPRET=1.

Triton decides at import time (and at each @triton.jit) whether it interprets, so TRITON_INTERPRET must be
set before triton is first imported, which another test file of the run may already have done. A file
with kernel tests therefore has one driver test in the parent pytest process that reruns the file in a fresh
interpreter with the variable set (`run_file_interpreted`), and marks its kernel tests to run only there.
A file whose interpreted run is long splits it by marker: a driver in the fast tier runs the cases not marked
slow, a driver marked slow the others, so the two run side by side under pytest-xdist.
"""
import os
import subprocess
import sys

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")


def run_file_interpreted(path: str, timeout: int, marks: str = None) -> None:
    """pytest `path` in a subprocess with TRITON_INTERPRET=1 (only its tests selected by the marker expression
    `marks`, e.g. "not slow", where given); assert that it passed and ran tests."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    select = ["-m", marks] if marks else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select,
                           os.path.abspath(path)], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"kernel tests failed under TRITON_INTERPRET=1:\n{proc.stdout[-20000:]}\n"
                                  f"{proc.stderr[-5000:]}")
    assert " passed" in proc.stdout and "no tests ran" not in proc.stdout, proc.stdout[-2000:]

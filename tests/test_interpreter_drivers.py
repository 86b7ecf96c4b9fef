"""Every driver test that reruns a file under TRITON_INTERPRET=1 runs in the parent process: a driver that a file's
skip-all-but-the-drivers wrapping also marks `needs_interpreter` is skipped in every tier, and the cases it drives
never run (nothing fails, so only this check tells)."""
import ast
import importlib.util
from pathlib import Path

import pytest
from interpreter import INTERPRETING

TESTS = Path(__file__).resolve().parent


def driver_files():
    """Test files with a function that calls `run_file_interpreted`, and those functions' names."""
    found = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and any(
                    isinstance(call, ast.Call) and getattr(call.func, "id", None) == "run_file_interpreted"
                    for call in ast.walk(node)):
                found.setdefault(path, []).append(node.name)
    return found


@pytest.mark.skipif(INTERPRETING, reason="checks the parent process, where the drivers run")
def test_every_interpreter_driver_runs_in_the_parent_process():
    files = driver_files()
    assert len(files) >= 7, files  # the kernel, copy, attention, AdamW, TMA tile, cross-entropy and compile files
    skipped = []
    for path, names in files.items():
        spec = importlib.util.spec_from_file_location(f"_drivers_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except pytest.skip.Exception:  # a file skipped whole (no triton): its drivers do not run anywhere
            continue
        for name in names:
            marks = getattr(getattr(module, name), "pytestmark", [])
            if any(m.name == "skipif" and m.args and m.args[0] for m in marks):
                skipped.append(f"{path.relative_to(TESTS)}::{name}")
    assert not skipped, f"interpreter drivers skipped in the parent process: {skipped}"

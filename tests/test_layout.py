"""The package imports one way, down the data path: a lower tier never imports an upper one, and no two
modules import each other (directly or through others), whether at module level or inside a function."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_int8"
# lowest first; the entry points (the package root, pretrain.py, megatron_lm.py) sit on top
TIERS = ("recipe", "reference", "dispatch", "kernels", "ops", "megatron", "peers", "training", "entry")
ENTRY_MODULES = {"megatron_int8", "megatron_int8.pretrain", "megatron_int8.megatron_lm"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tier_of(module: str) -> str:
    if module in ENTRY_MODULES:
        return "entry"
    first = module.split(".")[1]
    assert first in TIERS, f"{module} belongs to no tier: add it to TIERS in tests/test_layout.py"
    return first


def package_imports(path: Path, modules: set) -> set:
    """The package's modules that `path` imports, anywhere in the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            # `from pkg import name`: name is a module where one exists, else an attribute of pkg
            targets = [f"{root}.{a.name}" if f"{root}.{a.name}" in modules else root for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` imports a.b.c's deepest module we know
                target = target.rpartition(".")[0]
            if target.startswith("megatron_int8") and target != name:
                found.add(target)
    return found


def import_graph() -> dict:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): package_imports(p, modules) for p in paths}


def test_every_import_runs_down_the_tiers():
    upward = []
    for module, imported in import_graph().items():
        for target in imported:
            if TIERS.index(tier_of(target)) > TIERS.index(tier_of(module)):
                upward.append(f"{module} ({tier_of(module)}) imports {target} ({tier_of(target)})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = import_graph()
    state, cycles = {}, []

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_scan_sees_relative_and_function_level_imports(tmp_path):
    """The checker itself: a function-level relative import of an upper tier is found."""
    pkg = tmp_path / "megatron_int8"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "training.py").write_text("")
    (pkg / "ops" / "thing.py").write_text("def f():\n    from .. import training\n    from ..training import x\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, pkg
    try:
        graph = import_graph()
    finally:
        PACKAGE = saved
    assert graph["megatron_int8.ops.thing"] == {"megatron_int8.training"}


def test_shell_scripts_import_names_that_exist():
    """The Python that the shell scripts embed (heredocs, `python3 -c`) is not imported by any test: a renamed
    function would first fail on a GPU machine. Every `from megatron_int8... import name` in them must resolve."""
    import importlib
    import re

    pattern = re.compile(r"from (megatron_int8[\w.]*) import ([\w ,]+)")
    found = []
    for script in sorted(PACKAGE.parent.glob("*/**/*.sh")):
        for module, names in pattern.findall(script.read_text(encoding="utf-8")):
            for name in (n.split(" as ")[0].strip() for n in names.split(",")):
                found.append((script.name, module, name))
                assert hasattr(importlib.import_module(module), name), \
                    f"{script.name}: `from {module} import {name}`: no such name"
    assert any(script == "gpu_megatron_lm_check.sh" for script, _, _ in found)  # the scan sees the heredocs

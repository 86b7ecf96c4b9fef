#!/usr/bin/env python3
"""Build a JSONL text corpus from files already on this machine (no downloads): the .py sources of the
Python standard library, or of the installed packages (site-packages: larger, for bigger runs), or both
(all); --docs adds their documentation files (.rst, .md). One document per file: {"text": ..., "path": ...}.
`--text docstrings` keeps only the English prose of the sources instead: each file's module, class and function
docstrings of at least 8 words, without their doctest examples, one document per file.

    python3 scripts/prepare_tiny_corpus.py --output runs/tiny/corpus.jsonl --max-mb 8
    python3 scripts/prepare_tiny_corpus.py --source site-packages --output corpus.jsonl --max-mb 120
    python3 scripts/prepare_tiny_corpus.py --source all --docs --output corpus.jsonl --max-mb 2048   # everything
    python3 scripts/prepare_tiny_corpus.py --source all --text docstrings --output prose.jsonl --max-mb 40
"""
import argparse
import ast
import json
import math
import os
import sys
import sysconfig
import time

SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


# --source -> sysconfig path names, walked in this order (the stdlib walk skips its site-packages)
SOURCES = {"stdlib": ("stdlib",), "site-packages": ("purelib",), "all": ("stdlib", "purelib")}
DOC_SUFFIXES = (".rst", ".md")


def python_sources(root: str, max_file_bytes: int, suffixes=(".py",)):
    """Files with these suffixes under root (tests and caches skipped), sorted so that the corpus is the same
    on every run."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(directory, name)
            if name.endswith(suffixes) and 0 < os.path.getsize(path) <= max_file_bytes:
                yield root, path


def _definitions(node):
    """node and the classes and functions inside it, in source order (ast.walk goes level by level)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _definitions(child)
        elif not isinstance(child, (ast.expr, ast.Lambda)):  # definitions nested in if/try/with blocks
            yield from (d for d in _definitions(child) if d is not child)


def _without_doctests(text: str) -> str:
    """text less its doctest examples: each from a `>>>` line to the next blank line (prompts and outputs)."""
    kept, in_example = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(">>>"):
            in_example = True
        elif not line.strip():
            in_example = False
        if not in_example:
            kept.append(line)
    return "\n".join(kept).strip()


def docstring_prose(source: str, min_words: int = 8) -> str:
    """The module's, classes' and functions' docstrings of a Python source in source order, each of at least
    `min_words` words once its doctest examples are dropped, separated by blank lines; "" if it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    kept = []
    for node in _definitions(tree):
        text = _without_doctests(ast.get_docstring(node) or "")
        if len(text.split()) >= min_words:
            kept.append(text)
    return "\n\n".join(kept)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--source", choices=sorted(SOURCES), default="stdlib", help="which Python sources")
    parser.add_argument("--docs", action="store_true", help="also the documentation files (.rst, .md)")
    parser.add_argument("--text", choices=("source", "docstrings"), default="source",
                        help="the files' text (default) or only the docstrings of the .py files (English prose)")
    parser.add_argument("--max-mb", type=float, default=8.0, help="stop after this many MB of text")
    parser.add_argument("--max-file-kb", type=float, default=256.0, help="skip larger source files")
    args = parser.parse_args(argv)
    from plot_loss import output_problem  # the scripts' check of an output file (scripts/ leads sys.path)

    for flag, value in (("--max-mb", args.max_mb), ("--max-file-kb", args.max_file_kb)):
        if not (math.isfinite(value) and value > 0):  # 0 wrote a one-document corpus; inf raised OverflowError
            parser.error(f"{flag} must be a positive number, got {value}")
    if args.text == "docstrings" and args.docs:
        parser.error("--text docstrings takes the .py files' docstrings only: leave out --docs")
    problem = output_problem(args.output)
    if problem:
        parser.error(f"--output {problem}")
    roots = [sysconfig.get_paths()[name] for name in SOURCES[args.source]]
    suffixes = (".py",) + (DOC_SUFFIXES if args.docs else ())
    files = (found for root in roots for found in python_sources(root, int(args.max_file_kb * 1024), suffixes))
    budget, written, docs = int(args.max_mb * 2**20), 0, 0
    tmp = args.output + ".tmp"
    started = last = time.time()
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for root, path in files:
                try:
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                except (UnicodeDecodeError, OSError):
                    continue
                if args.text == "docstrings":
                    text = docstring_prose(text)
                    if not text:
                        continue
                out.write(json.dumps({"text": text, "path": os.path.relpath(path, root)}) + "\n")
                written += len(text.encode("utf-8"))
                docs += 1
                if written >= budget:
                    break
                if time.time() - last >= 5:
                    last = time.time()
                    print(f"  {docs} documents, {written / 2**20:.1f} of {args.max_mb:g} MB "
                          f"({written / 2**20 / (last - started):.1f} MB/s)", flush=True)
        if docs:
            os.replace(tmp, args.output)  # a partial corpus never looks complete
    finally:  # an interrupted or empty corpus leaves nothing behind
        if os.path.isfile(tmp):
            os.remove(tmp)
    if docs == 0:
        print(f"error: no Python sources found under {' or '.join(roots)}", file=sys.stderr)
        return 1
    print(f"corpus: {docs} documents, {written / 2**20:.1f} MB -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

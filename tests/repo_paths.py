"""The repository's folders, for tests at any depth under tests/ (pytest puts tests/ on sys.path)."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
SCRIPTS = os.path.join(ROOT, "scripts")
BENCHMARKS = os.path.join(ROOT, "benchmarks")

"""Loading a benchmark script (benchmarks/ is a folder of scripts, not a package) into a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str, monkeypatch):
    """benchmarks/NAME.py as a module, with benchmarks/ on sys.path for its own imports; both
    undone when the test ends."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module

"""The package's import graph: no cycles, and no module imports one on a higher floor
(errors/files/metrics/limits/unreadable -> fields/specs/workloads -> plan.ir -> cost -> plan -> sim -> planners -> report ->
runtime -> commands, STYLE.md). Imports inside functions count too.

runtime/ has floors of its own: its top-level modules (model, attention, stage, execute, ...: one
process) -> distributed/ (process groups, meshes, point-to-point, launch, checkpoint shards) ->
parallel/ (the model sharded over them: FSDP2, TP, heterogeneous exchange, a rank's step) ->
train/, dryrun, export (what drives a whole run)."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import lengthwise
from lengthwise.metrics import BUBBLE_RATIO, DP_IMBALANCE, MFU, STEP_TIME_S, TOKENS_PER_S
from lengthwise.sim import SimResult

ROOT = Path(lengthwise.__file__).parent
FLOORS = {"errors": 0, "files": 0, "metrics": 0, "limits": 0, "unreadable": 0, "fields": 1, "paths": 1, "specs": 1, "workloads": 1, "plan.ir": 2, "cost": 3, "plan": 4,
          "sim": 5, "planners": 6, "report": 7, "report_files": 7, "runtime": 8, "runtime.distributed": 8.2,
          "runtime.parallel": 8.4, "runtime.train": 8.6, "runtime.dryrun": 8.6, "runtime.export": 8.6, "commands": 9,
          "cli": 10, "__main__": 11}


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names[".".join(("lengthwise",) + parts)] = path
    return names


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `path` imports, anywhere in the file (`from a import b` counts a.b
    when b is a module, else a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            found.update(subs or {node.module})
    return found


def floor(module: str) -> int:
    parts = module.split(".")[1:]
    return FLOORS.get(".".join(parts[:2]), FLOORS.get(parts[0] if parts else "", -1))


def graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imports(path, known) for name, path in known.items()}


def test_no_module_imports_a_higher_floor():
    upward = [f"{a} -> {b}" for a, outs in graph().items() for b in outs if floor(b) > floor(a)]
    assert upward == []


def test_no_import_cycles():
    edges, state, cycles = graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_simulator_and_the_glossary_name_figures_alike():
    assert {STEP_TIME_S, BUBBLE_RATIO, DP_IMBALANCE, TOKENS_PER_S, MFU} <= {f.name for f in fields(SimResult)}

"""Nothing a user loads runs code: a scan of src/ for the calls that deserialise with pickle or
evaluate text, so a new one cannot slip in unnoticed.

Flagged: torch.load without weights_only=True, pickle / cPickle / dill load(s), an Unpickler,
np.load(..., allow_pickle=True), eval / exec, trust_remote_code=True, and torch.distributed.
checkpoint's loaders (whose `.metadata` is a pickle). The one allowed exception is the opt-in
loader of earlier versions' checkpoints behind --allow-pickle-checkpoint, kept in one module
(`ALLOWED`) so that this list stays one line long.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "lengthwise"
ALLOWED = {"runtime/distributed/legacy_dcp.py"}
"""Modules allowed to unpickle: the legacy DCP loader, reached only with --allow-pickle-checkpoint."""
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
LOADERS = {"load", "loads", "Unpickler", "open"}
"""What deserialises in those modules (dumping is writing: harmless)."""
DCP_LOADERS = {"load", "load_state_dict", "_load_state_dict_from_keys", "read_metadata", "FileSystemReader"}


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def findings(source: str) -> list[tuple[int, str]]:
    """(line, what) of every flagged call in one module's source."""
    tree = ast.parse(source)
    dcp_names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and (node.module or "").startswith("torch.distributed.checkpoint") for alias in node.names}
    dcp_modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names if alias.name.startswith("torch.distributed.checkpoint")}
    picklers = PICKLERS | {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                           for alias in node.names if alias.name.split(".")[0] in PICKLERS}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLERS:
            if any(a.name in LOADERS for a in node.names):
                found.append((node.lineno, f"imports a loader of {node.module}"))
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, last = name.rpartition(".")
        if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
            found.append((node.lineno, f"{name}()"))
        elif last == "load" and head == "torch" and not _is_true(_keyword(node, "weights_only")):
            found.append((node.lineno, "torch.load without weights_only=True"))
        elif head.split(".")[0] in picklers and last in LOADERS:
            found.append((node.lineno, f"{name}()"))
        elif last == "load" and head in ("np", "numpy") and _is_true(_keyword(node, "allow_pickle")):
            found.append((node.lineno, "np.load(allow_pickle=True)"))
        elif _is_true(_keyword(node, "trust_remote_code")):
            found.append((node.lineno, "trust_remote_code=True"))
        elif (head in dcp_modules and last in DCP_LOADERS) or (not head and last in dcp_names & DCP_LOADERS):
            found.append((node.lineno, f"torch.distributed.checkpoint {name}()"))
    return found


def modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_src_loads_nothing_with_pickle_outside_the_legacy_module():
    flagged = []
    for path in modules():
        relative = path.relative_to(SRC).as_posix()
        if relative in ALLOWED:
            continue
        flagged += [f"{relative}:{line}: {what}" for line, what in findings(path.read_text())]
    assert not flagged, "\n".join(flagged)


def test_the_allowed_module_exists_and_says_why():
    for relative in ALLOWED:
        text = (SRC / relative).read_text()
        assert "--allow-pickle-checkpoint" in text and "pickle" in text.split('"""')[1]


@pytest.mark.parametrize("line", [
    "import torch\ntorch.load(f)",
    "import torch\ntorch.load(f, weights_only=False)",
    "import pickle\npickle.loads(b)",
    "import pickle as p\np.load(f)",
    "import shelve\nshelve.open(f)",
    "from pickle import loads",
    "import numpy as np\nnp.load(f, allow_pickle=True)",
    "eval(open(f).read())",
    "exec(text)",
    "AutoTokenizer.from_pretrained(d, trust_remote_code=True)",
    "import torch.distributed.checkpoint as dcp\ndcp.load(state, checkpoint_id=p)",
    "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys\n"
    "_load_state_dict_from_keys(checkpoint_id=p)",
])
def test_the_scan_catches_each_kind(line):
    assert findings(line), line


@pytest.mark.parametrize("line", [
    "import torch\ntorch.load(f, weights_only=True)",
    "import numpy as np\nnp.load(f, allow_pickle=False)",
    "import json\njson.loads(text)",
    "import pickle\npickle.dumps(value)",
    "from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict\nget_optimizer_state_dict(m, o)",
])
def test_the_scan_lets_data_loads_pass(line):
    assert not findings(line), line

"""The planning side runs where PyTorch is not installed; the commands that run the model say
in one line what to install (torch's import blocked in a child process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

CHILD = r"""
import contextlib, io, json, sys
sys.modules["torch"] = None          # any `import torch` now raises ModuleNotFoundError
sys.path.insert(0, SRC)
from lengthwise.cli import COMMANDS, main

def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return {"code": code, "err": err.getvalue()}

results = {"--help": run(["--help"])}
results.update({f"{name} --help": run([name, "--help"]) for name in COMMANDS})
results.update({name: run([name]) for name in ("train", "verify", "profile")})
results["compare --confirm"] = run(["compare", "--profile", "tiny", "--model", "tiny", "--cluster", "cpu",
                                    "--gpus", "2", "--batch-size", "8", "--batches", "1", "--planners",
                                    "packing", "--out", OUT, "--no-pictures", "--confirm"])
print(json.dumps(results))
"""


def test_help_and_planning_commands_run_without_torch_and_model_commands_say_what_to_install(tmp_path):
    child = CHILD.replace("SRC", repr(str(SRC))).replace("OUT", repr(str(tmp_path / "report")))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True)
    results = json.loads(done.stdout)
    for name, result in results.items():
        if " --help" in name or name == "--help":
            assert result["code"] == 0, (name, result["err"])
        else:
            assert result["code"] == 2, (name, result)
            lines = result["err"].strip().splitlines()
            assert len(lines) == 1 and "pip install torch" in lines[0] and "Traceback" not in result["err"], name

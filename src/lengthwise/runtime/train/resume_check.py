"""What a resumed run checks and says about the checkpoint it continues.

    saved, step = trainer_state(path, trainer)          # UserError when its step claims disagree
    check_same(path, saved, config, RESUME_MUST_MATCH)  # the data stream and the weights' shape
    for line in setting_changes(saved, config): ...     # every other setting given anew

A checkpoint names its step three times: its folder (step-000006), trainer.json and MANIFEST.json.
They are written together, so a disagreement means a hand edit or a mix-up of folders; the run
would otherwise resume from one of them without a word (a manifest saying 999 resumed at 6).
Settings that may change on resume (learning-rate schedule, clipping, dtype, planner, steps)
are applied, and each change is announced, so a resumed run never differs silently.
Imports no PyTorch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from lengthwise.errors import UserError
from lengthwise.fields import is_int
from lengthwise.runtime.manifest import MANIFEST
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.unreadable import refuse_unreadable

NOT_ANNOUNCED = ("lr", "weight_decay", "out", "resume", "metrics", "progress")
"""Settings whose change on resume is not announced here: lr and weight decay are (schedule.py
apply_settings), the rest say where outputs go, not what is trained."""


def trainer_state(path: Path, trainer: Any) -> tuple[dict, int]:
    """(saved config, step) of a loaded trainer state; UserError when it is malformed or its step
    disagrees with the folder's name or its manifest."""
    if not (isinstance(trainer, dict) and isinstance(trainer.get("config"), dict) and is_int(trainer.get("step"))
            and trainer["step"] >= 0 and isinstance(trainer.get("sampler"), dict)):
        raise UserError(f"{path}: its trainer state lacks a step, config or sampler position; it is damaged or "
                        "not from lengthwise: resume another checkpoint")
    claims = {"its trainer state": trainer["step"]}
    if (match := re.fullmatch(r"step-(\d+)", path.name)) is not None:
        claims["its folder name"] = int(match[1])
    manifest_step = _manifest_step(path)
    if manifest_step is not None:
        claims[MANIFEST] = manifest_step
    if len(set(claims.values())) > 1:
        said = ", ".join(f"{where} says {step}" for where, step in claims.items())
        raise UserError(f"checkpoint {path} disagrees about its step ({said}): it was edited or mixed up "
                        "with another; resume another checkpoint")
    return trainer["config"], trainer["step"]


def _manifest_step(path: Path) -> Any:
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None
    with refuse_unreadable(manifest, "checkpoint manifest"):
        body = json.loads(manifest.read_bytes().decode("utf-8"))
    return body.get("step") if isinstance(body, dict) else None


def check_same(path: Path, saved: dict, config: TrainConfig, keys: tuple[str, ...]) -> None:
    """UserError when a setting that defines the data stream or the weights' shape differs."""
    for key in keys:
        old, new = saved.get(key), getattr(config, key)
        if old != new:
            raise UserError(f"checkpoint {path} was trained with {_flag(key)} {_shown(old)}, this run has "
                            f"{_shown(new)}; resume with the same value")


def setting_changes(saved: dict, config: TrainConfig, *, skip: tuple[str, ...] = ()) -> list[str]:
    """'--flag old -> new' for every setting of `config` that differs from the checkpoint's,
    except NOT_ANNOUNCED and `skip` (those that must match, refused before)."""
    changes = []
    for key, new in config.to_dict().items():
        if key in NOT_ANNOUNCED or key in skip or key not in saved:
            continue
        if saved[key] != new:
            changes.append(f"{_flag(key)} {_shown(saved[key])} -> {_shown(new)}")
    return changes


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _shown(value: Any) -> str:
    """A setting as a user would type it; None is 'unset' (the default), never 'None'."""
    if value is None:
        return "unset"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)

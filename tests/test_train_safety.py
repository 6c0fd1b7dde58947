"""Training safety: a NaN is never saved, settings are finite, --lr / --weight-decay apply on
resume, one writer per output folder, metrics never run ahead of checkpoints, debris of killed
saves is removed, and a batch the machine cannot hold is refused before it starts. Tiny model,
float64, a few short steps."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lengthwise.cli import build_parser, main
from lengthwise.commands.train import config_from_args
from lengthwise.errors import UserError
from lengthwise.runtime.checkpoint import latest_checkpoint
from lengthwise.runtime.train import memory_check
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.loop import train
from lengthwise.runtime.train.outputs import OutputLock
from lengthwise.runtime.train.schedule import apply_settings, first_nonfinite
from lengthwise.specs import model_preset

ARGS = ["train", "--no-progress", "--dtype", "float64", "--context-length", "64", "--batch-size", "3",
        "--steps", "2", "--threads", "1", "--device", "cpu"]


def small(**changes) -> TrainConfig:
    base = {"dtype": "float64", "context_length": 64, "batch_size": 3, "steps": 4, "lr": 1e-2,
            "progress": False, "options": {"chunk_size": 32, "k": 1}, "threads": 1, "device": "cpu"}
    return TrainConfig(**{**base, **changes})


def one_line_error(capsys, *argv: str) -> str:
    assert main([*ARGS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("flag", "value"), [("--lr", "inf"), ("--lr", "nan"), ("--weight-decay", "nan"),
                                             ("--grad-clip", "nan"), ("--min-lr", "inf"), ("--timeout", "nan")])
def test_non_finite_settings_are_one_line_errors(capsys, flag, value):
    assert f"{flag} {value}: must be a finite number" in one_line_error(capsys, flag, value)


def test_exploding_run_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    # lr 1e30: the first update throws every weight to ~1e30, so step 2's loss overflows
    with pytest.raises(UserError, match=r"step 2: the (loss|gradient norm) is .*last checkpoint.*step-000001"):
        train(small(lr=1e30, grad_clip=0.0, weight_decay=0.0, out=str(tmp_path), save_every=1))
    assert latest_checkpoint(tmp_path).name == "step-000001"
    assert not (tmp_path / "step-000002").exists()


def test_skip_nonfinite_counts_the_skipped_steps_and_saves_finite_weights(tmp_path):
    result = train(small(lr=1e30, grad_clip=0.0, weight_decay=0.0, skip_nonfinite=True, out=str(tmp_path),
                         metrics=str(tmp_path / "m.jsonl")))
    assert result.skipped_steps == 3 and [r.skipped for r in result.records] == [False, True, True, True]
    assert all(bool(torch.isfinite(p).all()) for p in result.model.parameters())
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line.get("skipped", False) for line in lines] == [False, True, True, True]


def test_first_nonfinite_names_the_parameter_in_model_order():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[1].weight.grad[0, 0] = math.nan
    model[1].bias.grad[0] = math.inf
    assert first_nonfinite(model.named_parameters()) == "1.weight"


def test_lr_and_weight_decay_given_on_resume_are_applied_and_logged(tmp_path, capsys):
    train(small(steps=2, out=str(tmp_path), metrics=str(tmp_path / "m.jsonl")))
    train(small(steps=4, lr=1e-3, weight_decay=0.05, out=str(tmp_path), metrics=str(tmp_path / "m.jsonl")))
    assert "--lr 0.01 -> 0.001, --weight-decay 0.1 -> 0.05" in capsys.readouterr().err
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lrs == [1e-2, 1e-2, 1e-3, 1e-3]
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1},
                                   {"params": [model.bias], "weight_decay": 0.0}], lr=1e-2)
    apply_settings(optimizer, small(lr=1e-3, weight_decay=0.05), {"lr": 1e-2, "weight_decay": 0.1})
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(1e-3, 0.05), (1e-3, 0.0)]


def test_a_second_writer_on_one_folder_is_a_one_line_error(tmp_path, capsys):
    with OutputLock(tmp_path):
        err = one_line_error(capsys, "--out", str(tmp_path))
    assert "in use by another lengthwise train (pid " in err


def test_metrics_are_trimmed_to_the_resumed_step_and_debris_is_removed(tmp_path):
    metrics = tmp_path / "m.jsonl"
    train(small(steps=2, out=str(tmp_path), save_every=1, metrics=str(metrics)))
    with metrics.open("a") as f:  # what a run killed after step 3 (saved at 2) leaves
        f.write(json.dumps({"step": 3, "loss": 1.0}) + "\n" + '{"step": 4, "lo')
    debris = tmp_path / ".tmp-step-000003-x1y2"
    debris.mkdir()
    train(small(steps=4, out=str(tmp_path), metrics=str(metrics)))
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    assert not debris.exists()


def test_a_batch_the_machine_cannot_hold_is_refused_before_it_starts(capsys, monkeypatch):
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: 1 << 30)
    err = one_line_error(capsys, "--batch-size", "100000", "--context-length", "512")
    assert "needs about 1.2 GiB of host memory" in err and "1.0 GiB is available" in err
    tiny = model_preset("tiny")
    assert memory_check.estimate_memory(small(), tiny).states == 4 * 8 * tiny.num_params  # float64


def test_timeout_reaches_the_config():
    assert config_from_args(build_parser(only="train").parse_args(["train", "--timeout", "12"])).timeout == 12.0


def test_unwritable_outputs_are_refused_before_training(capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    assert "--out /proc/ck: cannot write there" in one_line_error(capsys, "--out", "/proc/ck")
    assert "--metrics /proc/m.jsonl: cannot write there" in one_line_error(capsys, "--metrics", "/proc/m.jsonl")
    err = one_line_error(capsys, "--out", str(tmp_path / "a-file" / "run"))
    assert "a-file is a file" in err
    assert not (tmp_path / "lengthwise-runs").exists()


def test_a_run_failing_at_start_leaves_no_run_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "--resume nowhere: no such directory" in one_line_error(capsys, "--resume", "nowhere")
    assert list(tmp_path.iterdir()) == []


def test_train_says_when_documents_are_cut_and_reused(tmp_path, capsys):
    """5 long documents at --context-length 128 become rows of their first 128 tokens, and 2
    steps of 5 see each twice: both said with counts, not silently."""
    from lengthwise.cli import main

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(5):
        (docs / f"d{i}.txt").write_text("word " * 100)
    assert main(["train", "--data", str(docs), "--steps", "2", "--batch-size", "5", "--context-length", "128",
                 "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "5 of 5 sequences are over --context-length 128 and were cut" in err
    assert "use 10 sequences of 5, so each is trained on about 2.0 times" in err


def test_state_that_went_non_finite_with_a_finite_loss_is_never_saved(tmp_path, monkeypatch):
    """A weight made infinite by the update itself (the loss before it was finite) is caught by
    the check of the state right before the save: no step-000002, step-000001 named as kept."""
    from lengthwise.runtime.train import executor as executor_module

    real_step = executor_module.LocalExecutor.step

    def step_then_overflow(self, prepared, step):
        outcome = real_step(self, prepared, step)
        if step == 2:
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = math.inf
        return outcome

    monkeypatch.setattr(executor_module.LocalExecutor, "step", step_then_overflow)
    with pytest.raises(UserError, match=r"step 2: model\.\S+ holds NaN or infinite values, so it is not saved "
                                        r"and the last checkpoint, .*step-000001, is kept"):
        train(small(steps=3, out=str(tmp_path), save_every=1))
    assert latest_checkpoint(tmp_path).name == "step-000001" and not (tmp_path / "step-000002").exists()


def test_the_finiteness_check_flags_nan_and_inf_only_and_names_optimizer_state():
    from lengthwise.runtime.finite import nonfinite_state

    model = torch.nn.Linear(3, 2).double()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        model.weight.fill_(1e300)  # huge but finite: a 2-norm would overflow, the check must not
    half = torch.nn.Linear(2, 2).to(torch.float32)
    with torch.no_grad():
        half.weight.fill_(3e38)
    assert nonfinite_state(model.named_parameters(), optimizer) is None
    assert nonfinite_state(half.named_parameters(), None) is None
    optimizer.state[model.bias]["exp_avg_sq"][1] = math.nan
    assert nonfinite_state(model.named_parameters(), optimizer) == "optimizer exp_avg_sq of bias"
    model.weight.data[0, 0] = -math.inf
    assert nonfinite_state(model.named_parameters(), optimizer) == "weight"


def test_sigint_during_the_last_step_still_exits_130(tmp_path, capsys, monkeypatch):
    """The last step finishes and is saved, and the run says it was interrupted (exit 130), as
    a signal during any earlier step does."""
    import os
    import signal

    from lengthwise.runtime.train import loop

    real_run_step = loop._run_step

    def interrupted_last_step(setup, executor, prepared, step, started, waited):
        if step == setup.config.steps:
            os.kill(os.getpid(), signal.SIGINT)  # the StopRequest handler of `lengthwise train` takes it
        return real_run_step(setup, executor, prepared, step, started, waited)

    monkeypatch.setattr(loop, "_run_step", interrupted_last_step)
    assert main([*ARGS, "--out", str(tmp_path), "--chunk-size", "32", "--k", "1"]) == 130
    captured = capsys.readouterr()
    assert "interrupted during the last step, which finished and was saved" in captured.out
    assert (tmp_path / "step-000002").is_dir()


def test_resume_refuses_a_checkpoint_whose_step_claims_disagree(tmp_path):
    from lengthwise.runtime.train.resume_check import trainer_state

    folder = tmp_path / "step-000006"
    folder.mkdir()
    (folder / "MANIFEST.json").write_text(json.dumps({"step": 6}))
    trainer = {"step": 6, "config": {}, "sampler": {}}
    assert trainer_state(folder, trainer) == ({}, 6)
    (folder / "MANIFEST.json").write_text(json.dumps({"step": 999}))
    with pytest.raises(UserError, match="its trainer state says 6, its folder name says 6, MANIFEST.json says 999"):
        trainer_state(folder, trainer)
    with pytest.raises(UserError, match="lacks a step, config or sampler position"):
        trainer_state(folder, [6])


def test_the_distributed_check_refuses_on_every_rank_together(tmp_path):
    """One gloo rank here (a collective of one): the flag goes through the all-reduce every rank
    of a distributed save calls."""
    import torch.distributed as dist

    from lengthwise.runtime.finite import check_saveable_across_ranks

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2).double()
        check_saveable_across_ranks(model, None, step=3, device=torch.device("cpu"))
        model.bias.data[1] = math.nan
        with pytest.raises(UserError, match="step 3: bias on rank 0 holds NaN or infinite values"):
            check_saveable_across_ranks(model, None, step=3, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _finite_check_rank(rank: int) -> str:
    """A rank of a 2-process gloo group: rank 1's shard holds a NaN, rank 0's does not."""
    from lengthwise.runtime.finite import check_finite_across_ranks

    shard = torch.ones(3, dtype=torch.float64)
    if rank == 1:
        shard[2] = math.nan
    try:
        check_finite_across_ranks({"layers.0.weight": shard}, step=5, device=torch.device("cpu"))
    except UserError as exc:
        return str(exc)
    return "saved"


def test_a_nan_on_one_rank_stops_every_ranks_save():
    """The distributed save's check is collective: rank 0, whose own shard is finite, refuses too
    (naming another rank), so no rank starts writing while another refuses."""
    from lengthwise.runtime.distributed.launch import spawn

    message = spawn(_finite_check_rank, 2)
    assert message.startswith("step 5: another rank's weights or optimizer state holds NaN"), message

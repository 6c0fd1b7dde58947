"""`lengthwise train`: exact resume, the sampler across a resume, falling loss, metrics, padded
rows, config files and bad input. Tiny model, a few short sequences, float64 on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from lengthwise.cli import build_parser, main
from lengthwise.commands.train import config_from_args
from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.checkpoint import latest_checkpoint
from lengthwise.runtime.execute import run_step
from lengthwise.runtime.model import build_model
from lengthwise.runtime.train import load_model, train
from lengthwise.runtime.train_config import TrainConfig, load_toml
from lengthwise.runtime.train_step import padded_forward_backward
from lengthwise.runtime.weights import hf_config_dict
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset
from tolerance import normwise_error, reduction_tolerance

METRIC_KEYS = {"step", "loss", "tokens", "tokens_per_s", "peak_memory_bytes", "planning_ms"}


def small(**changes) -> TrainConfig:
    """Four float64 steps of 3 stdlib documents cut to 96 tokens; ChunkFlow chunks of 32 with
    K = 1, so long documents are split and their first slices re-forwarded."""
    base = {"dtype": "float64", "context_length": 96, "batch_size": 3, "steps": 4, "lr": 1e-2,
            "progress": False, "options": {"chunk_size": 32, "k": 1}, "threads": 1}
    return TrainConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 4-step run, and a run stopped after step 2 then resumed to step 4."""
    whole = train(small())
    out = tmp_path_factory.mktemp("ckpt")
    first = train(small(steps=2, out=str(out), save_every=1))
    resumed = train(small(steps=4, out=str(out)))
    return whole, first, resumed, out


def test_resume_is_bit_identical(runs):
    whole, _, resumed, _ = runs
    assert resumed.start_step == 2 and resumed.resumed_from.name == "step-000002"
    final, reference = resumed.model.state_dict(), whole.model.state_dict()
    assert final.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name
    assert [r.loss for r in resumed.records] == [r.loss for r in whole.records[2:]]


def test_resume_neither_skips_nor_repeats_sequences(runs):
    whole, first, resumed, _ = runs
    seen = [r.seq_ids for r in first.records + resumed.records]
    assert seen == [r.seq_ids for r in whole.records]
    flat = [i for ids in seen for i in ids]
    assert len(flat) == len(set(flat)) == 12  # one epoch of 731 documents: no repeats yet


def test_checkpoint_dir_is_a_model_dir_and_no_temp_dir_is_left(runs):
    _, first, _, out = runs
    # every step of the first run, then only the last of the resumed one (no save_every)
    assert sorted(p.name for p in out.iterdir()) == ["step-000001", "step-000002", "step-000004"]
    path = latest_checkpoint(out)
    assert path.name == "step-000004"
    loaded = load_model(str(out / "step-000002"), model_preset("tiny"), dtype=torch.float64,
                        device=torch.device("cpu"), seed=123)
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_loss_decreases_on_the_stdlib_corpus():
    result = train(TrainConfig(dtype="float32", context_length=128, batch_size=4, steps=8,
                               lr=1e-2, progress=False, threads=1))
    losses = [r.loss for r in result.records]
    assert losses[0] > 5.0  # about ln(260): random weights
    assert max(losses[-3:]) < losses[0] - 1.0, losses


def test_metrics_lines_have_the_keys(tmp_path):
    path = tmp_path / "metrics.jsonl"
    train(small(steps=2, metrics=str(path), planner="packing", options={}))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert METRIC_KEYS <= line.keys()
        assert line["tokens"] > 0 and line["peak_memory_bytes"] > 0 and line["tokens_per_s"] > 0


def test_padded_rows_train_like_unpadded_execution():
    spec = model_preset("tiny")
    lengths = [40, 7, 23, 31, 12]
    cluster = cluster_preset("cpu", 1)
    plan = get_planner("padding")(PlanRequest(
        lengths=lengths, model=spec, cluster=cluster, scheme=ParallelScheme(),
        cost=CostModel(model=spec, cluster=cluster), context_length=64,
        options={"micro_batch_size": 2}))
    assert any(c.pad_to > c.num_tokens for c in plan.pipelines[0].chunks)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in lengths]
    padded, plain = (build_model(spec, dtype=torch.float64, seed=0) for _ in range(2))
    loss_padded = padded_forward_backward(padded, plan, tokens, backend="reference")
    loss_plain = run_step(plain, plan, tokens, backend="reference")
    # padded rows add the same per-token terms, in another order and with zeros between them
    tolerance = reduction_tolerance(torch.float64, 64 * len(lengths))
    assert normwise_error(loss_padded, loss_plain) <= tolerance
    for (name, p), q in zip(padded.named_parameters(), plain.parameters()):
        assert normwise_error(p.grad, q.grad) <= tolerance, name


def _config(*argv: str) -> TrainConfig:
    return config_from_args(build_parser(only="train").parse_args(["train", *argv]))


def test_flags_override_the_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nlr = 0.5\nbatch_size = 4\nplanner = "packing"\n[options]\nk = 2\n')
    config = _config("--config", str(path), "--lr", "0.25", "--tokens-per-batch", "900", "--chunk-size", "64")
    assert (config.steps, config.lr, config.planner) == (7, 0.25, "packing")
    assert (config.batch_size, config.tokens_per_batch) == (None, 900)
    assert config.options == {"k": 2, "chunk_size": 64}
    assert _config().context_length == 512 and _config().overlong == "truncate"


def test_toml_type_mistake_names_the_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = "many"\n')
    with pytest.raises(UserError, match="key 'steps' must be int"):
        load_toml(path)


def one_line_error(capsys, *argv: str) -> str:
    assert main(["train", "--no-progress", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    return captured.err


def test_unknown_planner_is_one_line(capsys):
    assert "unknown planner 'fastest'" in one_line_error(capsys, "--planner", "fastest")


def test_missing_weights_dir_is_one_line(capsys, tmp_path):
    assert "unknown model" in one_line_error(capsys, "--model", str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(model_preset("tiny"))))
    assert "holds no model.safetensors" in one_line_error(capsys, "--model", str(tmp_path))


def test_bad_toml_key_is_named(capsys, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("stepz = 3\n")
    assert "unknown key 'stepz'" in one_line_error(capsys, "--config", str(path))

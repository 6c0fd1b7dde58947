"""Tier 3: `lengthwise train --planner hydraulis` across processes with heterogeneous pipelines
(runtime/train/dist_hetero.py): 4 gloo ranks in float64, tiny model.

- Two steps with pipeline 0 = tp2 x pp1 (ranks 0, 1) and pipeline 1 = tp1 x pp2 (ranks 2, 3),
  AdamW on each rank's owned shard of the float32/float64 masters (each element owned by one of
  its holders), weights pulled back into the propagation layout every step: the weights equal
  single-process training of the same plans.
- A third step under another strategy (one tp2 x pp2 pipeline): switching inside the run (the
  masters and moments moved to the new owners) equals resuming the second step's checkpoint with
  `--pipelines tp2-pp2` (loaded in the saved layout, then moved the same way), bit for bit, and
  the switch is logged with its cost: the optimizer state moved (3 x 8 bytes per element whose
  owner changed) and the weights pulled (every held element but those the rank owns).

Tolerance of the single-process comparison: the sums run in other orders (the tp2 pipeline
splits the hidden and head reductions, the owners sum the pipelines' gradients); the largest
reduction is over a step's tokens times the hidden width, as in tests/test_train_parallel.py
(about 1.1e-11 relative to each tensor's largest weight, well below 1e-9; measured
8.1e-13 after 3 steps).

- 8 ranks, a context-parallel pipeline beside two tp pipelines and a pp pipeline, 2 steps
  (`test_a_cp2_pipeline_beside_tp_and_pp_pipelines_trains_exactly`).

Not run here, too slow for the suite (2 shared CPU cores):

- the planner choosing each batch's strategy itself on 4 ranks, charging switches (cp4 for
  step 1, 4 x dp for steps 2-3, cp4 again for step 4: two switches, each moving 0 bytes of
  optimizer state, since every rank holds, and so owns the same quarter of, every element in
  both strategies); 1.0e-12 relative after 4 steps, and resuming step 2's checkpoint to step 4
  gives the same weights bit for bit:

      lengthwise train --planner hydraulis --nproc 4 --dp 4 --dtype float64 --context-length 1024 \\
          --batch-size 8 --steps 4 --save-every 2 --lr 1e-2 --threads 1 --out OUT

  each compared with the same command without --nproc (one process runs the same plans).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lengthwise.cli import build_parser, main
from lengthwise.commands.train import config_from_args
from lengthwise.runtime.distributed.launch import spawn
from lengthwise.runtime.train.loop import train
from lengthwise.runtime.export import checkpoint_weights
from lengthwise.specs import model_preset
from tolerance import reduction_tolerance

CONTEXT, BATCH, HIDDEN = 96, 4, 128
HETERO, SWITCHED = "tp2-pp1,tp1-pp2", "tp2-pp2"
ARGS = ["--planner", "hydraulis", "--dtype", "float64", "--context-length", str(CONTEXT), "--batch-size", str(BATCH),
        "--lr", "1e-2", "--threads", "1", "--no-progress"]
"""Steps of 4 stdlib documents cut to 96 tokens; clipping (norm 1) is active (norms 3-15)."""
TOLERANCE = reduction_tolerance(torch.float64, BATCH * CONTEXT * HIDDEN)


def config_of(*argv: str):
    return config_from_args(build_parser(only="train").parse_args(["train", *ARGS, *argv]))


def _switching_rank(rank: int, config, strategies: tuple[str, ...]) -> list[dict]:
    """One rank of `config`, planning batch i with the strategy strategies[i] (the run's own
    planner and options otherwise); returns the switches it measured."""
    from lengthwise.runtime.distributed.mesh import Mesh
    from lengthwise.runtime.train.dist_launch import rank_executor
    from lengthwise.runtime.train.loop import Setup, run_training
    from lengthwise.runtime.train.signals import StopRequest

    mesh = Mesh.from_default_group(timeout_s=config.timeout)
    setup = Setup(config, device=mesh.device, whole_model=False)
    planned = setup.plan
    setup.plan = lambda batch: planned(batch, options={**config.options, "pipelines": strategies[batch.index]})
    with StopRequest(quiet=True) as stop:
        executor = rank_executor(setup, mesh)
        run_training(setup, executor, stop=stop)
    return executor.switches


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def switching_run(tmp_path_factory):
    """Steps 1-2 with HETERO, step 3 with SWITCHED, checkpoints after steps 2 and 3."""
    out = tmp_path_factory.mktemp("hetero")
    config = config_of("--pipelines", HETERO, "--steps", "3", "--save-every", "2", "--nproc", "4",
                       "--out", str(out), "--metrics", str(out / "metrics.jsonl"))
    switches = spawn(_switching_rank, 4, config, (HETERO, HETERO, SWITCHED), timeout_s=300)
    return out, switches


def test_heterogeneous_pipelines_train_to_the_single_process_weights(switching_run):
    out, _ = switching_run
    reference = train(config_of("--pipelines", HETERO, "--steps", "2"))
    expected = reference.model.state_dict()
    trained = checkpoint_weights(out / "step-000002")
    assert trained.keys() == expected.keys()
    for name, tensor in trained.items():
        assert (tensor - expected[name]).abs().max() <= TOLERANCE * expected[name].abs().max(), name
    assert [m["loss"] for m in metrics(out)[:2]] == pytest.approx([r.loss for r in reference.records], rel=TOLERANCE)


def test_a_strategy_switch_equals_resuming_in_the_new_strategy(switching_run, tmp_path):
    out, switches = switching_run
    shutil.copytree(out / "step-000002", tmp_path / "step-000002")
    assert main(["train", *ARGS, "--pipelines", SWITCHED, "--steps", "3", "--nproc", "4", "--out", str(tmp_path),
                 "--metrics", str(tmp_path / "metrics.jsonl")]) == 0
    resumed, switched = checkpoint_weights(tmp_path / "step-000003"), checkpoint_weights(out / "step-000003")
    for name, tensor in resumed.items():
        assert torch.equal(switched[name], tensor), name
    assert metrics(tmp_path)[0]["loss"] == metrics(out)[2]["loss"]
    # the switch, as measured and logged before step 4: the float64 master and both moments of
    # every element whose owner changed moved to its new owner (counted here from the two
    # layouts' owned elements), and every rank pulled its tp2 x pp2 weights but those it owns
    [switch] = switches
    assert metrics(out)[2]["switch"] == switch
    assert (switch["step"], switch["from"], switch["to"]) == (3, HETERO, SWITCHED)
    old, new = _layout([(2, 1, 1, (4,)), (1, 2, 1, (2, 2))]), _layout([(2, 2, 1, (2, 2))])
    changed = sum(int((~torch.isin(old.owned_indices(n, r), new.owned_indices(n, r))).sum())
                  for n in old.shapes for r in range(4))
    assert changed > 0 and switch["optimizer_state_bytes_moved"] == 3 * 8 * changed
    # tp2 x pp2 holds every element once but the norms, whole on both TP ranks
    assert switch["weight_bytes_pulled"] == (sum(new.local_size) - sum(new.shard_size)) * 8
    spec = model_preset("tiny")
    assert sum(new.local_size) - sum(new.shard_size) == (2 * spec.num_layers + 1) * spec.hidden
    assert switch["seconds"] > 0


def _layout(pipelines):
    """The owned-by-holders layout of the tiny model under `pipelines` (tp, pp, cp, layers per stage)."""
    from lengthwise.runtime.parallel.hetero_layout import ExchangeLayout
    from lengthwise.runtime.parallel.hetero_reducer import strategy_holdings, whole_shapes

    shapes = whole_shapes(model_preset("tiny"))
    holdings, dims = strategy_holdings(model_preset("tiny"), pipelines, list(shapes))
    return ExchangeLayout(shapes, holdings, dims=dims)


def test_pipelines_and_degrees_are_checked_in_one_line(capsys):
    assert main(["train", *ARGS, "--pipelines", HETERO, "--nproc", "2"]) == 2
    assert main(["train", *ARGS, "--pipelines", HETERO, "--nproc", "4", "--dp", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err
    assert f"--pipelines {HETERO} uses 4 processes, --nproc gives 2" in err
    assert "leave out --dp/--pp/--cp/--tp" in err


def test_a_cp2_pipeline_beside_tp_and_pp_pipelines_trains_exactly(tmp_path):
    """8 ranks: tp1-pp1-cp2 (ranks 0, 1), two tp2-pp1 pipelines and a tp1-pp2 one, 2 steps of 8
    documents; weights, losses and the held-out loss (run sharded in the same strategy) equal
    one process running the same plans."""
    strategy = ["--pipelines", "tp1-pp1-cp2,tp2-pp1,tp2-pp1,tp1-pp2", "--batch-size", "8", "--steps", "2",
                "--eval-every", "2", "--eval-sequences", "4"]
    assert main(["train", *ARGS, *strategy, "--nproc", "8", "--out", str(tmp_path),
                 "--metrics", str(tmp_path / "metrics.jsonl")]) == 0
    reference = train(config_of(*strategy))
    tolerance = reduction_tolerance(torch.float64, 8 * CONTEXT * HIDDEN)
    expected, trained = reference.model.state_dict(), checkpoint_weights(tmp_path / "step-000002")
    assert trained.keys() == expected.keys()
    for name, tensor in trained.items():
        assert (tensor - expected[name]).abs().max() <= tolerance * expected[name].abs().max(), name
    assert [m["loss"] for m in metrics(tmp_path)] == pytest.approx([r.loss for r in reference.records], rel=tolerance)
    assert [m.get("eval_loss") for m in metrics(tmp_path)] == \
        [None, pytest.approx(reference.records[1].eval_loss, rel=tolerance)]

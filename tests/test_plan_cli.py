"""`lengthwise plan`, run in-process: valid plans for every baseline at 32 GPUs, summary, JSON, options."""

from __future__ import annotations

import json

import pytest

from lengthwise.cli import main
from lengthwise.commands.plan import default_context_length
from lengthwise.commands.planner_flags import parse_option
from lengthwise.cost import CostModel
from lengthwise.plan.ir import StepPlan
from lengthwise.plan.validate import validate_plan

BASELINES = ("padding", "packing", "sorted", "token-balanced")
SCHEME_32 = ["--model", "qwen2.5-7b", "--cluster", "h100", "--dp", "8", "--pp", "4"]
LMSYS_512 = ["--profile", "lmsys", "--batch-size", "512"]


@pytest.mark.parametrize("planner", BASELINES)
def test_baseline_plans_512_lmsys_sequences_on_32_gpus_validly(tmp_path, capsys, planner):
    out = tmp_path / "plan.json"
    assert main(["plan", "--planner", planner, *LMSYS_512, *SCHEME_32, "--out", str(out)]) == 0
    plan = StepPlan.load(out)
    validate_plan(plan, CostModel(model=plan.model, cluster=plan.cluster))
    assert plan.planner == planner and len(plan.lengths) == 512 and plan.num_gpus == 32
    assert [p.pp for p in plan.pipelines] == [4] * 8
    assert plan.metrics["planning_ms"] > 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "planned in" in text
    assert len([line for line in text.splitlines() if line.split()[:1] in (["0"], ["7"])]) == 2


def test_json_prints_the_whole_plan(capsys):
    assert main(["plan", "--planner", "packing", "--profile", "lmsys", "--batch-size", "64",
                 "--model", "qwen2.5-1.5b", "--dp", "2", "--json"]) == 0
    plan = StepPlan.from_dict(json.loads(capsys.readouterr().out))
    validate_plan(plan)
    assert plan.cluster.num_gpus == 2 and len(plan.pipelines) == 2


def test_option_reaches_the_planner(capsys):
    assert main(["plan", "--planner", "padding", "--profile", "tiny", "--batch-size", "16",
                 "--model", "tiny", "--cluster", "cpu", "--option", "micro_batch_size=4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["options"]["micro_batch_size"] == 4
    assert len(plan["pipelines"][0]["chunks"]) == 4


def test_same_seed_writes_the_same_plan(capsys):
    argv = ["plan", "--planner", "packing", *LMSYS_512, *SCHEME_32, "--seed", "5", "--json"]
    plans = []
    for _ in range(2):
        assert main(argv) == 0
        plan = json.loads(capsys.readouterr().out)
        plan["metrics"].pop("planning_ms")
        plans.append(plan)
    assert plans[0] == plans[1]


def test_parse_option_reads_numbers_booleans_and_strings():
    assert parse_option("micro_batch_size=4") == ("micro_batch_size", 4)
    assert parse_option("ratio=0.5") == ("ratio", 0.5)
    assert parse_option("equal-count=true") == ("equal_count", True)
    assert parse_option("chunk_size=auto") == ("chunk_size", "auto")
    assert parse_option("k=none") == ("k", None)


def test_default_context_length_is_the_longest_rounded_up_to_a_power_of_two():
    assert default_context_length([100, 5765]) == 8192
    assert default_context_length([4096]) == 4096
    assert default_context_length([1]) == 1


def test_help_opens_with_an_example(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    assert "lengthwise plan --planner packing --profile lmsys" in capsys.readouterr().out


def test_written_files_have_the_usual_permissions(tmp_path):
    """Outputs are readable by others as any file the user writes (0666 less the umask), not
    0600 as a temporary file would leave them."""
    import os

    from lengthwise.files import write_atomic

    mask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "out.json", "{}")
    finally:
        os.umask(mask)
    assert (tmp_path / "out.json").stat().st_mode & 0o777 == 0o644


def test_summary_says_when_gpus_run_no_pipeline(capsys):
    """A plan whose pipelines leave GPUs of the scheme without work (as a Hydraulis strategy
    without the parts whose model states cannot fit does) says how many, in the summary."""
    from types import SimpleNamespace

    from lengthwise.commands.plan import summary
    from lengthwise.specs import ParallelScheme

    assert main(["plan", "--planner", "packing", "--profile", "lmsys", "--batch-size", "64",
                 "--model", "qwen2.5-1.5b", "--dp", "2", "--pp", "2", "--json"]) == 0
    plan = StepPlan.from_dict(json.loads(capsys.readouterr().out))
    request = SimpleNamespace(scheme=ParallelScheme(dp=2, pp=2), context_length=8192)
    assert "run no pipeline" not in summary(plan, request, None)
    plan.pipelines = plan.pipelines[:1]
    assert "2 of the 4 GPUs run no pipeline of this plan" in summary(plan, request, None)

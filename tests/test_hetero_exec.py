"""A heterogeneous plan with tensor parallelism on one pipeline only runs exactly: 4 gloo ranks in
float64, pipeline 0 = tp2 x pp1 (ranks 0, 1), pipeline 1 = tp1 x pp2 (ranks 2, 3); loss and every
gradient against the single-process Hugging Face oracle
(runtime/parallel/hetero_reducer.HeteroReducer sums the tp shards and the whole parameters through
the optimisation-propagation exchange).

The `tied-*` cases run Qwen2's layout (q/k/v biases, the LM head is the embedding): the tied
table is held by the first and the last stage of each pipeline, whole or as tp vocabulary rows,
and its gradient (both uses, every pipeline) is summed as one parameter."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from lengthwise.runtime.distributed.launch import spawn
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.parallel.verify_dist import VerifyJob, verify_worker
from lengthwise.specs import cluster_preset, model_preset
from plan_helpers import hand_plan


PP1, PP2 = ["F0 F1 B1 B0"], ["F0 F1 B1 B0", "F0 F1 B1 B0"]
ONE = ["F0 B0"]
CASES = {
    # (tp2 x pp1) + (tp1 x pp2): 4 ranks
    "4": ("tiny", [40, 30, 50, 20], [("0[0:40] 1[0:30]", PP1, 2), ("2[0:50] 3[0:20]", PP2, 1)]),
    # (tp2 x pp2) + (tp1 x pp1) + (tp1 x pp1): 6 ranks, a split sequence on the tp2 pipeline
    "6": ("tiny", [60, 30, 50, 20, 10], [("0[0:30] 0[30:60]+1[0:30]", PP2, 2), ("2[0:50] 3[0:20]", PP1, 1),
                                         ("4[0:10]", ONE, 1)]),
    # tied: one tp2 head-and-embedding DTensor beside two whole copies (through the exchange)
    "tied-tp2-pp1,tp1-pp1,tp1-pp1": ("tiny-qwen", [40, 30, 50, 20], [("0[0:40] 1[0:30]", PP1, 2),
                                                                      ("2[0:50]", ONE, 1), ("3[0:20]", ONE, 1)]),
    # tied: the table on both stages of the pp2 pipeline (ranks 0, 1), whole (all-reduce)
    "tied-tp1-pp2,tp1-pp1,tp1-pp1": ("tiny-qwen", [40, 30, 50, 20], [("0[0:40] 1[0:30]", PP2, 1),
                                                                      ("2[0:50]", ONE, 1), ("3[0:20]", ONE, 1)]),
    # tied, 6 ranks: tp2 rows on stages 0 (ranks 0, 1) and 1 (ranks 2, 3), whole on ranks 4 and 5
    "tied-tp2-pp2,tp1-pp2": ("tiny-qwen", [60, 30, 50, 20], [("0[0:30] 0[30:60]+1[0:30]", PP2, 2),
                                                              ("2[0:50] 3[0:20]", PP2, 1)]),
}


def nproc_of(case: str) -> int:
    return sum(tp * len(stages) for _, stages, tp in CASES[case][2])


def make_plan(case: str):
    model, lengths, pipes = CASES[case]
    plan = hand_plan(model_preset(model), lengths, [(c, s) for c, s, _ in pipes])
    for i, (_, _, tp) in enumerate(pipes):
        plan.pipelines[i] = dataclasses.replace(plan.pipelines[i], tp=tp)
    plan = dataclasses.replace(plan, zero=0)
    plan.cluster = cluster_preset("cpu", plan.num_gpus)
    return plan


def _worker(rank: int, cases: tuple[str, ...]) -> dict:
    """Every case of one size in turn, in one group of processes (a process group and the
    workers' start-up shared)."""
    mesh = Mesh.from_default_group(timeout_s=120)
    results = {}
    for case in cases:
        job = VerifyJob(make_plan=functools.partial(make_plan, case), backend="reference", timeout_s=120,
                        dtype=torch.float64)
        results[case] = verify_worker(rank, job, mesh)
    return results


@pytest.fixture(scope="module")
def results() -> dict:
    """Every case's rank-0 result: one spawn per number of ranks (4 and 6)."""
    found = {}
    for nproc in sorted({nproc_of(case) for case in CASES}):
        cases = tuple(case for case in CASES if nproc_of(case) == nproc)
        found.update(spawn(_worker, nproc, cases, timeout_s=300))
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_heterogeneous_tp_equals_the_oracle(results, case):
    result = results[case]
    assert result["passed"], result
    assert result["max_rel_grad_diff"] <= 1e-9
    assert abs(result["loss"] - result["reference_loss"]) <= 1e-9 * abs(result["reference_loss"])
    assert all(c["dp_elements"] > 0 for c in result["comm"])  # the exchange ran on every rank


def test_verify_cli_runs_a_fixed_heterogeneous_hydraulis_strategy(capsys):
    """`lengthwise verify --planner hydraulis --nproc 4 --pipelines tp2-pp1,tp1-pp2`: the 4-rank
    case above, planned by hydraulis with its strategy fixed (in process: the workers come from
    the test session's fork server)."""
    import json

    from lengthwise.cli import main

    assert main(["verify", "--planner", "hydraulis", "--nproc", "4", "--pipelines", "tp2-pp1,tp1-pp2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["max_rel_grad_diff"] <= 1e-9
    assert main(["verify", "--planner", "hydraulis", "--nproc", "4", "--pipelines", "tp2-pq1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tp2-pq1" in err


def test_a_vocabulary_some_tp_does_not_divide_is_named(tmp_path, capsys):
    """The exchange maps one layout onto another; a padded vocabulary has no counterpart."""
    import json

    from lengthwise.cli import main

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 261, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["verify", "--planner", "hydraulis", "--nproc", "4", "--pipelines", "tp2-pp1,tp1-pp2",
                 "--model-config", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "261 tokens, which tp 2 does not divide" in err

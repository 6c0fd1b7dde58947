"""`lengthwise verify`: plans a batch, executes it, and compares with unpacked training.

Also checks that the comparison has teeth: an executor with one wrong mask bit or one label
taken across a document boundary fails it.
"""

from __future__ import annotations

import json

import pytest
import torch

from lengthwise.cli import main
from lengthwise.runtime import verify as verify_module
from lengthwise.runtime.attention import ChunkLayout
from lengthwise.runtime.layout import _cached_bias
from lengthwise.runtime.weights import hf_config_dict
from lengthwise.specs import ModelSpec

SMALL = ModelSpec(name="small", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8,
                  ffn=48, vocab=64)


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config_dict(SMALL)))
    return str(path)


def _verify_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["verify", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_chunkflow_pipeline_plan_matches_transformers(capsys, config_json):
    pytest.importorskip("transformers")
    code, out = _verify_json(capsys, "--model-config", config_json, "--lengths", "40,9,7,20",
                             "--chunk-size", "16", "--k", "1", "--pp", "2")
    assert code == 0 and out["passed"] and out["oracle"] == "transformers"
    assert {"max_abs_grad_diff", "max_rel_grad_diff", "loss", "reference_loss", "oracle", "passed"} <= set(out)
    assert out["max_rel_grad_diff"] <= 1e-9 and out["planner"] == "chunkflow"


def test_packing_over_two_replicas_with_unpacked_oracle(capsys, config_json):
    code = main(["verify", "--model-config", config_json, "--lengths", "30,9,7,20", "--planner", "packing",
                 "--dp", "2", "--oracle", "unpacked"])
    text = capsys.readouterr().out
    assert code == 0 and "PASSED" in text and "unpacked" in text


def test_exit_status_is_one_above_the_tolerance(capsys, config_json, monkeypatch):
    monkeypatch.setitem(verify_module.TOLERANCE, torch.float64, -1.0)
    code = main(["verify", "--model-config", config_json, "--lengths", "12,5", "--planner", "packing",
                 "--oracle", "unpacked"])
    assert code == 1 and "FAILED" in capsys.readouterr().out


@pytest.fixture
def fresh_biases():
    """Masks built while a test patches them must not outlive it in the bias cache."""
    _cached_bias.cache_clear()
    yield
    _cached_bias.cache_clear()


@pytest.mark.parametrize("backend", ["reference", "cpu-flash"])
def test_one_wrong_mask_bit_fails_verification(capsys, config_json, monkeypatch, fresh_biases, backend):
    """Letting the first token of the second document see the last key of the first."""
    honest = ChunkLayout.mask

    def leaky(self, device):
        mask = honest(self, device).clone()
        if len(self.q_lens) > 1:
            mask[self.q_lens[0], self.k_lens[0] - 1] = True
        return mask

    monkeypatch.setattr(ChunkLayout, "mask", leaky)
    code, out = _verify_json(capsys, "--model-config", config_json, "--lengths", "9,5",
                             "--planner", "packing", "--oracle", "unpacked", "--backend", backend)
    assert code == 1 and out["max_rel_grad_diff"] > 1e-6


def test_a_label_across_documents_fails_verification(capsys, config_json, monkeypatch):
    from lengthwise.runtime import stage
    honest = stage.chunk_labels

    def across(chunk, token_ids):
        labels = honest(chunk, token_ids)
        if len(chunk.segments) > 1:  # first document's last token "predicts" the second's first
            labels[chunk.segments[0].num_tokens - 1] = token_ids[chunk.segments[1].seq_id][0]
        return labels

    monkeypatch.setattr(stage, "chunk_labels", across)
    code, out = _verify_json(capsys, "--model-config", config_json, "--lengths", "9,5",
                             "--planner", "packing", "--oracle", "unpacked")
    assert code == 1 and out["loss"] != out["reference_loss"]


def test_unavailable_backend_exits_two_with_one_line(capsys, config_json):
    code = main(["verify", "--model-config", config_json, "--backend", "varlen"])
    err = capsys.readouterr().err
    assert code == 2 and "varlen is unavailable" in err and err.count("\n") == 1


def test_unknown_model_exits_two(capsys):
    assert main(["verify", "--model-config", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_help_shows_an_example(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--help"])
    assert exc.value.code == 0 and "lengthwise verify --model-config tiny" in capsys.readouterr().out


def _planned(name: str, lengths: list[int], **degrees):
    from lengthwise.cost import CostModel
    from lengthwise.plan.validate import validate_plan
    from lengthwise.planners import PlanRequest, get_planner
    from lengthwise.specs import ParallelScheme, cluster_preset

    scheme = ParallelScheme(**degrees)
    cluster = cluster_preset("cpu", scheme.num_gpus)
    cost = CostModel(model=SMALL, cluster=cluster)
    plan = get_planner(name)(PlanRequest(lengths=lengths, model=SMALL, cluster=cluster, scheme=scheme,
                                         cost=cost, context_length=128))
    validate_plan(plan, cost)
    return plan


@pytest.mark.parametrize("name", __import__("lengthwise.planners", fromlist=["x"]).PLANNER_NAMES)
def test_every_available_planner_trains_exactly(name):
    """Whatever a planner decides (packing, splitting, placement, schedule), executing its plan
    equals unpacked training."""
    plan = _planned(name, [100, 30, 17, 60, 5, 41, 9], dp=2, pp=2)
    result = verify_module.verify_plan(plan, dtype=torch.float64, seed=3, oracle="unpacked")
    assert result.passed, result.to_dict()

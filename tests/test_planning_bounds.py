"""Batches too large to plan are refused up front, as one line naming the bound (issue 28)."""

from __future__ import annotations

import pytest

import lengthwise.planners.auto as auto
import lengthwise.planners.infinipipe.planner as infinipipe
import lengthwise.planners.slimpack.planner as slimpack
from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.planners import PlanRequest
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset


def request(sequences: int) -> PlanRequest:
    model = MODEL_PRESETS["qwen2.5-7b"]
    scheme = ParallelScheme(dp=8, pp=2)
    cluster = cluster_preset("h100", scheme.num_gpus)
    return PlanRequest(lengths=[1] * sequences, model=model, cluster=cluster, scheme=scheme,
                       cost=CostModel(model=model, cluster=cluster), context_length=8192)


@pytest.mark.parametrize("module,fn", [(slimpack, slimpack.plan_slimpack), (infinipipe, infinipipe.plan_infinipipe),
                                       (auto, auto.plan_auto)])
def test_a_batch_over_the_bound_is_refused_before_any_work(module, fn, monkeypatch):
    over = request(module.MAX_SEQUENCES + 1)

    def no_work(*args, **kwargs):
        raise AssertionError("the planner started work on a batch over its bound")

    for name in ("check_lengths", "try_planner", "proxy_factor"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, no_work)
    with pytest.raises(UserError) as err:
        fn(over)
    message = str(err.value)
    assert "\n" not in message
    assert f"{module.MAX_SEQUENCES:,}" in message and f"{module.MAX_SEQUENCES + 1:,}" in message
    assert "--batch-size" in message


@pytest.mark.parametrize("module", [slimpack, infinipipe, auto])
def test_a_batch_at_the_bound_passes_the_check(module, monkeypatch):
    """The bound itself is allowed: the planner goes on to its first step (stopped here)."""
    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    name = "proxy_factor" if module is auto else "check_lengths"
    monkeypatch.setattr(module, name, reached)
    fn = {slimpack: slimpack.plan_slimpack, infinipipe: infinipipe.plan_infinipipe, auto: auto.plan_auto}[module]
    with pytest.raises(Reached):
        fn(request(module.MAX_SEQUENCES))

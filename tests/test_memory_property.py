"""Each planner's memory model against the simulator: every plan a planner emits fits memory
when the simulator replays it (peak <= the GPU's capacity on every stage of every pipeline, the
busiest CP rank of each, `SimResult.fits`).

A planner sizes its chunks, micro-batches or buckets by its own memory model (ChunkFlow's
`stage_memory_bytes`, the baselines' `max_seq_len`, Skrull's bucket, ...); the simulator's memory
replay is the oracle they must agree with. The cases are seeded long-tail batches with one
sequence of half to all of the context length, on schemes where memory binds (tp 1 x pp 4 of a
7B model holds about a 16K chunk; cp 2 splits a long one over two ranks), so forgetting a term of
a model (ChunkFlow's K chunks in flight, its K/V gradient buffer) gives a plan the simulator puts
over capacity. A planner may refuse a case (UserError: the batch does not fit its scheme); each
planner must plan at least one.
"""

from __future__ import annotations

import numpy as np
import pytest

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.metrics import GIB
from lengthwise.planners import PlanRequest
from lengthwise.planners.registry import CANDIDATE_PLANNERS
from lengthwise.sim import simulate_plan
from lengthwise.specs import MODEL_PRESETS, ParallelScheme, cluster_preset
from lengthwise.workloads import get_profile

K = 1024
CASES = [
    # (model, scheme, profile, sequences, context length, seed)
    ("llama2-7b", "dp1-tp1-pp4-cp1", "chunkflow-eval", 64, 128 * K, 0),
    ("llama2-7b", "dp1-tp1-pp4-cp1", "lmsys", 32, 256 * K, 1),
    ("qwen2.5-7b", "dp1-tp2-pp4-cp1", "lmsys", 64, 256 * K, 1),
    ("qwen2.5-7b", "dp1-tp4-pp2-cp2", "lmsys", 48, 64 * K, 2),
    ("llama2-7b", "dp2-tp2-pp2-cp2", "commoncrawl", 48, 32 * K, 3),
    ("qwen2.5-7b", "dp2-tp4-pp2-cp1", "chunkflow-eval", 64, 32 * K, 4),
]
CHUNKFLOW_LAST_STAGE_GAP = ("qwen2.5-7b", "dp1-tp1-pp4-cp1", "chunkflow-eval", 32, 128 * K, 0)
"""A case ChunkFlow's default ChunkSize once overflowed (8K chunks, simulated peak 78.1 of 73.6
GiB on the last stage): its memory model counted max(K, pp - stage) = 1 chunk in flight there,
but the state-aware schedule forwards the two standalone chunks while the long sequence's last
chunks still run (F10 F1 B1 F11 F0 B0 B10 B11: three chunks' activations at once), and
Qwen2.5's 152K-token vocabulary makes each of them large. The model now reads the count off the
schedule it emits (`chunkflow.build.inflight_chunks`). Since the schedule's re-forwards are forward
items of their own and an N no longer counts against the warm-up (plan/schedules.py
`_first_in_first_out`), the last stage holds one chunk here and 8K chunks fit."""


def make_request(model: str, scheme: str, profile: str, n: int, context: int, seed: int) -> PlanRequest:
    """A seeded batch of the profile with one sequence of half to all of the context length."""
    parsed = ParallelScheme.parse(scheme)
    cluster = cluster_preset("h100", parsed.num_gpus)
    cost = CostModel(model=MODEL_PRESETS[model], cluster=cluster)
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in get_profile(profile).sample(n, rng, below=context + 1)]
    lengths[int(rng.integers(n))] = int(context * rng.uniform(0.5, 1.0))
    return PlanRequest(lengths=lengths, model=cost.model, cluster=cluster, scheme=parsed, cost=cost,
                       context_length=context, seed=seed)


@pytest.fixture(scope="module")
def requests() -> list[PlanRequest]:
    return [make_request(*case) for case in CASES]


@pytest.mark.parametrize("name", list(CANDIDATE_PLANNERS))
def test_every_plan_fits_memory_in_the_simulator(name, requests):
    planned = 0
    for case, request in zip(CASES, requests):
        try:
            plan = CANDIDATE_PLANNERS[name](request)
        except UserError:
            continue  # the planner says the batch does not fit this scheme: no plan to check
        planned += 1
        result = simulate_plan(plan, request.cost)
        peak = max(max(row) for row in result.peak_memory)
        assert result.fits and peak <= request.cost.capacity_bytes, (
            f"{name} on {case}: simulated peak {peak / GIB:.1f} GiB > "
            f"{request.cost.capacity_bytes / GIB:.1f} GiB capacity")
    assert planned, f"{name} planned none of the cases"


def test_chunkflow_default_chunk_fits_on_the_last_stage():
    """ChunkFlow's default ChunkSize counts the chunks its schedule holds on each stage, with the
    split sequences first at most max(K, pp - stage) (one on the last stage at 8K here), and the
    simulator agrees that the plan fits."""
    from lengthwise.planners.chunkflow.build import inflight_chunks

    request = make_request(*CHUNKFLOW_LAST_STAGE_GAP)
    held = inflight_chunks(request, 8 * K, 1)
    assert held[-1] == 1 and all(h <= max(1, len(held) - s) for s, h in enumerate(held))
    plan = CANDIDATE_PLANNERS["chunkflow"](request)
    assert simulate_plan(plan, request.cost).fits

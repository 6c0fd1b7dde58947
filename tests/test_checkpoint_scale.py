"""A distributed checkpoint save at 70B / 256 ranks (fake tensors, fake process group) holds no
more than one rank's shards on any rank: it writes the tensors the rank holds, as they are, and
issues no collective (nothing is gathered)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lengthwise.cost import CostModel
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.parallel.checkpoint_scale import save_footprint
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset


@pytest.fixture(scope="module")
def plan_70b():
    spec, scheme = model_preset("llama-70b"), ParallelScheme(dp=8, pp=4, tp=8)
    cluster = cluster_preset("h100", scheme.num_gpus)
    return get_planner("chunkflow")(PlanRequest(
        lengths=[4096] * 8, model=spec, cluster=cluster, scheme=scheme,
        cost=CostModel(model=spec, cluster=cluster), context_length=4096, seed=0,
        options={"chunk_size": 4096, "k": 1}))


@pytest.mark.parametrize("rank", [255])  # the last stage: the head and the tied embedding besides its layers
def test_a_70b_save_on_256_ranks_holds_no_more_than_the_ranks_own_shards(plan_70b, rank):
    found = save_footprint(plan_70b, rank)
    assert found.world_size == 256
    assert found.collectives == 0 and found.pieces_not_own == 0
    assert 0 < found.written_bytes <= found.own_bytes
    whole_model = 70e9 * 4 * 3  # fp32 masters and two AdamW moments of every parameter
    assert found.own_bytes < whole_model / 64  # a shard: 1/256 of the stage-major state, with replicated norms
    print(f"rank {rank}: holds {found.own_bytes:,} bytes of shards, writes {found.written_bytes:,}, "
          f"largest piece {found.largest_piece_bytes:,}")

"""ChunkFlow Table 5 (chunkflow.txt lines 261-271): peak memory of Qwen2.5-7B at <TP4, SP4, PP1,
selective>, K = 1, ChunkSize 2K / 4K / 8K, 32K and 256K contexts, within 10% of every cell.

The model is configured as the paper's system was, with two settings `CostModel` names:
`grads_held_all_step` (Megatron-LM's fp32 main-gradient buffer, allocated once and zeroed
between steps) and `nograd_keeps_graph` (Algorithm 2's first forward of a re-forwarded slice
runs with autograd on and drops its loss, so its graph lives until the next forward returns).
The activations are the executor's per-tensor account (`cost/memory.py`), not fitted to the
table. Without the two settings the executor itself would hold 0.79-0.95 of each cell
(`python benchmarks/chunkflow_table5.py` writes both columns)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def table5():
    spec = importlib.util.spec_from_file_location("chunkflow_table5", BENCH / "chunkflow_table5.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chunkflow_table5", module)
    spec.loader.exec_module(module)
    return module


def test_every_cell_of_table5_within_ten_percent(table5):
    for (context, chunk), paper in table5.PAPER.items():
        ours = table5.simulated_peak(context, chunk, chunkflow_system=True)
        assert ours == pytest.approx(paper, rel=0.10), (context, chunk)


def test_memory_grows_with_chunksize_and_barely_with_context(table5):
    """The table's point: the peak follows ChunkSize; the longer context adds only its K/V state
    (the 256K column over the 32K one by less than 256K tokens' K/V and its gradient)."""
    from lengthwise.cost import CostModel
    from lengthwise.specs import MODEL_PRESETS, cluster_preset

    K = 1024
    peaks = {(ctx, c): table5.simulated_peak(ctx, c, chunkflow_system=True) for ctx, c in table5.PAPER}
    for ctx in (32 * K, 256 * K):
        assert peaks[ctx, 2 * K] < peaks[ctx, 4 * K] < peaks[ctx, 8 * K]
    cm = CostModel(model=MODEL_PRESETS["qwen2.5-7b"], cluster=cluster_preset("h100", 4))
    kv = cm.kv_bytes(256 * K, layers=28, tp=4) / table5.GIB
    for c in (2 * K, 4 * K, 8 * K):
        assert 0 < peaks[256 * K, c] - peaks[32 * K, c] < 2 * kv

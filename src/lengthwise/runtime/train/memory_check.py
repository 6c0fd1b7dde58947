"""Will the run fit? An estimate made before any weight or document is loaded.

    need = estimate_memory(config, spec, nproc=1)
    check_memory(need, torch.device("cpu"))        # UserError when the machine cannot hold it

What a training process holds, and what this counts (an upper bound for each part):
- model states: weights, gradients and AdamW's two moments, all in the parameter dtype
  (torch's AdamW keeps its moments in the parameter's dtype): 4 values per parameter;
- token ids: the batch being trained and the one planned ahead (train.py plans a step ahead),
  each at most batch_size * context_length (or tokens_per_batch) int64 ids, plus the plan's
  bookkeeping per sequence;
- activations saved for backward of the largest piece the executor holds at once: a chunk of
  at most max(context_length, chunk_size) tokens, K of them for ChunkFlow (chunkflow §4.2),
  at the per-token figures of cost/memory.py (which assume 2-byte values; scaled to the dtype).
On CUDA the states and activations are on the GPU, the token ids in host memory; on CPU all in
host memory, once per local process of a `--nproc` run.

A rank of a distributed run holds one stage: at most ceil(layers / pp) layers plus the
embedding, norm and head (an upper bound for every stage), split over tp, and its states
sharded over dp x cp under FSDP2 (zero >= 1) while the whole stage's weights and gradients are
gathered for the step (zero 1 / 2; ZeRO-3 gathers one layer at a time, still bounded by that).
With --dtype bfloat16 under FSDP2 the sharded states are float32 and the gathered copies bf16.
A Hydraulis rank holds its part of the current strategy's stage plus the float32 masters and
AdamW moments of the elements of it that it owns, 1/d of them for d holders
(`train/dist_hetero.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lengthwise.cost.memory import BYTES_BF16, activation_bytes_per_token_layer, head_bytes_per_token
from lengthwise.errors import UserError
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.specs import ModelSpec

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}
ID_BYTES = 8
"""Token ids are int64 tensors."""
SEQUENCE_BYTES = 2048
"""Per-sequence overhead of a batch in flight (its tensor, plan segments, lists), rounded up."""
GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class MemoryNeed:
    """Bytes a run needs, by part (see the module docstring)."""

    states: int
    token_ids: int
    activations: int
    processes: int
    """Local processes each holding all of it (CPU) or each on its own GPU (CUDA)."""

    def describe(self) -> str:
        return (f"model states {self.states / GIB:.2f} GiB, two batches of token ids "
                f"{self.token_ids / GIB:.2f} GiB, activations {self.activations / GIB:.2f} GiB"
                + (f", times {self.processes} processes" if self.processes > 1 else ""))


def estimate_memory(config: TrainConfig, spec: ModelSpec, *, nproc: int = 1, rank_part: bool = False) -> MemoryNeed:
    """What `config` needs per process (module docstring); `rank_part`: each process is one rank
    of a distributed run, holding its part of the model (else the whole model)."""
    value = DTYPE_BYTES[config.dtype]
    tokens = config.tokens_per_batch or (config.batch_size or 16) * config.context_length
    sequences = config.batch_size or 0  # a token budget's sequence count is unknown up front
    chunk = max(config.context_length, int(config.options.get("chunk_size") or 0))
    live = min(tokens, chunk * max(1, int(config.options.get("k") or 1)))
    per_token = (activation_bytes_per_token_layer(spec) * spec.num_layers + head_bytes_per_token(spec))
    states = _rank_states(config, spec) if rank_part else 4 * spec.num_params * value
    return MemoryNeed(states=states,
                      token_ids=2 * (tokens * ID_BYTES + sequences * SEQUENCE_BYTES),
                      activations=int(live * per_token * value / BYTES_BF16), processes=nproc)


def _rank_states(config: TrainConfig, spec: ModelSpec) -> int:
    """Model-state bytes of the fullest rank of a distributed run (module docstring)."""
    value = DTYPE_BYTES[config.dtype]
    if config.planner == "hydraulis":
        return _hetero_states(config, spec, value)
    stage = (-(-spec.num_layers // config.pp) * spec.params_per_layer + spec.embedding_params) / config.tp
    if config.zero == 0:
        return int(4 * stage * value)
    master = 4 if config.dtype == "bfloat16" else value
    shards = config.dp * config.cp
    return int(4 * stage * master / shards + 2 * stage * value)  # sharded states + gathered weights, gradients


def _hetero_states(config: TrainConfig, spec: ModelSpec, value: int) -> int:
    """A Hydraulis rank (`train/dist_hetero.py`): its largest propagation part's weights and
    gradients in the run's dtype (the fullest stage over the --pipelines schemes; the whole
    model when the planner picks strategies itself), plus, for the elements it owns (1/d of what
    it holds, d = the pipelines x CP ranks holding each element; all N ranks as one-GPU
    pipelines when the planner picks), the masters, the two AdamW moments and the pushed
    gradient (float32, float64 for a float64 run)."""
    schemes = config.pipeline_schemes or [(1, 1, 1)]
    holders = sum(cp for _, _, cp in config.pipeline_schemes) if config.pipeline_schemes else config.num_ranks
    stage = max((-(-spec.num_layers // pp) * spec.params_per_layer + spec.embedding_params) / tp
                for tp, pp, _ in schemes)
    master = 8 if config.dtype == "float64" else 4
    return int(2 * stage * value + 4 * stage * master / holders)


def check_memory(need: MemoryNeed, device: torch.device) -> None:
    """UserError in one line when `need` exceeds what this machine has available."""
    host = need.token_ids if device.type == "cuda" else need.states + need.token_ids + need.activations
    host *= need.processes if device.type != "cuda" else 1
    places = [("host memory", host, available_host_bytes())]
    if device.type == "cuda":
        places.append((f"GPU {device}", need.states + need.activations, torch.cuda.mem_get_info(device)[0]))
    for where, wanted, available in places:
        if available is not None and wanted > available:
            raise UserError(f"this run needs about {wanted / GIB:.1f} GiB of {where} ({need.describe()}), "
                            f"{available / GIB:.1f} GiB is available: lower --batch-size / --tokens-per-batch "
                            f"or --context-length")


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else free physical pages; None if unknown."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None

"""The StepPlan: everything a planner decides for one global batch, as plain data.

Vocabulary (used throughout the project):

- *sequence* / *document*: one training example of the global batch, `seq_id` indexes
  `StepPlan.lengths`.
- *segment* / *slice*: tokens [start, stop) of one sequence. A segment with start > 0 attends
  to the K/V of tokens [0, start) of its sequence: its *context*.
- *chunk*: one packed row of segments (a micro-batch, a MicroPack); the unit a stage runs.
- *pipeline*: one data-parallel replica with its own (tp, pp, cp); heterogeneous pipelines
  (Hydraulis) have different degrees.
- *stage*: one pipeline stage, running a contiguous range of layers.
- *action*: one step of a stage's schedule, `F`, `B` or `N` (ChunkFlow's forward without grad
  that keeps only K/V state) of one chunk.

String forms round-trip: an action is `F3`, `B3`, `N3`, with `.r4` when the forward keeps only
the checkpoints of 4 of the stage's layers (those layers are recomputed before the backward),
and `.m20` when 20 more of its layers keep only their MLP block's input and recompute the MLP
(`F3.r4.m20`: layers 0-3 of the stage recomputed whole, 4-23 their MLP only, the rest none).
A segment is `7[0:4096]`; a chunk is `7[0:4096]+2[0:100]`.

Backward grouping (SlimPack §4.1.2): a pipeline may carry `backward_chunks`, a separate grouping
of the same tokens into backward units; `B` actions then index those. When absent, backward unit
i is forward chunk i.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from lengthwise.errors import UserError
from lengthwise.files import json_text, read_json, write_atomic
from lengthwise.fields import MAX_LENGTH, Fields, check_recorded_options, check_spec_fields
from lengthwise.limits import MAX_EXTRA_SECONDS
from lengthwise.specs import ClusterSpec, ModelSpec

FORWARD = "F"
BACKWARD = "B"
FORWARD_NOGRAD = "N"
ACTION_KINDS = (FORWARD, BACKWARD, FORWARD_NOGRAD)

MAX_DEGREE = 2**20
"""Largest tp, cp, stage layer count or recompute count a plan file may name (far above any
real cluster; keeps a damaged file from asking for 10^12 of anything)."""

MODEL_RANGES = {**{name: (1, 2**24) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                                "ffn", "vocab")},
                "rope_theta": (1e-6, 1e12), "rms_eps": (1e-30, 1.0)}
"""What a plan file's model may hold: 16M of anything is beyond every model, and keeps every
FLOP and byte count the cost model derives finite."""
CLUSTER_RANGES = {"num_gpus": (1, 2**24), "gpus_per_node": (1, 2**16), "gpu_memory_gb": (1e-3, 2.0**20),
                  "peak_tflops": (1e-3, 1e9), "intra_bw_gbps": (1e-3, 1e9), "inter_bw_gbps": (1e-3, 1e9),
                  "intra_latency_us": (0.0, 1e9), "inter_latency_us": (0.0, 1e9)}
"""What a plan file's cluster may hold: positive rates (no division by zero) bounded so that
transfer and compute times stay finite."""

SHARDED = -1
"""`Segment.cp_rank` value: the segment is sharded over the pipeline's whole CP group."""


@dataclass(frozen=True, order=True)
class Segment:
    """Tokens [start, stop) of sequence `seq_id`; context is [0, start)."""

    seq_id: int
    start: int
    stop: int
    cp_rank: int = SHARDED
    """Which CP rank holds the segment whole, or SHARDED (-1) to split it over the CP group
    (Skrull's distributed sequences). With cp = 1 both mean the same."""

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    @property
    def context(self) -> int:
        return self.start

    def __str__(self) -> str:
        place = "" if self.cp_rank == SHARDED else f"@{self.cp_rank}"
        return f"{self.seq_id}[{self.start}:{self.stop}]{place}"

    @classmethod
    def parse(cls, text: str) -> Segment:
        m = re.fullmatch(r"([0-9]+)\[([0-9]+):([0-9]+)\](?:@([0-9]+))?", text.strip())
        if not m:
            raise UserError(f"bad segment {text!r}: expected SEQ[START:STOP] or SEQ[START:STOP]@RANK")
        rank = SHARDED if m.group(4) is None else int(m.group(4))
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)), rank)


@dataclass(frozen=True)
class Chunk:
    """One packed row: segments laid end to end, attention causal within each segment's
    sequence only. `pad_to` > num_tokens means a padded micro-batch (padding baseline): its k
    segments are each padded to pad_to / k tokens, and the padding costs compute."""

    segments: tuple[Segment, ...]
    pad_to: int = 0

    # Cached: planners and the simulator ask a packed row of hundreds of segments for its
    # tokens and pairs many times per plan (the chunk is frozen, so the sums never change).
    @cached_property
    def num_tokens(self) -> int:
        return sum(s.stop - s.start for s in self.segments)

    @cached_property
    def attention_pairs(self) -> int:
        """Causal (query, key) pairs of its segments, unpadded: position p of a sequence sees
        p + 1 keys, so a segment [start, stop) has (stop(stop+1) - start(start+1)) / 2."""
        return sum((s.stop * (s.stop + 1) - s.start * (s.start + 1)) // 2 for s in self.segments)

    @property
    def row_tokens(self) -> int:
        """Tokens the row occupies, padding included."""
        return max(self.num_tokens, self.pad_to)

    def __str__(self) -> str:
        body = "+".join(str(s) for s in self.segments)
        return f"{body}/pad{self.pad_to}" if self.pad_to else body

    @classmethod
    def parse(cls, text: str) -> Chunk:
        body, _, pad = text.partition("/pad")
        if pad and not re.fullmatch(r"[0-9]+", pad):
            raise UserError(f"bad chunk {text!r}: expected SEG+SEG... with an optional /padN")
        segs = tuple(Segment.parse(t) for t in body.split("+") if t)
        return cls(segs, int(pad) if pad else 0)


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule."""

    kind: str
    """F (forward keeping activations), B (backward), N (forward without grad, keeps K/V)."""
    chunk: int
    """Index into the pipeline's chunks (for B: into backward_chunks when present)."""
    recompute_layers: int = 0
    """For F: how many of this stage's layers keep only their input and are recomputed
    before the backward (InfiniPipe's chunk-level checkpointing): its first ones. 0 keeps
    everything."""
    recompute_mlp: int = 0
    """For F: how many of the stage's other layers (the next ones after the `recompute_layers`)
    keep, of their MLP block (post-attention norm, gate, up, SwiGLU, down), only its input and
    recompute it before its backward: selective recomputation, a level between none and full
    that drops the SwiGLU's 2 x ffn values per token (gate and up), the most a layer keeps
    (`cost/memory.py`), and reruns neither the attention nor a CP exchange. 0: none."""

    def __str__(self) -> str:
        suffix = f".r{self.recompute_layers}" if self.recompute_layers else ""
        suffix += f".m{self.recompute_mlp}" if self.recompute_mlp else ""
        return f"{self.kind}{self.chunk}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Action:
        m = re.fullmatch(r"([FBN])([0-9]+)(?:\.r([0-9]+))?(?:\.m([0-9]+))?", text.strip())
        if not m:
            raise UserError(f"bad action {text!r}: expected F3, B3, N3, F3.r2, F3.m2 or F3.r2.m5")
        return cls(m.group(1), int(m.group(2)), int(m.group(3) or 0), int(m.group(4) or 0))


@dataclass
class PipelinePlan:
    """One data-parallel replica: its degrees, chunks, and each stage's action list."""

    chunks: list[Chunk]
    stages: list[list[Action]]
    tp: int = 1
    cp: int = 1
    backward_chunks: list[Chunk] | None = None
    layers_per_stage: list[int] | None = None
    """Layers on each stage; None splits the model's layers evenly."""
    schedule: str = "1f1b"
    """Name of the schedule that generated `stages` (informational)."""
    extra_comm_s: float = 0.0
    """Communication charged to this pipeline outside its stages' actions, seconds
    (e.g. Hydraulis' parameter pull / gradient push between heterogeneous pipelines)."""

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def bwd_units(self) -> list[Chunk]:
        return self.backward_chunks if self.backward_chunks is not None else self.chunks

    def stage_layers(self, num_layers: int) -> list[int]:
        if self.layers_per_stage is not None:
            return list(self.layers_per_stage)
        base, extra = divmod(num_layers, self.pp)
        return [base + (1 if s < extra else 0) for s in range(self.pp)]

    def to_dict(self) -> dict:
        d = {
            "tp": self.tp, "cp": self.cp, "schedule": self.schedule,
            "chunks": [str(c) for c in self.chunks],
            "stages": [" ".join(str(a) for a in acts) for acts in self.stages],
        }
        if self.backward_chunks is not None:
            d["backward_chunks"] = [str(c) for c in self.backward_chunks]
        if self.layers_per_stage is not None:
            d["layers_per_stage"] = list(self.layers_per_stage)
        if self.extra_comm_s:
            d["extra_comm_s"] = self.extra_comm_s
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "pipeline") -> PipelinePlan:
        """A pipeline from its JSON object, every field type- and range-checked."""
        f = Fields(d, where)
        f.only(("tp", "cp", "schedule", "chunks", "stages", "backward_chunks", "layers_per_stage", "extra_comm_s"))
        bwd = f.data.get("backward_chunks")
        layers = f.data.get("layers_per_stage")
        return cls(
            chunks=[Chunk.parse(c) for c in f.array("chunks", item="str")],
            stages=[[Action.parse(a) for a in s.split()] for s in f.array("stages", item="str", min_len=1)],
            tp=f.integer("tp", lo=1, hi=MAX_DEGREE, default=1), cp=f.integer("cp", lo=1, hi=MAX_DEGREE, default=1),
            schedule=f.string("schedule", default="1f1b"),
            backward_chunks=None if bwd is None else [Chunk.parse(c) for c in f.array("backward_chunks", item="str")],
            layers_per_stage=None if layers is None else f.ints("layers_per_stage", lo=0, hi=MAX_DEGREE),
            extra_comm_s=_extra_seconds(f, "extra_comm_s"),
        )


def _extra_seconds(f: Fields, key: str) -> float:
    """A pipeline's extra time, seconds: finite, >= 0 and at most MAX_EXTRA_SECONDS (1e308 s would
    be reported as the step's time)."""
    value = f.number(key, default=0.0)
    if value > MAX_EXTRA_SECONDS:
        raise f.fail(key, f"a number of seconds in [0, {MAX_EXTRA_SECONDS:g}]", value)
    return value


@dataclass
class StepPlan:
    """One global batch's plan: what every pipeline runs, and what the planner predicted."""

    planner: str
    model: ModelSpec
    cluster: ClusterSpec
    lengths: list[int]
    """Token count of each sequence of the global batch, indexed by seq_id."""
    pipelines: list[PipelinePlan]
    zero: int = 1
    """ZeRO stage across the data-parallel group."""
    options: dict = field(default_factory=dict)
    """The planner's options, for the record."""
    metrics: dict = field(default_factory=dict)
    """Predictions (FLOPs per pipeline, padding fraction, planning time ...)."""

    @property
    def num_gpus(self) -> int:
        return sum(p.num_gpus for p in self.pipelines)

    @property
    def loss_tokens(self) -> int:
        """Positions that predict a next token: every token but each sequence's last."""
        if self.lengths and min(self.lengths) >= 1:  # the usual case, at C speed
            return sum(self.lengths) - len(self.lengths)
        return sum(max(n - 1, 0) for n in self.lengths)

    def to_dict(self) -> dict:
        return {
            "format": "lengthwise.stepplan/1",
            "planner": self.planner,
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "zero": self.zero,
            "lengths": list(self.lengths),
            "loss_tokens": self.loss_tokens,
            "options": self.options,
            "metrics": self.metrics,
            "pipelines": [p.to_dict() for p in self.pipelines],
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan") -> StepPlan:
        """A plan from its JSON object, every field type- and range-checked (the invariants
        between fields are `plan.validate.validate_plan`'s)."""
        f = Fields(d, where)
        if f.data.get("format") != "lengthwise.stepplan/1":
            raise UserError("not a lengthwise plan: the JSON lacks format 'lengthwise.stepplan/1'")
        f.only(("format", "planner", "model", "cluster", "zero", "lengths", "loss_tokens", "options", "metrics",
                "pipelines"))
        model = ModelSpec.from_dict(check_spec_fields(ModelSpec, f.mapping("model"), f"{where} model", MODEL_RANGES))
        model.validate()
        cluster = ClusterSpec.from_dict(check_spec_fields(ClusterSpec, f.mapping("cluster"), f"{where} cluster",
                                                      CLUSTER_RANGES))
        cluster.validate()
        lengths = f.ints("lengths", lo=1, hi=MAX_LENGTH, min_len=1)
        recorded = f.integer("loss_tokens", lo=0, default=None) if "loss_tokens" in f.data else None
        if recorded is not None and recorded != sum(n - 1 for n in lengths):
            raise UserError(f"{where}: loss_tokens {recorded} != sum(length - 1) = {sum(n - 1 for n in lengths)} "
                            "over its lengths: the file was edited; plan the batch again")
        pipes = f.array("pipelines", item="dict", min_len=1)
        return cls(
            planner=f.string("planner"), model=model, cluster=cluster, lengths=list(lengths),
            pipelines=[PipelinePlan.from_dict(p, f"{where} pipeline {i}") for i, p in enumerate(pipes)],
            zero=f.integer("zero", lo=0, hi=3, default=1),
            options=check_recorded_options(f.mapping("options", default={}), where),
            metrics=f.mapping("metrics", default={}),
        )

    def to_json(self) -> str:
        return json_text(self.to_dict())

    def save(self, path: str | Path) -> None:
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> StepPlan:
        return read_json(path, "plan", cls.from_dict)

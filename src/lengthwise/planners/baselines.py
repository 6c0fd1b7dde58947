"""Baseline planners: how trainers without length-aware planning build micro-batches.

All of them keep every sequence whole, run a plain 1F1B schedule over the scheme's PP stages, and
give each of the scheme's dp pipelines its own micro-batches. They differ in how micro-batches
are formed and spread over data-parallel ranks:

- `padding`: a fixed number of sequences per micro-batch in sampler order, each padded to the
  longest in its micro-batch (Hydraulis §2.2, fig. 1 left); micro-batches dealt round-robin.
  On a long-tail batch most of each row is padding: one 16K outlier pads its 7 neighbours.
- `packing`: best-fit-decreasing packing into rows of the context length, then the same number
  of packs per DP rank in shuffled order (the Megatron/NeMo/TRL default that SlimPack §6 and
  Hydraulis §2.2 compare against). No padding, but packs with one long sequence cost many
  times a pack of short ones (quadratic attention), so ranks straggle.
- `megatron`: Megatron-LM as ChunkFlow, InfiniPipe, SlimPack and Hydraulis run it for their
  comparisons: the scheme it is given, micro-batches of packed samples of the context length
  filled in sampler order (no sorting), the same count per DP rank, 1F1B, and full activation
  recomputation when a context-length micro-batch does not fit without it (`recompute`); where
  it does not fit even so, micro-batches of the longest length that fits. With
  `micro_batch_size` N, micro-batches of N sequences in sampler order instead, unpacked and
  padded to their longest, memory sized for N context-length sequences (ChunkFlow's Megatron-LM
  ran N = 1: chunkflow.txt §6.1, line 214). As each paper ran it:
  - SlimPack's (slimpack.txt §6.1, line 181: best-fit packing, SlimPack's partial recomputation
    and activation offload "as needed"): `packing` best-fit (best-fit decreasing, packs in
    shuffled order) and `recompute_per_batch`, partial recomputation decided per batch: the
    fewest of 0, 1/4, 1/2, 3/4 or all of each stage's layers with which the simulated step fits. Offload is not modelled
    (the cost model and simulator have no host-memory tier): the baseline is as strong as
    SlimPack's would be only where recomputation alone makes a batch fit.
  - InfiniPipe's (infinipipe.txt §5.1, line 347: micro-batches formed as FlexSP forms them,
    checkpointing set once for the context): best-fit packing, `recompute` auto.
  - ChunkFlow's: `micro_batch_size` 1. Hydraulis' (hydraulis.txt line 279, Table 3): the
    defaults, at Table 3's scheme.
- `sorted`: LongAlign's sorted batching (ChunkFlow §6 "smart batching"): sort by length, cut the
  sorted list into micro-batches of similar lengths that fit the token budget, pad each to its
  longest, deal the micro-batches to ranks in shuffled order. Little padding, same stragglers.
- `static-cp`: DeepSpeed with Ulysses-style static context parallelism as Skrull measured it
  (skrull §6: "DeepSpeed, ZeRO-2, DP=4, CP=8"): every sequence is its own micro-batch, sharded
  over the whole CP group however short, dealt to the DP ranks in sampler order (a distributed
  sampler), 1F1B over the stages. Many small rows: little memory and short bubbles, but short
  sequences pay the CP exchange and small-GEMM efficiency. As Skrull's DeepSpeed ran it
  (skrull.txt line 92, ZeRO-2): `grad_reduce` micro-batch, a gradient reduce-scatter over
  dp x cp after every micro-batch's backward, in bf16 and charged serially (DeepSpeed's
  defaults for a bf16 run under ZeRO-2, `micro_batch_reduction_s`); the default, `step`,
  reduces once as the other baselines do.
- `token-balanced`: verl-style balancing: Karmarkar-Karp splits the sequences over DP ranks by
  token count, then each rank packs its share best-fit-decreasing. Equal tokens per rank, but
  not equal attention FLOPs.

Cost, n sequences over D pipelines: padding and static-cp O(n), packing and sorted O(n log n) (a sort, then
best-fit by bisection over open bins), megatron O(n) next-fit and O(n log n) best-fit (with
`recompute_per_batch`, up to 5 simulations of the plan), token-balanced Karmarkar-Karp O(n log n)
in the usual case (packing_utils) plus best-fit-decreasing per rank; schedules are made once per
distinct pipeline shape.

Every baseline takes `recompute` (none / mlp / full / auto, default auto; megatron's auto can be
decided per batch, `recompute_per_batch`): auto takes the cheapest level with which the longest
sequence fits 1F1B: none, else every layer's MLP block recomputed (`F3.m14`: the SwiGLU's
tensors, most of a layer's, dropped for a rerun of the gate and up projections), else every
layer whole. megatron's auto, the papers' Megatron-LM, chooses between none and full only, for a
context-length micro-batch: the selective recomputation those runs had was Megatron's
core-attention recomputation, which frees nothing with flash attention (it saves no scores);
`recompute mlp` gives it the MLP level (Megatron-Core's later `--recompute-modules mlp`).

Options: `PaddingOptions`, `PackingOptions`, `MegatronOptions`, `StaticCPOptions`,
`SortedOptions`, `TokenBalancedOptions` in planners/options.py.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace

from lengthwise.errors import UserError
from lengthwise.cost import memory as mem
from lengthwise.cost.model import RECOMPUTE_LEVELS, split_layers
from lengthwise.plan.ir import Chunk, StepPlan
from lengthwise.planners.base import (
    PlanRequest, check_lengths, check_request, finish_plan, pipelines_from_chunks, recompute_forwards,
    take_options, whole,
)
from lengthwise.planners.packing_utils import best_fit_decreasing, karmarkar_karp, split_to_multiple
from lengthwise.sim import simulate_plan


PAPER_BASELINES: dict[str, tuple[str, dict]] = {
    # chunkflow.txt §6.1 (line 214): Megatron-LM at a micro-batch size of 1, one unpacked sequence each
    "chunkflow": ("megatron", {"micro_batch_size": 1}),
    # skrull.txt §5 (line 92): DeepSpeed with ZeRO-2, reduce-scattering gradients after every micro-batch
    # (in bf16, serially: DeepSpeed's defaults, `micro_batch_reduction_s`)
    "skrull": ("static-cp", {"grad_reduce": "micro-batch"}),
    # slimpack.txt §6.1 (line 181): Megatron-LM with best-fit packing and partial recomputation as needed
    # (per batch here); its activation offload is not modelled
    "slimpack": ("megatron", {"packing": "best-fit", "recompute_per_batch": True}),
    # infinipipe.txt §5.1 (line 347): micro-batches "as FlexSP" forms them (best-fit packing here: FlexSP's
    # rule is not in the text), checkpointing fixed once for the context (`recompute` auto)
    "infinipipe": ("megatron", {"packing": "best-fit"}),
    # hydraulis.txt §8.1 (line 279): Megatron-LM with one static strategy (Table 3's), its defaults
    "hydraulis": ("megatron", {}),
}
"""Paper -> (baseline planner, its options): the baseline each paper measured its speedups
against, as that paper ran it, selectable by the paper's name."""


def deal(items: list, k: int) -> list[list]:
    """Round-robin: item i goes to group i mod k."""
    return [items[r::k] for r in range(k)]


def padded_chunk(seq_ids: list[int], lengths: list[int]) -> Chunk:
    """A micro-batch of whole sequences, each padded to the longest (row = count x longest)."""
    longest = max(lengths[i] for i in seq_ids)
    row = len(seq_ids) * longest
    real = sum(lengths[i] for i in seq_ids)
    return Chunk(whole(seq_ids, lengths), pad_to=row if row > real else 0)


def packed_chunk(seq_ids: list[int], lengths: list[int]) -> Chunk:
    return Chunk(whole(seq_ids, lengths))


def _check_padded_fits(groups: list[list[int]], lengths: list[int], budget: int, mbs: int) -> None:
    for g, ids in enumerate(groups):
        row = len(ids) * max(lengths[i] for i in ids)
        if row > budget:
            raise UserError(
                f"micro_batch_size {mbs} pads micro-batch {g} to {len(ids)} x "
                f"{max(lengths[i] for i in ids)} = {row} tokens > {budget} that fit one pipeline: "
                f"lower micro_batch_size"
            )


def plan_padding(request: PlanRequest) -> StepPlan:
    """Fixed-size micro-batches in sampler order, padded to their longest (Hydraulis §2.2)."""
    started = time.perf_counter()
    opts = take_options(request, "padding")
    limit, level = baseline_limit(request, opts.recompute)
    lengths = request.lengths
    # Default: as many rows of the batch's longest sequence as one pipeline's memory holds.
    default = max(1, limit // max(lengths, default=1))
    mbs = opts.micro_batch_size or default
    groups = [list(range(i, min(i + mbs, len(lengths)))) for i in range(0, len(lengths), mbs)]
    _check_padded_fits(groups, lengths, limit, mbs)
    chunks = [padded_chunk(g, lengths) for g in groups]
    pipelines = with_recompute(request, pipelines_from_chunks(request, deal(chunks, request.scheme.dp)), level)
    return finish_plan(request, pipelines, planner="padding", started=started,
                       options={"micro_batch_size": mbs, "recompute": level})


def plan_packing(request: PlanRequest) -> StepPlan:
    """Best-fit-decreasing packs of the context length, an equal count per DP rank."""
    started = time.perf_counter()
    opts = take_options(request, "packing")
    limit, level = baseline_limit(request, opts.recompute)
    capacity = min(request.context_length, limit)
    lengths, dp = request.lengths, request.scheme.dp
    bins = split_to_multiple(best_fit_decreasing(lengths, capacity), lengths, dp)
    # The data loader sees packs in random order; ranks take consecutive ones.
    random.Random(request.seed).shuffle(bins)
    chunks = [packed_chunk(b, lengths) for b in bins]
    pipelines = with_recompute(request, pipelines_from_chunks(request, deal(chunks, dp)), level)
    return finish_plan(request, pipelines, planner="packing", started=started,
                       options={"pack_tokens": capacity, "recompute": level})


def baseline_limit(request: PlanRequest, choice: str, *, auto: tuple[str, ...] = RECOMPUTE_LEVELS) -> tuple[int, str]:
    """(tokens one pipeline holds, recomputation level) for a baseline's `recompute` option
    (`choice`, checked by `BaselineOptions`): `none` keeps every activation, `mlp` drops every
    layer's MLP block's tensors, `full` keeps each layer's input only, `auto` the cheapest of
    the levels `auto` (cheapest first) with which the longest sequence fits. UserError when the
    longest sequence fits at none of them."""
    check_lengths(request)
    longest = max(request.lengths)
    if choice == "none":
        return check_request(request), "none"
    levels = auto if choice == "auto" else (choice,)
    s = request.scheme
    for level in levels:
        limit = int(request.cost.max_seq_len(tp=s.tp, pp=s.pp, cp=s.cp, dp=s.dp, zero=s.zero, recompute=level))
        if longest <= limit:
            return limit, level
    raise UserError(
        f"sequence {request.lengths.index(longest)} has {longest} tokens > {limit}, the longest one "
        f"pipeline of {s} can hold even with {levels[-1]} recomputation: raise --tp, --pp or --cp, or use a "
        "splitting planner")


def with_recompute(request: PlanRequest, pipelines: list, level: str) -> list:
    """The pipelines, every stage's forwards recomputing all its layers (`full`) or all their MLP
    blocks (`mlp`), or as they are (`none`)."""
    layers = split_layers(request.model.num_layers, request.scheme.pp)
    if level == "full":
        recompute_forwards(pipelines, layers)
    elif level == "mlp":
        recompute_forwards(pipelines, None, layers)
    return pipelines


def plan_megatron(request: PlanRequest) -> StepPlan:
    """Megatron-LM's packed micro-batches of the context length (or `micro_batch_size` unpacked
    sequences), recomputing when it must."""
    started = time.perf_counter()
    opts = take_options(request, "megatron")
    check_lengths(request)
    lengths, dp = request.lengths, request.scheme.dp
    mbs = opts.micro_batch_size
    per_batch = opts.recompute_per_batch
    if per_batch and opts.recompute != "auto":
        raise UserError(f"megatron: recompute_per_batch decides the recomputation, recompute {opts.recompute} "
                        "fixes it: drop one of them")
    # per batch: micro-batches as large as full recomputation holds, the layers recomputed per batch
    choice = "full" if per_batch else opts.recompute
    if mbs is None:
        level, capacity = _megatron_setting(request, choice)
        if opts.packing == "best-fit":
            bins = split_to_multiple(best_fit_decreasing(lengths, capacity), lengths, dp)
            random.Random(request.seed).shuffle(bins)  # the data loader sees packs in random order
        else:
            bins = split_to_multiple(next_fit(lengths, capacity), lengths, dp)
        chunks = [packed_chunk(b, lengths) for b in bins]
        shape = {"micro_batch_tokens": capacity, "packing": opts.packing}
    else:
        # memory is sized for a micro-batch of mbs context-length sequences, as Megatron-LM's
        # --micro-batch-size and --seq-length do
        sized = replace(request, context_length=mbs * request.context_length)
        level, capacity = _megatron_setting(sized, choice)
        groups = [list(range(i, min(i + mbs, len(lengths)))) for i in range(0, len(lengths), mbs)]
        _check_padded_fits(groups, lengths, capacity, mbs)
        chunks = [padded_chunk(g, lengths) for g in groups]
        shape = {"micro_batch_size": mbs}
    if per_batch:
        return _fewest_recompute(request, chunks, started, shape)
    pipelines = with_recompute(request, pipelines_from_chunks(request, deal(chunks, dp)), level)
    return finish_plan(request, pipelines, planner="megatron", started=started,
                       options={"recompute": level, **shape})


PARTIAL_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Shares of each stage's layers `megatron --recompute-per-batch true` tries, fewest first (SlimPack's
baseline has SlimPack's partial recomputation: slimpack.txt line 181; its levels are SlimPack's)."""


def _fewest_recompute(request: PlanRequest, chunks: list[Chunk], started: float, shape: dict) -> StepPlan:
    """This batch's micro-batches with the fewest recomputed layers (PARTIAL_SHARES of each
    stage's) whose simulated step fits memory, decided per batch as a user of Megatron-LM's
    partial recomputation tunes it to the memory; all layers when none fits (the validator then
    reports what does not fit). Activation offload, the other memory saver SlimPack's baseline
    has, is not modelled: the cost model and simulator have no host-memory tier."""
    layers = split_layers(request.model.num_layers, request.scheme.pp)
    levels: list[list[int]] = []
    for share in PARTIAL_SHARES:
        level = [min(n, math.ceil(share * n - 1e-9)) for n in layers]
        if level not in levels:
            levels.append(level)
    plan = None
    for level in levels:
        pipelines = recompute_forwards(pipelines_from_chunks(request, deal(chunks, request.scheme.dp)), level)
        name = "none" if not any(level) else "full" if level == layers else "partial"
        plan = finish_plan(request, pipelines, planner="megatron", started=started,
                           options={"recompute": name, **shape})
        plan.metrics["recompute_layers"] = level
        if simulate_plan(plan, request.cost).fits:
            break
    return plan


def plan_static_cp(request: PlanRequest) -> StepPlan:
    """One sequence per micro-batch, each sharded over the CP group, dealt in sampler order; with
    `grad_reduce` micro-batch, the gradients reduced after every micro-batch (DeepSpeed ZeRO-2)."""
    started = time.perf_counter()
    opts = take_options(request, "static-cp")
    _, level = baseline_limit(request, opts.recompute)
    chunks = [packed_chunk([i], request.lengths) for i in range(len(request.lengths))]
    pipelines = with_recompute(request, pipelines_from_chunks(request, deal(chunks, request.scheme.dp)), level)
    if opts.grad_reduce == "micro-batch":
        per_reduction = micro_batch_reduction_s(request)
        for pipe in pipelines:
            # the simulator charges the reduction after the last backward; the others come here
            pipe.extra_comm_s = per_reduction * max(0, len(pipe.chunks) - 1)
    return finish_plan(request, pipelines, planner="static-cp", started=started,
                       options={"recompute": level, "grad_reduce": opts.grad_reduce})


def micro_batch_reduction_s(request: PlanRequest) -> float:
    """Seconds of one micro-batch's gradient reduction over dp x cp, the slowest stage's.

    Skrull's baseline is DeepSpeed with ZeRO-2 (skrull.txt line 92; the text says no more about
    it). ZeRO-2 reduce-scatters the gradients during every micro-batch's backward, in buckets,
    in DeepSpeed's communication dtype, which for a bf16 run (Qwen2.5 on H100s; the paper
    names no precision) is bf16 unless `communication_data_type` is set: 2 bytes a gradient,
    half the fp32 the step's reduction is charged (`grad_sync_time`). DeepSpeed's
    `overlap_comm` defaults to off below ZeRO-3, so each bucket's reduction runs on the compute
    stream and the micro-batch waits for it: serial. (Turned on, it could hide at most the
    micro-batch's own backward: in the compare suite's Skrull scenarios about 6% of a 7B
    micro-batch's reduction on LMSys, 20-30% on LMSys at 0.5B and ChatQA2 at 7B, and about all
    of it on ChatQA2 at 0.5B.) Each micro-batch but the last adds one such
    reduction, charged after the pipeline's last backward (PipelinePlan.extra_comm_s); the
    last is the step's reduction the simulator charges every plan."""
    s = request.scheme
    ranks = s.dp * s.cp
    if ranks <= 1:
        return 0.0
    inter = s.num_gpus > request.cluster.gpus_per_node
    layers = split_layers(request.model.num_layers, s.pp)
    return max(request.cost.grad_sync_time(layers=n, tp=s.tp, dp=ranks, zero=s.zero, inter_node=inter,
                                           first=i == 0, last=i == len(layers) - 1, bytes_per_grad=mem.BYTES_BF16)
               for i, n in enumerate(layers))


def next_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequences in sampler order into rows of at most `capacity` tokens, a new row whenever the
    next one does not fit (Megatron-LM's packed dataset fills rows as samples come)."""
    rows: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if rows[-1] and used + n > capacity:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def _megatron_setting(request: PlanRequest, choice: str) -> tuple[str, int]:
    """(recomputation level, tokens per packed micro-batch). Context-length micro-batches;
    `auto` recomputes every layer only when one does not fit 1F1B without (pp - s in flight
    on stage s, `CostModel.max_seq_len`: what the simulator charges, the backward's working set
    included). Where the chosen setting cannot hold a context-length micro-batch, micro-batches
    shrink to the longest it holds, as a Megatron-LM user lowers --seq-length to the memory;
    `baseline_limit` names the sequence when even the longest one does not fit."""
    if choice == "auto":
        s = request.scheme
        plain = request.cost.max_seq_len(tp=s.tp, pp=s.pp, cp=s.cp, dp=s.dp, zero=s.zero)
        choice = "none" if request.context_length <= plain else "full"
    limit, level = baseline_limit(request, choice)
    return level, min(request.context_length, limit)


def _sorted_groups(lengths: list[int], budget: int, mbs: int | None) -> list[list[int]]:
    """Longest first; a micro-batch grows while its padded row (count x its longest) fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # Descending order: the group's first sequence is its longest.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget \
                and (mbs is None or len(groups[-1]) < mbs):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def plan_sorted(request: PlanRequest) -> StepPlan:
    """LongAlign sorted batching: similar lengths per micro-batch, batches in random order."""
    started = time.perf_counter()
    opts = take_options(request, "sorted")
    limit, level = baseline_limit(request, opts.recompute)
    budget = min(request.context_length, limit)
    mbs = opts.micro_batch_size
    groups = _sorted_groups(request.lengths, budget, mbs)
    random.Random(request.seed).shuffle(groups)
    chunks = [padded_chunk(g, request.lengths) for g in groups]
    pipelines = with_recompute(request, pipelines_from_chunks(request, deal(chunks, request.scheme.dp)), level)
    return finish_plan(request, pipelines, planner="sorted", started=started,
                       options={"micro_batch_size": mbs, "row_tokens": budget, "recompute": level})


def plan_token_balanced(request: PlanRequest) -> StepPlan:
    """Karmarkar-Karp over DP ranks by token count, then best-fit-decreasing packs per rank."""
    started = time.perf_counter()
    opts = take_options(request, "token-balanced")
    limit, level = baseline_limit(request, opts.recompute)
    capacity = min(request.context_length, limit)
    lengths = request.lengths
    shares = karmarkar_karp(lengths, request.scheme.dp, equal_count=opts.equal_count)
    per_pipeline = []
    for share in shares:
        bins = best_fit_decreasing([lengths[i] for i in share], capacity)
        per_pipeline.append([packed_chunk([share[j] for j in b], lengths) for b in bins])
    pipelines = with_recompute(request, pipelines_from_chunks(request, per_pipeline), level)
    return finish_plan(request, pipelines, planner="token-balanced", started=started,
                       options={"pack_tokens": capacity, "equal_count": opts.equal_count, "recompute": level})

"""Training: AdamW over planned global batches, planning one step ahead, resumable exactly.

    from lengthwise.runtime.train.loop import train
    from lengthwise.runtime.train.config import TrainConfig
    result = train(TrainConfig(steps=50, metrics="metrics.jsonl", out="ckpt", save_every=10))
    [r.loss for r in result.records]

A step: the sampler's next global batch -> its token ids and the planner's validated StepPlan
-> forward and backward as the plan says (`train/step.forward_backward`; loss = summed token
cross-entropy / the batch's loss tokens, so equal to unpacked training whatever the plan) ->
gradient clipping -> AdamW -> one metrics line, the progress bar, maybe a checkpoint.

Planning runs ahead of training (DESIGN.md, Executor): while step n executes, one worker
thread reads batch n+1's tokens and plans it. A plan depends only on the batch and the seed
(planner seed = run seed + batch index), never on timing, so results are the same whether
planning is hidden or not; `wait_ms` in the metrics shows whether it was.

Resume: a checkpoint after step n holds the weights, the AdamW state, the RNG states and the
sampler position after batch n (not after the prefetched batch n+1), so a run resumed from it
draws, plans and computes exactly what the uninterrupted run did: the final weights are
bit-identical (tests/test_train.py).

Executors. The loop above is shared; what runs a step's plan is an executor (train/executor.py).
`LocalExecutor`: this process runs every pipeline and stage (`run_step`), AdamW over all
parameters, checkpoints in runtime/checkpoint.py. `train/dist.RankExecutor`: one rank of
dp * pp * cp processes runs its stage (`run_rank_step`), AdamW over the parameters it holds,
clipping by the global norm, checkpoints through torch.distributed.checkpoint; only rank 0
writes metrics and the progress bar.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lengthwise.cost import CostModel
from lengthwise.errors import UserError
from lengthwise.plan.ir import StepPlan
from lengthwise.plan.validate import validate_plan
from lengthwise.planners import PlanRequest, get_planner
from lengthwise.runtime.model import CausalLM, build_model
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.executor import Executor, LocalExecutor, PreparedStep
from lengthwise.runtime.weights import INDEX_NAME, WEIGHTS_NAME, load_weights
from lengthwise.specs import (
    MODEL_PRESETS,
    ModelSpec,
    ParallelScheme,
    cluster_preset,
    model_preset,
)
from lengthwise.workloads.sampler import GlobalBatch, GlobalBatchSampler
from lengthwise.workloads.source import LengthSource, corpus_source


@dataclass(kw_only=True)
class StepRecord:
    """What one optimizer step did; `metrics()` is its metrics-file line."""

    step: int
    """Steps completed, counting from 1."""
    loss: float
    """Mean token cross-entropy of the global batch (nats), before the update."""
    tokens: int
    """Real tokens in the global batch."""
    seq_ids: tuple[int, ...]
    """The batch's sequences (corpus indices), in sampler order."""
    step_s: float
    """Wall time of the step, seconds, waiting for its plan included."""
    wait_ms: float
    """Of that, time spent waiting for the planning thread, milliseconds."""
    planning_ms: float
    """Time the planner (and plan validation) took in the worker thread, milliseconds."""
    peak_memory_bytes: int
    """Saved-for-backward bytes (CPU) or CUDA max_memory_allocated, this step (the largest
    over the ranks of a distributed run)."""
    memory_kind: str
    """saved_for_backward or cuda_max_allocated."""
    grad_norm: float
    """Global gradient 2-norm before clipping."""
    planner: str
    """Planner that made the step's plan."""
    padding_fraction: float
    """Padding share of the plan's row tokens."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    def metrics(self) -> dict:
        return {"step": self.step, "loss": self.loss, "tokens": self.tokens,
                "sequences": len(self.seq_ids), "tokens_per_s": self.tokens_per_s,
                "step_s": self.step_s, "peak_memory_bytes": self.peak_memory_bytes,
                "memory_kind": self.memory_kind, "planning_ms": self.planning_ms,
                "wait_ms": self.wait_ms, "grad_norm": self.grad_norm, "planner": self.planner,
                "padding_fraction": self.padding_fraction}


@dataclass(kw_only=True)
class TrainResult:
    """A finished run (or the part of it this call ran)."""

    model: CausalLM | None
    """The trained model; None for a distributed run (each rank held a part; the weights are
    in its checkpoints)."""
    records: list[StepRecord] = field(default_factory=list)
    """One per step this call ran."""
    start_step: int = 0
    """Steps already done when this call began (from a checkpoint)."""
    checkpoint: Path | None = None
    """The last checkpoint written, if any."""
    resumed_from: Path | None = None
    """The checkpoint this call resumed from, if any."""
    nproc: int = 1
    """Processes that ran the steps."""


class Setup:
    """Everything a run builds once: data, model, optimizer, and how to plan a batch."""

    def __init__(self, config: TrainConfig, *, device: torch.device | None = None):
        config.validate()
        self.config = config
        self.planner = get_planner(config.planner)  # an unknown name fails before any work
        self.device = device or resolve_device(config.device)
        if config.threads is not None or self.device.type == "cpu":
            torch.set_num_threads(config.threads or 1)
        self.spec = model_preset(config.model)
        self.scheme = ParallelScheme(dp=config.dp, pp=config.pp, cp=config.cp)
        self.scheme.validate(self.spec)
        self.model = load_model(config.model, self.spec, dtype=getattr(torch, config.dtype),
                                device=self.device, seed=config.seed)
        self.source = corpus_source(config.data, config.tokenizer, config.context_length,
                                    config.overlong, text_field=config.text_field)
        _check_vocab(self.source, self.spec)
        self.sampler = GlobalBatchSampler(self.source, seed=config.seed, **config.sampler_size)

    def prepare(self, batch: GlobalBatch, sampler_state: dict) -> PreparedStep:
        """Token ids and the validated plan of `batch` (runs on the worker thread)."""
        token_ids = [torch.as_tensor(self.source.tokens(i), dtype=torch.long) for i in batch.seq_ids]
        started = time.perf_counter()
        plan = self.plan(batch)
        return PreparedStep(batch=batch, plan=plan, token_ids=token_ids, sampler_state=sampler_state,
                         planning_ms=(time.perf_counter() - started) * 1e3)

    def plan(self, batch: GlobalBatch) -> StepPlan:
        """The validated plan of `batch`: a function of the batch and the run's seed only."""
        cluster = cluster_preset(self.config.cluster, self.scheme.num_gpus)
        cost = CostModel(model=self.spec, cluster=cluster)
        request = PlanRequest(lengths=list(batch.lengths), model=self.spec, cluster=cluster,
                              scheme=self.scheme, cost=cost, context_length=self.config.context_length,
                              seed=self.config.seed + batch.index, options=dict(self.config.options))
        plan = self.planner(request)
        validate_plan(plan, cost)
        return plan


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu; cuda without a GPU is a UserError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: this torch sees no CUDA GPU; use --device cpu or auto")
    return torch.device(name)


def load_model(name: str, spec: ModelSpec, *, dtype: torch.dtype, device: torch.device,
               seed: int) -> CausalLM:
    """A preset or config.json: seeded random weights. A directory: its model.safetensors,
    read by Hugging Face names (runtime/weights.py)."""
    if name in MODEL_PRESETS or not Path(name).is_dir():
        return build_model(spec, dtype=dtype, device=device, seed=seed)
    if not any((Path(name) / file).exists() for file in (WEIGHTS_NAME, INDEX_NAME)):
        raise UserError(f"--model {name}: the directory holds no {WEIGHTS_NAME}; give a "
                        f"directory with config.json and {WEIGHTS_NAME}, or a config.json "
                        f"file to start from random weights")
    model = build_model(spec, dtype=dtype, device=device)  # every weight is overwritten
    load_weights(model, name)
    return model


def _check_vocab(source: LengthSource, spec: ModelSpec) -> None:
    vocab = source.corpus.vocab_size
    if vocab > spec.vocab:
        raise UserError(f"the tokenizer has {vocab} ids > the model's vocab_size {spec.vocab}: "
                        f"use a matching --tokenizer or --model")


def make_optimizer(model: CausalLM, config: TrainConfig, *,
                   held: Iterable[torch.nn.Parameter] | None = None) -> torch.optim.AdamW:
    """AdamW over `held` (default: all of the model's parameters); weight decay on matrices
    (embeddings included), none on norms and biases."""
    params = list(model.parameters() if held is None else held)  # tied weights appear once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr)


def train(config: TrainConfig) -> TrainResult:
    """Run `config` to config.steps total steps on this process, resuming from a checkpoint
    when there is one."""
    setup = Setup(config)
    return run_training(setup, LocalExecutor(config, setup.model, make_optimizer(setup.model, config)))


def run_training(setup: Setup, executor: Executor) -> TrainResult:
    """The loop every executor shares: resume, then plan one step ahead and run to config.steps."""
    result = TrainResult(model=executor.result_model, nproc=executor.nproc)
    result.resumed_from = _resume_path(setup.config, executor)
    if result.resumed_from is not None:
        result.start_step = _resume(setup, executor, result.resumed_from)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lengthwise-plan") as pool:
        _loop(setup, executor, result, pool)
    return result


def _resume_path(config: TrainConfig, executor: Executor) -> Path | None:
    if config.resume is not None:
        if not Path(config.resume).is_dir():
            raise UserError(f"--resume {config.resume}: no such directory")
        return Path(config.resume)
    return None if config.out is None else executor.latest_checkpoint(config.out)


def _resume(setup: Setup, executor: Executor, path: Path) -> int:
    trainer = executor.load(path)
    saved = trainer["config"]
    for key in executor.must_match:
        if saved.get(key) != getattr(setup.config, key):
            raise UserError(f"checkpoint {path} was trained with {key}={saved.get(key)!r}, this run "
                            f"has {getattr(setup.config, key)!r}; resume with the same value")
    setup.sampler.load_state_dict(trainer["sampler"])
    return int(trainer["step"])


def _loop(setup: Setup, executor: Executor, result: TrainResult, pool: ThreadPoolExecutor) -> None:
    config, step = setup.config, result.start_step
    if step >= config.steps:
        return
    progress = _progress_bar(config, step, executor.is_reporter)
    ahead = _submit(setup, pool)
    try:
        while step < config.steps:
            started = time.perf_counter()
            prepared = ahead.result()
            waited = time.perf_counter() - started
            step += 1
            if step < config.steps:
                ahead = _submit(setup, pool)  # plan step n+1 while step n runs
            record = _run_step(setup, executor, prepared, step, started, waited)
            result.records.append(record)
            if executor.is_reporter:
                _report(config, record, progress)
            if _checkpoint_due(config, step):
                result.checkpoint = _save(setup, executor, step, prepared, record)
    finally:
        ahead.cancel()
        progress.close()


def _submit(setup: Setup, pool: ThreadPoolExecutor) -> Future:
    batch = setup.sampler.next_batch()
    return pool.submit(setup.prepare, batch, setup.sampler.state_dict())


def _run_step(setup: Setup, executor: Executor, prepared: PreparedStep, step: int, started: float,
              waited: float) -> StepRecord:
    outcome = executor.step(prepared, step)
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)
    batch = prepared.batch
    return StepRecord(step=step, loss=outcome.loss, tokens=batch.num_tokens, seq_ids=batch.seq_ids,
                      step_s=time.perf_counter() - started, wait_ms=waited * 1e3,
                      planning_ms=prepared.planning_ms, peak_memory_bytes=outcome.peak_memory_bytes,
                      memory_kind=outcome.memory_kind, grad_norm=outcome.grad_norm,
                      planner=prepared.plan.planner,
                      padding_fraction=float(prepared.plan.metrics.get("padding_fraction", 0.0)))


def _progress_bar(config: TrainConfig, step: int, shown: bool):
    from tqdm import tqdm

    return tqdm(total=config.steps, initial=step, desc="train", unit="step",
                disable=not (config.progress and shown), dynamic_ncols=True)


def _report(config: TrainConfig, record: StepRecord, progress) -> None:
    progress.set_postfix(loss=f"{record.loss:.4f}", tok_s=f"{record.tokens_per_s:,.0f}", refresh=False)
    progress.update(1)
    if config.metrics is not None:
        path = Path(config.metrics)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record.metrics()) + "\n")


def _checkpoint_due(config: TrainConfig, step: int) -> bool:
    if config.out is None:
        return False
    return step == config.steps or (config.save_every is not None and step % config.save_every == 0)


def _save(setup: Setup, executor: Executor, step: int, prepared: PreparedStep, record: StepRecord) -> Path:
    trainer = {"sampler": prepared.sampler_state, "config": setup.config.to_dict(),
               "loss": record.loss}
    return executor.save(step, trainer)

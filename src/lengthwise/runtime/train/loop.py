"""Training: AdamW over planned global batches, planning one step ahead, resumable exactly.

    from lengthwise.runtime.train.config import TrainConfig
    from lengthwise.runtime.train.loop import train
    result = train(TrainConfig(steps=50, metrics="metrics.jsonl", out="ckpt", save_every=10))
    [r.loss for r in result.records]

A step: the sampler's next global batch -> its token ids and the planner's validated StepPlan
-> forward and backward as the plan says (`train/step.forward_backward`; loss = summed token
cross-entropy / the batch's loss tokens, so equal to unpacked training whatever the plan) ->
gradient clipping -> AdamW at the scheduled learning rate (schedule.py) -> maybe the
held-out loss (heldout.py) -> maybe a checkpoint -> then one metrics line and the progress
bar (report.py), so the metrics file never runs ahead of the checkpoints. A step whose
loss or gradient norm is not finite makes no update and stops the run with a UserError naming
it (or is skipped and counted, with skip_nonfinite): nothing non-finite is ever saved.

Stopping: SIGINT / SIGTERM only set a flag (signals.py), read between steps; the run
then checkpoints the finished step and returns with `interrupted` set. Ranks of a distributed
run agree on the flag at every step boundary, so all stop after the same step. The output
folder is locked for the run (outputs.py), debris of killed saves is removed, and on
resume the metrics file is trimmed to the resumed step.

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
dp * pp * cp * tp processes runs its stage (`run_rank_step`), AdamW over its shards of it,
clipping by the global norm, checkpoints through torch.distributed.checkpoint; only rank 0
writes metrics and the progress bar.
"""

from __future__ import annotations

import contextlib
import math
import sys
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
from lengthwise.planners.hydraulis.cost import pipelines_name
from lengthwise.runtime.compile import compile_layers, compile_wanted
from lengthwise.runtime.model import CausalLM, build_model
from lengthwise.runtime.train.config import TrainConfig
from lengthwise.runtime.train.executor import Executor, LocalExecutor, PreparedStep
from lengthwise.runtime.finite import check_saveable
from lengthwise.runtime.train.heldout import hold_out
from lengthwise.runtime.train.memory_check import check_memory, estimate_memory
from lengthwise.runtime.train.outputs import OutputLock, owns_metrics, remove_debris, save_tokenizer, trim_metrics
from lengthwise.runtime.train.report import Reporter, StepRecord, nonfinite_message
from lengthwise.runtime.train.resume_check import check_same, setting_changes, trainer_state
from lengthwise.runtime.train.schedule import apply_settings, current_lr, make_scheduler
from lengthwise.runtime.train.signals import StopRequest
from lengthwise.runtime.weights import INDEX_NAME, WEIGHTS_NAME, load_weights
from lengthwise.unreadable import refuse_unreadable
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
    config: TrainConfig | None = None
    """The configuration run (with the output folder chosen for it)."""
    interrupted: bool = False
    """A signal stopped the run early (after its checkpoint, when it has an output folder)."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite loss or gradient norm (skip_nonfinite)."""


class Setup:
    """Everything a run builds once: data, model, optimizer, and how to plan a batch."""

    def __init__(self, config: TrainConfig, *, device: torch.device | None = None, whole_model: bool = True):
        """`whole_model`: build the whole model here (one process); a rank of a distributed run
        builds only its stage's part itself (`train/dist.RankExecutor`), `model` stays None."""
        config.validate()
        self.config = config
        self.planner = get_planner(config.planner)  # an unknown name fails before any work
        self.device = device or resolve_device(config.device)
        if config.threads is not None or self.device.type == "cpu":
            torch.set_num_threads(config.threads or 1)
        self.spec = model_preset(config.model)
        self.scheme = ParallelScheme(dp=config.dp, pp=config.pp, cp=config.cp, tp=config.tp, zero=config.zero)
        self.scheme.validate(self.spec)
        need = estimate_memory(config, self.spec, nproc=config.nproc or 1, rank_part=not whole_model)
        check_memory(need, self.device)
        self.model = load_model(config.model, self.spec, dtype=getattr(torch, config.dtype),
                                device=self.device, seed=config.seed) if whole_model else None
        if self.model is not None and compile_wanted(True if config.compile_chain else config.compile, self.device):
            compile_layers(self.model, chain=config.compile_chain)
        self.source = corpus_source(config.data, config.tokenizer, config.context_length,
                                    config.overlong, text_field=config.text_field, cache_dir=config.token_cache)
        _check_vocab(self.source, self.spec)
        self.eval_ids: tuple[int, ...] = ()
        """Corpus indices of the held-out sequences (config.eval_every), never trained on."""
        if config.eval_every is not None:
            self.source, self.eval_ids = hold_out(self.source, count=config.eval_sequences, seed=config.seed)
        self.sampler = GlobalBatchSampler(self.source, seed=config.seed, **config.sampler_size)
        self.previous_strategy: str | None = None
        """The pipelines of the last plan (--planner hydraulis; a resumed run: the checkpoint's)."""

    def prepare(self, batch: GlobalBatch, sampler_state: dict) -> PreparedStep:
        """Token ids and the validated plan of `batch` (runs on the worker thread)."""
        token_ids = [torch.as_tensor(self.source.tokens(i), dtype=torch.long) for i in batch.seq_ids]
        started = time.perf_counter()
        plan = self.plan(batch)
        return PreparedStep(batch=batch, plan=plan, token_ids=token_ids, sampler_state=sampler_state,
                         planning_ms=(time.perf_counter() - started) * 1e3)

    def plan(self, batch: GlobalBatch, *, options: dict | None = None) -> StepPlan:
        """The validated plan of `batch`: a function of the batch and the run's seed only, and
        for --planner hydraulis choosing its strategy also of the strategy planned before it
        (`previous_strategy`, passed as the `previous` option: a switch is charged).
        `options`: planner options instead of the run's (a test switching strategies)."""
        cluster = cluster_preset(self.config.cluster, self.config.num_ranks)
        cost = CostModel(model=self.spec, cluster=cluster, sequence_parallel=self.config.sequence_parallel)
        options = dict(self.config.options if options is None else options)
        hydraulis = self.config.planner == "hydraulis"
        if hydraulis and self.previous_strategy is not None and not options.get("pipelines"):
            options.setdefault("previous", self.previous_strategy)
        request = PlanRequest(lengths=list(batch.lengths), model=self.spec, cluster=cluster,
                              scheme=self.scheme, cost=cost, context_length=self.config.context_length,
                              seed=self.config.seed + batch.index, options=options)
        plan = self.planner(request)
        validate_plan(plan, cost)
        if hydraulis:
            self.previous_strategy = pipelines_name(plan.pipelines)
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
    if weights_folder(name) is None:
        return build_model(spec, dtype=dtype, device=device, seed=seed)
    model = build_model(spec, dtype=dtype, device=device)  # every weight is overwritten
    load_weights(model, name)
    return model


def weights_folder(name: str) -> str | None:
    """`name` when --model names a folder of Hugging Face weights; None for a preset or a
    config.json (seeded random weights). A folder without weights is a UserError."""
    if name in MODEL_PRESETS or not Path(name).is_dir():
        return None
    if not any((Path(name) / file).exists() for file in (WEIGHTS_NAME, INDEX_NAME)):
        raise UserError(f"--model {name}: the directory holds no {WEIGHTS_NAME}; give a "
                        f"directory with config.json and {WEIGHTS_NAME}, or a config.json "
                        f"file to start from random weights")
    return name


def data_notes(source: LengthSource, config: TrainConfig) -> list[str]:
    """What the run does to its data that a user would not guess: documents cut or dropped at the
    context length, and documents seen more than once (epochs), with counts."""
    notes = [note] if (note := source.overlong_note()) else []
    per_step = config.sampler_size.get("batch_size")
    if per_step:
        seen = per_step * config.steps
        if seen > len(source.lengths):
            notes.append(f"{source.name}: {config.steps} steps of {per_step} sequences use {seen:,} sequences of "
                         f"{len(source.lengths):,}, so each is trained on about {seen / len(source.lengths):.1f} times "
                         "(epochs)")
    return notes


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
    return torch.optim.AdamW(groups, lr=config.lr, **optimizer_implementation(params))


def optimizer_implementation(params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """AdamW's fused kernel when every parameter is on a GPU (one kernel per step instead of a
    dozen per parameter group), the foreach one elsewhere."""
    if params and all(p.device.type == "cuda" and p.dtype.is_floating_point for p in params):
        return {"fused": True}
    return {"foreach": True}


def train(config: TrainConfig, *, stop: StopRequest | None = None) -> TrainResult:
    """Run `config` to config.steps total steps on this process, resuming from a checkpoint
    when there is one. `stop`: a signal flag installed by the caller (else one is installed
    for the run)."""
    setup = Setup(config)
    return run_training(setup, LocalExecutor(config, setup.model, make_optimizer(setup.model, config)), stop=stop)


def run_training(setup: Setup, executor: Executor, *, stop: StopRequest | None = None) -> TrainResult:
    """The loop every executor shares: lock the output folder, resume, then plan one step ahead
    and run to config.steps, or until a signal (signals.py)."""
    config = setup.config
    result = TrainResult(model=executor.result_model, nproc=executor.nproc, config=config)
    with contextlib.ExitStack() as stack:
        if stop is None:
            stop = stack.enter_context(StopRequest(quiet=not executor.is_reporter))
        if executor.is_reporter and config.out is not None:
            stack.enter_context(OutputLock(config.out))
            remove_debris(config.out)  # only safe while this run holds the lock
            if config.tokenizer is not None:
                save_tokenizer(config.tokenizer, config.out)
        result.resumed_from = _resume_path(config, executor)
        if result.resumed_from is not None:
            result.start_step = _resume(setup, executor, result.resumed_from)
        if executor.is_reporter and owns_metrics(config, resumed=result.resumed_from is not None):
            trim_metrics(config.metrics, result.start_step)  # lines of steps past the checkpoint
        if executor.is_reporter and config.out is not None:
            print(f"lengthwise train: checkpoints and metrics in {config.out}/", file=sys.stderr)
        if executor.is_reporter:
            for line in data_notes(setup.source, config):
                print(f"lengthwise train: {line}", file=sys.stderr)
        scheduler = make_scheduler(executor.optimizer, config, done=result.start_step)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lengthwise-plan") as pool:
            _loop(setup, executor, result, _Run(pool=pool, scheduler=scheduler, stop=stop))
    return result


def _resume_path(config: TrainConfig, executor: Executor) -> Path | None:
    if config.resume is not None:
        if not Path(config.resume).is_dir():
            raise UserError(f"--resume {config.resume}: no such directory")
        return Path(config.resume)
    return None if config.out is None else executor.latest_checkpoint(config.out)


def _resume(setup: Setup, executor: Executor, path: Path) -> int:
    trainer = executor.load(path)
    saved, step = trainer_state(path, trainer)
    check_same(path, saved, setup.config, executor.must_match)
    with refuse_unreadable(path, "checkpoint's sampler position"):
        setup.sampler.load_state_dict(trainer["sampler"])
    if trainer.get("strategy") is not None:  # a Hydraulis run plans its next batch from the saved strategy
        setup.previous_strategy = trainer["strategy"]
    changes = apply_settings(executor.optimizer, setup.config, saved)
    changes += setting_changes(saved, setup.config, skip=executor.must_match)
    if changes and executor.is_reporter:
        print(f"lengthwise train: resuming {path} with {', '.join(changes)}", file=sys.stderr)
    return step


@dataclass(kw_only=True)
class _Run:
    """What the loop drives besides the setup and the executor."""

    pool: ThreadPoolExecutor
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stop: StopRequest


def _loop(setup: Setup, executor: Executor, result: TrainResult, run: _Run) -> None:
    config, step = setup.config, result.start_step
    if step >= config.steps or executor.agree_stop(run.stop.requested):
        result.interrupted = step < config.steps
        return
    reporter = Reporter(config, shown=executor.is_reporter, step=step)
    ahead = _submit(setup, run.pool)
    try:
        while step < config.steps:
            started = time.perf_counter()
            prepared = ahead.result()
            waited = time.perf_counter() - started
            step += 1
            if step < config.steps:
                ahead = _submit(setup, run.pool)  # plan step n+1 while step n runs
            record = _run_step(setup, executor, prepared, step, started, waited)
            record.lr = current_lr(executor.optimizer)
            run.scheduler.step()
            result.skipped_steps += _check_finite(config, record, result)
            result.records.append(record)
            if _due(config.eval_every, step, config.steps):
                record.eval_loss = _evaluate(setup, executor)
            stopping = step < config.steps and executor.agree_stop(run.stop.requested)
            if config.out is not None and (_checkpoint_due(config, step) or stopping):
                result.checkpoint = _save(setup, executor, step, prepared, record)
            reporter.step(record)  # after the checkpoint: a resume never repeats a line
            if stopping:
                result.interrupted = True
                break
    finally:
        ahead.cancel()
        reporter.close()


def _submit(setup: Setup, pool: ThreadPoolExecutor) -> Future:
    batch = setup.sampler.next_batch()
    return pool.submit(setup.prepare, batch, setup.sampler.state_dict())


def _run_step(setup: Setup, executor: Executor, prepared: PreparedStep, step: int, started: float,
              waited: float) -> StepRecord:
    outcome = executor.step(prepared, step)
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)
    batch = prepared.batch
    record = StepRecord(step=step, loss=outcome.loss, tokens=batch.num_tokens, seq_ids=batch.seq_ids,
                        step_s=time.perf_counter() - started, wait_ms=waited * 1e3,
                        planning_ms=prepared.planning_ms, peak_memory_bytes=outcome.peak_memory_bytes,
                        memory_kind=outcome.memory_kind, grad_norm=outcome.grad_norm,
                        planner=prepared.plan.planner,
                        padding_fraction=float(prepared.plan.metrics.get("padding_fraction", 0.0)))
    record.skipped = not outcome.finite
    record.switch = outcome.switch
    if record.skipped:
        record.nonfinite_param = outcome.nonfinite_param
    return record


def _check_finite(config: TrainConfig, record: StepRecord, result: TrainResult) -> int:
    """1 for a skipped non-finite step (skip_nonfinite); a UserError naming it otherwise, so
    that nothing non-finite is ever checkpointed (the last checkpoint stays the newest)."""
    if not record.skipped:
        return 0
    if config.skip_nonfinite:
        return 1
    raise UserError(nonfinite_message(record, result.checkpoint or result.resumed_from))


def _evaluate(setup: Setup, executor: Executor) -> float | None:
    return executor.held_out_loss(setup)  # collective in a distributed run, None off rank 0


def _due(every: int | None, step: int, last: int) -> bool:
    return every is not None and (step % every == 0 or step == last)


def _checkpoint_due(config: TrainConfig, step: int) -> bool:
    return step == config.steps or (config.save_every is not None and step % config.save_every == 0)


def _save(setup: Setup, executor: Executor, step: int, prepared: PreparedStep, record: StepRecord) -> Path:
    trainer = {"sampler": prepared.sampler_state, "config": setup.config.to_dict(),
               "loss": record.loss if math.isfinite(record.loss) else None}
    if setup.config.planner == "hydraulis":  # the strategy the resumed run's next plan switches from
        trainer["strategy"] = pipelines_name(prepared.plan.pipelines)
    if isinstance(executor, LocalExecutor):  # a distributed executor agrees across ranks first (dist.py)
        check_saveable(executor.model, executor.optimizer, step=step,
                       kept=lambda: executor.latest_checkpoint(setup.config.out))
    return executor.save(step, trainer)

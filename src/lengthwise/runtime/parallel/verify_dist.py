"""Check a distributed run against the oracle: the same loss and every gradient.

    result = spawn(verify_worker, 4, VerifyJob(make_plan=..., dtype=torch.float64, seed=0))
    result["passed"], result["max_rel_grad_diff"], result["comm"]

Every rank plans the batch itself (`make_plan`, deterministic), builds its own stage of the
seeded model, parallelised as the plan says (`parallel/build.build_rank_model`: TP, FSDP2),
and the tokens, runs its part (`step.run_rank_step`), and sends its reduced gradients to rank 0,
which builds the whole model with the same seed (the seeded weights do not depend on the split)
and compares them with the oracle of single-process `verify` (transformers' model, or this
package's model unpacked), reporting the same keys as `lengthwise verify --json`, plus what
each rank sent (`comm`, per rank, `stats.CommStats`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.compile import compile_layers
from lengthwise.runtime.distributed.mesh import Mesh
from lengthwise.runtime.parallel.step import gather_grads, run_rank_step
from lengthwise.runtime.model import build_model
from lengthwise.runtime.parallel.build import ParallelOptions, build_rank_model
from lengthwise.runtime.verify import (
    TOLERANCE,
    VerifyResult,
    compare_grads,
    random_tokens,
    resolve_oracle,
    transformers_loss_and_grads,
    unpacked_loss_and_grads,
)
from lengthwise.runtime.weights import load_weights


@dataclass(kw_only=True)
class VerifyJob:
    """What every rank of a distributed verify does (picklable: spawn sends it to the workers)."""

    make_plan: Callable[[], StepPlan]
    """Plans the global batch; called on every rank (a module-level function or a partial)."""
    dtype: torch.dtype = torch.float64
    backend: str = "auto"
    seed: int = 0
    """Seeds the weights (seed) and the token ids (seed + 1), as single-process verify does."""
    oracle: str = "auto"
    timeout_s: float = 60.0
    """Receive and collective time-out, seconds."""
    data_parallel: str = "fsdp"
    """fsdp or replicate (`parallel/build.ParallelOptions`)."""
    param_dtype: torch.dtype | None = None
    """Compute dtype under FSDP2 (bfloat16 over `dtype` master weights)."""
    weights: str | None = None
    """A Hugging Face checkpoint to start from instead of seeded weights (each rank reads its
    stage's tensors)."""
    sequence_parallel: bool = True
    """Under tp > 1, split the residual stream's rows over TP (`parallel/build.ParallelOptions`)."""
    compile: str | None = None
    """torch.compile backend of every decoder layer on every rank (`runtime/compile.py`:
    inductor, or aot_eager on a CPU, where inductor's C++ compile is slow); None: eager."""
    compile_chain: bool = False
    """Compiled with up to four layers in one region, attention included (`compile_layers(..., chain=True)`)."""
    head_block_bytes: int | None = None
    """Bytes of the LM head's wide logits per block (`loss.head_loss_sum`); None: the default,
    `cost.memory.HEAD_BLOCK_BYTES`. A few rows' worth makes a tiny model's head run in several
    blocks, as a large vocabulary's does."""


def verify_worker(rank: int, job: VerifyJob, mesh: Mesh | None = None) -> dict | None:
    """Run on every rank (inside `spawn` or torchrun); rank 0 returns the result dict."""
    mesh = mesh or Mesh.from_default_group(timeout_s=job.timeout_s)
    plan = job.make_plan()
    options = ParallelOptions(data_parallel=job.data_parallel, param_dtype=job.param_dtype,
                              sequence_parallel=job.sequence_parallel)
    seed = None if job.weights else job.seed
    model = build_rank_model(plan, mesh, dtype=job.dtype, seed=seed, weights=job.weights, options=options)
    if job.compile:
        compile_layers(model, backend=job.compile, chain=job.compile_chain)
    if job.head_block_bytes and hasattr(model, "lm_head"):
        model.lm_head.block_bytes = job.head_block_bytes
    token_ids = random_tokens(plan.lengths, plan.model.vocab, job.seed + 1)
    step = run_rank_step(model, plan, token_ids, mesh=mesh, backend=job.backend)
    grads = gather_grads(model, step.layout, plan)
    comm = [None] * mesh.world_size if rank == 0 else None
    dist.gather_object(step.stats.to_dict() | {"actions": step.num_actions, "loop_s": step.loop_s,
                                          "sharding": step.sharding}, comm, dst=0)
    if rank != 0:
        return None
    whole = build_model(plan.model, dtype=job.dtype, device=mesh.device, seed=seed)
    if job.weights:
        load_weights(whole, job.weights)
    result = compare_with_oracle(whole, token_ids, step.loss, grads, job)
    return result.to_dict() | {"planner": plan.planner, "nproc": mesh.world_size, "comm": comm}


def compare_with_oracle(model, token_ids, loss: float, grads: dict, job: VerifyJob) -> VerifyResult:
    oracle = resolve_oracle(job.oracle)
    if oracle == "transformers":
        ref_loss, ref_grads = transformers_loss_and_grads(model, token_ids)
    else:
        ref_loss, ref_grads = unpacked_loss_and_grads(model, token_ids, backend=job.backend)
    abs_diff, rel_diff, worst = compare_grads(grads, ref_grads)
    return VerifyResult(loss=loss, reference_loss=float(ref_loss), max_abs_grad_diff=abs_diff,
                        max_rel_grad_diff=rel_diff, worst_param=worst, oracle=oracle,
                        tolerance=TOLERANCE.get(job.param_dtype or job.dtype, 1e-1))

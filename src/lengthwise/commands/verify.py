"""Check that a planner's plan trains exactly: same loss and gradients as unpacked training.

    lengthwise verify --model-config tiny --lengths 200,30,17,60,5 --chunk-size 64 --k 1 --pp 2
    lengthwise verify --model-config tiny-qwen --profile chunkflow-eval --batch-size 16 --context-length 512 --overlong truncate --planner packing --dp 2
    lengthwise verify --model-config path/to/config.json --lengths 300,40 --dtype float32 --json
    lengthwise verify --nproc 4 --dp 2 --pp 2 --lengths 200,30,17,60,5 --chunk-size 32 --k 1
    lengthwise verify --nproc 4 --dp 2 --cp 2 --planner skrull --lengths 150,40,17,60,5,90,33,12 --option bucket_size=100
    torchrun --nproc-per-node 4 -m lengthwise verify --pp 4 --chunk-size 48 --k 1

Builds the model from the config (a preset or a Hugging Face config.json) with random weights
(seeded by --seed), draws random token ids, plans the batch with --planner (default chunkflow,
else packing), executes the whole plan on this process (every pipeline and stage; with --nproc N, or under
torchrun, on N processes, one per pipeline stage and CP rank, gloo on CPU), and
compares the loss and every parameter's gradient with Hugging Face transformers' own model
run on each sequence alone (or, without transformers, with this package's model run
unpacked; the output says which). Exit status 0 when the largest relative gradient and loss
differences are within the dtype's tolerance (float64 1e-9, float32 1e-4, bfloat16 1e-1),
1 when not, 2 on a usage error. The relative difference of a parameter is
max|g - g_ref| / max|g_ref|. On CPU, attention runs the `cpu-flash` backend (`--backend
reference` checks the masked yardstick instead); `varlen` needs CUDA with bfloat16 or float16
(--device cuda --dtype bfloat16).
"""

from __future__ import annotations

import argparse
import re

from lengthwise.files import json_text
from lengthwise.commands.common import (add_backend_arg, add_compile_arg, add_workload_args, batch_lengths_from_args,
                                         compile_choice)
from lengthwise.commands.plan import default_context_length
from lengthwise.commands.planner_flags import add_planner_option_args, planner_options
from lengthwise.errors import UserError
from lengthwise.limits import BATCH_SEQUENCES, CONTEXT_LENGTH, LOCAL_PROCESSES, check_gpus, check_seconds, check_size
from lengthwise.planners import PLANNER_NAMES, get_planner
from lengthwise.specs import ParallelScheme, cluster_preset, model_preset

DTYPES = ("float64", "float32", "bfloat16")
DEFAULT_LENGTHS = [200, 30, 17, 60, 5]
DEFAULT_BATCH_SIZE = 8
"""Sequences drawn from --profile/--data/--lengths FILE without --batch-size."""


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", metavar="PRESET|config.json", default="tiny",
                        help="model preset or Hugging Face config.json (default tiny)")
    parser.add_argument("--planner", metavar="NAME",
                        help=f"one of {', '.join(PLANNER_NAMES)} (default chunkflow)")
    parser.add_argument("--batch-size", metavar="N", type=int,
                        help="sequences drawn from --profile/--data/--lengths FILE (default 8)")
    parser.add_argument("--pp", metavar="P", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--dp", metavar="D", type=int, default=1, help="data-parallel pipelines (default 1)")
    parser.add_argument("--cp", metavar="C", type=int, default=1, help="context-parallel ranks per stage (default 1)")
    parser.add_argument("--tp", metavar="T", type=int, default=1,
                        help="tensor-parallel ranks per stage (default 1; needs --nproc or torchrun)")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                        help="with --tp > 1: keep whole activations on every TP rank (all-reduce after each "
                             "block) instead of splitting the residual stream's rows over TP (the default)")
    parser.add_argument("--zero", metavar="Z", type=int, default=1, choices=(0, 1, 2, 3),
                        help="across processes: 3 = FSDP2 resharding after each forward (ZeRO-3), 1/2 = "
                             "FSDP2 sharding states only, 0 = whole replicas (default 1)")
    parser.add_argument("--nproc", metavar="N", type=int,
                        help="run on N local worker processes (gloo; N = dp x pp x cp x tp), compare with the oracle")
    parser.add_argument("--timeout", metavar="SECONDS", type=float, default=60.0,
                        help="with --nproc or torchrun: longest wait for a message or collective (default 60)")
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="model dtype (default float64)")
    add_backend_arg(parser)
    add_compile_arg(parser)
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--oracle", choices=("auto", "transformers", "unpacked"), default="auto",
                        help="what to compare with (default auto: transformers when installed)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_planner_option_args(parser)
    add_workload_args(parser)
    for action in parser._actions:  # --lengths also takes the batch inline
        if action.dest == "lengths":
            action.metavar = "a,b,c|FILE"
            action.help = f"the batch's lengths, comma-separated (default {','.join(map(str, DEFAULT_LENGTHS))}), or a lengths file"


def run(args: argparse.Namespace) -> int:
    if args.nproc is not None:  # the workers' fork server imports torch while this process does
        from lengthwise.runtime.distributed.forkserver import start_fork_server

        start_fork_server(oracle=args.oracle != "unpacked")
    import torch

    from lengthwise.runtime.attention import resolve_backend
    from lengthwise.runtime.verify import verify_plan

    dtype = getattr(torch, args.dtype)
    backend = resolve_backend(args.backend, torch.device(args.device), dtype)
    plan = build_plan(args)
    if args.nproc is not None or _under_torchrun():
        from lengthwise.runtime.parallel.build import check_hetero_vocabulary
        from lengthwise.sim.inputs import heterogeneous

        if heterogeneous(plan):
            check_hetero_vocabulary(plan)  # before any process starts
        return run_distributed(args, plan, backend)
    if args.tp > 1:
        raise UserError(f"--tp {args.tp} runs across processes: add --nproc {plan_world(plan)} (or launch with torchrun)")
    compile, chain = compile_choice(args)
    result = verify_plan(plan, dtype=dtype, backend=backend, seed=args.seed, oracle=args.oracle,
                         device=args.device, compile=compile, compile_chain=chain)
    if args.json:
        print(json_text({**result.to_dict(), "planner": plan.planner, "dtype": args.dtype,
                          "backend": backend, "lengths": plan.lengths}, indent=1))
    else:
        print(summary(plan, result, args.dtype, backend))
    return 0 if result.passed else 1


def build_plan(args: argparse.Namespace):
    """Plan the batch with the chosen planner and validate it, as `lengthwise plan` does."""
    from lengthwise.cost import CostModel
    from lengthwise.plan.validate import validate_plan
    from lengthwise.planners import PlanRequest

    check_sizes(args)
    model = model_preset(args.model_config)
    scheme = ParallelScheme(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp, zero=args.zero)
    scheme.validate(model)
    options = planner_options(args)
    gpus = scheme.num_gpus
    if options.get("pipelines") is not None:  # hydraulis' fixed heterogeneous strategy
        from lengthwise.planners.hydraulis.cost import parse_pipelines

        gpus = sum(tp * pp * cp for tp, pp, cp in parse_pipelines(str(options["pipelines"])))
    cluster = cluster_preset("cpu", gpus)
    cost = CostModel(model=model, cluster=cluster, sequence_parallel=args.sequence_parallel)
    lengths = batch_lengths(args)
    request = PlanRequest(lengths=lengths, model=model, cluster=cluster, scheme=scheme, cost=cost,
                          context_length=args.context_length or default_context_length(lengths),
                          seed=args.seed, options=options)
    plan = get_planner(args.planner or "chunkflow")(request)
    validate_plan(plan, cost)
    return plan


def check_sizes(args: argparse.Namespace) -> None:
    """Every count bounded (limits.py) before a model is built or a process started."""
    check_size("--batch-size", args.batch_size, BATCH_SEQUENCES)
    check_size("--context-length", args.context_length, CONTEXT_LENGTH)
    check_size("--nproc", args.nproc, LOCAL_PROCESSES)
    check_seconds("--timeout", args.timeout)
    check_gpus(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp)


def plan_world(plan) -> int:
    return plan.num_gpus


def _under_torchrun() -> bool:
    from lengthwise.runtime.distributed.launch import under_torchrun

    return under_torchrun()


def run_distributed(args: argparse.Namespace, plan, backend: str) -> int:
    """Every worker plans the batch itself, runs its part; rank 0 compares with the oracle."""
    import functools

    import torch

    from lengthwise.runtime.distributed.launch import end_process_group, init_from_torchrun, spawn
    from lengthwise.runtime.distributed.mesh import check_world_size
    from lengthwise.runtime.compile import compile_wanted
    from lengthwise.runtime.parallel.verify_dist import VerifyJob, verify_worker
    from lengthwise.runtime.verify import VerifyResult

    compile, chain = compile_choice(args)
    job = VerifyJob(make_plan=functools.partial(build_plan, args), dtype=getattr(torch, args.dtype),
                    backend=backend, seed=args.seed, oracle=args.oracle, timeout_s=args.timeout,
                    data_parallel="replicate" if args.zero == 0 else "fsdp",
                    sequence_parallel=args.sequence_parallel,
                    compile="inductor" if compile_wanted(compile, args.device) else None, compile_chain=chain)
    if _under_torchrun():
        mesh = init_from_torchrun(device=args.device, timeout_s=args.timeout)
        out = verify_worker(mesh.rank, job, mesh)
        end_process_group()  # before the exit frees an FSDP2 model and its groups in any order
        if mesh.rank != 0:
            return 0
    else:
        if torch.device(args.device).type != "cpu":
            raise UserError(f"--nproc starts CPU workers (gloo); for --device {args.device} launch with "
                            f"torchrun --nproc-per-node {args.nproc} -m lengthwise verify ...")
        check_world_size(plan, args.nproc)
        out = spawn(verify_worker, args.nproc, job, timeout_s=args.timeout)
    if args.json:
        print(json_text({**out, "dtype": args.dtype, "backend": backend, "lengths": plan.lengths}, indent=1))
    else:
        fields = ("loss", "reference_loss", "max_abs_grad_diff", "max_rel_grad_diff", "worst_param", "oracle", "tolerance")
        print(summary(plan, VerifyResult(**{k: out[k] for k in fields}), args.dtype, backend))
        sent = ", ".join(f"rank {r}: {c['p2p_elements']}/{c['dp_elements']}/{c['cp_gather_elements']}"
                         for r, c in enumerate(out["comm"]))
        print(f"  {out['nproc']} processes; elements sent (p2p/dp/cp): {sent}")
    return 0 if out["passed"] else 1


def batch_lengths(args: argparse.Namespace) -> list[int]:
    """--lengths a,b,c inline, else the workload arguments, else the default batch."""
    if args.lengths and re.fullmatch(r"\s*-?\d+(\s*,\s*-?\d+)*\s*", args.lengths):
        lengths = [int(t) for t in args.lengths.split(",")]
        bad = next((i for i, n in enumerate(lengths) if n < 1), None)
        if bad is not None:
            raise UserError(f"--lengths {args.lengths}: length {bad + 1} is {lengths[bad]}; every length must be "
                            "at least 1 token")
    elif args.lengths or args.profile or args.data:
        return _drawn_lengths(args)
    else:
        lengths = list(DEFAULT_LENGTHS)
    if args.batch_size is not None:
        given = f"--lengths {args.lengths}" if args.lengths else f"the built-in batch {','.join(map(str, lengths))}"
        raise UserError(f"--batch-size {args.batch_size} sizes a batch drawn from --profile, --data or a lengths "
                        f"file; {given} has {len(lengths)} sequences of its own: drop --batch-size or give the lengths")
    return _checked(lengths, args)


def _drawn_lengths(args: argparse.Namespace) -> list[int]:
    """The first global batch of the workload arguments, DEFAULT_BATCH_SIZE sequences unless --batch-size."""
    return _checked(batch_lengths_from_args(args, args.batch_size or DEFAULT_BATCH_SIZE), args)


def _checked(lengths: list[int], args: argparse.Namespace) -> list[int]:
    if min(lengths) < 1:
        raise UserError(f"--lengths {args.lengths}: every length must be at least 1")
    if max(lengths) < 2:
        raise UserError("every sequence of the batch is 1 token, so no position predicts a next token "
                        "and there is no loss to compare: give a sequence of 2 or more tokens")
    return lengths


def summary(plan, result, dtype: str, backend: str) -> str:
    pipes = plan.pipelines
    oracle = ("Hugging Face transformers, each sequence alone" if result.oracle == "transformers"
              else "this package's model unpacked (transformers is not installed)")
    shapes = sorted({(p.tp, p.pp, p.cp) for p in pipes})
    layout = (f"{len(pipes)} pipeline(s) of tp{shapes[0][0]} x pp{shapes[0][1]} x cp{shapes[0][2]}"
              if len(shapes) == 1 else
              f"{len(pipes)} pipelines of their own schemes ({', '.join(f'tp{p.tp}-pp{p.pp}-cp{p.cp}' for p in pipes)})")
    return "\n".join([
        f"verify: {plan.planner} plan of {len(plan.lengths)} sequences ({sum(plan.lengths):,} tokens, "
        f"longest {max(plan.lengths):,}) on {plan.model.name}: {layout}, "
        f"{sum(len(p.chunks) for p in pipes)} chunks, {dtype}, attention {backend}",
        f"  oracle: {oracle}",
        f"  loss {result.loss:.15g} vs {result.reference_loss:.15g} (relative difference {result.loss_rel_diff:.2e})",
        f"  largest gradient difference: absolute {result.max_abs_grad_diff:.3e}, relative "
        f"{result.max_rel_grad_diff:.3e} ({result.worst_param}); tolerance {result.tolerance:g}",
        "  PASSED" if result.passed else "  FAILED: above the tolerance",
    ])

"""Largest sizes any command accepts, in one place, each with the reason it is where it is.

    from lengthwise.limits import BATCH_SEQUENCES, check_size
    check_size("--batch-size", args.batch_size, BATCH_SEQUENCES)
    # --batch-size 1000000000000 is over the limit of 1,000,000 sequences (...): give a smaller one

Every count a user types (sequences, draws, batches, GPUs, processes, tokens) is checked here
before any work starts, so a typo such as an extra zero fails in its first second with the
bound and why, instead of allocating terabytes, running for days or printing a table of a
hundred thousand lines. The bounds are far above every published setting; each docstring says
why it is where it is, with what a run at the bound costs where that was measured (on the
2-core CPU machine).
Imports nothing but the error type: the planning side uses it without PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lengthwise.errors import UserError


@dataclass(frozen=True)
class Limit:
    """An inclusive upper bound on one kind of size, with its unit and a short reason for the message."""

    most: int | float
    unit: str
    reason: str


MAX_LENGTH = 2**40
"""Longest sequence any file may name, tokens (a trillion: beyond every context length, and small
enough that token and attention-pair sums stay exact in float64 arithmetic where they matter)."""

CONTEXT_LENGTH = Limit(MAX_LENGTH, "tokens", "the longest sequence any input may hold (2^40)")
"""--context-length: no sequence can be longer than MAX_LENGTH, so neither can the context."""

SAMPLES = Limit(10**8, "draws", "about 36 bytes each while the statistics are computed: 3.6 GB at the limit")
"""`workload --samples`: lengths drawn and sorted in memory at once (int64 plus float64 copies);
10^7 draws measured 360 MB peak and 4 s, so the limit is about 3.6 GB and under a minute."""

BATCH_SEQUENCES = Limit(10**6, "sequences", "one global batch is planned as a whole; published ones hold thousands")
"""--batch-size of plan, verify, compare and train: one global batch, planned as a whole. 10^5
sequences plan with packing in 3 s; the slower planners grow faster than linearly."""

TOKENS_PER_BATCH = Limit(10**9, "tokens", "a million sequences of a thousand tokens; published global "
                         "batches hold about 16 million")
"""--tokens-per-batch: the sampler draws sequences until the budget is reached."""

BATCHES = Limit(1000, "batches", "every planner plans and simulates each batch (seconds each at the "
                "default size), so 1,000 batches are already hours; the means settle long before")
"""`compare --batches`: global batches sampled, each planned and simulated by every planner."""

GPUS = Limit(65536, "GPUs", "beyond the largest clusters trained on")
"""Parallel degrees of plan, compare, verify, train: their product is the GPUs the plan runs on,
and the plan and its simulation keep a table per pipeline and stage (a million pipelines took
208 s to plan, empty)."""

LOCAL_PROCESSES = Limit(256, "processes", "each worker process on this machine loads its own PyTorch "
                        "(about 300 MB) and opens sockets to every other")
"""--nproc of verify and train: local gloo/NCCL workers started on this one machine."""

THREADS = Limit(1024, "threads", "more than any machine's cores; each is an operating-system thread of torch")
"""`train --threads`: torch.set_num_threads."""

STAGES = Limit(1024, "stages", "more pipeline stages than any model has decoder layers")
"""`simulate --stages` in the direct mode."""

DIRECT_CHUNKS = Limit(10**6, "chunks", "the direct mode simulates every action of every chunk on every stage")
"""`simulate --fwd`: forward times given on the command line."""

LAYERS = Limit(1024, "layers", "more decoder layers than any model has (Llama 3 405B has 126)")
"""`profile --layers`: decoder layers built and timed on this device."""

REPEATS = Limit(1000, "repeats", "every repeat times each chunk again; the median settles within a few")
"""`profile --repeats` and `--warmup`: timed and untimed runs of each chunk."""

TIMEOUT_S = Limit(7 * 24 * 3600, "seconds", "a week; a wait that long is a hang, and far longer ones overflow "
                  "the process group's timer")
"""--timeout of train and verify: how long a rank waits for the others."""

DRYRUN_RANKS = Limit(256, "ranks", "each rank's dry run builds its stage at full size on fake tensors, "
                     "seconds to a minute apiece")
"""`dryrun --ranks`: ranks dry-run one after another in this process."""

MAX_DIRECT_TIME = 1e12
"""Largest forward time (and backward ratio) the direct mode takes: sums of a million such times
stay finite, so every result is a number."""

MAX_EXTRA_SECONDS = 1e6
"""Largest extra time a plan may add to a step (options such as extra_comm_s), seconds: eleven
days, far above any real step, and small enough that sums over a step stay meaningful."""


def check_size(flag: str, value: int | float | None, limit: Limit, *, least: int | None = 1) -> None:
    """UserError when `value` (None: not given) is below `least` (None: left to the caller) or
    above the limit, naming the flag, the bound and why."""
    if value is None:
        return
    if least is not None and value < least:
        raise UserError(f"{flag} {value} must be at least {least}")
    if value > limit.most:
        raise UserError(f"{flag} {value} is over the limit of {limit.most:,} {limit.unit} ({limit.reason}): "
                        "give a smaller one")


def check_seconds(flag: str, value: float | None, limit: Limit = TIMEOUT_S) -> None:
    """A positive, finite number of seconds at most the limit (None: not given)."""
    if value is None:
        return
    if not 0 < value <= limit.most:  # False for NaN too
        raise UserError(f"{flag} {value} must be a number of seconds in (0, {limit.most:,}] ({limit.reason})")


def check_gpus(*, dp: int, tp: int, pp: int, cp: int) -> None:
    """UserError showing the arithmetic when dp x tp x pp x cp is over GPUS (degrees below 1 are
    left to the scheme's own check, which names the degree)."""
    degrees = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
    if min(degrees.values()) < 1:
        return
    total = dp * tp * pp * cp
    if total > GPUS.most:
        shown = " x ".join(f"{k}({v})" for k, v in degrees.items())
        raise UserError(f"{shown} = {total:,} GPUs is over the limit of {GPUS.most:,} ({GPUS.reason}): "
                        "lower the degrees")

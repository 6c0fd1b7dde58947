"""Every planner's options: one keyword-only dataclass per planner, each field's default and help
text written once here.

    PLANNER_OPTIONS["chunkflow"]          # ChunkFlowOptions
    option_defaults("chunkflow")          # {"chunk_size": None, "k": None}

Planners read `PlanRequest.options` (a plain dict, as plan files store it) against their class
(`planners.base.take_options`); the `plan`, `train`, `verify` and `compare` commands build one
flag per option name from these classes (`commands/common.py`), so `--chunk-size` and `--k` are
declared here and nowhere else. A default of None means the planner chooses (the help says how).
Options a flag cannot carry (nested tables) have `flag=None` and are set in Python or TOML.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def option(default: Any = None, help: str = "", *, flag: str | None = "", metavar: str = "VALUE",
           factory: Any = None) -> Any:
    """A dataclass field carrying its CLI help; `flag=None` keeps it off the command line, a
    non-empty `flag` renames it (when the plain name is already a command flag)."""
    meta = {"help": help, "flag": flag, "metavar": metavar}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True, frozen=True)
class PaddingOptions:
    micro_batch_size: int | None = option(
        None, "sequences per micro-batch, each padded to its longest; default: as many rows of the "
        "batch's longest sequence as one pipeline's memory holds under 1F1B", metavar="N")
    recompute: str = option(
        "auto", "activation recomputation: none, full (every layer keeps only its input), or auto, the "
        "fastest that fits (none when it fits, else full), as a Megatron-LM user would choose",
        metavar="none|full|auto")


@dataclass(kw_only=True, frozen=True)
class PackingOptions:
    recompute: str = option(
        "auto", "activation recomputation: none, full (every layer keeps only its input), or auto, the "
        "fastest that fits (none when it fits, else full), as a Megatron-LM user would choose",
        metavar="none|full|auto")


@dataclass(kw_only=True, frozen=True)
class MegatronOptions:
    micro_batch_size: int | None = option(
        None, "sequences per micro-batch, unpacked, in sampler order, each padded to its longest (ChunkFlow's "
        "Megatron-LM ran 1: chunkflow.txt §6.1); default: packed micro-batches of the context length", metavar="N")
    recompute: str = option(
        "auto", "activation recomputation: none, full (every layer keeps only its input), or auto, the "
        "fastest that fits (none when it fits, else full), as a Megatron-LM user would choose",
        metavar="none|full|auto")


@dataclass(kw_only=True, frozen=True)
class StaticCPOptions:
    recompute: str = option(
        "auto", "activation recomputation: none, full (every layer keeps only its input), or auto, the "
        "fastest that fits (none when it fits, else full), as a Megatron-LM user would choose",
        metavar="none|full|auto")


@dataclass(kw_only=True, frozen=True)
class SortedOptions:
    micro_batch_size: int | None = option(
        None, "most sequences per micro-batch; default: as many as fill the token budget", metavar="N")
    recompute: str = option(
        "auto", "activation recomputation: none, full (every layer keeps only its input), or auto, the "
        "fastest that fits (none when it fits, else full), as a Megatron-LM user would choose",
        metavar="none|full|auto")


@dataclass(kw_only=True, frozen=True)
class TokenBalancedOptions:
    equal_count: bool = option(False, "give every data-parallel rank the same number of sequences",
                               metavar="BOOL")
    recompute: str = option(
        "auto", "activation recomputation: none, full (every layer keeps only its input), or auto, the "
        "fastest that fits (none when it fits, else full), as a Megatron-LM user would choose",
        metavar="none|full|auto")


@dataclass(kw_only=True, frozen=True)
class ChunkFlowOptions:
    chunk_size: int | str | None = option(
        None, "tokens per chunk, or 'auto' for the grid search over ChunkSize and K (chunkflow §5); "
        "default: the largest power of two (at least 256) that fits memory, capped so each stage "
        "sees about 2 pp chunks", metavar="TOKENS")
    k: int | None = option(
        None, "chunks of a long sequence whose activations are kept at once (chunkflow §4.2); "
        "default 1, searched too with chunk_size=auto", metavar="K")


@dataclass(kw_only=True, frozen=True)
class SkrullOptions:
    bucket_size: int | None = option(
        None, "tokens one CP rank holds, the paper's C (skrull §5); default: from the memory model",
        metavar="TOKENS")
    refine: bool = option(True, "after Algorithm 1, shard local stragglers while that lowers the DACP "
                          "objective (our addition); false runs the paper's heuristic only", metavar="BOOL")


@dataclass(kw_only=True, frozen=True)
class HydraulisOptions:
    profile: str | None = option(
        None, "workload profile whose length distribution strategies are proposed for once and cached "
        "(hydraulis §7); default: each batch's own histogram", flag="--hydraulis-profile", metavar="NAME")
    trials: int = option(100, "Algorithm 1's random dispatch trials T (appendix D)", metavar="T")
    dispatch_work: int = option(4_000_000, "cap on sequences x pipelines x trials x candidates of one "
                                "dispatch pass (the trial count drops on large clusters, at least 1)",
                                metavar="N")
    max_tp: int | None = option(None, "largest tensor-parallel degree in the scheme space; default: GPUs "
                                "per node", metavar="N")
    max_pp: int = option(8, "largest pipeline degree in the scheme space", metavar="N")
    max_cp: int = option(8, "largest context-parallel degree in the scheme space", metavar="N")
    length_step: int = option(128, "the strategy DP's length grid, tokens (§7 footnote 4)", metavar="TOKENS")
    pipelines: str | None = option(
        None, "fix the strategy instead of searching: one scheme per data-parallel pipeline, e.g. "
        "tp2-pp1,tp1-pp2 (cp optional: tp1-pp1-cp2); their GPUs must add up to the cluster's",
        metavar="SCHEMES")
    previous: str | None = option(
        None, "the strategy the previous batch ran (the pipelines grammar; the training loop passes it): "
        "a candidate with other pipelines is charged the switch's optimizer-state move and weight pull",
        metavar="SCHEMES")
    pipeline_step: float = option(0.1, "the strategy DP's pipeline-count grid, pipelines", metavar="X")
    util_threshold: float = option(0.85, "efficiency that defines UtilLen (appendix C), in (0, 1)",
                                   metavar="X")
    milp_solves: int = option(8, "eq. 1 MILPs solved per batch for the slowest pipelines", metavar="N")
    milp_node_limit: int = option(500, "branch-and-bound nodes per eq. 1 MILP", metavar="N")
    milp_time_limit_s: float = option(0.02, "seconds per eq. 1 MILP (a safety net: a solve it cuts short "
                                      "may differ between runs)", metavar="SECONDS")


@dataclass(kw_only=True, frozen=True)
class InfiniPipeOptions:
    num_slices: int | None = option(None, "N, slices of the longest sequence (infinipipe §3.2); default: "
                                    "tuned by a search over N", metavar="N")
    slice_candidates: int = option(10, "most feasible values of N planned when tuning", metavar="N")
    balanced_chunking: bool = option(True, "Algorithm 1's workload-balanced chunking; false is the "
                                     "'w/o wbc' ablation (equal-token slices)", metavar="BOOL")
    checkpointing: str = option("adaptive", "'adaptive' (the §3.3.3 MILP), 'none' (no recomputation) or "
                                "'full' (every layer of every chunk recomputed)", metavar="MODE")
    score: str = option("simulate", "how the chosen N is picked: 'simulate' (the search compares N by the "
                        "DP's estimate, then the simulator picks among the 2 best) or 'estimate' (the best "
                        "by estimate)", metavar="MODE")
    milp_time_limit_s: float = option(0.1, "HiGHS seconds per checkpointing MILP; on time-out the better "
                                      "of the incumbent and the rounded LP optimum is used", metavar="SECONDS")


@dataclass(kw_only=True, frozen=True)
class SlimPackOptions:
    num_micropacks: int | None = option(None, "MicroPacks per pipeline; default: swept by simulation "
                                        "(slimpack §5.1)", metavar="N")
    max_micropacks: int | None = option(None, "top of the MicroPack sweep; default 32 x pp", metavar="N")
    asymmetric: bool = option(True, "regroup the backward (slimpack §4.1.2); false runs each forward "
                              "MicroPack's own backward (the §6.3 ablation)", metavar="BOOL")
    dp_merge: bool = option(True, "merge data-parallel ranks for outliers (slimpack §4.1.1)", metavar="BOOL")
    schedule: str = option("auto", "'steady', 'lean' or 'auto' (steady, lean for the pipelines steady "
                           "fits at no MicroPack count)", metavar="NAME")
    recompute: str = option(
        "auto", "activation recomputation (slimpack §6.1 recomputes as memory requires): none; full (every "
        "forward recomputes all its stage's layers); or auto: none whenever some MicroPack count fits, else "
        "the fastest in simulation of 1/4, 1/2, 3/4 or all of each stage's layers that fit. The "
        "distributed executor refuses recomputing a MicroPack with CP-sharded segments (a DP-Merged "
        "outlier's, cp > 1)", metavar="none|full|auto")


@dataclass(kw_only=True, frozen=True)
class AutoOptions:
    candidates: list[str] | None = option(None, "planner names to try; default: every planner but auto",
                                          flag=None)
    schemes: dict[str, dict[str, int]] = option(help="{planner: {dp, tp, pp, cp}} per candidate; default: "
                                                "the request's scheme", flag=None, factory=dict)
    candidate_options: dict[str, dict[str, Any]] = option(help="{planner: {option: value}} passed to that "
                                                          "candidate", flag=None, factory=dict)
    preselect_above: int = option(
        8192, "batches of more sequences than this are first planned by every candidate on a proxy "
        "(every k-th sequence by length on dp/k pipelines) and only the best `preselect` of them at full "
        "size; at or below it every candidate plans the full batch", metavar="N")
    preselect: int = option(1, "candidates planned at full size after the proxy's ranking (the next ones "
                            "in its order too while none of them gives a valid plan that fits)", metavar="N")
    preselect_margin: float = option(
        0.02, "also plan at full size every candidate whose proxy step time is within this fraction of "
        "the proxy's fastest (a close call is settled on the full batch)", metavar="X")
    proxy_factor: int | None = option(
        None, "the proxy's k: it keeps every k-th sequence, longest first, on dp/k pipelines of the same "
        "tp, pp and cp; default: the largest divisor of dp that leaves at least proxy_sequences sequences "
        "and min_proxy_pipelines pipelines (no preselection when that is 1)", metavar="K")
    proxy_sequences: int = option(2048, "fewest sequences the default proxy keeps", metavar="N")
    min_proxy_pipelines: int = option(8, "fewest data-parallel pipelines the default proxy keeps", metavar="N")


PLANNER_OPTIONS: dict[str, type] = {
    "padding": PaddingOptions,
    "packing": PackingOptions,
    "megatron": MegatronOptions,
    "static-cp": StaticCPOptions,
    "sorted": SortedOptions,
    "token-balanced": TokenBalancedOptions,
    "chunkflow": ChunkFlowOptions,
    "skrull": SkrullOptions,
    "hydraulis": HydraulisOptions,
    "infinipipe": InfiniPipeOptions,
    "slimpack": SlimPackOptions,
    "auto": AutoOptions,
}
"""Planner name -> its options class; the keys are the planner registry's names."""


def option_defaults(planner: str) -> dict[str, Any]:
    """The planner's options at their defaults, as the dict planners read."""
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(PLANNER_OPTIONS[planner])}


def option_flag(f: dataclasses.Field) -> str | None:
    """The command-line flag of one option field, None if it has none."""
    flag = f.metadata["flag"]
    return None if flag is None else flag or "--" + f.name.replace("_", "-")

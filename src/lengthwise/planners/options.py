"""Every planner's options: one keyword-only dataclass per planner, each field's default, help
text and check written once here, and the objects planners read.

    build_options("chunkflow", {"chunk_size": 4096})   # ChunkFlowOptions(chunk_size=4096, k=None)
    ChunkFlowOptions(chunk_size=0)                      # UserError: ... must be a positive number ...
    option_defaults("chunkflow")                        # {"chunk_size": None, "k": None}

Planners turn `PlanRequest.options` (a plain dict, as plan files and TOML store it, or an
instance of the planner's class) into their class with `planners.base.take_options` and read
typed fields (`opts.chunk_size`); constructing a class checks every field, so no planner
re-checks a type. The `plan`, `train`, `verify` and `compare` commands build one flag per option
name from these classes (`commands/planner_flags.py`), so `--chunk-size` and `--k` are declared
here and nowhere else. A default of None means the planner chooses (the help says how); the
string "none" of a choice field (`recompute`, `checkpointing`) is a choice like any other.
Options a flag cannot carry (nested tables) have `flag=None` and are set in Python or TOML.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from lengthwise.errors import UserError


@dataclass(frozen=True)
class Check:
    """What an option accepts: a test of its value and the words an error names it by."""

    test: Callable[[Any], bool]
    expects: str
    choices: tuple[str, ...] = ()
    """The strings a choice option takes (its flag and --option keep "none" a string)."""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def one_of(*choices: str) -> Check:
    return Check(lambda v: v in choices, "one of " + ", ".join(choices), choices)


POSITIVE_INT = Check(lambda v: _int(v) and v >= 1, "a positive integer")
POSITIVE_INT_OR_NONE = Check(lambda v: v is None or (_int(v) and v >= 1), "a positive integer or none")
NON_NEGATIVE_INT = Check(lambda v: _int(v) and v >= 0, "a non-negative integer")
POSITIVE_NUMBER = Check(lambda v: _number(v) and v > 0, "a positive number")
NON_NEGATIVE_FRACTION = Check(lambda v: _number(v) and v >= 0, "a fraction >= 0")
OPEN_FRACTION = Check(lambda v: _number(v) and 0 < v < 1, "a number in (0, 1)")
BOOL = Check(lambda v: isinstance(v, bool), "true or false")
TEXT_OR_NONE = Check(lambda v: v is None or isinstance(v, str), "a string or none")
CHUNK_SIZE = Check(lambda v: v is None or v == "auto" or (_int(v) and v >= 1),
                   "a positive number of tokens or 'auto'")
NAMES_OR_NONE = Check(lambda v: v is None or (isinstance(v, list) and all(isinstance(n, str) for n in v)),
                      "a list of planner names or none")
TABLE = Check(lambda v: isinstance(v, dict) and all(isinstance(t, dict) for t in v.values()),
              "a table {planner: {name: value}}")


def option(default: Any = None, help: str = "", *, check: Check, flag: str | None = "",
           metavar: str = "VALUE", factory: Any = None) -> Any:
    """A dataclass field carrying its CLI help and check; `flag=None` keeps it off the command
    line, a non-empty `flag` renames it (when the plain name is already a command flag)."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "check": check}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


class Options:
    """Base of every planner's options class: each field is checked when an instance is made,
    so a planner reads only values of the declared kind."""

    planner: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value, check = getattr(self, f.name), f.metadata["check"]
            if not check.test(value):
                raise UserError(f"{self.planner} option {f.name} must be {check.expects}, got {value!r}")


RECOMPUTE = one_of("none", "mlp", "full", "auto")


def recompute_option(help: str = "activation recomputation: none; mlp (every layer recomputes its MLP block in "
                     "backward, keeping its attention's tensors: Qwen2.5-1.5B's layers keep under a quarter of their "
                     "activations for a fifth more linear FLOPs); full (every layer keeps only its input); or auto, the "
                     "cheapest that fits the batch's longest sequence: none, else mlp, else full (megatron: "
                     "none, else full, as the papers' Megatron-LM ran it)") -> Any:
    """The `recompute` field: one declaration, shared by the baselines (slimpack words its own)."""
    return option("auto", help, check=RECOMPUTE, metavar="none|mlp|full|auto")


@dataclass(kw_only=True, frozen=True)
class BaselineOptions(Options):
    """What every baseline takes (planners/baselines.py)."""

    recompute: str = recompute_option()


@dataclass(kw_only=True, frozen=True)
class PaddingOptions(BaselineOptions):
    planner: ClassVar[str] = "padding"
    micro_batch_size: int | None = option(
        None, "sequences per micro-batch, each padded to its longest; default: as many rows of the "
        "batch's longest sequence as one pipeline's memory holds under 1F1B", metavar="N",
        check=POSITIVE_INT_OR_NONE)


@dataclass(kw_only=True, frozen=True)
class PackingOptions(BaselineOptions):
    planner: ClassVar[str] = "packing"


@dataclass(kw_only=True, frozen=True)
class MegatronOptions(BaselineOptions):
    planner: ClassVar[str] = "megatron"
    recompute_per_batch: bool = option(
        False, "with recompute auto, decide it per batch: the fewest of 0, 1/4, 1/2, 3/4 or all of each stage's "
        "layers with which the simulated step fits (partial recomputation, SlimPack's baseline: slimpack.txt "
        "line 181); default: decided once from the context length, none or full", metavar="BOOL", check=BOOL)
    packing: str = option(
        "next-fit", "how packed micro-batches are filled: next-fit (sampler order, a new micro-batch when the "
        "next sequence does not fit: Megatron-LM's packed dataset) or best-fit (best-fit decreasing, the "
        "baseline SlimPack ran: slimpack.txt line 181)", flag="--megatron-packing", metavar="next-fit|best-fit",
        check=one_of("next-fit", "best-fit"))
    micro_batch_size: int | None = option(
        None, "sequences per micro-batch, unpacked, in sampler order, each padded to its longest (ChunkFlow's "
        "Megatron-LM ran 1: chunkflow.txt §6.1); default: packed micro-batches of the context length", metavar="N",
        check=POSITIVE_INT_OR_NONE)


@dataclass(kw_only=True, frozen=True)
class StaticCPOptions(BaselineOptions):
    planner: ClassVar[str] = "static-cp"
    grad_reduce: str = option(
        "step", "when gradients are reduced over dp x cp: step (once, after the last backward) or micro-batch "
        "(after every micro-batch's backward, in bf16 and serially, as DeepSpeed ZeRO-2 does by default under "
        "gradient accumulation: Skrull's baseline, skrull.txt line 92)", metavar="step|micro-batch", check=one_of("step", "micro-batch"))


@dataclass(kw_only=True, frozen=True)
class SortedOptions(BaselineOptions):
    planner: ClassVar[str] = "sorted"
    micro_batch_size: int | None = option(
        None, "most sequences per micro-batch; default: as many as fill the token budget", metavar="N",
        check=POSITIVE_INT_OR_NONE)


@dataclass(kw_only=True, frozen=True)
class TokenBalancedOptions(BaselineOptions):
    planner: ClassVar[str] = "token-balanced"
    equal_count: bool = option(False, "give every data-parallel rank the same number of sequences",
                               metavar="BOOL", check=BOOL)


@dataclass(kw_only=True, frozen=True)
class ChunkFlowOptions(Options):
    planner: ClassVar[str] = "chunkflow"
    chunk_size: int | str | None = option(
        None, "tokens per chunk, or 'auto' for the grid search over ChunkSize and K (chunkflow §5); "
        "default: the largest power of two (at least 256) that fits memory, capped so each stage "
        "sees about 2 pp chunks", metavar="TOKENS", check=CHUNK_SIZE)
    k: int | None = option(
        None, "chunks of a long sequence whose activations are kept at once (chunkflow §4.2); "
        "default 1, searched too with chunk_size=auto", metavar="K", check=POSITIVE_INT_OR_NONE)


@dataclass(kw_only=True, frozen=True)
class SkrullOptions(Options):
    planner: ClassVar[str] = "skrull"
    bucket_size: int | None = option(
        None, "tokens one CP rank holds, the paper's C (skrull §5); default: from the memory model",
        metavar="TOKENS", check=POSITIVE_INT_OR_NONE)
    refine: bool = option(True, "after Algorithm 1, shard local stragglers while that lowers the DACP "
                          "objective (our addition); false runs the paper's heuristic only", metavar="BOOL",
                          check=BOOL)


@dataclass(kw_only=True, frozen=True)
class HydraulisOptions(Options):
    planner: ClassVar[str] = "hydraulis"
    profile: str | None = option(
        None, "workload profile whose length distribution strategies are proposed for once and cached "
        "(hydraulis §7); default: each batch's own histogram", flag="--hydraulis-profile", metavar="NAME",
        check=TEXT_OR_NONE)
    trials: int = option(100, "Algorithm 1's random dispatch trials T (appendix D)", metavar="T",
                         check=POSITIVE_INT)
    dispatch_work: int = option(4_000_000, "cap on sequences x pipelines x trials x candidates of one "
                                "dispatch pass: each candidate's trials are cut so that sequences x its "
                                "pipelines x trials x the batch's feasible candidates stays within it (the "
                                "trial count drops on large clusters, at least 1)",
                                metavar="N", check=POSITIVE_INT)
    max_tp: int | None = option(None, "largest tensor-parallel degree in the scheme space; default: GPUs "
                                "per node", metavar="N", check=POSITIVE_INT_OR_NONE)
    max_pp: int = option(8, "largest pipeline degree in the scheme space", metavar="N", check=POSITIVE_INT)
    max_cp: int = option(8, "largest context-parallel degree in the scheme space", metavar="N",
                         check=POSITIVE_INT)
    length_step: int = option(128, "the strategy DP's length grid, tokens (§7 footnote 4)", metavar="TOKENS",
                              check=POSITIVE_INT)
    pipelines: str | None = option(
        None, "fix the strategy instead of searching: one scheme per data-parallel pipeline, e.g. "
        "tp2-pp1,tp1-pp2 (cp optional: tp1-pp1-cp2); their GPUs must add up to the cluster's",
        metavar="SCHEMES", check=TEXT_OR_NONE)
    previous: str | None = option(
        None, "the strategy the previous batch ran (the pipelines grammar; the training loop passes it): "
        "a candidate with other pipelines is charged the switch's optimizer-state move and weight pull",
        metavar="SCHEMES", check=TEXT_OR_NONE)
    pipeline_step: float = option(0.1, "the strategy DP's pipeline-count grid, pipelines", metavar="X",
                                  check=POSITIVE_NUMBER)
    util_threshold: float = option(0.85, "efficiency that defines UtilLen (appendix C), in (0, 1)",
                                   metavar="X", check=OPEN_FRACTION)
    milp_solves: int = option(8, "eq. 1 MILPs solved per batch for the slowest pipelines", metavar="N",
                              check=NON_NEGATIVE_INT)
    milp_node_limit: int = option(500, "branch-and-bound nodes per eq. 1 MILP", metavar="N",
                                  check=POSITIVE_INT)
    milp_time_limit_s: float = option(0.02, "seconds per eq. 1 MILP (a safety net: a solve it cuts short "
                                      "may differ between runs)", metavar="SECONDS", check=POSITIVE_NUMBER)


@dataclass(kw_only=True, frozen=True)
class InfiniPipeOptions(Options):
    planner: ClassVar[str] = "infinipipe"
    num_slices: int | None = option(None, "N, slices of the longest sequence (infinipipe §3.2); default: "
                                    "tuned by a search over N", metavar="N", check=POSITIVE_INT_OR_NONE)
    slice_candidates: int = option(10, "most feasible values of N planned when tuning", metavar="N",
                                   check=POSITIVE_INT)
    balanced_chunking: bool = option(True, "Algorithm 1's workload-balanced chunking; false is the "
                                     "'w/o wbc' ablation (equal-token slices)", metavar="BOOL", check=BOOL)
    checkpointing: str = option("adaptive", "'adaptive' (the §3.3.3 MILP), 'none' (no recomputation) or "
                                "'full' (every layer of every chunk recomputed)", metavar="MODE",
                                check=one_of("adaptive", "none", "full"))
    score: str = option("simulate", "how the chosen N is picked: 'simulate' (the search compares N by the "
                        "DP's estimate, then the simulator picks among the 2 best) or 'estimate' (the best "
                        "by estimate)", metavar="MODE", check=one_of("simulate", "estimate"))
    milp_time_limit_s: float = option(0.1, "HiGHS seconds per checkpointing MILP; on time-out the better "
                                      "of the incumbent and the rounded LP optimum is used", metavar="SECONDS",
                                      check=POSITIVE_NUMBER)


@dataclass(kw_only=True, frozen=True)
class SlimPackOptions(Options):
    planner: ClassVar[str] = "slimpack"
    num_micropacks: int | None = option(None, "MicroPacks per pipeline; default: swept by simulation "
                                        "(slimpack §5.1)", metavar="N", check=POSITIVE_INT_OR_NONE)
    max_micropacks: int | None = option(None, "top of the MicroPack sweep; default 32 x pp", metavar="N",
                                        check=POSITIVE_INT_OR_NONE)
    asymmetric: bool = option(True, "regroup the backward (slimpack §4.1.2); false runs each forward "
                              "MicroPack's own backward (the §6.3 ablation)", metavar="BOOL", check=BOOL)
    dp_merge: bool = option(True, "merge data-parallel ranks for outliers (slimpack §4.1.1)", metavar="BOOL",
                            check=BOOL)
    schedule: str = option("auto", "'steady', 'lean' or 'auto' (steady, lean for the pipelines steady "
                           "fits at no MicroPack count)", metavar="NAME",
                           check=one_of("auto", "steady", "lean"))
    recompute: str = option(
        "auto", "activation recomputation (slimpack §6.1 recomputes as memory requires): none; mlp (every "
        "forward recomputes the MLP block of all its stage's layers; ours, not the paper's); full (every "
        "forward recomputes all its stage's layers); or auto: none whenever some MicroPack count fits, else "
        "the fastest in simulation of 1/4, 1/2, 3/4 or all of each stage's layers that fit. The "
        "distributed executor refuses recomputing whole layers of a MicroPack with CP-sharded segments (a "
        "DP-Merged outlier's, cp > 1)", metavar="none|mlp|full|auto", check=one_of("none", "mlp", "full", "auto"))


@dataclass(kw_only=True, frozen=True)
class AutoOptions(Options):
    planner: ClassVar[str] = "auto"
    candidates: list[str] | None = option(None, "planner names to try; default: every planner but auto",
                                          flag=None, check=NAMES_OR_NONE)
    schemes: dict[str, dict[str, int]] = option(help="{planner: {dp, tp, pp, cp}} per candidate; default: "
                                                "the request's scheme", flag=None, factory=dict, check=TABLE)
    candidate_options: dict[str, dict[str, Any]] = option(help="{planner: {option: value}} passed to that "
                                                          "candidate", flag=None, factory=dict, check=TABLE)
    preselect_above: int = option(
        8192, "batches of more sequences than this are first planned by every candidate on a proxy "
        "(every k-th sequence by length on dp/k pipelines) and only the best `preselect` of them at full "
        "size; at or below it every candidate plans the full batch", metavar="N", check=POSITIVE_INT)
    preselect: int = option(1, "candidates planned at full size after the proxy's ranking (the next ones "
                            "in its order too while none of them gives a valid plan that fits)", metavar="N",
                            check=POSITIVE_INT)
    preselect_margin: float = option(
        0.02, "also plan at full size every candidate whose proxy step time is within this fraction of "
        "the proxy's fastest (a close call is settled on the full batch)", metavar="X",
        check=NON_NEGATIVE_FRACTION)
    proxy_factor: int | None = option(
        None, "the proxy's k: it keeps every k-th sequence, longest first, on dp/k pipelines of the same "
        "tp, pp and cp; default: the largest divisor of dp that leaves at least proxy_sequences sequences "
        "and min_proxy_pipelines pipelines (no preselection when that is 1)", metavar="K",
        check=POSITIVE_INT_OR_NONE)
    proxy_sequences: int = option(2048, "fewest sequences the default proxy keeps", metavar="N",
                                  check=POSITIVE_INT)
    min_proxy_pipelines: int = option(8, "fewest data-parallel pipelines the default proxy keeps", metavar="N",
                                      check=POSITIVE_INT)


PLANNER_OPTIONS: dict[str, type[Options]] = {
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
    """The planner's options at their defaults, by name."""
    return options_dict(PLANNER_OPTIONS[planner]())


def option_flag(f: dataclasses.Field) -> str | None:
    """The command-line flag of one option field, None if it has none."""
    flag = f.metadata["flag"]
    return None if flag is None else flag or "--" + f.name.replace("_", "-")


def option_names(planner: str) -> set[str]:
    return {f.name for f in dataclasses.fields(PLANNER_OPTIONS[planner])}


def build_options(planner: str, given: Mapping[str, Any] | Options) -> Options:
    """The planner's options object from a dict of given options (defaults fill the rest) or an
    instance of its class; an unknown name or a value its check refuses is a UserError. A None
    given to a choice field that has a "none" choice means that choice (a TOML or --option
    `none` read as Python's None)."""
    cls = PLANNER_OPTIONS[planner]
    if isinstance(given, cls):
        return given
    if isinstance(given, Options):
        raise UserError(f"planner {planner} takes {cls.__name__}, not {type(given).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        valid = ", ".join(fields) or "none"
        raise UserError(f"planner {planner} has no option {', '.join(unknown)}: its options are {valid}")
    return cls(**{name: none_choice(fields[name], value) for name, value in given.items()})


def none_choice(f: dataclasses.Field, value: Any) -> Any:
    """`value`, or the choice "none" where the field offers it and the value is None."""
    return "none" if value is None and "none" in f.metadata["check"].choices else value


def options_dict(opts: Options) -> dict[str, Any]:
    """Every field of `opts` by name, as a plan file stores options (values copied)."""
    return dataclasses.asdict(opts)  # type: ignore[call-overload]


def given_options(opts: Mapping[str, Any] | Options) -> dict[str, Any]:
    """The options as a plain dict: a dict as it is, an options object's fields that differ from
    their defaults (what a `PlanRequest` built from that dict would hold)."""
    if not isinstance(opts, Options):
        return dict(opts)
    defaults = type(opts)()
    return {f.name: value for f in dataclasses.fields(opts)  # type: ignore[arg-type]
            if (value := getattr(opts, f.name)) != getattr(defaults, f.name)}

"""Hydraulis' parallel scheme space and its cost model: MaxLen(P), T(l, P), UtilLen(P) (hydraulis
§5.1, §6.1, appendices B and C).

A *scheme* P = <TP, PP, CP> is the configuration of one pipeline. The space holds TP in powers of
two up to a node (TP across nodes is not modelled by the cost model, so it is not offered), PP
among the divisors of the layer count (§5.1's D_P) up to `max_pp`, and CP > 1 over the widest
TP (up to `max_cp`, further while the context length needs it; see scheme_space).

T(l, P) is the forward + backward seconds of one micro-batch on the slowest stage of P. The cost
model is affine in a chunk's row tokens and causal (query, key) pairs, so we read it as

    T(chunk) = a * keys + b * tokens + c          (hydraulis B.2: a l^2 + b l + c per scheme)

with c charged once per micro-batch (kernel launches and small-GEMM under-use are per chunk, not
per packed document) and a sequence's own share w(l) = a * l (l + 1) / 2 + b * l. The three
coefficients are probed from `CostModel` on three chunks, so an analytic model and a measured
profile both work. UtilLen(P) (appendix C) is the row length at which the GEMM part reaches
`util_threshold` (0.85) of its asymptotic efficiency: b l / (b l + c) >= 0.85.

MaxLen(P) follows B.1: FP32 master weights and Adam moments are fully sharded over all N GPUs
(optimization-propagation disaggregation, §5.2), BF16 weights and gradients follow the scheme;
that is ZeRO-1 with dp = N / (TP * PP) in the cost model's terms. The executor shards them over
each element's holders instead (runtime/parallel/hetero.py: ZeRO-1 over the strategy's
pipelines x CP ranks), which the planner's per-strategy limit applies (planner._part_limits).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from lengthwise.cost import CostModel, split_layers
from lengthwise.cost.model_memory import ExchangeHolders
from lengthwise.errors import UserError
from lengthwise.cost import memory as mem
from lengthwise.plan.ir import Chunk, Segment
from lengthwise.specs import ModelSpec

PROBE_SHORT = 1024
"""Tokens of the probe chunks that read a, b, c off the cost model (any two lengths do)."""
PROBE_LONG = 8192


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """One pipeline's parallel scheme P and what it costs (hydraulis §6.1 cost model)."""

    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline stages."""
    cp: int
    """Context-parallel degree (1 unless the context length needs it)."""
    max_len: int
    """MaxLen(P): longest micro-batch (tokens) the pipeline holds with 1F1B in flight (B.1)."""
    util_len: int
    """UtilLen(P): micro-batch tokens at which GEMMs reach the utilisation threshold (app. C)."""
    attn_s: float
    """a: seconds per causal (query, key) pair on the slowest stage, forward + backward."""
    token_s: float
    """b: seconds per token on the slowest stage, forward + backward."""
    chunk_s: float
    """c: seconds per micro-batch on the slowest stage (launches, small-GEMM under-use)."""

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.cp

    def __str__(self) -> str:
        cp = f",cp{self.cp}" if self.cp > 1 else ""
        return f"<tp{self.tp},pp{self.pp}{cp}>"

    def seq_time(self, lengths):
        """w(l): a sequence's share of a micro-batch's stage time, seconds (numpy-friendly)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.attn_s * lengths * (lengths + 1) / 2 + self.token_s * lengths

    def chunk_time(self, lengths) -> float:
        """T of one micro-batch packing these sequences: sum of w plus the per-chunk c."""
        return float(np.sum(self.seq_time(lengths))) + self.chunk_s

    def dp_time(self, lengths):
        """Per-sequence cost used by the strategy proposal: w(l) plus c amortised over a
        micro-batch of at least UtilLen tokens (appendix C: short sequences get packed)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.seq_time(lengths) + self.chunk_s * np.minimum(1.0, lengths / self.util_len)


def _stage_time(cost: CostModel, chunk: Chunk, *, layers: int, tp: int, cp: int, last: bool) -> float:
    """Forward + backward seconds of a chunk on one stage, with CP's K/V exchange (backward 2x)."""
    t = cost.forward_time(chunk, layers=layers, tp=tp, cp=cp, head=last)
    t += cost.backward_time(chunk, layers=layers, tp=tp, cp=cp, head=last)
    if cp > 1:
        inter = tp * cp > cost.cluster.gpus_per_node
        t += 3 * cost.cp_comm_time(chunk, layers=layers, tp=tp, cp=cp, inter_node=inter)
    return t


def _probe(*lengths: int) -> Chunk:
    return Chunk(tuple(Segment(i, 0, n) for i, n in enumerate(lengths)))


def _stage_coefficients(cost: CostModel, *, layers: int, tp: int, cp: int, last: bool) -> tuple[float, float, float]:
    """(a, b, c) of one stage from three probes: c = 2 T(x) - T(x + x), then a, b from T(x), T(y)."""
    x, y = PROBE_SHORT, PROBE_LONG
    t = lambda *ls: _stage_time(cost, _probe(*ls), layers=layers, tp=tp, cp=cp, last=last)
    tx = t(x)
    c = max(0.0, 2 * tx - t(x, x))
    kx, ky = x * (x + 1) / 2, y * (y + 1) / 2
    a, b = np.linalg.solve(np.array([[kx, x], [ky, y]], dtype=np.float64), np.array([tx - c, t(y) - c]))
    return max(float(a), 0.0), max(float(b), 1e-30), c


def scheme_coefficients(cost: CostModel, *, tp: int, pp: int, cp: int) -> tuple[float, float, float]:
    """Coefficient-wise maximum over the stages (the slowest stage bounds every micro-batch)."""
    layers = split_layers(cost.model.num_layers, pp)
    seen = {(n, s == pp - 1) for s, n in enumerate(layers)}
    fits = [_stage_coefficients(cost, layers=n, tp=tp, cp=cp, last=last) for n, last in sorted(seen)]
    return tuple(max(f[i] for f in fits) for i in range(3))


def util_len(token_s: float, chunk_s: float, threshold: float) -> int:
    """Smallest row length with b l / (b l + c) >= threshold (hydraulis appendix C)."""
    return max(1, math.ceil(threshold / (1.0 - threshold) * chunk_s / token_s))


def paper_max_len(cost: CostModel, *, tp: int, pp: int, cp: int, num_gpus: int) -> int:
    """MaxLen(P) with FP32 states sharded over all N GPUs (B.1): dp = N / (TP * PP), ZeRO-1."""
    return cost.max_seq_len(tp=tp, pp=pp, cp=cp, dp=max(1, num_gpus // (tp * pp * cp)), zero=1)


def make_scheme(cost: CostModel, *, tp: int, pp: int, cp: int, num_gpus: int, threshold: float) -> Scheme | None:
    """The scheme with its MaxLen and coefficients; None when model states alone overflow."""
    max_len = paper_max_len(cost, tp=tp, pp=pp, cp=cp, num_gpus=num_gpus)
    if max_len < 1:
        return None
    a, b, c = scheme_coefficients(cost, tp=tp, pp=pp, cp=cp)
    return Scheme(tp=tp, pp=pp, cp=cp, max_len=max_len, util_len=min(util_len(b, c, threshold), max_len),
                  attn_s=a, token_s=b, chunk_s=c)


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


def tp_degrees(model: ModelSpec, *, max_tp: int, gpus_per_node: int, num_gpus: int) -> list[int]:
    top = min(max_tp, gpus_per_node, num_gpus)
    return [t for t in _powers_of_two(top) if model.num_heads % t == 0]


def pp_degrees(model: ModelSpec, *, max_pp: int, num_gpus: int) -> list[int]:
    """hydraulis §5.1: PP degrees divide the layer count."""
    return [p for p in range(1, min(max_pp, num_gpus) + 1) if model.num_layers % p == 0]


def scheme_space(cost: CostModel, *, num_gpus: int, context_length: int, max_tp: int, max_pp: int,
                 max_cp: int, threshold: float) -> list[Scheme]:
    """The parallel scheme space (§5.1): TP within a node x PP, and CP over the widest TP.

    CP > 1 stands in for the paper's TP degrees beyond a node (its 32B runs use TP 16 for
    the longest sequences), which our cost model does not price: it adds memory for long
    contexts and shortens the longest sequence's latency. It is offered up to max_cp, and
    beyond that while the context length still needs it."""
    model, node = cost.model, cost.cluster.gpus_per_node
    tps = tp_degrees(model, max_tp=max_tp, gpus_per_node=node, num_gpus=num_gpus)
    pps = pp_degrees(model, max_pp=max_pp, num_gpus=num_gpus)
    schemes = _schemes(cost, tps, pps, [1], num_gpus, threshold)
    for cp in _powers_of_two(num_gpus)[1:]:
        if cp > max_cp and max((s.max_len for s in schemes), default=0) >= context_length:
            break
        schemes += _schemes(cost, tps[-1:], pps, [cp], num_gpus, threshold)
    return sorted(schemes, key=lambda s: (s.num_gpus, s.pp, s.cp, s.tp))


def _schemes(cost, tps, pps, cps, num_gpus, threshold) -> list[Scheme]:
    out = []
    for tp in tps:
        for pp in pps:
            for cp in cps:
                if tp * pp * cp <= num_gpus:
                    s = make_scheme(cost, tp=tp, pp=pp, cp=cp, num_gpus=num_gpus, threshold=threshold)
                    out += [s] if s is not None else []
    return out


def sync_time(cost: CostModel, scheme: Scheme, *, num_pipelines: int, num_gpus: int,
              inter_node: list[bool] | None = None, ranks: int | None = None) -> float:
    """The gradient reduction the simulator charges each pipeline (sim/inputs.py: an all-reduce
    over the pipelines x cp ranks, as every CP rank holds the stage's weights; ZeRO-1), slowest
    stage, seconds. `inter_node[s]`: whether stage s's group spans nodes (`stage_groups_inter`;
    default: whenever the cluster does); `ranks` overrides the group size. Its volume equals
    §5.2's push (reduce-scatter) plus pull (all-gather) when the strategy is homogeneous, where
    LNK reduces to exactly those."""
    ranks = num_pipelines * scheme.cp if ranks is None else ranks
    if ranks <= 1:
        return 0.0
    layers = split_layers(cost.model.num_layers, scheme.pp)
    inter = inter_node if inter_node is not None else [num_gpus > cost.cluster.gpus_per_node] * scheme.pp
    return max(cost.grad_sync_time(layers=n, tp=scheme.tp, dp=ranks, zero=1, inter_node=inter[s],
                                   first=s == 0, last=s == scheme.pp - 1) for s, n in enumerate(layers))


def stage_groups_inter(schemes: list[Scheme], *, gpus_per_node: int) -> list[bool]:
    """For each stage index, whether its data-parallel group (that stage of every pipeline that
    has one) spans nodes, pipelines taking GPUs in order (how sim/inputs.py places a plan)."""
    offsets = np.cumsum([0] + [s.num_gpus for s in schemes]).tolist()
    return [len({(off + s * q.tp * q.cp) // gpus_per_node for off, q in zip(offsets, schemes) if s < q.pp}) > 1
            for s in range(max(q.pp for q in schemes))]


def link_time(cost: CostModel, scheme: Scheme, *, num_gpus: int, holders: ExchangeHolders) -> float:
    """§5.2's exchange of one pipeline's slowest stage in a heterogeneous strategy whose
    elements have `holders` holders, as the executor runs it (runtime/parallel/hetero.py) and
    the simulator charges it (sim/inputs.py): every element is owned by one of its holders, so
    each GPU pushes the bf16 gradients of what it holds and others own and pulls their weights
    back, one all-to-all each way (`CostModel.exchange_time`: the volume of a ring all-reduce
    among the holders); nothing is all-reduced. Charged in full (§5.3 hides most of it behind
    compute: hydraulis Table 1, 1.71 s -> 1.18 s; the executor does not overlap it yet)."""
    inter = num_gpus > cost.cluster.gpus_per_node
    layers = split_layers(cost.model.num_layers, scheme.pp)
    return max(cost.exchange_time(layers=n, tp=scheme.tp, first=s == 0, last=s == scheme.pp - 1, holders=holders,
                                  inter_node=inter) for s, n in enumerate(layers))


def scheme_holders(cost: CostModel, schemes) -> ExchangeHolders:
    """`CostModel.hetero_holders` of a strategy whose pipelines run `schemes`."""
    return cost.hetero_holders([(s.tp, s.pp, s.cp) for s in schemes])


def exchange_time(cost: CostModel, scheme: Scheme, *, num_pipelines: int, num_gpus: int,
                  heterogeneous: bool, inter_node: list[bool] | None = None, ranks: int | None = None,
                  holders: ExchangeHolders | None = None) -> float:
    """Optimization-propagation exchange of one pipeline as the simulator will see it: in a
    heterogeneous strategy (`holders` of its elements) the exchange among each element's
    holders (`link_time`), otherwise the gradient all-reduce of a homogeneous plan
    (`sync_time`)."""
    if heterogeneous:
        return link_time(cost, scheme, num_gpus=num_gpus, holders=holders)
    return sync_time(cost, scheme, num_pipelines=num_pipelines, num_gpus=num_gpus, inter_node=inter_node,
                     ranks=ranks)


def plan_exchange(cost: CostModel, schemes: list[Scheme], *, num_gpus: int) -> list[float]:
    """`exchange_time` of every pipeline of a plan whose pipelines run `schemes` in this order
    (GPUs assigned in order): exactly the simulator's charge, the slowest stage's reduction (a
    homogeneous plan) or exchange (a heterogeneous one)."""
    inter = stage_groups_inter(schemes, gpus_per_node=cost.cluster.gpus_per_node)
    hetero = len(set(schemes)) > 1
    holders = scheme_holders(cost, schemes)
    each = {s: exchange_time(cost, s, num_pipelines=len(schemes), num_gpus=num_gpus, heterogeneous=hetero,
                             inter_node=inter[:s.pp], holders=holders)
            for s in set(schemes)}  # pipelines of a scheme alike
    return [each[s] for s in schemes]


def switch_time(cost: CostModel, old: list[tuple[int, int, int]], new: list[tuple[int, int, int]], *,
                num_gpus: int) -> float:
    """Seconds a strategy switch from pipelines `old` to `new` ((tp, pp, cp) each, in rank
    order) costs the executor (runtime/parallel/hetero.HeteroExchange.switch), 0 when they are
    the same: the fp32 master and AdamW's two moments (12 bytes per element) move from the old
    owners to the new ones in one all-to-all over every GPU, then every GPU pulls its new
    pieces' bf16 weights (one pull of the new layout's exchange). Charged as if every element
    changed owner (an upper bound: an element whose owner holds it in both strategies and is
    picked again stays), at the fullest GPU's owned state, the larger of what it sends and
    receives; nothing moves when every GPU holds the same pieces in both (the owners follow
    from the holdings alone: e.g. 4 x tp1-pp1 and tp1-pp1-cp4), then only the pull is charged."""
    if list(old) == list(new):
        return 0.0

    def stages(pipelines):
        holders = cost.hetero_holders(pipelines)
        for tp, pp, _ in pipelines:
            for s, n in enumerate(split_layers(cost.model.num_layers, pp)):
                yield dict(layers=n, tp=tp, first=s == 0, last=s == pp - 1, holders=holders)

    def holdings(pipelines):  # what each GPU holds, in rank order (tp rank innermost)
        out = []
        for tp, pp, cp in pipelines:
            layers = split_layers(cost.model.num_layers, pp)
            out += [(tp, sum(layers[:s]), n, s == 0, s == pp - 1, t) for s, n in enumerate(layers)
                    for _ in range(cp) for t in range(tp)]
        return out

    inter = num_gpus > cost.cluster.gpus_per_node
    move = 0.0
    if holdings(old) != holdings(new):
        owned = max(cost.hetero_owned(**kw) for p in (old, new) for kw in stages(p))
        state = mem.OPTIMIZER_BYTES_PER_PARAM * owned
        move = cost.collective_time("all_to_all", state * num_gpus / max(1, num_gpus - 1), ranks=num_gpus,
                                    inter_node=inter)
    pull = max(cost.exchange_time(**kw, inter_node=inter) / 2 for kw in stages(new))
    return move + pull


def exchange_elements(held: list[int], owned: list[int]) -> float:
    """Elements the optimisation-propagation exchange sends over the network per direction (pull
    or push), summed over ranks, when each rank holds `held[r]` parameter elements and owns
    `owned[r]` of them (runtime/parallel/hetero.py): each holder pushes what others own, and each
    owner pulls back to the other holders, sum of owned_r (h - 1) = the same total."""
    return float(sum(held) - sum(owned))


def exchange_bytes(held: list[int], owned: list[int], *, elem_bytes: int) -> float:
    """Bytes of one step's exchange: a pull of weights and a push of gradients."""
    return 2 * exchange_elements(held, owned) * elem_bytes


def allreduce_bytes(held: list[int], *, replicas: int, elem_bytes: int) -> float:
    """Bytes a homogeneous ring all-reduce of the same gradients sends, summed over ranks (each
    rank sends 2 (d - 1) / d of its shard over d replicas): the baseline the exchange is
    compared with."""
    if replicas <= 1:
        return 0.0
    return 2 * sum(held) * (replicas - 1) / replicas * elem_bytes


def pipelines_name(pipelines) -> str:
    """tp2-pp1,tp1-pp2 (the pipelines option's grammar) of pipelines with tp, pp and cp, in order."""
    return ",".join(f"tp{p.tp}-pp{p.pp}" + (f"-cp{p.cp}" if p.cp > 1 else "") for p in pipelines)


def parse_pipelines(text: str) -> list[tuple[int, int, int]]:
    """`tp2-pp1,tp1-pp2-cp2` -> [(tp, pp, cp), ...], one per data-parallel pipeline."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"tp(\d+)-pp(\d+)(?:-cp(\d+))?", item.strip())
        if not m or min(int(g) for g in m.groups() if g is not None) < 1:
            raise UserError(f"pipeline scheme {item!r}: expected tpT-ppP or tpT-ppP-cpC with positive degrees, "
                            "e.g. tp2-pp1,tp1-pp2")
        out.append((int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)))
    return out

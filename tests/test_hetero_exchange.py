"""The optimisation-propagation exchange of heterogeneous pipelines (runtime/parallel/hetero.py):
4 gloo ranks in float64, one pipeline of tp2 x pp1 (ranks 0, 1: row and column shards) and one of
tp1 x pp2 (ranks 2, 3: whole parameters on different stages). Pulled weights equal the master
exactly, pushed gradients equal the sum of every rank's shards, AdamW on the owner's shard equals
AdamW on whole parameters, and the bytes sent equal the cost model's charge."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lengthwise.planners.hydraulis.cost import allreduce_bytes, exchange_bytes, exchange_elements
from lengthwise.runtime.distributed.launch import spawn
from lengthwise.runtime.parallel.hetero import WHOLE, HeteroExchange, Shard, shard_indices
from tolerance import normwise_error, reduction_tolerance

SHAPES = {"w": (8, 12), "v": (12, 16), "b": (12,)}
HOLDINGS = [
    {"w": Shard(0, 0, 2), "v": Shard(1, 0, 2), "b": WHOLE},  # pipeline 0, tp rank 0 (row / column)
    {"w": Shard(0, 1, 2), "v": Shard(1, 1, 2), "b": WHOLE},  # pipeline 0, tp rank 1
    {"w": WHOLE, "b": WHOLE},                                 # pipeline 1, stage 0
    {"v": WHOLE},                                             # pipeline 1, stage 1
]


def _full():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}


def _grads_of(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    for n, shard in HOLDINGS[rank].items():
        out[n] = torch.randn(shard_indices(SHAPES[n], shard).numel(), generator=g, dtype=torch.float64)
    return out


def _worker(rank: int):
    W = dist.get_world_size()
    full = _full()
    ex = HeteroExchange.for_shape(("test", 0), SHAPES, HOLDINGS)
    assert HeteroExchange.for_shape(("test", 0), SHAPES, HOLDINGS) is ex
    ex.init_master(full, torch.float64)
    errs = {}
    pulled = ex.unflatten_local(ex.pull())
    errs["pull"] = max([(pulled[n].reshape(-1) - full[n].reshape(-1)[shard_indices(SHAPES[n], s)]).abs().max().item()
                        for n, s in HOLDINGS[rank].items()] + [0.0])
    # expected: every rank's gradient shards scattered into whole parameters and summed
    expected = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    for r in range(W):
        for n, g in _grads_of(r).items():
            expected[n].view(-1).index_add_(0, shard_indices(SHAPES[n], HOLDINGS[r][n]), g)
    mine = _grads_of(rank)
    local = torch.cat([mine[n] for n in ex.held_names()]) if mine else torch.zeros(0, dtype=torch.float64)
    grad = ex.push(local)
    saved = ex.master.clone()
    errs["push"] = 0.0
    for n in SHAPES:
        start = ex.shard_offset[n][rank]
        got = grad[start:start + ex.master_view(n).numel()]
        errs["push"] = max(errs["push"], normwise_error(got, expected[n].reshape(-1)[rank::W]))
    # AdamW on the owner's flat shard == AdamW on whole parameters
    master = torch.nn.Parameter(ex.master)
    master.grad = grad
    torch.optim.AdamW([master], lr=1e-2, weight_decay=0.1).step()
    ex.master = master.data
    errs["adam"] = 0.0
    for n in SHAPES:
        ref = torch.nn.Parameter(full[n].clone())
        ref.grad = expected[n].clone()
        torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1).step()
        errs["adam"] = max(errs["adam"], normwise_error(ex.master_view(n), ref.data.reshape(-1)[rank::W]))
    assert not torch.equal(saved, ex.master)
    sent = torch.tensor([float(ex.bytes_sent)], dtype=torch.float64)
    dist.all_reduce(sent)
    err = torch.tensor([errs["pull"], errs["push"], errs["adam"]], dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return {"pull": err[0].item(), "push": err[1].item(), "adam": err[2].item(),
            "bytes": sent.item(), "held": ex.held_elements()}


def test_exchange_reduces_mixed_tp_layouts_exactly():
    out = spawn(_worker, 4, timeout_s=120)
    assert out["pull"] == 0.0
    # each element sums at most 3 ranks' terms (ranks 0/1, 2 and for b all three)
    assert out["push"] <= reduction_tolerance(torch.float64, 3)
    assert out["adam"] <= reduction_tolerance(torch.float64, 8)
    charge = exchange_bytes(out["held"], world=4, elem_bytes=8)
    assert abs(out["bytes"] - charge) <= 0.01 * charge
    assert out["held"] == [48 + 96 + 12, 48 + 96 + 12, 96 + 12, 192]
    # baseline of the same volume: a homogeneous all-reduce over the 2 pipelines
    assert allreduce_bytes(out["held"], replicas=2, elem_bytes=8) > 0


# a second strategy over the same 4 ranks: one tp4 pipeline (row shards of w, column shards of v)
SWITCHED = [{"w": Shard(0, r, 4), "v": Shard(1, r, 4), "b": WHOLE} for r in range(4)]


def _switch_worker(rank: int):
    """Step 1 on HOLDINGS, switch, step 2 on SWITCHED; against AdamW on whole parameters over
    the same two summed gradients (= restarting from a checkpoint in the second strategy, since
    the whole-parameter reference does not know the layout)."""
    W = dist.get_world_size()
    full = _full()
    ex = HeteroExchange.for_shape(("switch", 0), SHAPES, HOLDINGS)
    ex.init_master(full, torch.float64)
    master = torch.nn.Parameter(ex.master)
    opt = torch.optim.AdamW([master], lr=1e-2, weight_decay=0.1)
    ref = {n: torch.nn.Parameter(full[n].clone()) for n in SHAPES}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.1)
    err = 0.0
    for step, holdings in enumerate([HOLDINGS, SWITCHED]):
        if step:
            ex = ex.switch(("switch", 1), SHAPES, holdings)
            pulled = ex.unflatten_local(ex.last_pull)
            for n, s in holdings[rank].items():  # the new layout's weights are the master's
                whole = ref[n].data.reshape(-1)[shard_indices(SHAPES[n], s)]
                err = max(err, normwise_error(pulled[n].reshape(-1), whole))
        gens = [torch.Generator().manual_seed(1000 * step + r) for r in range(W)]
        grads = [{n: torch.randn(shard_indices(SHAPES[n], s).numel(), generator=gens[r], dtype=torch.float64)
                  for n, s in holdings[r].items()} for r in range(W)]
        for n in SHAPES:
            ref[n].grad = torch.zeros_like(ref[n])
        for r in range(W):
            for n, g in grads[r].items():
                ref[n].grad.view(-1).index_add_(0, shard_indices(SHAPES[n], holdings[r][n]), g)
        mine = grads[rank]
        master.grad = ex.push(torch.cat([mine[n] for n in ex.held_names()]))
        opt.step()
        ref_opt.step()
        for n in SHAPES:
            err = max(err, normwise_error(ex.master_view(n), ref[n].data.reshape(-1)[rank::W]))
    out = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return {"err": out.item(), "moved": ex.switch_cost["state_bytes_moved"],
            "pull_bytes": ex.switch_cost["pull_bytes"]}


def test_strategy_switch_moves_no_state_and_matches_whole_parameter_training():
    out = spawn(_switch_worker, 4, timeout_s=120)
    assert out["err"] <= reduction_tolerance(torch.float64, 8)
    assert out["moved"] == 0
    # the switch's first pull, rank 0 as owner: the charge of the symmetric tp4 layout (each rank
    # holds 24 + 48 + 12 elements; every shard row a multiple of 4 wide) split evenly over 4 ranks
    assert out["pull_bytes"] == exchange_elements([84] * 4, world=4) * 8 / 4


# 3 ranks and row lengths 3 does not divide (14, 20): an owner's elements of a column shard shift
# from row to row, repeating every 3 rows (`blocks`' row phases)
ODD_SHAPES = {"a": (5, 14), "b": (6, 4, 5), "c": (9,)}
ODD_HOLDINGS = [
    {"a": Shard(1, 0, 2), "b": Shard(1, 1, 2), "c": WHOLE},
    {"a": Shard(1, 1, 2), "b": WHOLE},
    {"a": WHOLE, "b": Shard(1, 0, 2), "c": WHOLE},
]


def _odd_worker(rank: int):
    W = dist.get_world_size()
    full = {n: torch.randn(s, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            for n, s in ODD_SHAPES.items()}
    grads = [{n: torch.randn(shard_indices(ODD_SHAPES[n], s).numel(), generator=torch.Generator().manual_seed(r),
                             dtype=torch.float64) for n, s in ODD_HOLDINGS[r].items()} for r in range(W)]
    ex = HeteroExchange(ODD_SHAPES, ODD_HOLDINGS)
    held = torch.cat([full[n].reshape(-1)[shard_indices(ODD_SHAPES[n], ODD_HOLDINGS[rank][n])]
                      for n in ex.held_names()])
    ok = {"init": torch.equal(ex.init_master_from_held(held, dtype=torch.float64),
                              torch.cat([full[n].reshape(-1)[rank::W] for n in ODD_SHAPES]))}
    ok["pull"] = torch.equal(ex.pull(), held)
    # the owner sums from zero in rank order, as scattering every rank's terms in rank order does
    expected = {n: torch.zeros(s, dtype=torch.float64).reshape(-1) for n, s in ODD_SHAPES.items()}
    for r in range(W):
        for n, g in grads[r].items():
            expected[n].index_add_(0, shard_indices(ODD_SHAPES[n], ODD_HOLDINGS[r][n]), g)
    pushed = ex.push(torch.cat([grads[rank][n] for n in ex.held_names()]))
    ok["push"] = torch.equal(pushed, torch.cat([expected[n][rank::W] for n in ODD_SHAPES]))
    every = [None] * W
    dist.all_gather_object(every, ok)
    return every


def test_exchange_is_exact_when_the_world_does_not_divide_the_rows():
    for rank, ok in enumerate(spawn(_odd_worker, 3, timeout_s=120)):
        assert ok == {"init": True, "pull": True, "push": True}, rank

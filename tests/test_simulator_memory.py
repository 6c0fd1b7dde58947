"""Memory replay and the step metrics: activations, K/V state and gradients, recomputation,
communication placement, gradient reduction, imbalance, throughput."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_simulator import TINY, make_plan, random_plans, split, task_lookup, whole

import lengthwise.cost.memory as mem
from lengthwise.cost import CostModel
from lengthwise.plan.ir import Action, Chunk, Segment
from lengthwise.sim import simulate_plan, simulate_times

TINY_LAYERS = 4


def cost(plan) -> CostModel:
    return CostModel(model=plan.model, cluster=plan.cluster)


def states(cm: CostModel, plan, pp: int) -> list[float]:
    layers = plan.pipelines[0].stage_layers(plan.model.num_layers)
    return [cm.model_state_bytes(layers=n, dp=len(plan.pipelines), first=s == 0, last=s == pp - 1)
            for s, n in enumerate(layers)]


def grads(cm: CostModel, plan, pp: int) -> list[float]:
    """The gradients' part of `states`, made in each stage's first backward."""
    layers = plan.pipelines[0].stage_layers(plan.model.num_layers)
    return [cm.grad_bytes(layers=n, dp=len(plan.pipelines), first=s == 0, last=s == pp - 1)
            for s, n in enumerate(layers)]


def live_intervals(result, stage: int, chunks: list[int]) -> list[tuple[float, float]]:
    """(start of F, end of B) of each chunk on a stage: when its activations are held."""
    tl, find = result.timeline, task_lookup(result)
    return [(tl.start[find[0, stage, 0, c]], tl.finish[find[0, stage, 2, c]]) for c in chunks]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])  # ends first on ties
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("pp, m", [(2, 2), (3, 5), (4, 4), (4, 9)])
def test_1f1b_equal_chunks_peak_at_p_minus_s_activations(pp, m):
    r = simulate_times([1.0] * m, pp)
    assert r.peak_memory[0] == [float(min(pp - s, m)) for s in range(pp)]
    plan = make_plan([[whole(i, 64) for i in range(m)]], pp=pp)
    cm = cost(plan)
    result = simulate_plan(plan, cm)
    chunk = plan.pipelines[0].chunks[0]
    for s, n in enumerate(plan.pipelines[0].stage_layers(TINY_LAYERS)):
        first, last, held = s == 0, s == pp - 1, min(pp - s, m)
        grad = grads(cm, plan, pp)[s]
        base = states(cm, plan, pp)[s] - grad  # no gradient before the stage's first backward
        act = cm.activation_bytes(chunk, layers=n, head=last)
        # the loss's backward on the last stage (its bf16 logit gradient), a layer's SwiGLU
        # backward elsewhere; the LM head's bf16 logits in the forward
        work = cm.backward_work_bytes(chunk, layers=n, head=last)
        head = cm.head_forward_bytes(chunk) if last else 0.0
        assert work > 0 and (head > 0) == last
        moments = [base + held * act + head,  # the last warm-up forward's LM head
                   base + held * act + work]  # B0 starts
        if first:  # B0's embedding backward: B0's chunk freed, every gradient made, the bf16 table
            moments.append(base + (held - 1) * act + grad + 2 * TINY.vocab * TINY.hidden)
        if m > held:  # the steady state holds `held` chunks again, beside the gradients
            moments += [base + grad + held * act + head, base + grad + held * act + work]
        elif held > 1:  # B1 starts
            moments.append(base + grad + (held - 1) * act + work)
        assert result.peak_memory[0][s] == pytest.approx(max(moments))


def test_state_aware_k1_keeps_one_split_activation():
    group = list(range(1, 6))
    r = simulate_times([1, 2, 2, 2, 2, 2, 1], 3, schedule="state-aware-1f1b", groups=[(1, 5)], k=1)
    for s in range(3):
        assert max_overlap(live_intervals(r, s, group)) == 1
    full = simulate_times([1, 2, 2, 2, 2, 2, 1], 3, schedule="state-aware-1f1b", groups=[(1, 5)], k=5)
    assert not np.any(full.timeline.tasks.kind == 1)
    assert sum(map(sum, full.reforward)) == 0
    assert max_overlap(live_intervals(full, 0, group)) == 5


@pytest.mark.parametrize("k", [1, 2, 3])
def test_state_aware_keeps_at_most_k_split_activations(k):
    r = simulate_times([2] * 6, 4, schedule="state-aware-1f1b", groups=[(0, 5)], k=k)
    assert all(max_overlap(live_intervals(r, s, list(range(6)))) <= k for s in range(4))


def test_split_sequence_holds_kv_state_and_kv_gradients():
    chunks = split(0, [0, 96, 160])
    plan = make_plan([chunks], pp=1)
    cm = cost(plan)
    r = simulate_plan(plan, cm)
    acts = [cm.activation_bytes(c, layers=4, head=True) for c in chunks]
    # while a B runs: on TINY's 260-word vocabulary the final norm's backward, once the loss's
    # softmax is freed, is the largest working set, not the loss's (`cost/memory.py`)
    work = [cm.backward_work_bytes(c, layers=4, head=True) for c in chunks]
    assert all(w > cm.head_backward_bytes(c) for w, c in zip(work, chunks))
    kv = cm.kv_bytes(96, layers=4)
    grad = grads(cm, plan, 1)[0]
    base = states(cm, plan, 1)[0] - grad
    table = 2 * TINY.vocab * TINY.hidden  # the embedding's bf16 gradient at each B's end
    # F0 F1 B1 B0. While B1 runs: both chunks' activations, slice 0's K/V and the K/V-gradient
    # buffer, no gradient yet; at B1's end (its embedding backward) chunk 1 is freed and every
    # gradient made; B0 then holds them all beside chunk 0.
    moments = [base + sum(acts) + 2 * kv + work[1], base + acts[0] + 2 * kv + grad + table,
               base + acts[0] + 2 * kv + grad + max(work[0], table - acts[0])]
    assert r.peak_memory[0][0] == pytest.approx(max(moments))
    # state-aware with k = 1 re-forwards slice 0 after B1 (no grad: K/V only), then F0 B0
    rerun = simulate_plan(make_plan([chunks], pp=1, schedule="state-aware-1f1b", k=1), cm)
    moments = [base + acts[1] + kv + kv + work[1], base + kv + kv + grad + table,
               base + acts[0] + 2 * kv + grad + max(work[0], table - acts[0])]
    assert rerun.peak_memory[0][0] == pytest.approx(max(moments))


def level_during(result, task: int) -> float:
    """Highest memory held while a task runs (its start's allocations in, its end's frees not)."""
    tl, curve = result.timeline, result.timeline.memory
    inside = (curve.time >= tl.start[task]) & (curve.time < tl.finish[task])
    return float(curve.level[inside].max())


def test_chunkflow_system_holds_a_dropped_forwards_graph_until_the_next_forward_ends():
    """`CostModel.nograd_keeps_graph`: ChunkFlow's Algorithm 2 runs slice 0's and slice 1's first
    forwards with autograd on and drops their losses, so each graph lives to the end of the
    next forward; `grads_held_all_step`: Megatron-LM's gradient buffer exists before the step.
    State-aware K = 1 on one stage: N0 N1 F2 B2 F1 B1 F0 B0."""
    chunks = split(0, [0, 64, 128, 192])
    plan = make_plan([chunks], pp=1, schedule="state-aware-1f1b", k=1)
    assert [str(a) for a in plan.pipelines[0].stages[0][:3]] == ["N0", "N1", "F2"]
    executor = cost(plan)
    system = CostModel(model=plan.model, cluster=plan.cluster, nograd_keeps_graph=True, grads_held_all_step=True)
    ours, theirs = simulate_plan(plan, executor), simulate_plan(plan, system)
    find = task_lookup(ours)
    n1, f2 = find[0, 0, 1, 1], find[0, 0, 0, 2]
    act = executor.activation_bytes(chunks[0], layers=TINY_LAYERS, head=True)  # every slice is 64 tokens
    kv = executor.kv_bytes(64, layers=TINY_LAYERS)
    head = executor.head_forward_bytes(chunks[2])
    full, grad = states(executor, plan, 1)[0], grads(executor, plan, 1)[0]
    assert theirs.timeline.memory.base[0] == pytest.approx(full)
    assert ours.timeline.memory.base[0] == pytest.approx(full - grad)
    # while F2 runs: slice 1's dropped graph beside F2's own, the K/V of slices 0 and 1
    assert level_during(theirs, f2) == pytest.approx(full + 2 * act + 2 * kv + head)
    assert level_during(ours, f2) == pytest.approx(full - grad + act + 2 * kv + head)
    # while N1 runs: slice 0's graph (freed at N1's end) and N1's own, where the executor holds
    # one layer's working set; the K/V of both slices from their first forwards' starts
    assert level_during(theirs, n1) == pytest.approx(full + 2 * act + 2 * kv)
    one_layer = executor.activation_bytes(chunks[1], layers=1)
    assert level_during(ours, n1) == pytest.approx(full - grad + one_layer + 2 * kv)


def test_recomputed_layers_shrink_activations_and_lengthen_backward():
    # chunks long enough that B0's start (both chunks held) is each plan's peak, not the
    # gradients made by B0 (the tiny model's 3 MB) beside one chunk
    chunks = [whole(0, 2048), whole(1, 2048)]
    gpipe = [[Action.parse(a) for a in "F0 F1 B0 B1".split()]]
    redo = [[Action.parse(a) for a in "F0.r2 F1.r2 B0 B1".split()]]
    plain, ckpt = (make_plan([chunks], pp=1, stages=s) for s in (gpipe, redo))
    cm = cost(plain)
    a, b = simulate_plan(plain, cm), simulate_plan(ckpt, cm)
    full = cm.activation_bytes(chunks[0], layers=4, head=True)
    kept = cm.activation_bytes(chunks[0], layers=4, head=True, recompute_layers=2)
    # both chunks keep less; B0 re-materialises one layer at a time (per-layer checkpoints),
    # beside that layer's backward, which on the LM head's stage runs once the loss's backward
    # is done and the head's kept tensors are freed: it adds to the backward's working set only
    # what the layer's moment outgrows the loss's by
    # (and the SwiGLU product, which a recomputed layer's nodes keep, `mem.product_bytes_per_token`)
    one_layer = cm.recompute_transient_bytes(chunks[0], recompute_layers=2)
    product = mem.product_bytes_per_token(cm.model) * sum(g.stop - g.start for g in chunks[0].segments)
    assert one_layer == pytest.approx((full - kept) / 2 + product)
    work = [cm.backward_work_bytes(chunks[0], layers=4, head=True, remat=r) for r in (0.0, one_layer)]
    assert 0.0 <= work[1] - work[0] <= one_layer
    assert a.peak_memory[0][0] - b.peak_memory[0][0] == pytest.approx(2 * (full - kept) - (work[1] - work[0]))
    extra = cm.backward_time(chunks[0], layers=4, head=True, recompute_layers=2) - cm.backward_time(
        chunks[0], layers=4, head=True)
    assert b.makespan - a.makespan == pytest.approx(2 * extra)


def test_handoffs_use_the_inter_node_link_where_stages_cross_nodes():
    plan = make_plan([[whole(0, 256)]], pp=4, tp=4, per_node=8)  # stages on GPUs 0-3 | 4-7 || 8-11 | 12-15
    cm = cost(plan)
    r = simulate_plan(plan, cm)
    find = task_lookup(r)
    nbytes = cm.boundary_bytes(plan.pipelines[0].chunks[0], tp=4)
    sends = [r.timeline.send[find[0, s, 0, 0]] for s in range(3)]
    assert sends[0] == sends[2] == pytest.approx(cm.p2p_time(nbytes, inter_node=False))
    assert sends[1] == pytest.approx(cm.p2p_time(nbytes, inter_node=True))
    assert r.timeline.start[find[0, 2, 0, 0]] == pytest.approx(r.timeline.finish[find[0, 1, 0, 0]] + sends[1])


def test_sharded_segments_pay_cp_exchange_once_forward_once_backward():
    """The forward all-gathers the K/V of sharded segments, the backward reduce-scatters their
    gradients (the same bytes, priced as a reduce-scatter)."""
    chunk = Chunk((Segment(0, 0, 512),))  # SHARDED over the CP group by default
    plan = make_plan([[chunk]], pp=1, cp=2)
    cm = cost(plan)
    r = simulate_plan(plan, cm)
    gather = cm.cp_comm_time(chunk, layers=4, cp=2)
    scatter = cm.cp_grad_comm_time(chunk, layers=4, cp=2)
    assert gather > 0 and scatter > 0
    assert scatter == pytest.approx(4 * cm.collective_time("reduce_scatter", cm.cp_kv_layer_bytes(chunk),
                                                            ranks=2, inter_node=False))
    fwd = cm.forward_time(chunk, layers=4, cp=2, head=True)
    bwd = cm.backward_time(chunk, layers=4, cp=2, head=True)
    assert r.makespan == pytest.approx(fwd + gather + bwd + scatter)
    assert r.timeline.comm.tolist() == pytest.approx([gather, scatter])


def test_tp_stages_pay_the_embedding_and_head_collectives():
    """Under tp the first stage's actions pay the embedding's sequence-parallel collective and
    the last stage's the LM head's (`CostModel.sp_edge_comm_time`); a one-stage pipeline both."""
    chunk = Chunk((Segment(0, 0, 512),))
    for pp in (1, 2):
        plan = make_plan([[chunk]], pp=pp, tp=2)
        cm = cost(plan)
        r = simulate_plan(plan, cm)
        layers = plan.pipelines[0].stage_layers(plan.model.num_layers)
        want = 0.0
        for s, n in enumerate(layers):
            kw = {"layers": n, "tp": 2, "head": s == pp - 1, "embed": s == 0}
            want += cm.forward_time(chunk, **kw) + cm.backward_time(chunk, **kw)
            assert cm.sp_edge_comm_time(512, tp=2, head=kw["head"], embed=kw["embed"]) > 0
        send = r.timeline.send.sum()
        assert r.makespan == pytest.approx(want + send)


def test_gradient_reduction_waits_for_the_slowest_replica_of_each_stage():
    light = [whole(0, 64), whole(1, 64)]
    heavy = [whole(2, 256), whole(3, 256), whole(4, 256)]
    plan = make_plan([light, heavy], pp=2)
    plan.pipelines[0].extra_comm_s = 0.5
    r = simulate_plan(plan, cost(plan))
    tl = r.timeline
    stage_end = np.zeros(4)
    np.maximum.at(stage_end, tl.tasks.pipeline * 2 + tl.tasks.stage, tl.finish)
    sync = np.array(r.grad_sync).reshape(-1)
    assert np.all(sync > 0)
    aligned = np.maximum(stage_end[:2], stage_end[2:])
    expected = max((aligned + sync[:2]).max() + 0.5, (aligned + sync[2:]).max())
    assert r.step_time_s == pytest.approx(expected)


def test_dp_imbalance_is_slowest_over_fastest():
    plan = make_plan([[whole(0, 64)], [whole(1, 64), whole(2, 64)]], pp=1)
    r = simulate_plan(plan, cost(plan))
    slow, fast = max(r.pipeline_makespan), min(r.pipeline_makespan)
    assert r.dp_imbalance == pytest.approx(slow / fast) and r.dp_imbalance > 1.5
    assert r.dp_imbalance_spread == pytest.approx((slow - fast) / slow)


def test_throughput_mfu_and_fit_follow_their_definitions():
    plan = make_plan([[whole(0, 300), Chunk((Segment(1, 0, 100), Segment(2, 0, 60)))]], pp=2)
    cm = cost(plan)
    r = simulate_plan(plan, cm)
    assert r.tokens == 460
    assert r.tokens_per_s == pytest.approx(460 / r.step_time_s)
    flops = sum(cm.forward_flops(c, layers=4, head=True) + cm.backward_flops(c, layers=4, head=True)
                for c in plan.pipelines[0].chunks)
    assert r.mfu == pytest.approx(flops / (r.step_time_s * 2 * plan.cluster.peak_tflops * 1e12))
    assert r.fits is True and r.capacity_bytes == cm.capacity_bytes
    d = json.loads(json.dumps(r.to_dict()))
    assert {"makespan", "step_time_s", "bubble_ratio", "reforward_counted_as_busy", "peak_memory",
            "dp_imbalance", "fits", "tokens_per_s", "mfu"} <= set(d)


# ---- the batched replay is the per-pipeline replay ----

def per_pipeline_replay(plan, cm):
    """The memory curves built pipeline by pipeline (memory.memory_events), as the engine did
    before it built every pipeline's events at once."""
    from lengthwise.sim.dag import build_pipeline, concatenate, evaluate
    from lengthwise.sim.inputs import plan_inputs
    from lengthwise.sim.memory import memory_events, replay, split_sequences
    from lengthwise.sim.simulate import _task_tables

    inputs = plan_inputs(plan, cm)
    deps = [p.deps for p in inputs]
    pipes = [build_pipeline(p.stages, p.chunks, p.backward_chunks, d) for p, d in zip(inputs, deps)]
    tasks = concatenate(pipes)
    dur, _, send = _task_tables(inputs, tasks)
    start, finish = evaluate(tasks, dur, send)
    offs = np.cumsum([0] + [len(p.stages) for p in inputs])
    gstage = offs[:-1][tasks.pipeline] + tasks.stage
    ids, ends, deltas = [], [], []
    for i, (inp, pipe, d) in enumerate(zip(inputs, pipes, deps)):
        t, e, x = memory_events(pipe, d, inp.sizes, split_sequences(inp.chunks, inp.backward_chunks or inp.chunks))
        ids.append(t + tasks.offsets[i])
        ends.append(e)
        deltas.append(x)
    tid, at_end = np.concatenate(ids), np.concatenate(ends)
    time = np.where(at_end, finish[tid], start[tid])
    base = np.concatenate([np.asarray(p.sizes.state, dtype=np.float64) for p in inputs])
    return replay(gstage[tid], time, np.concatenate(deltas), base)


def assert_same_curves(a, b):
    for name in ("stage", "time", "level", "base", "peak"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


@settings(max_examples=40, deadline=None)
@given(plan=random_plans(), system=st.booleans())
def test_batched_memory_replay_is_the_per_pipeline_replay(plan, system):
    # split sequences, no-grad forwards (state-aware K), several pipelines of different shapes;
    # `system`: ChunkFlow's system's settings (dropped graphs held to the next forward)
    cm = CostModel(model=plan.model, cluster=plan.cluster, nograd_keeps_graph=system, grads_held_all_step=system)
    assert_same_curves(simulate_plan(plan, cm).timeline.memory, per_pipeline_replay(plan, cm))


def test_batched_memory_replay_with_recomputation_and_slimpack_units():
    from test_planner_slimpack import plan as slimpack_plan, sample

    chunks = split(0, [0, 300, 700, 1000]) + [whole(1, 200)]
    plain = make_plan([chunks], pp=2).pipelines[0].stages
    stages = [[Action(a.kind, a.chunk, 2 if a.kind == "F" else 0) for a in acts] for acts in plain]
    plan = make_plan([chunks, [whole(2, 500), whole(3, 64)]], pp=2)  # a second pipeline without recomputation
    plan.pipelines[0] = make_plan([chunks], pp=2, stages=stages).pipelines[0]
    assert any(a.recompute_layers for acts in plan.pipelines[0].stages for a in acts)
    cm = cost(plan)
    assert_same_curves(simulate_plan(plan, cm).timeline.memory, per_pipeline_replay(plan, cm))
    out, req = slimpack_plan(sample("github", 64, 32 * 1024), dp=4, pp=2, context=32 * 1024)
    assert any(p.backward_chunks is not None for p in out.pipelines)
    assert_same_curves(simulate_plan(out, req.cost).timeline.memory, per_pipeline_replay(out, req.cost))


@settings(max_examples=60, deadline=None)
@given(events=st.lists(st.tuples(st.integers(0, 40000), st.sampled_from([0.0, -0.0, 0.5, 1.0, 1e-300, 2.5, 7.0]),
                                 st.floats(-4.0, 4.0)), max_size=60))
def test_event_order_is_lexsort_of_stage_time_and_frees_first(events):
    from lengthwise.sim.memory import _event_order

    stage = np.array([e[0] for e in events], dtype=np.int64)
    time = np.array([e[1] for e in events], dtype=np.float64)
    delta = np.array([e[2] for e in events], dtype=np.float64)
    assert np.array_equal(_event_order(stage, time, delta), np.lexsort((delta > 0, time, stage)))


def test_backward_units_free_their_cells_one_by_one():
    """With backward units apart from the forward chunks (SlimPack), each cell, the part of a
    chunk one unit holds, is its own row: its activations are made by the chunk's F and freed by
    its unit's B (runtime/cells.py). One chunk of two 128-token sequences backwarded by two
    units, one sequence each: while the second B runs the stage holds the second sequence's
    cell only, beside the gradients the first B made, and its working set (the loss's, or the
    embedding's bf16 table once the cell is freed); the whole chunk's 256 tokens were held
    until the last B before."""
    from lengthwise.plan.ir import PipelinePlan, StepPlan
    from test_simulator import cluster

    chunk = Chunk((Segment(0, 0, 128), Segment(1, 0, 128)))
    units = [Chunk((Segment(1, 0, 128),)), Chunk((Segment(0, 0, 128),))]
    stages = [[Action("F", 0), Action("B", 0), Action("B", 1)]]
    plan = StepPlan(planner="test", model=TINY, cluster=cluster(1, 8), lengths=[128, 128],
                    pipelines=[PipelinePlan(chunks=[chunk], stages=stages, backward_chunks=units)])
    cm = cost(plan)
    r = simulate_plan(plan, cm)
    mem, b1 = r.timeline.memory, task_lookup(r)[0, 0, 2, 1]
    at = np.flatnonzero(mem.time == r.timeline.start[b1])[-1]   # after B0's frees and B1's allocations
    grad = grads(cm, plan, 1)[0]
    cell = cm.activation_bytes(Chunk((Segment(0, 0, 128),)), layers=4, head=True)
    work = max(cm.backward_work_bytes(units[1], layers=4, head=True), 2 * TINY.vocab * TINY.hidden - cell)
    assert mem.level[at] == pytest.approx(states(cm, plan, 1)[0] + cell + work)
    # B0, the stage's first: both cells, no gradient yet; at its end (its embedding backward)
    # its cell is freed and every gradient made
    first = max(cm.backward_work_bytes(units[0], layers=4, head=True), 2 * TINY.vocab * TINY.hidden + grad - cell)
    b0 = task_lookup(r)[0, 0, 2, 0]
    assert mem.level[np.flatnonzero(mem.time == r.timeline.start[b0])[-1]] == pytest.approx(
        states(cm, plan, 1)[0] - grad + 2 * cell + first)

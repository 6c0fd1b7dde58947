"""Schedules as data: generators (GPipe, 1F1B, state-aware 1F1B) and the deadlock checker."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lengthwise.errors import UserError
from lengthwise.plan.ir import Action, Chunk, Segment
from lengthwise.plan.schedule_checks import check_message_order, check_schedule
from lengthwise.plan.schedules import (
    SCHEDULE_NAMES,
    chunk_groups,
    dependencies,
    format_schedule,
    held_chunks,
    make_schedule,
)


def whole(seq: int, n: int = 10) -> Chunk:
    return Chunk((Segment(seq, 0, n),))


def slices(seq: int, cuts: list[int]) -> list[Chunk]:
    return [Chunk((Segment(seq, a, b),)) for a, b in zip(cuts[:-1], cuts[1:])]


def acts(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


@st.composite
def chunk_lists(draw):
    """Standalone chunks and split sequences, in a random order that keeps slices in order."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=7))  # slices per sequence
    slots = draw(st.permutations([seq for seq, n in enumerate(sizes) for _ in range(n)]))
    next_slice = [0] * len(sizes)
    chunks = []
    for seq in slots:
        i = next_slice[seq]
        next_slice[seq] += 1
        chunks.append(Chunk((Segment(seq, 10 * i, 10 * (i + 1)),)))
    return chunks


def test_equal_chunks_1f1b_is_warmup_steady_cooldown():
    chunks = [whole(i) for i in range(6)]
    stages = make_schedule("1f1b", chunks, pp=4)
    for s, actions in enumerate(stages):
        kinds = "".join(a.kind for a in actions)
        warm = 4 - s - 1
        assert kinds == "F" * warm + "FB" * (6 - warm) + "B" * warm
        assert [a.chunk for a in actions if a.kind == "B"] == list(range(6))


def test_gpipe_runs_all_forwards_then_all_backwards():
    stages = make_schedule("gpipe", [whole(i) for i in range(3)], pp=2)
    assert [str(a) for a in stages[1]] == ["F0", "F1", "F2", "B0", "B1", "B2"]


@settings(max_examples=120, deadline=None)
@given(chunks=chunk_lists(), pp=st.integers(1, 5), name=st.sampled_from(SCHEDULE_NAMES),
       k=st.one_of(st.none(), st.integers(1, 4)))
def test_generated_schedules_never_deadlock(chunks, pp, name, k):
    stages = make_schedule(name, chunks, pp=pp, k=k)
    check_schedule(stages, chunks)
    check_message_order(stages)
    for actions in stages:
        for c in range(len(chunks)):
            assert sum(a == Action("F", c) for a in actions) == 1
            assert sum(a == Action("B", c) for a in actions) == 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), k=st.integers(1, 6), pp=st.integers(1, 4))
def test_state_aware_reruns_first_n_minus_k_slices(n, k, pp):
    chunks = [whole(100)] + slices(0, list(range(n + 1))) + [whole(101)]
    stages = make_schedule("state-aware-1f1b", chunks, pp=pp, k=k)
    nograd = [a.chunk for a in stages[0] if a.kind == "N"]
    assert nograd == list(range(1, 1 + max(n - k, 0)))
    order = [a.chunk for a in stages[-1] if a.kind == "B" and 1 <= a.chunk <= n]
    assert order == list(range(n, 0, -1))  # backward in reverse slice order


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), pp=st.integers(1, 5), k=st.integers(1, 3))
def test_state_aware_reforwards_after_the_freeing_backward_on_every_stage(sizes, pp, k):
    """Chunks as ChunkFlow builds them (split sequences first, then whole ones): on every stage a
    slice runs forward again only after the backward of the slice K places later (Algorithm 2),
    and a stage holds at most max(K, pp - stage) chunks' activations."""
    sizes = sorted(sizes, key=lambda n: n == 1)
    chunks, slice_of = [], []
    for seq, n in enumerate(sizes):
        chunks += slices(seq, list(range(0, 10 * n + 1, 10)))
        slice_of += [(seq, i) for i in range(n)]
    index = {sl: c for c, sl in enumerate(slice_of)}
    for s, actions in enumerate(make_schedule("state-aware-1f1b", chunks, pp=pp, k=k)):
        names = [str(a) for a in actions]
        for c, (seq, i) in enumerate(slice_of):
            if f"N{c}" in names:
                assert names.index(f"F{c}") > names.index(f"B{index[seq, i + k]}")
        assert held_chunks(actions) <= max(k, pp - s)


def test_chunk_dependencies_follow_segments():
    chunks = [Chunk((Segment(0, 0, 5), Segment(1, 0, 3))), whole(2), Chunk((Segment(0, 5, 9),)),
              Chunk((Segment(0, 9, 12), Segment(3, 0, 4)))]
    assert dependencies(chunks).fwd_after == ((), (), (0,), (2,))
    assert chunk_groups(chunks) == [[0, 2, 3], [1]]


def test_missing_previous_slice_is_a_user_error():
    with pytest.raises(UserError, match="no chunk holds a slice ending there"):
        dependencies([Chunk((Segment(0, 5, 9),))])


def test_slices_out_of_order_are_rejected():
    with pytest.raises(UserError, match="order chunks"):
        make_schedule("1f1b", slices(0, [0, 4, 8])[::-1], pp=2)


def test_unknown_schedule_names_the_valid_ones():
    with pytest.raises(UserError, match="gpipe, 1f1b, state-aware-1f1b"):
        make_schedule("zb-v", [whole(0)], pp=2)


def test_deadlocking_schedule_rejected_with_grid():
    chunks = [whole(0), whole(1)]
    stages = [acts("F0 F1 B1 B0"), acts("F0 B0 B1 F1")]  # stage 1 runs B1 before F1
    with pytest.raises(UserError) as info:
        check_schedule(stages, chunks)
    text = str(info.value)
    assert "deadlock" in text and "stage0" in text and "stage1" in text
    error_row = next(line for line in text.splitlines() if "<-- ERROR HERE" in line)
    assert "B1" in error_row
    assert "stage 1 B1 waits for F1 on stage 1" in text


def test_split_sequence_backward_in_forward_order_deadlocks():
    chunks = slices(0, [0, 4, 8])
    with pytest.raises(UserError, match="stage 0 B0 waits for B1 on stage 0"):
        check_schedule([acts("F0 F1 B0 B1")], chunks)


@pytest.mark.parametrize("text, problem", [
    ("F0 F0 B0", "runs twice"),
    ("F0 N0 B0", "N0 after F0"),
    ("F0 B0 F7", "out of range"),
    ("F0", "never runs B0"),
])
def test_malformed_stage_lists_are_rejected(text, problem):
    with pytest.raises(UserError, match=problem):
        check_schedule([acts(text)], [whole(0)])


def test_nograd_and_grad_forwards_do_not_stand_in_for_each_other():
    chunks = slices(0, [0, 4, 8])
    with pytest.raises(UserError, match="stage 1 F0 waits for F0 on stage 0"):
        check_schedule([acts("N0 F1 B1 F0 B0"), acts("F0 F1 B1 B0")], chunks)
    with pytest.raises(UserError, match="waits for N0 on stage 0, which stage 0 never runs"):
        check_schedule([acts("F0 F1 B1 B0"), acts("N0 F1 B1 F0 B0")], chunks)


def test_backward_units_wait_for_every_forward_they_read():
    chunks = [Chunk((Segment(0, 0, 4),)), Chunk((Segment(1, 0, 4),))]
    units = [Chunk((Segment(0, 0, 4), Segment(1, 0, 4)))]  # SlimPack-style regrouping
    deps = dependencies(chunks, units)
    assert deps.bwd_needs == ((0, 1),)
    check_schedule([acts("F0 F1 B0")], chunks, units)
    with pytest.raises(UserError, match="waits for F1"):
        check_schedule([acts("F0 B0 F1")], chunks, units)


def test_format_schedule_has_one_column_per_stage():
    text = format_schedule(make_schedule("1f1b", [whole(0), whole(1)], pp=3))
    assert text.splitlines()[0].split() == ["pos", "stage0", "stage1", "stage2"]


def test_a_link_whose_ends_disagree_on_message_order_is_rejected():
    """NCCL pairs messages by order: stage 0 sending F1 before F0 while stage 1 receives F0
    first would hand F1's activation to F0."""
    with pytest.raises(UserError, match=r"forward messages from stage 0 to stage 1 arrive out of order: "
                                        r"message 0 is F1 when sent but F0 when received"):
        check_message_order([acts("F1 F0 B0 B1"), acts("F0 F1 B0 B1")])
    with pytest.raises(UserError, match="backward messages from stage 1 to stage 0"):
        check_message_order([acts("F0 F1 B0 B1"), acts("F0 F1 B1 B0")])
    check_message_order([acts("F0 F1 B0 B1"), acts("F0 B0 F1 B1")])  # interleavings may differ


def test_chunkflow_reforwards_keep_one_order_on_every_link():
    """The plan of the issue that found the problem: ChunkFlow K = 1 at pp = 4 re-forwards a
    slice after more first forwards on stage 0 than on stage 3; every stage now runs stage 0's
    forward order."""
    chunks = [whole(0), *slices(1, [0, 4, 8, 12]), whole(2), whole(3), *slices(4, [0, 4, 8])]
    stages = make_schedule("state-aware-1f1b", chunks, pp=4, k=1)
    check_schedule(stages, chunks)
    check_message_order(stages)
    assert any(str(a) == "N1" for a in stages[3]) and any(str(a) == "F1" for a in stages[3])


def test_held_chunks_counts_forwards_until_their_backward_and_not_nograd_forwards():
    """A chunk's activations are held from its F to its B; an N keeps K/V only. The last stage
    list the state-aware 1F1B generator once emitted for a 10-slice sequence and two standalone
    chunks holds three at once (1F1B's warm-up bound, pp - stage, would say one)."""
    stage = [Action.parse(a) for a in "N0 N1 F2 B2 F10 F1 B1 F11 F0 B0 B10 B11".split()]
    assert held_chunks(stage) == 3
    assert held_chunks([Action.parse(a) for a in "F0 B0 F1 B1".split()]) == 1
    assert held_chunks([]) == 0

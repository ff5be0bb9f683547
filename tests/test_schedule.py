"""Schedules as data: every built-in schedule, every size, no model and no threads."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule import (
    COSTS,
    UNIT,
    Action,
    Kind,
    available_schedules,
    get_schedule,
    makespan,
    simulate,
    validate,
)
from lightning_pipe.schedule.__main__ import page

RANKS = range(1, 9)
MICROBATCHES = range(1, 17)
VIRTUAL = (1, 2)
BUILT_IN = [
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "zero-bubble",
    "looped-bfs",
    "interleaved-zero-bubble",
    "zbv",
    "dualpipev",
]
FULL = {Kind.FORWARD, Kind.BACKWARD}
SPLIT = {Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}
#: chunks per rank each schedule is drawn with
DRAWN_VIRTUAL = {"interleaved-1f1b": 2, "looped-bfs": 2, "interleaved-zero-bubble": 2, "zbv": 2, "dualpipev": 2}


def expected_rejection(name: str, ranks: int, microbatches: int, virtual: int) -> str | None:
    """The part of the message a combination must be rejected with, or None if it is valid."""
    if name in ("1f1b", "zero-bubble") and virtual > 1:
        return "one stage on each rank"
    if name == "interleaved-1f1b" and virtual > 1 and microbatches % ranks:
        return "not a multiple of"
    if name == "interleaved-zero-bubble" and microbatches % max(1, microbatches // ranks):
        return "not a multiple of"
    if name in ("zbv", "dualpipev") and virtual != 2:
        return "pass virtual_stages=2"
    if name == "dualpipev" and microbatches < 2 * ranks:
        return "at least as many microbatches as stages"
    return None


def test_every_built_in_schedule_is_registered() -> None:
    assert set(BUILT_IN) <= set(available_schedules())
    known = "1f1b, async, dualpipev, gpipe, interleaved-1f1b, interleaved-zero-bubble, looped-bfs, zbv, zero-bubble"
    with pytest.raises(ScheduleError, match=f"unknown schedule 'nope'; available: {known}"):
        get_schedule("nope")


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_size_is_valid_or_rejected_with_a_message(name: str) -> None:
    """Stages 1-8 x microbatches 1-16 x virtual_stages 1-2: valid lists, or a ScheduleError saying why."""
    factory = get_schedule(name)
    for ranks, microbatches, virtual in itertools.product(RANKS, MICROBATCHES, VIRTUAL):
        reason = expected_rejection(name, ranks, microbatches, virtual)
        if reason is not None:
            with pytest.raises(ScheduleError, match=reason):
                factory(ranks, microbatches, virtual).actions()
            continue
        schedule = factory(ranks, microbatches, virtual)
        lists = schedule.actions()  # validated: complete, ordered, on the right ranks, no deadlock
        stages = ranks * virtual
        assert len(lists) == ranks
        runs = [(a.stage, a.kind, a.microbatch) for actions in lists for a in actions]
        assert len(runs) == len(set(runs))  # each of a microbatch's F, B, I and W at most once on each stage
        kinds: dict[tuple[int, int], set[Kind]] = {}
        for s, k, m in runs:
            kinds.setdefault((s, m), set()).add(k)
        assert len(kinds) == stages * microbatches  # F, and B or I and W, on every stage for every microbatch
        assert all(found in (FULL, SPLIT) for found in kinds.values())
        for rank, actions in enumerate(lists):
            assert {a.stage for a in actions} == {s for s in range(stages) if schedule.rank_of(s) == rank}
        validate(lists, stages, microbatches, schedule.rank_of)


@pytest.mark.parametrize("ranks", RANKS)
def test_peak_activations(ranks: int) -> None:
    """GPipe holds every microbatch; 1F1B at most ranks - rank; ZB-H1 never more than 1F1B's first rank."""
    for microbatches in MICROBATCHES:
        gpipe = get_schedule("gpipe")(ranks, microbatches, 1).peak_activations()
        onefoneb = get_schedule("1f1b")(ranks, microbatches, 1).peak_activations()
        zb = get_schedule("zero-bubble")(ranks, microbatches, 1).peak_activations()
        assert gpipe == [microbatches] * ranks
        assert onefoneb == [min(ranks - r, microbatches) for r in range(ranks)]
        assert max(zb) <= max(onefoneb)


@pytest.mark.parametrize("ranks", RANKS)
def test_zero_bubble_is_never_slower_than_1f1b(ranks: int) -> None:
    """With a backward costing two forwards (I = W = 1), ZB-H1's step is never longer than 1F1B's."""
    for microbatches in MICROBATCHES:
        zb = get_schedule("zero-bubble")(ranks, microbatches, 1)
        onefoneb = get_schedule("1f1b")(ranks, microbatches, 1)
        assert makespan(zb.actions(), ranks) <= makespan(onefoneb.actions(), ranks)
        if microbatches >= ranks > 1:  # the steady state exists: the paper's bubble, (R - 1) units
            assert makespan(zb.actions(), ranks) == 3 * microbatches + ranks - 1
            assert zb.bubble() < onefoneb.bubble()


def test_interleaving_shrinks_the_bubble() -> None:
    for ranks in range(2, 9):
        for microbatches in range(ranks, 17, ranks):
            plain = get_schedule("1f1b")(ranks, microbatches, 1).bubble(UNIT)
            interleaved = get_schedule("interleaved-1f1b")(ranks, microbatches, 2).bubble(UNIT)
            assert interleaved < plain, (ranks, microbatches)


def test_interleaved_places_stage_s_on_rank_s_mod_ranks() -> None:
    schedule = get_schedule("interleaved-1f1b")(4, 8, 2)
    assert schedule.num_stages == 8
    for rank, actions in enumerate(schedule.actions()):
        assert {a.stage for a in actions} == {rank, rank + 4}
    # microbatches go through a rank's chunks in groups of num_ranks
    first = [str(a) for a in schedule.actions()[0][:8]]
    assert first == ["0F0", "0F1", "0F2", "0F3", "4F0", "4F1", "4F2", "4F3"]


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for ranks, microbatches in itertools.product(RANKS, MICROBATCHES):
        assert (
            get_schedule("interleaved-1f1b")(ranks, microbatches, 1).actions()
            == get_schedule("1f1b")(ranks, microbatches, 1).actions()
        )


def test_gpipe_with_virtual_stages_runs_each_rank_in_model_order() -> None:
    lists = get_schedule("gpipe")(2, 2, 2).actions()
    assert [str(a) for a in lists[0]] == ["0F0", "0F1", "2F0", "2F1", "2B1", "2B0", "0B1", "0B0"]


def test_zero_bubble_splits_every_backward() -> None:
    schedule = get_schedule("zero-bubble")(4, 8, 1)
    kinds = {a.kind for actions in schedule.actions() for a in actions}
    assert kinds == {Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}
    start = schedule.simulate(COSTS)
    # the last rank runs I right after F (the critical path); rank 0 postpones nothing, rank 3 three W's
    assert [str(a) for a in schedule.actions()[3][:4]] == ["3F0", "3I0", "3F1", "3I1"]
    assert start[Action.parse("3I0")] == start[Action.parse("3F0")] + 1


def test_grids_draw_every_action_once() -> None:
    for name in BUILT_IN:
        schedule = get_schedule(name)(4, 8, DRAWN_VIRTUAL.get(name, 1))
        lines = schedule.grid().splitlines()
        assert len(lines) == 4
        for line, actions in zip(lines, schedule.actions(), strict=True):
            assert sorted(line.split("|")[1].split()) == sorted(map(str, actions)), name


def test_simulate_with_costs_stretches_backwards() -> None:
    lists = get_schedule("gpipe")(1, 2, 1).actions()
    assert simulate(lists, 1, COSTS) == {
        Action.parse("0F0"): 0,
        Action.parse("0F1"): 1,
        Action.parse("0B1"): 2,
        Action.parse("0B0"): 4,
    }


def test_docs_page_is_up_to_date() -> None:
    """docs/schedules.md is the output of ``python -m lightning_pipe.schedule 4 8``."""
    docs = Path(__file__).parent.parent / "docs" / "schedules.md"
    assert docs.read_text() == page(4, 8), "regenerate: python -m lightning_pipe.schedule 4 8 > docs/schedules.md"

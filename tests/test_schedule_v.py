"""The schedules torch.distributed.pipelining has besides ours: looped BFS, interleaved zero bubble, ZB-V, DualPipeV."""

from __future__ import annotations

import pytest

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule import (
    COSTS,
    LOOP,
    UNIT,
    Action,
    Kind,
    Schedule,
    V,
    get_schedule,
    placement_of,
    resolve_schedule,
    stage_ranks,
)

V_SHAPED = ("zbv", "dualpipev")


def test_v_placement_puts_stage_r_and_2p_minus_1_minus_r_on_rank_r() -> None:
    assert stage_ranks(V, 8, 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stage_ranks(LOOP, 8, 4) == [0, 1, 2, 3, 0, 1, 2, 3]
    for name in V_SHAPED:
        schedule = get_schedule(name)(4, 8, 2)
        assert placement_of(get_schedule(name)) == V
        for rank, actions in enumerate(schedule.actions()):
            assert {a.stage for a in actions} == {rank, 7 - rank}, name
    for name in ("looped-bfs", "interleaved-zero-bubble"):
        assert placement_of(get_schedule(name)) == LOOP


def test_a_function_or_an_instance_keeps_its_placement() -> None:
    def mine(ranks: int, microbatches: int, virtual: int) -> Schedule:
        return get_schedule("zbv")(ranks, microbatches, virtual)

    mine.placement = V  # type: ignore[attr-defined]
    assert placement_of(resolve_schedule(mine)) == V
    assert placement_of(resolve_schedule(get_schedule("zbv")(2, 4, 2))) == V
    assert placement_of(resolve_schedule("1f1b")) == LOOP


@pytest.mark.parametrize("name", V_SHAPED)
def test_v_shaped_schedules_need_two_chunks(name: str) -> None:
    with pytest.raises(ScheduleError, match="pass virtual_stages=2 and stages = 2 x ranks"):
        get_schedule(name)(2, 4, 1)
    with pytest.raises(ScheduleError, match="pass virtual_stages=2"):
        get_schedule(name)(2, 4, 3)


def test_dualpipev_needs_a_microbatch_per_stage() -> None:
    with pytest.raises(ScheduleError, match=r"at least as many microbatches as stages \(8\).*microbatches=8"):
        get_schedule("dualpipev")(4, 7, 2)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_zbv_has_zero_bubble_and_1f1b_activations(ranks: int) -> None:
    """The paper's unit costs (F = I = W, per chunk): with microbatches >= 2 ranks no rank idles from its
    first action to its last, so the step is the work (6 units a microbatch) plus the fill of ranks - 1
    forwards, whatever the microbatch count; and a rank holds 2 ranks half-size activations = 1F1B's peak."""
    onefoneb_peak = ranks  # 1F1B's first rank holds ranks full activations
    for microbatches in range(2 * ranks, 4 * ranks + 1):
        schedule = get_schedule("zbv")(ranks, microbatches, 2)
        start = schedule.simulate(UNIT)
        for rank, actions in enumerate(schedule.actions()):
            times = sorted(start[a] for a in actions)
            assert times == [rank + i for i in range(len(actions))], (rank, microbatches)  # no gap
            assert len(actions) == 2 * 3 * microbatches
        assert max(start.values()) + 1 == 6 * microbatches + ranks - 1
        assert [p / 2 for p in schedule.peak_activations()] == [onefoneb_peak] * ranks  # half-size chunks
        onefoneb = get_schedule("1f1b")(ranks, microbatches, 1)
        assert schedule.bubble(COSTS) < get_schedule("zero-bubble")(ranks, microbatches, 1).bubble() < onefoneb.bubble()


@pytest.mark.parametrize("ranks", [2, 4])
def test_dualpipev_pairs_a_forward_with_a_backward_and_matches_zbv(ranks: int) -> None:
    for microbatches in (2 * ranks, 4 * ranks):
        dual = get_schedule("dualpipev")(ranks, microbatches, 2)
        zbv = get_schedule("zbv")(ranks, microbatches, 2)
        assert dual.bubble(COSTS) == pytest.approx(zbv.bubble(COSTS))  # B = I + W: the same step
        assert max(dual.peak_activations()) <= 2 * ranks + 1
        kinds = {a.kind for actions in dual.actions() for a in actions}
        assert kinds == {Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}
        last = dual.actions()[-1]  # the last rank's main phase: F of one chunk, then B of the other
        pairs = list(zip(last, last[1:], strict=False))
        assert any(f.kind is Kind.FORWARD and b.kind is Kind.BACKWARD and f.stage != b.stage for f, b in pairs)


def test_looped_bfs_runs_chunks_breadth_first() -> None:
    lists = get_schedule("looped-bfs")(2, 2, 2).actions()
    assert [str(a) for a in lists[0]] == ["0F0", "0F1", "2F0", "2F1", "2B1", "2B0", "0B1", "0B0"]
    assert not get_schedule("looped-bfs").loss_after_all_forwards  # each loss as its output arrives
    for ranks in (2, 4):
        assert get_schedule("looped-bfs")(ranks, 8, 1).actions() == get_schedule("gpipe")(ranks, 8, 1).actions()
        bfs = get_schedule("looped-bfs")(ranks, 8, 2).peak_activations()
        assert bfs == [16] * ranks  # every chunk's every microbatch


def test_interleaved_zero_bubble_beats_interleaved_1f1b() -> None:
    for ranks in (2, 4):
        for microbatches in (2 * ranks, 4 * ranks):
            zb = get_schedule("interleaved-zero-bubble")(ranks, microbatches, 2)
            plain = get_schedule("interleaved-1f1b")(ranks, microbatches, 2)
            assert zb.bubble() < plain.bubble()
            assert zb.peak_activations() == [2 * ranks] * ranks  # ranks whole stages: ZB-H1's (1F1B's rank 0)
            assert {a.stage for a in zb.actions()[0]} == {0, ranks}
    with pytest.raises(ScheduleError, match="microbatches=5 is not a multiple of 2"):
        get_schedule("interleaved-zero-bubble")(2, 5, 2)
    first = [str(a) for a in get_schedule("interleaved-zero-bubble")(2, 4, 2).actions()[0][:5]]
    assert first == ["0F0", "0F1", "2F0", "2F1", "2I0"]  # chunk 0 in rounds of 2, then chunk 1, then its I


def test_grids_of_the_v_shaped_schedules() -> None:
    schedule = get_schedule("zbv")(2, 4, 2)
    lines = schedule.grid().splitlines()
    assert lines[0].startswith("rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0")
    assert lines[1].startswith("rank 1 |     1F0 2F0 1F1 2F1 2I0 2W0")
    assert Action.parse("3F0") in schedule.actions()[0]  # the last stage sits on rank 0
    for name in ("zbv", "dualpipev"):  # the grid each docstring draws is the schedule's own, whole
        built = get_schedule(name)(2, 4, 2)
        assert "\n".join(f"        {line}" for line in built.grid().splitlines()) in (type(built).__doc__ or "")


def test_bubbles_follow_their_formulas() -> None:
    """With F = 1, B = 2, I = W = 1 (a chunk of v costs 1/v): interleaved-1f1b and looped-bfs (p-1)/(vm+p-1),
    interleaved-zero-bubble ZB-H1's over v, (p-1)/(3vm+p-1); zbv and dualpipev (p-1)/(6m+p-1)."""
    for ranks, microbatches in ((2, 4), (2, 8), (4, 8), (4, 16)):
        p, m = ranks, microbatches
        for virtual in (1, 2, 3):
            for name in ("interleaved-1f1b", "looped-bfs"):
                schedule = get_schedule(name)(p, m, virtual)
                assert schedule.bubble() == pytest.approx((p - 1) / (virtual * m + p - 1)), (name, p, m, virtual)
            zb1p = get_schedule("interleaved-zero-bubble")(p, m, virtual).bubble()
            assert zb1p == pytest.approx((p - 1) / (3 * virtual * m + p - 1)), (p, m, virtual)
        for name in V_SHAPED:
            assert get_schedule(name)(p, m, 2).bubble() == pytest.approx((p - 1) / (6 * m + p - 1)), (name, p, m)

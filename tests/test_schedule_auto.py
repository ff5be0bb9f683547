"""``schedule="auto"``'s decision (`lightning_pipe.schedule.auto`) from costs given by hand: no model, no devices."""

from __future__ import annotations

import pytest

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule import (
    AsyncOneFOneB,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    StageCost,
    StepCosts,
    ZeroBubbleH1,
    choose,
    initial_placement,
    makespan,
    register_schedule,
    registered_schedules,
)
from lightning_pipe.schedule.action import Action

# today's schedules by hand: what these tests decide must not move when more schedules are registered
TODAYS = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved-1f1b": Interleaved1F1B,
    "zero-bubble": ZeroBubbleH1,
    "async": AsyncOneFOneB,
}


def even(ranks: int, f: float = 1.0, i: float = 1.0, w: float = 1.0, act: int = 100, split: int = 0) -> StepCosts:
    return StepCosts([StageCost(f, i, w, 0.0, act, split)] * ranks, microbatches=2 * ranks)


def test_prediction_is_the_simulated_step_with_the_measured_times() -> None:
    costs = StepCosts([StageCost(1.0, 0.5, 0.5), StageCost(2.0, 1.0, 1.0)], microbatches=4)
    choice = choose(costs, {"1f1b": OneFOneB}, ranks=2, virtual_stages=1, microbatches=[4])
    schedule = OneFOneB(2, 4)
    expected = makespan(schedule.actions(), 2, lambda a: costs.stages[a.stage].compute(a.kind))
    assert choice.chosen.predicted == pytest.approx(expected)
    # stage 1 is twice as slow and the step follows it: stage 0's F0, stage 1's 4 x (F + B), stage 0's last B
    assert expected == pytest.approx(1.0 + 4 * 4.0 + 1.0)


def test_zero_bubble_wins_where_the_weight_gradient_fills_the_bubble() -> None:
    choice = choose(even(4), TODAYS, ranks=4, virtual_stages=1, microbatches=[8])
    assert choice.chosen.name == "zero-bubble"
    one = choice.predicted("1f1b", 8)
    assert one is not None and choice.chosen.predicted is not None and choice.chosen.predicted < one
    table = choice.table()
    assert f"schedule='auto' chose {choice.chosen.name!r} (placement 'loop') with 8 microbatches" in table
    assert "1f1b" in table and "gpipe" in table and "skipped: asynchronous" in table


def test_fsdp_leaves_out_split_backward_and_the_budget_leaves_out_gpipe() -> None:
    costs = even(2, act=1000, split=500)
    choice = choose(costs, TODAYS, 2, 1, [4], budget=2500, split_backward=False)
    reasons = {c.name: c.reason for c in choice.candidates}
    assert reasons["zero-bubble"] == "splits the backward, which FSDP refuses"
    assert "exceeds the budget" in reasons["gpipe"]  # 4 x 1000 bytes held at once
    assert choice.chosen.name in ("1f1b", "interleaved-1f1b") and choice.chosen.peak_bytes == 2000
    with pytest.raises(ScheduleError, match="the smallest peak is 2.0 KiB"):
        choose(costs, TODAYS, 2, 1, [4], budget=1000)


def test_microbatches_within_the_budget() -> None:
    # measured with 4 microbatches of 1000 bytes; 8 halves each microbatch's bytes and the compute per action
    costs = StepCosts([StageCost(1.0, 1.0, 1.0, 0.1, 1000)] * 2, microbatches=4)
    free = choose(costs, {"1f1b": OneFOneB}, 2, 1, [2, 4, 8])
    assert free.chosen.microbatches == 8  # the smallest bubble while the overhead per action is small
    tight = choose(costs, {"1f1b": OneFOneB}, 2, 1, [2, 4, 8], budget=2000)
    assert [c.microbatches for c in tight.candidates if c.fits] == [4, 8]
    expensive = StepCosts([StageCost(1.0, 1.0, 1.0, 5.0, 1000)] * 2, microbatches=4)
    assert choose(expensive, {"1f1b": OneFOneB}, 2, 1, [2, 4, 8]).chosen.microbatches == 2


def test_candidates_are_the_registry_including_schedules_registered_later() -> None:
    class Late(OneFOneB):
        name = "late"

    register_schedule("late-test", Late)
    try:
        choice = choose(even(2, w=0.0), registered_schedules(), 2, 1, [4])
        assert "late-test" in {c.name for c in choice.candidates if c.fits}
    finally:
        from lightning_pipe import schedule

        schedule._SCHEDULES.pop("late-test")
    # a schedule whose check() refuses the configuration is left out with its own words
    choice = choose(even(4), TODAYS, 2, 2, [3])
    reasons = {c.name: c.reason for c in choice.candidates}
    assert "not a multiple of 2 ranks" in reasons["interleaved-1f1b"]
    assert "virtual_stages=2" in reasons["1f1b"]
    fits = {c.name for c in choice.candidates if c.fits}
    assert "gpipe" in fits and choice.chosen.name in fits and not {"1f1b", "interleaved-1f1b"} & fits


def test_placement_other_than_the_built_pipelines_is_predicted_but_left_out() -> None:
    class Swapped(OneFOneB):
        def rank_of(self, stage: int) -> int:
            return self.num_ranks - 1 - stage

        def build(self) -> list[list[Action]]:
            return super().build()[::-1]

    choice = choose(even(2), {"1f1b": OneFOneB, "swapped": Swapped}, 2, 1, [4], placements=[[0, 1]])
    swapped = {c.name: c for c in choice.candidates}["swapped"]
    assert swapped.reason == "placement 'loop', in which the built pipeline cannot run" and swapped.predicted
    assert choice.chosen.name == "1f1b" and "swapped" in choice.table()


def test_a_v_schedule_wins_where_its_simulated_step_is_shortest() -> None:
    # 4 stages alike on 2 ranks, a hand-off of half a forward: the V keeps the middle hand-off on one rank
    costs = StepCosts([StageCost(1.0, 1.0, 1.0)] * 4, microbatches=8, latency=0.5)
    free = choose(costs, registered_schedules(), 2, 2, [8])
    assert free.chosen.name == "zbv" and free.chosen.placement == "v"
    by_name = {c.name: c.predicted for c in free.candidates if c.fits}
    assert free.chosen.predicted == min(p for p in by_name.values() if p is not None)
    assert "schedule='auto' chose 'zbv' (placement 'v') with 8 microbatches" in free.table()
    # a pipeline built round-robin that cannot move its stages: the best loop schedule, the V ones predicted only
    kept = choose(costs, registered_schedules(), 2, 2, [8], placements=[[0, 1, 0, 1]])
    assert kept.chosen.placement == "loop"
    zbv = {c.name: c for c in kept.candidates}["zbv"]
    assert not zbv.fits and zbv.predicted == free.chosen.predicted


def test_the_hand_off_delays_only_inputs_from_another_rank() -> None:
    # one microbatch through 2 stages: F0 | hand-off | F1, B1 | hand-off | B0 (B costs 2)
    lists = GPipe(2, 1).actions()
    assert makespan(lists, 2) == pytest.approx(6.0)
    assert makespan(lists, 2, latency=0.5) == pytest.approx(7.0)
    # the V: stages 1 and 2 share rank 1, so their hand-off is free; 0 -> 1 and 2 -> 3 cross ranks
    zbv = registered_schedules()["zbv"](2, 4, 2)
    crossing = makespan(zbv.actions(), 4, latency=0.25) - makespan(zbv.actions(), 4)
    assert 0 < crossing < 0.25 * 2 * 4 * 2  # fewer than every message of the step


def test_initial_placement_is_the_unit_costs_best() -> None:
    schedules = registered_schedules()
    assert initial_placement(schedules, 2, 2, 8) == "v"  # ZB-V: no bubble for M >= 2 x ranks
    assert initial_placement(schedules, 2, 2, 2) == "loop"
    assert initial_placement(schedules, 2, 1, 8) == "loop"  # one stage per rank: no V schedule fits

"""GPipe and 1F1B as data: action lists, text form, grids, the memory plan, validation."""

from __future__ import annotations

import pytest

from lightning_pipe.schedule import Action, GPipe, Kind, OneFOneB, ScheduleError, get_schedule, validate


def test_action_text_form_round_trips() -> None:
    action = Action(1, Kind.FORWARD, 0)
    assert str(action) == "1F0" and Action.parse("1F0") == action
    assert Action.parse("12B3") == Action(12, Kind.BACKWARD, 3)
    with pytest.raises(ValueError, match="expected <stage>"):
        Action.parse("F1")


@pytest.mark.parametrize("cls", [GPipe, OneFOneB])
@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("microbatches", range(1, 17))
def test_every_combination_is_valid(cls: type, stages: int, microbatches: int) -> None:
    schedule = cls(stages, microbatches)
    lists = schedule.actions()
    assert len(lists) == stages
    assert sum(len(a) for a in lists) == 2 * stages * microbatches


def test_peak_activations() -> None:
    assert GPipe(4, 8).peak_activations() == [8, 8, 8, 8]
    assert OneFOneB(4, 8).peak_activations() == [4, 3, 2, 1]
    assert OneFOneB(4, 2).peak_activations() == [2, 2, 2, 1]


def test_grid_of_1f1b() -> None:
    assert OneFOneB(2, 2).grid() == "rank 0 | 0F0 0F1     0B0     0B1\nrank 1 |     1F0 1B0 1F1 1B1"


def test_validation_marks_the_faulty_action() -> None:
    bad = [
        [Action(0, Kind.BACKWARD, 0), Action(0, Kind.FORWARD, 0)],
        [Action(1, Kind.FORWARD, 0), Action(1, Kind.BACKWARD, 0)],
    ]
    with pytest.raises(ScheduleError, match=r"(?s)deadlock.*0B0\*"):
        validate(bad, 2, 1)
    missing = [[Action(0, Kind.FORWARD, 0)], [Action(1, Kind.FORWARD, 0), Action(1, Kind.BACKWARD, 0)]]
    with pytest.raises(ScheduleError, match="missing 0B0"):
        validate(missing, 2, 1)


def test_registry() -> None:
    assert get_schedule("1F1B") is OneFOneB
    with pytest.raises(ScheduleError, match="available: 1f1b, async, dualpipev, gpipe"):
        get_schedule("nope")

"""User schedules: functions and classes producing action lists, validated with the faulty action marked."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import mlp

from lightning_pipe import Pipeline
from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule import Action, ActionLists, Schedule, resolve_schedule, validate


def lists(*ranks: str) -> ActionLists:
    return [[Action.parse(text) for text in rank.split()] for rank in ranks]


def marked(message: str) -> list[str]:
    """The actions drawn with the ``*`` mark in an error's grid."""
    return [token.rstrip("*") for line in message.splitlines() if "|" in line for token in line.split() if "*" in token]


def rejection(actions: ActionLists, stages: int, microbatches: int) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(actions, stages, microbatches)
    return str(info.value)


def test_a_valid_hand_written_schedule_passes() -> None:
    validate(lists("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"), 2, 2)
    validate(lists("0F0 0I0 0W0", "1F0 1I0 1W0"), 2, 1)  # a split backward
    validate(lists("0F0 0F1 0B0 0I1 0W1", "1F0 1F1 1I1 1W1 1B0"), 2, 2)  # B and I/W on different microbatches


def test_a_backward_before_its_forward_is_marked() -> None:
    message = rejection(lists("0F0 0B0", "1B0 1F0"), 2, 1)
    assert "1B0 runs before 1F0" in message
    assert marked(message) == ["1B0"]


def test_a_weight_gradient_before_its_input_gradient_is_marked() -> None:
    message = rejection(lists("0F0 0W0 0I0"), 1, 1)
    assert "0W0 runs before 0I0" in message
    assert marked(message) == ["0W0"]


def test_a_send_without_its_receive_is_marked() -> None:
    message = rejection(lists("0F0 0B0", "1B0"), 2, 1)
    assert "0F0 sends its activation to stage 1 but no rank runs 1F0" in message
    assert marked(message) == ["0F0"]


def test_a_forward_without_a_backward_is_marked() -> None:
    message = rejection(lists("0F0 0F1 0B0", "1F0 1F1 1B0 1B1"), 2, 2)
    assert "0F1 has no backward" in message and "gradient from stage 1 is never received" in message
    assert marked(message) == ["0F1"]


def test_an_input_gradient_without_its_weight_gradient_is_marked() -> None:
    message = rejection(lists("0F0 0I0"), 1, 1)
    assert "0I0 has no 0W0" in message
    assert marked(message) == ["0I0"]


def test_mixing_b_and_split_backward_for_one_microbatch_is_rejected() -> None:
    message = rejection(lists("0F0 0B0 0I0 0W0"), 1, 1)
    assert "0B0 and a split backward" in message


def test_wrong_rank_duplicates_and_range_are_marked() -> None:
    assert marked(rejection(lists("0F0 1F0 0B0 1B0", ""), 2, 1)) == ["1F0"]
    assert "appears twice" in rejection(lists("0F0 0F0 0B0"), 1, 1)
    assert "outside 1 stages x 1 microbatches" in rejection(lists("0F0 0F1 0B0"), 1, 1)


def test_a_deadlock_is_found_and_the_first_stuck_action_marked() -> None:
    # rank 0 waits for 1B0 before running 0F1; rank 1 runs 1F1 (needs 0F1) before 1B0
    message = rejection(lists("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"), 2, 2)
    assert "deadlock" in message and "(0B0, 1F1)" in message
    assert marked(message) == ["0B0"]


def test_entries_must_be_actions() -> None:
    with pytest.raises(ScheduleError, match="not an Action"):
        validate([["0F0"]], 1, 1)  # type: ignore[list-item]


def zigzag(num_ranks: int, num_microbatches: int) -> list[list[str]]:
    """A user schedule as text: every rank forwards all microbatches, then backwards them in order."""
    return [
        [f"{r}F{m}" for m in range(num_microbatches)] + [f"{r}B{m}" for m in range(num_microbatches)]
        for r in range(num_ranks)
    ]


class EagerWeights(Schedule):
    """A user `Schedule` subclass: GPipe order with split backwards, W right after I."""

    name = "eager-weights"

    def build(self) -> ActionLists:
        m = range(self.num_microbatches)
        return [
            [Action.parse(f"{r}F{i}") for i in m] + [Action.parse(f"{r}{k}{i}") for i in reversed(m) for k in "IW"]
            for r in range(self.num_ranks)
        ]


def test_resolve_accepts_names_functions_classes_and_instances() -> None:
    assert resolve_schedule("1f1b")(2, 2, 1).name == "1f1b"
    from_function = resolve_schedule(zigzag)(3, 4, 1)
    assert from_function.name == "zigzag" and from_function.peak_activations() == [4, 4, 4]
    assert resolve_schedule(EagerWeights)(2, 3, 1).actions()[0][3] == Action.parse("0I2")
    instance = EagerWeights(2, 3)
    assert resolve_schedule(instance)(2, 3, 1) is instance
    with pytest.raises(ScheduleError, match="built for"):
        resolve_schedule(instance)(2, 4, 1)
    with pytest.raises(ScheduleError, match="neither a name"):
        resolve_schedule(42)


def test_a_faulty_user_function_is_reported_before_any_work() -> None:
    def broken(num_ranks: int, num_microbatches: int) -> list[list[str]]:
        lists = zigzag(num_ranks, num_microbatches)
        lists[1].remove("1B1")
        return lists

    with pytest.raises(ScheduleError) as info:
        resolve_schedule(broken)(2, 2, 1).actions()
    assert "1F1 has no backward" in str(info.value) and marked(str(info.value)) == ["1F1"]
    with pytest.raises(ScheduleError, match="one action list per rank"):
        resolve_schedule(lambda r, m: [[]])(2, 2, 1).actions()
    with pytest.raises(ScheduleError, match="cannot parse action '0X0'"):
        resolve_schedule(lambda r, m: [["0X0"]])(1, 1, 1).actions()


@pytest.mark.parametrize("schedule", [zigzag, EagerWeights])
def test_user_schedules_train_through_the_pipeline(schedule: object) -> None:
    model = mlp(depth=4)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)
    F.cross_entropy(reference(x), y).backward()
    with Pipeline(model, stages=3, schedule=schedule, partition="uniform", timeout=30) as pipe:
        pipe.train_step(x, y, F.cross_entropy, microbatches=3)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0)


def test_a_faulty_user_schedule_fails_the_step_before_any_work() -> None:
    def backwards_first(num_ranks: int, num_microbatches: int) -> list[list[str]]:
        return [[f"{r}B0", f"{r}F0"] for r in range(num_ranks)]

    model = mlp(depth=4)
    with Pipeline(model, stages=2, schedule=backwards_first, partition="uniform", timeout=30) as pipe:
        with pytest.raises(ScheduleError, match=r"0B0 runs before 0F0"):
            pipe.train_step(torch.randn(4, 8), torch.zeros(4, dtype=torch.long), F.cross_entropy, microbatches=1)
    assert all(p.grad is None for p in model.parameters())

"""What crosses between the coordinator and a stage's process every step is packed: a step's plan keeps its actions
as bytes, a rank's records cross as one plain pickle; both come back equal."""

from __future__ import annotations

import pickle

import pytest

from lightning_pipe.comm import by_value
from lightning_pipe.engine.messages import StepPlan
from lightning_pipe.engine.step_result import Records
from lightning_pipe.schedule import Action, Kind, resolve_schedule
from lightning_pipe.schedule.action import pack_actions, unpack_actions


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"])
def test_a_step_plan_crosses_with_every_action_of_its_schedule(name: str) -> None:
    virtual = 2 if name in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    for actions in resolve_schedule(name)(4, 8, virtual).actions():
        plan = StepPlan("train", actions, dataflow=True, update_every=3)
        for crossed in (pickle.loads(pickle.dumps(plan)), by_value.copy(plan)):
            assert crossed.actions == actions and crossed.actions is not actions
            assert (crossed.mode, crossed.dataflow, crossed.update_every) == ("train", True, 3)
        assert unpack_actions(pack_actions(actions)) == actions


def test_packed_actions_keep_large_indices_and_each_unpacking_is_a_new_list() -> None:
    actions = [Action(70, Kind.BACKWARD_WEIGHT, 100_000), Action(0, Kind.BACKWARD_INPUT, 3)]
    data = pack_actions(actions)
    first, second = unpack_actions(data), unpack_actions(data)
    assert first == second == actions
    first.pop()  # a stage may change its list: the next step's is whole
    assert unpack_actions(data) == actions


def test_records_cross_as_the_same_list() -> None:
    records = Records([("0F0 idle", 1.5, 2.25), ("0F0", 2.25, 3.0)])
    assert by_value.copy(records) == list(records)
    assert pickle.loads(pickle.dumps(records)) == list(records)

"""transport="rpc": stages in worker processes compute what the unsplit model computes.

One pool of four worker processes serves every pipeline of this module (``keep_alive``), so the
processes start once; each test builds its stages on them afresh.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from rpc_models import OverflowsBackward, worker_pool
from torch import nn

from lightning_pipe import Pipeline, StageError
from lightning_pipe.comm import COORDINATOR, MessageKind
from lightning_pipe.comm.rpc import RpcCommunicator
from lightning_pipe.engine import StageProtocol


def mlp(depth: int = 4, width: int = 16, inputs: int = 8, classes: int = 3, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def data(rows: int = 24, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


@pytest.fixture(scope="module")
def pool() -> Iterator[RpcCommunicator]:
    yield from worker_pool(4)


def rpc_pipeline(pool: RpcCommunicator, model: nn.Module, stages: int, **kwargs: object) -> Pipeline:
    return Pipeline(model, stages=stages, transport=pool, partition="uniform", timeout=60, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_gradients_equal_unsplit(pool: RpcCommunicator, schedule: str, stages: int) -> None:
    model = mlp()
    x, y = data()
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    checkpoint = "always" if schedule == "gpipe" else "never"  # recomputation happens on the workers too
    with rpc_pipeline(pool, model, stages, schedule=schedule, checkpoint=checkpoint) as pipe:
        for microbatches in (1, 3, 4, 8):
            pipe.coordinator.stages.call(StageProtocol.zero_grad, True)
            pipe.train_step(x, y, F.cross_entropy, microbatches=microbatches)
            got = pipe.grads()
            assert got.keys() == expected.keys()
            for name, want in expected.items():
                torch.testing.assert_close(got[name], want, atol=1e-5, rtol=0, msg=f"{name}, {microbatches} mb")
        assert all(p.grad is None for p in model.parameters()), "gradients stay on the stages"
        torch.testing.assert_close(pipe.forward(x, microbatches=3), reference(x), atol=1e-6, rtol=0)


def test_a_weight_two_stages_of_a_sequential_hold_takes_the_unsplit_update(pool: RpcCommunicator) -> None:
    """An output head tied to the embedding (one parameter in stages 0 and 3 of an ``nn.Sequential``): each worker
    holds a copy; the copies get the sum of their gradients and take the unsplit model's steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 11, bias=False))  # fmt: skip
    model[5].weight = model[0].weight
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(4)
    with rpc_pipeline(pool, model, 4, schedule="1f1b") as pipe:
        assert pipe.tied == [[(0, "0.weight"), (3, "5.weight")]]
        opt = pipe.optimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        for _ in range(3):
            x, y = torch.randint(0, 11, (12,), generator=g), torch.randint(0, 11, (12,), generator=g)
            opt.zero_grad()
            ref_opt.zero_grad()
            pipe.train_step(x, y, F.cross_entropy, microbatches=3)
            F.cross_entropy(reference(x), y).backward()
            opt.step()
            ref_opt.step()
        state = pipe.state_dict()
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_parameters_after_three_steps_equal_unsplit(pool: RpcCommunicator, schedule: str, stages: int) -> None:
    """Per-stage Adam over two parameter groups, an LR change before step 3, clipping by the global norm."""
    model = mlp()
    reference = copy.deepcopy(model)

    def groups(m: nn.Module) -> list[dict[str, object]]:
        return [
            {"params": [p for n, p in m.named_parameters() if n.endswith("weight")], "lr": 0.01},
            {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "lr": 0.02, "weight_decay": 0.1},
        ]

    ref_opt = torch.optim.Adam(groups(reference), betas=(0.8, 0.9))
    with rpc_pipeline(pool, model, stages, schedule=schedule) as pipe:
        opt = pipe.optimizer(torch.optim.Adam(groups(model), betas=(0.8, 0.9)))
        for step in range(3):
            x, y = data(seed=step)
            if step == 2:  # what an LR scheduler does: write the template's param_groups
                for o in (opt, ref_opt):
                    o.param_groups[0]["lr"] = 0.005
            opt.zero_grad()
            ref_opt.zero_grad()
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            F.cross_entropy(reference(x), y).backward()
            norm = opt.clip_grad_norm_(0.5)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            torch.testing.assert_close(norm, ref_norm, atol=1e-5, rtol=1e-5)
            opt.step()
            ref_opt.step()
        state = pipe.state_dict()
        assert list(state) == list(reference.state_dict())
        for name, want in reference.state_dict().items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=name)
        # the optimizer's state comes back in the unsplit optimizer's layout
        got, want = opt.state_dict(), ref_opt.state_dict()
        assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
        assert [g["lr"] for g in got["param_groups"]] == [0.005, 0.02]
        for index, ref_state in want["state"].items():
            for key, value in ref_state.items():
                torch.testing.assert_close(got["state"][index][key], value, atol=1e-5, rtol=0)


def test_checkpoint_resume_continues_like_unsplit(pool: RpcCommunicator) -> None:
    """State gathered from one pipeline and loaded into another (other init) continues identically."""
    trained = mlp(seed=0)
    opt = torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    with rpc_pipeline(pool, trained, 2) as pipe:
        stage_opt = pipe.optimizer(opt)
        pipe.train_step(x, y, F.cross_entropy)
        stage_opt.step()
        module_state, optimizer_state = pipe.state_dict(), stage_opt.state_dict()
    reference = mlp(seed=5)
    reference.load_state_dict(module_state)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_opt.load_state_dict(optimizer_state)
    resumed = mlp(seed=7)  # other initial values: everything must come from the checkpoint
    with rpc_pipeline(pool, resumed, 4, schedule="gpipe") as pipe:
        stage_opt = pipe.optimizer(torch.optim.SGD(resumed.parameters(), lr=0.3, momentum=0.9))
        pipe.load_state_dict(module_state)
        stage_opt.load_state_dict(optimizer_state)
        assert stage_opt.param_groups[0]["lr"] == 0.1
        pipe.train_step(x, y, F.cross_entropy)
        stage_opt.step()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        pipe.sync_module()
    for p, q in zip(resumed.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_grad_scaler_check_covers_every_stage(pool: RpcCommunicator) -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = data()
    F.cross_entropy(reference(x), y).backward()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with rpc_pipeline(pool, model, 4) as pipe:
        opt = pipe.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        pipe.train_step(x, y, F.cross_entropy, scaler=scaler)
        assert opt.unscale_(1.0 / scaler.get_scale()) is False
        for name, p in reference.named_parameters():
            torch.testing.assert_close(pipe.grads()[name], p.grad, atol=1e-5, rtol=0)


def test_grad_scaler_sees_an_overflow_in_one_stage(pool: RpcCommunicator) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), OverflowsBackward(), nn.Linear(16, 16), nn.Linear(16, 3))
    x, y = data()
    with Pipeline(model, stages=2, partition=[2, 3], transport=pool, timeout=60) as pipe:
        opt = pipe.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        pipe.train_step(x, y, F.cross_entropy, scaler=torch.amp.GradScaler("cpu", init_scale=2.0))
        grads = pipe.coordinator.stages.call(StageProtocol.grads)
        finite = [all(torch.isfinite(g).all() for g in part.values()) for part in grads]
        assert finite == [False, True]  # only the first stage overflowed
        assert opt.unscale_(0.5) is True


def test_posted_calls_run_in_order_and_a_failure_is_raised_at_the_next_wait(pool: RpcCommunicator) -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = data()
    F.cross_entropy(reference(x), y).backward()
    with rpc_pipeline(pool, model, 4) as pipe:
        opt = pipe.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):  # each round: posts, then a call that sees every one of them
            pipe.train_step(x, y, F.cross_entropy)  # apply_grads is posted
            pipe.coordinator.stages.post(StageProtocol.scale_grads, 0.5)
            got = pipe.grads()
            for name, p in reference.named_parameters():
                torch.testing.assert_close(got[name], p.grad * 0.5, atol=1e-5, rtol=0)
            opt.zero_grad()
            assert all(g is None for g in pipe.grads().values())
        one_too_many = [([{}],)] * 3 + [([{}, {}],)]  # rank 3's optimizer has one group, not two
        pipe.coordinator.stages.post_each(StageProtocol.set_hparams, one_too_many)
        with pytest.raises(StageError, match=r"stage 3 on .* failed in action set_hparams: ValueError") as info:
            pipe.train_step(x, y, F.cross_entropy)
        assert "call_set_hparams" in info.value.remote_traceback
        assert pipe.coordinator.stages.ping() == [0, 1, 2, 3]
        pipe.coordinator.stages.post(StageProtocol.set_hparams, [{}, {}])  # fails on every rank: raised once
        with pytest.raises(StageError, match="failed in action set_hparams"):
            pipe.coordinator.stages.ping()
        assert pipe.coordinator.stages.ping() == [0, 1, 2, 3]


def test_no_parameter_crosses_processes_during_a_step(pool: RpcCommunicator) -> None:
    """Per step: one message per activation/gradient hand-off between processes, and exactly their bytes.

    The last stage (rank 3) runs in this process (`rpc.home`): it computes the losses, so its output and the
    output's gradient never cross; what it exchanges with the coordinator is handed over by reference.
    """
    model = mlp(depth=4, width=32)
    x, y = data(rows=32)
    stages, microbatches = 4, 4
    last = stages - 1
    with rpc_pipeline(pool, model, stages, schedule="1f1b") as pipe:
        assert pool.ranks_served.home == last and pool.shares_objects
        for _ in range(2):  # warm-up; checkpoint="auto" measures in the first step and decides before the second
            pipe.train_step(x, y, F.cross_entropy, microbatches=microbatches)
        pipe.coordinator.settle()  # the first stages' ends of the step arrive after train_step returned
        pool.stats(reset=True)
        pipe.train_step(x, y, F.cross_entropy, microbatches=microbatches)
        pipe.coordinator.settle()
        stats = pool.stats(reset=True)
        boundary = []  # bytes of each stage's output for the whole batch
        h = x
        for shard in pipe.shards:
            h = shard.module(h)
            boundary.append(h.numel() * h.element_size())
        coordinator = stats[COORDINATOR]
        assert coordinator.messages == {
            MessageKind.STEP: stages - 1,
            MessageKind.ACTIVATION: microbatches,
            MessageKind.POST: stages - 1,  # apply_grads, which no stage answers unless it fails
        }
        assert coordinator.local == {MessageKind.STEP: 1, MessageKind.POST: 1}  # to the last stage, in this process
        assert coordinator.tensor_bytes[MessageKind.ACTIVATION] == x.numel() * x.element_size()
        for rank in range(stages):
            s = stats[rank]
            expected = {MessageKind.ACTIVATION: microbatches, MessageKind.DONE: 1} if rank < last else {}
            if rank > 0:
                expected[MessageKind.GRAD] = microbatches
            assert s.messages == expected, f"rank {rank}"
            assert s.tensor_bytes[MessageKind.ACTIVATION] == (boundary[rank] if rank < last else 0)
            assert s.tensor_bytes[MessageKind.GRAD] == (boundary[rank - 1] if rank > 0 else 0)
            assert s.parameter_tensors == 0 and not s.failures
        assert stats[last].local == {MessageKind.LOSS: microbatches, MessageKind.DONE: 1}
        moved = sum(s.total_bytes() for s in stats.values())
        assert moved == 2 * sum(boundary[:-1]) + x.numel() * x.element_size()
        # the detector works: gathering the state sends every parameter of the workers' stages once
        pipe.state_dict()
        after = pool.stats()
        remote = [p for shard in pipe.shards[:last] for p in shard.module.parameters()]
        assert sum(after[r].parameter_tensors for r in range(stages)) == len(remote)
        assert sum(after[r].total_bytes() for r in range(stages)) == sum(p.numel() * p.element_size() for p in remote)
        assert after[last].local[MessageKind.REPLY] == 1  # the last stage's state: copied within this process

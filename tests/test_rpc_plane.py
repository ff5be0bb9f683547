"""transport="rpc": activations and gradients cross over the world's data plane, a private process group.

The plane's groups are made on the RPC world's own store, apart from torch.distributed's default
group (`test_rpc_default_group`: a user's default group is left as it was).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from helpers import mlp
from rpc_models import assert_grads_equal, classification_data, unsplit_grads, worker_pool

from lightning_pipe import Pipeline
from lightning_pipe.comm import COORDINATOR, MessageKind
from lightning_pipe.comm.rpc import RpcCommunicator
from lightning_pipe.comm.rpc.plane import PlaneLayout, address


@pytest.fixture(scope="module")
def pool() -> Iterator[RpcCommunicator]:
    yield from worker_pool(3)


def data(rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return classification_data(rows)


# where tensors go: the layout every slot receives
def test_slots_on_gpus_of_their_own_join_nccl_and_slots_sharing_one_stay_on_gloo() -> None:
    own = PlaneLayout.of([("a", "cuda:0"), ("a", "cuda:1"), ("b", "cuda"), ("b", "cpu")])
    assert own.size == 5 and own.nccl == (1, 2, 3) and own.shared == ()  # cuda:0 of a and of b are two GPUs
    assert "between ranks 0, 1, 2 (CUDA devices of their own) over NCCL" in own.describe()
    mixed = PlaneLayout.of([("a", "cuda:0"), ("a", "cuda"), ("a", "cuda:1")])
    assert mixed.nccl == () and mixed.shared == (("cuda:0 of a", (1, 2)),)  # one GPU alone: no pair for NCCL
    assert "ranks 0, 1 share cuda:0 of a" in mixed.describe() and "through host memory" in mixed.describe()
    cpu = PlaneLayout.of([("a", "cpu"), ("a", "cpu"), ("a", "fakegpu:0")])
    assert cpu == PlaneLayout(4) and cpu.describe() == "activations and gradients go point to point over gloo"
    assert PlaneLayout.from_json(mixed.to_json()) == mixed


def test_each_launch_and_rank_has_its_own_address() -> None:
    addresses = {address(launch, rank) for launch in ("ab12-000001", "ab12-000002") for rank in (-1, 0, 1, 7)}
    assert len(addresses) == 8 and min(addresses) > 0  # never the wire's own inbox (-2)


# the plane at work
def test_tensors_and_control_cross_over_the_data_plane(pool: RpcCommunicator) -> None:
    model = mlp(depth=4, width=32)
    x, y = data()
    microbatches = 4
    with Pipeline(model, stages=3, transport=pool, partition="uniform", timeout=60, checkpoint="never") as pipe:
        plane = pool.data_plane
        assert plane is not None
        pipe.train_step(x, y, F.cross_entropy, microbatches=microbatches)
        pipe.coordinator.settle()
        pool.stats(reset=True)
        plane.stats(reset=True)
        pipe.train_step(x, y, F.cross_entropy, microbatches=microbatches)
        pipe.coordinator.settle()
        stats = pool.stats()
        sent, last = stats[COORDINATOR], stats[2]
        framed = plane.stats()
    # the coordinator's activations (microbatch 0 alone, the others as one bundle) went as frames, and so did its
    # control messages to the two ranks in worker processes (the step, the post applying its gradients): one link
    # per pair of processes keeps each sender's order
    control = {MessageKind.STEP: 2, MessageKind.POST: 2}
    assert framed[COORDINATOR].messages == {MessageKind.ACTIVATION: 2, **control}
    assert framed[COORDINATOR].tensor_bytes[MessageKind.ACTIVATION] == x.numel() * 4
    assert sent.tensor_bytes[MessageKind.ACTIVATION] == x.numel() * 4
    assert sent.messages[MessageKind.ACTIVATION] == microbatches and sent.messages[MessageKind.STEP] == 2
    assert sum(sent.host_bytes.values()) == 0  # CPU tensors: nothing to copy
    # the last stage (rank 2) runs in this process: it computes the losses, its step comes by reference, and
    # neither its output nor the output's gradient crosses; its input gradients go back over the plane
    assert sent.local[MessageKind.STEP] == 1 and MessageKind.GRAD not in sent.messages
    assert last.local[MessageKind.LOSS] == microbatches and last.local[MessageKind.DONE] == 1
    assert MessageKind.OUTPUT not in last.messages and last.messages[MessageKind.GRAD] == microbatches
    assert framed[2].tensor_bytes[MessageKind.GRAD] == last.tensor_bytes[MessageKind.GRAD] > 0


def test_a_pool_keeps_its_data_plane_across_pipelines(pool: RpcCommunicator) -> None:
    """Two pipelines of other shapes one after the other on the same workers and the same groups."""
    planes = []
    for stages, width in ((3, 16), (2, 24)):
        model = mlp(width=width)
        x, y = data()
        want = unsplit_grads(model, x, y)
        with Pipeline(model, stages=stages, transport=pool, partition="uniform", timeout=60) as pipe:
            planes.append(pool.data_plane)
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            got = pipe.grads()
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-5, msg=name)
    assert planes[0] is not None and planes[0] is planes[1] is pool.data_plane
    assert pool.data_plane.direct is None, "a world of four processes keeps a receiving thread per peer"


def test_a_rank_holding_consecutive_stages_hands_them_their_inputs_itself(pool: RpcCommunicator) -> None:
    """runner="linear": every stage on rank 0, whose activations and gradients go to its own inbox."""
    model = mlp(width=16)
    x, y = data()
    want = unsplit_grads(model, x, y)
    with Pipeline(model, stages=3, runner="linear", transport=pool, partition="uniform", timeout=60) as pipe:
        pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        pipe.coordinator.settle()
        got = pipe.grads()
        sent = pool.stats()[0]
    assert_grads_equal(got, want)
    assert sent.messages[MessageKind.ACTIVATION] == 2 * 4  # stage 0 -> 1 and 1 -> 2, to itself

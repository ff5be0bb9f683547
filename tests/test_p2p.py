"""transport=P2PCommunicator: stages in the processes of a gloo world, messages by isend/irecv.

The tests share real processes (`p2p_procs`) on 127.0.0.1: three worlds (2, 3 and 4 processes) started side
by side, each process playing several scenarios in turn (a process start costs seconds); pipeline rank 0 of
each pipeline compares against the unsplit model itself and writes what it measured per scenario, and each
test checks its scenario's results. Every process is waited for with a deadline and killed if still running.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from launching import kill
from rpc_models import worker_env
from torch.utils import _pytree as pytree

from lightning_pipe.base import tree
from lightning_pipe.comm.base import Message, MessageKind
from lightning_pipe.comm.p2p.frames import (
    INLINE_BYTES,
    TensorHeader,
    bundle,
    decode_signature,
    encode_signature,
    frame_bytes,
    frame_tensors,
    header,
    header_fields,
    inline_size,
    join_payload,
    pack,
    split_payload,
    unbundle,
)
from lightning_pipe.comm.p2p.send import IN_FLIGHT

HERE = Path(__file__).parent
HELPER = HERE / "p2p_procs.py"

pytestmark = pytest.mark.timed  # bounds waits by the clock: alone under xdist (tests/machine_share.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# the worlds, started side by side: a world plays its scenarios in turn (one that kills a process last)
WORLDS = {"two": (2, "train,last,kill_stage"), "three": (3, "train,kill_coordinator"), "four": (4, "dp")}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every world of WORLDS at once (each its processes, each process several scenarios), within ``timeout``;
    the processes are forked after one import (`forked_processes.py`: a cold process spends seconds importing torch
    and lightning_pipe), each waited for and killed if still running. Each world's results are under
    ``<folder>/<name>``. The timeout guards against a hang: the six launches of 50 s each that these worlds
    replace."""
    folder, timeout = tmp_path_factory.mktemp("p2p"), 300.0
    env = worker_env() | {"LIGHTNING_PIPE_WORKER": "1", "OMP_NUM_THREADS": "1"}
    processes = []
    for name, (world, scenarios) in WORLDS.items():
        (folder / name).mkdir()
        port = str(free_port())
        for rank in range(world):
            log = str(folder / name / f"{rank}.log")
            processes.append([log, scenarios, str(rank), str(world), port, str(folder / name)])
    spec = folder / "processes.json"
    spec.write_text(json.dumps({"script": str(HELPER), "timeout": timeout, "processes": processes}))
    with open(folder / "forked.log", "wb") as log:
        command = [sys.executable, str(HERE / "forked_processes.py"), str(spec)]
        parent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            parent.wait(timeout + 60)  # it kills what runs past ``timeout`` itself
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill(parent)  # its session: the forked processes too
            parent.wait(10)
    if parent.returncode != 0:
        tails = "\n".join(world_tails(folder, name) for name in WORLDS)
        ended = f"forked_processes.py ended with {parent.returncode} (1: a process ran past {timeout} s)"
        pytest.fail(f"{ended}\n{(folder / 'forked.log').read_text()}{tails}")
    return folder


def results_of(worlds: Path, name: str, scenario: str) -> dict[int, dict[str, Any]]:
    """Each rank's result of ``scenario`` in world ``name`` (a killed rank has none)."""
    world, scenarios = WORLDS[name]
    assert scenario in scenarios.split(",")
    results = {}
    for rank in range(world):
        path = worlds / name / scenario / f"{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
            where = f"{scenario} in world {name}, rank {rank}"
            assert results[rank]["ok"], f"{where}: {results[rank].get('traceback')}\n{world_tails(worlds, name)}"
    assert results, f"{scenario} in world {name}: no rank has a result (an earlier scenario failed?)\n" + world_tails(
        worlds, name
    )
    return results


def world_tails(worlds: Path, name: str) -> str:
    logs = sorted((worlds / name).glob("*.log"))
    return "\n".join(f"--- {name}: rank {log.stem} ---\n{log.read_text()[-2000:]}" for log in logs)


def check_training(result: dict[str, Any]) -> None:
    for schedule in ("gpipe", "1f1b"):
        got = result[schedule]
        assert got["state"] < 1e-6, f"{schedule}: parameters differ from the unsplit model's by {got['state']}"
        assert got["forward"] < 1e-6, f"{schedule}: outputs differ by {got['forward']}"
        # signatures are negotiated in the first step: later steps send headers and raw tensors only
        assert got["tensor_pickled"] == 0, f"{schedule}: {got['tensor_pickled']} pickled bytes in a warm step"
        assert got["tensor_messages"] > 0 and got["tensor_bytes"] > 0
        assert got["tensor_header_bytes"] == 64 * got["tensor_messages"]
        # a gloo send says it completed only once waited on: the link waits for its old sends, never holds them all
        assert got["in_flight"] <= IN_FLIGHT + 1, f"{schedule}: {got['in_flight']} sends still held"


def test_two_processes_train_like_the_unsplit_model_and_carry_errors(worlds: Path) -> None:
    results = results_of(worlds, "two", "train")
    coordinator = results[0]
    check_training(coordinator)
    assert coordinator["large_equal"], "a 64 MiB activation crossed damaged"
    error = coordinator["stage_error"]
    assert error.startswith("stage 1 on global rank 1 (pipeline rank 1 of replica 0) failed"), error
    assert "ValueError: bad row reached the stage" in error
    posted = coordinator["posted_error"]  # a call the coordinator posted, raised at its next step
    assert posted.startswith("stage 1 on global rank 1 (pipeline rank 1 of replica 0) failed"), posted
    assert "in action load_random_state: KeyError(5)" in posted
    assert results[1]["error"] is None, "the serving process left serve_stages cleanly on release"


def test_the_coordinator_holding_the_last_stage_trains_like_the_unsplit_model(worlds: Path) -> None:
    """Launched mode's layout: the coordinator runs the last stage and feeds stage 0 in the other process, a
    step's later inputs as one bundle (inline, and one too large for a frame)."""
    results = results_of(worlds, "two", "last")
    coordinator = results[0]
    assert coordinator["ok"], coordinator.get("traceback")
    got = coordinator["1f1b"]
    assert got["state"] < 1e-5 and got["forward"] < 1e-5, got
    assert coordinator["bundle_equal"] and coordinator["small_bundle_equal"]
    assert results[1]["error"] is None


def test_three_processes_train_like_the_unsplit_model(worlds: Path) -> None:
    results = results_of(worlds, "three", "train")
    check_training(results[0])
    assert results[1]["error"] is None and results[2]["error"] is None


def test_two_pipelines_of_two_average_gradients_over_their_replicas(worlds: Path) -> None:
    """Four processes, two pipelines at once on different data; on_build replicates each stage over its replicas."""
    results = results_of(worlds, "four", "dp")
    for coordinator in (0, 2):
        check_training(results[coordinator])
    assert results[1]["error"] is None and results[3]["error"] is None


def test_a_stage_process_killed_mid_step_fails_the_step_naming_it(worlds: Path) -> None:
    results = results_of(worlds, "two", "kill_stage")
    assert 1 not in results, "the stage's process killed itself"
    error, seconds = results[0]["error"], results[0]["seconds"]
    assert error.startswith("lost global rank 1 (pipeline rank 1 of replica 0): "), error
    assert seconds < 30


def test_a_serving_process_leaves_when_its_coordinator_is_killed(worlds: Path) -> None:
    """Both serving processes of a world of three leave when its coordinator is killed."""
    results = results_of(worlds, "three", "kill_coordinator")
    for rank in (1, 2):
        error = results[rank]["error"]
        assert error is not None and error.startswith("lost global rank 0 (pipeline rank 0 of replica 0): "), error
        assert results[rank]["at"] - results[0]["killed_at"] < 30


def test_a_signature_describes_a_payload_without_its_tensors() -> None:
    x, grad = torch.randn(3, 4), torch.ones(2, dtype=torch.float64)
    payload = ({"x": x, "n": 3}, [True, None], (grad,))
    signature, tensors = split_payload(MessageKind.ACTIVATION, payload)
    assert signature is not None and [t is x for t in tensors] == [True, False]
    again = decode_signature(encode_signature(signature))
    assert again == signature and hash(again) == hash(signature)
    rebuilt = join_payload(again, [x.clone(), grad.clone()])
    assert rebuilt[0]["n"] == 3 and rebuilt[1] == [True, None]
    assert torch.equal(rebuilt[0]["x"], x) and torch.equal(rebuilt[2][0], grad)
    assert signature.nbytes == x.numel() * 4 + grad.numel() * 8
    other, _ = split_payload(MessageKind.ACTIVATION, ({"x": x[:2], "n": 3}, [True, None], (grad,)))
    assert other != signature, "another shape is another signature"
    assert Message(MessageKind.GRAD).kind == "grad"


def test_a_plain_payload_finds_its_signature_by_its_shape_the_same_as_pytree_makes_it() -> None:
    x = torch.randn(2, 4)
    payload = ((x,), [True, None], 3)
    signature, tensors = split_payload(MessageKind.ACTIVATION, payload)
    again, _ = split_payload(MessageKind.ACTIVATION, ((x.clone(),), [True, None], 3))
    assert again is signature and tensors == [x]
    leaves, spec = pytree.tree_flatten(payload)
    assert signature.spec == spec and signature.others == tuple((i, v) for i, v in enumerate(leaves) if i)
    assert tree.flatten(payload)[1] is tree.flatten(payload)[1] == spec
    assert tree.unflatten(leaves, tree.flatten(payload)[1]) == payload
    changed = [((x,), [1, None], 3), ((x,), [True, None], 4), ((x[:1],), [True, None], 3), ([x], [True, None], 3)]
    changed.append(((x.requires_grad_(),), [True, None], 3))
    for other in changed:  # a scalar's type or value, a tensor's shape or requires_grad, a container's type
        made, _ = split_payload(MessageKind.ACTIVATION, other)
        assert made != signature and made == split_payload(MessageKind.ACTIVATION, other)[0]
        assert made.spec == pytree.tree_flatten(other)[1]
    assert split_payload(MessageKind.GRAD, payload)[0] != signature


def test_an_inline_frame_packs_a_message_into_one_buffer_and_back() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7), torch.tensor([True, False]), torch.empty(0, 4)]
    tensors += [torch.randn(2).half(), torch.randn(4, 6).t()]  # the last is not contiguous
    tensors += [torch.randn(3, dtype=torch.bfloat16), torch.randn(2, 2, requires_grad=True)]  # numpy lacks bf16
    tensors += [torch.randn(3, dtype=torch.complex64).conj()]  # a conjugate view numpy cannot see
    metas = [TensorHeader.of(t) for t in tensors]
    fields = header_fields(3, 1, Message(MessageKind.GRAD, step=2, stage=1, microbatch=5), extra=5, inline=True)
    frame = pack(fields, b"hello", tensors)
    assert frame.dtype == np.uint8 and frame.size == inline_size(5, metas) <= INLINE_BYTES
    assert frame[:64].view(np.int64).tolist() == [3, 1, -1, 2, 1, 5, 5, 1]
    into = np.full(frame.size + 100, 7, dtype=np.uint8)  # a sender's ring buffer, larger than the frame
    assert pack(fields, b"hello", tensors, into) is into
    blob, back = frame_bytes(frame, 5), frame_tensors(frame, 5, metas)
    assert blob == b"hello" == frame_bytes(into, 5)
    expected = [t.detach().resolve_conj() for t in tensors]
    for received in (back, frame_tensors(into, 5, metas)):
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(received, expected, strict=True))
    frame[:] = 0  # the receiver posts the frame's buffer again at once: what it returned are copies
    assert torch.equal(back[0], expected[0]) and torch.equal(back[-3], expected[-3])


def test_a_bundle_carries_consecutive_microbatches_as_one_message() -> None:
    inputs = [Message(MessageKind.ACTIVATION, 7, 0, m, ((torch.full((2, 3), float(m)),), [False])) for m in (1, 2, 3)]
    one = bundle(inputs)
    head = header(0, 0, one, extra=0, inline=True, bundled=len(inputs)).tolist()
    assert head[5] == 1 and head[7] == 1 + 2 * 2, "the first microbatch and the count are in the header"
    back = unbundle(one, head)
    assert [(m.kind, m.step, m.stage, m.microbatch) for m in back] == [
        (MessageKind.ACTIVATION, 7, 0, m) for m in (1, 2, 3)
    ]
    assert all(torch.equal(b.payload[0][0], i.payload[0][0]) for b, i in zip(back, inputs, strict=True))
    assert unbundle(inputs[0], header(0, 0, inputs[0], extra=0).tolist()) == [inputs[0]]
    with pytest.raises(ValueError, match="consecutive"):
        bundle([inputs[0], inputs[2]])

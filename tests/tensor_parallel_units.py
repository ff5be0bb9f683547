"""Tensor-parallel units over two tensor ranks, run by the 4 processes of a launch (``tensor_parallel_train.py
--units``, after its cases): a one-rank mesh's collectives do nothing, so these run where they do work.

The 4 processes form a 2 x 2 mesh (``row``, ``tensor``): each row's two processes are the tensor ranks of a
2-rank tensor mesh. Each process writes what it saw to ``<out>/units-rank<g>.json`` (``error``: what it raised):

- ``frames``: a DTensor sharded along dim 1 over its row's tensor mesh (the values of its row's seed) crosses to the
  same tensor rank of the other row as a link sends it: its local part (the tensor rank's half) as the tensors,
  its placements in the header (`encode_signature`), over gloo; rebuilt over the receiver's own tensor mesh;
- ``split_backward``: a `Block` under the Colwise/Rowwise plan over the 2-rank tensor mesh (each rank holding its
  half of the heads and hidden units), its backward split into ``backward_input`` and ``backward_weight``, against
  the plain block's backward (not parallelised) and the parallel block's one ordinary backward.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def frames(mesh: Any) -> dict[str, Any]:
    """A DTensor sent to the other row's same tensor rank and received from it; what arrived."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lightning_pipe.comm.base import MessageKind
    from lightning_pipe.comm.p2p.dtensor_frames import use_tensor_mesh
    from lightning_pipe.comm.p2p.frames import decode_signature, encode_signature, join_payload, split_payload

    row, tensor_rank = mesh.get_coordinate()
    tensor = mesh["tensor"]
    value, plain = values_of(row)
    sent = distribute_tensor(value, tensor, [Shard(1)]).requires_grad_()
    signature, tensors = split_payload(MessageKind.ACTIVATION, {"x": sent, "y": plain})
    assert signature is not None
    peer = int(mesh.mesh[1 - row, tensor_rank])
    message: list[Any] = [encode_signature(signature)]
    if row == 0:  # one side sends first, the other receives first
        dist.send_object_list(message, peer)
        dist.recv_object_list(message, peer)
    else:
        received_header = [None]
        dist.recv_object_list(received_header, peer)
        dist.send_object_list(message, peer)
        message = received_header
    arrived = decode_signature(message[0])
    received = [meta.empty(torch.device("cpu")) for meta in arrived.metas]
    requests = [dist.isend(t.contiguous(), peer) for t in tensors] + [dist.irecv(t, peer) for t in received]
    for request in requests:
        request.wait()
    use_tensor_mesh(tensor)
    try:
        got = join_payload(arrived, received)
    finally:
        use_tensor_mesh(None)
    expected, expected_plain = values_of(1 - row)
    x = got["x"]
    return {
        "sent_types": [type(t).__name__ for t in tensors],
        "sent_local": list(tensors[0].shape),
        "layouts": [None if m.layout is None else repr(m.layout.placements) for m in arrived.metas],
        "dtensor": isinstance(x, DTensor),
        "placements": repr(x.placements) if isinstance(x, DTensor) else None,
        "mesh_ranks": x.device_mesh.mesh.tolist() if isinstance(x, DTensor) else None,
        "leaf": x.is_leaf,
        "requires_grad": x.requires_grad,
        "local": x.to_local().tolist() if isinstance(x, DTensor) else None,
        "expected_local": expected.chunk(2, dim=1)[tensor_rank].tolist(),
        "full_diff": (x.full_tensor() - expected).abs().max().item() if isinstance(x, DTensor) else None,
        "plain_type": type(got["y"]).__name__,
        "plain_diff": (got["y"] - expected_plain).abs().max().item(),
    }


def values_of(row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The DTensor's whole value and a plain tensor that a row sends (its own, so a mix-up shows)."""
    g = torch.Generator().manual_seed(10 + row)
    return torch.randn(2, 4, 3, generator=g), torch.randn(2, generator=g)


def split_backward(mesh: Any) -> dict[str, Any]:
    """The split backward of a tensor-parallel block against the plain block's backward."""
    from tensor_parallel_train import Block, tensor_parallel_plan
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_pipe.engine.split_backward import backward_input, backward_weight

    torch.manual_seed(0)
    plain, whole, block = Block(), Block(), Block()
    for parallel in (whole, block):
        parallel.load_state_dict(plain.state_dict())
        parallelize_module(parallel, mesh["tensor"], tensor_parallel_plan())  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)  # the same input and output gradient on both tensor ranks
    x, grad = torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, 16, generator=g)
    inputs = [x.clone().requires_grad_() for _ in range(3)]
    plain(inputs[0]).backward(grad)
    whole(inputs[1]).backward(grad)  # tensor parallel, one ordinary backward
    output = block(inputs[2])
    (input_grad,), pending = backward_input([output], [grad], inputs[2:], list(block.parameters()))
    no_weight_grads = all(p.grad is None for p in block.parameters())
    backward_weight(pending)
    grads = {}
    for (key, p), w, q in zip(block.named_parameters(), whole.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and w.grad is not None and q.grad is not None, key
        split_grad, whole_grad = (full(t.grad) for t in (p, w))
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # type: ignore[attr-defined]
        grads[key] = {
            "dtensor": isinstance(p, DTensor), "grad_dtensor": isinstance(p.grad, DTensor),
            "local_share": local.numel() / q.numel(), "scale": q.grad.abs().max().item(),
            "plain_diff": (split_grad - q.grad).abs().max().item(),
            "whole_diff": (split_grad - whole_grad).abs().max().item(),
        }  # fmt: skip
    assert input_grad is not None and inputs[0].grad is not None and inputs[1].grad is not None
    return {
        "pending": bool(pending.groups),
        "no_weight_grads_before_w": no_weight_grads,
        "input_plain_diff": (input_grad - inputs[0].grad).abs().max().item(),
        "input_whole_diff": (input_grad - inputs[1].grad).abs().max().item(),
        "input_scale": inputs[0].grad.abs().max().item(),
        "grads": grads,
    }


def full(tensor: torch.Tensor | None) -> torch.Tensor:
    """A gradient's whole value (a DTensor gathered over its mesh)."""
    from torch.distributed.tensor import DTensor

    assert tensor is not None, "no gradient"
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


def run(out: Path) -> None:
    """Both units in this process (one of 4), after ``torch.distributed`` is initialised (the launch's cases did,
    or this does: gloo, the variables of the launcher)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    result: dict[str, Any] = {}
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("row", "tensor"))
        result["frames"] = frames(mesh)
        result["split_backward"] = split_backward(mesh)
    except Exception:  # noqa: BLE001 - what this process raised is the result
        result["error"] = traceback.format_exc()
    (out / f"units-rank{rank}.json").write_text(json.dumps(result))

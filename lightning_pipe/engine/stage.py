"""`StageWorker`: a rank's event loop. Runs its actions in order as their inputs arrive."""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from lightning_pipe import tree
from lightning_pipe.backends import StageTrace, build_executables
from lightning_pipe.comm.base import COORDINATOR, Endpoint, Message, MessageKind, deadline, remaining
from lightning_pipe.engine.plan import EVAL, TRAIN, LossPlan, StageSpec, StepPlan
from lightning_pipe.engine.stage_state import StageStateCalls
from lightning_pipe.errors import PipeTimeoutError, StageError
from lightning_pipe.executors import Activation
from lightning_pipe.grads import GradStash
from lightning_pipe.runtime import runtime_registry
from lightning_pipe.schedule import Action, Kind

_IDLE_POLL = 1.0  # seconds between checks while waiting for the next step
Key = tuple[int, str, int, int]  # (step, kind, stage, microbatch)


class _Abort(Exception):
    """The coordinator dropped the current step."""


class _LossError(Exception):
    """The criterion failed on the last stage: the coordinator re-raises ``error`` itself, unwrapped."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class StageWorker(StageStateCalls):
    """Holds one or more shards on a device, serves steps, control calls and stop requests."""

    def __init__(self, spec: StageSpec, endpoint: Endpoint) -> None:
        self.spec = spec
        self.endpoint = endpoint
        self.rank = spec.rank
        self.shards = {shard.index: shard for shard in spec.shards}
        self.runtimes = {
            index: spec.runtime if spec.runtime is not None else runtime_registry.create(shard.device)
            for index, shard in self.shards.items()
        }
        for index, shard in self.shards.items():
            shard.module = self.runtimes[index].move_module(shard.module)
            shard.module._pipe_runtime = self.runtimes[index]
        # each shard's forward per mode, run by its backend; executor modules get these as their model
        devices = {index: runtime.torch_device for index, runtime in self.runtimes.items()}
        self.executables, self.traces = build_executables(self.shards.values(), spec.backend, devices)
        self._pending: dict[Key, Message] = {}
        self._saved: dict[tuple[int, int], Activation] = {}
        self._grads = GradStash(p for shard in self.shards.values() for p in shard.module.parameters())
        self._aborted = -1
        self._stop = False
        self._initialized: set[int] = set()
        self._parts: list[tuple[str, float, float]] = []  # this step's action parts (see lightning_pipe.trace)
        self._loss: LossPlan | None = None  # set when this rank computes the step's losses
        self._outputs: dict[int, Any] = {}  # last stage: outputs awaiting their loss, by microbatch

    # event loop
    def serve(self) -> None:
        """Wait for messages until STOP; the seed's event loop over the stage's inbox."""
        if self.spec.options.get("num_threads"):  # this thread's intra-op pool (it is per thread once set)
            torch.set_num_threads(self.spec.options["num_threads"])
        while not self._stop:
            message = self.endpoint.recv(_IDLE_POLL)
            if message is None:
                continue
            if message.kind == MessageKind.STOP:
                return
            if message.kind == MessageKind.STEP:
                self._run_step(message.step, message.payload)
            elif message.kind == MessageKind.CALL:
                self._call(message)
            elif message.kind == MessageKind.ABORT:
                self._forget(message.step)
            elif message.step > self._aborted:
                self._pending[(message.step, message.kind, message.stage, message.microbatch)] = message

    def _call(self, message: Message) -> None:
        name, args = message.payload
        try:
            result: Any = getattr(self, f"call_{name}")(*args)
            reply = Message(MessageKind.REPLY, message.step, payload=(True, result))
        except Exception as exc:  # reported to the coordinator, which raises it
            error = StageError(self.rank, None, name, repr(exc), traceback.format_exc(), self.endpoint.host(self.rank))
            reply = Message(MessageKind.REPLY, message.step, payload=(False, error))
        self.endpoint.send(COORDINATOR, reply)

    # a step
    def _run_step(self, step: int, plan: StepPlan) -> None:
        records: list[tuple[str, float, float]] = []
        self._parts = []
        self._loss = plan.loss
        action: Action | None = None
        training = plan.mode == TRAIN
        outcome: Message | None = None
        if training:
            self._grads.begin()
        try:
            for action in plan.actions:
                start = time.perf_counter()
                if action.kind is Kind.FORWARD:
                    self._forward(step, action, training)
                else:
                    self._backward(step, action)
                records.append((str(action), start, time.perf_counter()))
            for index, shard in self.shards.items():
                self.runtimes[index].get_pending_result(shard.module, True)
            outcome = Message(MessageKind.DONE, step, payload=(records, self._parts))
        except _Abort:
            self._forget(step)
        except _LossError as exc:  # the user's step code failed: raise its own exception, not a StageError
            outcome = Message(MessageKind.ERROR, step, payload=exc.error)
            self._forget(step)
        except Exception as exc:
            error = StageError(
                action.stage if action else self.rank,
                action.microbatch if action else None,
                str(action) if action else None,
                f"{type(exc).__name__}: {exc}",
                traceback.format_exc(),
                self.endpoint.host(self.rank),
            )
            outcome = Message(MessageKind.ERROR, step, payload=error)
            self._forget(step)
        finally:
            if training:
                # before telling the coordinator: once it hears DONE, Lightning may zero p.grad
                self._grads.end()
        if outcome is not None:
            self.endpoint.send(COORDINATOR, outcome)

    def _forward(self, step: int, action: Action, training: bool) -> None:
        s, m = action.stage, action.microbatch
        shard, runtime = self.shards[s], self.runtimes[s]
        model = self.executables[(s, TRAIN if training else EVAL)]
        t = time.perf_counter()
        inputs, mask = self._wait(step, MessageKind.ACTIVATION, s, m).payload
        t = self._span(action, "idle", t)
        inputs = runtime.convert_batch(inputs)
        device = runtime.torch_device
        if s not in self._initialized:
            self._initialized.add(s)
            runtime.initialize_module(shard.module, inputs, None)
        t = self._span(action, "recv", t)
        with self._autocast(device):
            if not training:
                with torch.no_grad():
                    outputs = shard.forward.run(model, inputs, device)
                out_mask = [False] * len(tree.flatten(outputs)[0])
            elif self.spec.checkpoint[s]:
                leaves = tree.as_leaves(inputs, mask)
                rng = torch.get_rng_state()
                with torch.no_grad():
                    outputs = shard.forward.run(model, leaves, device)
                self._saved[(s, m)] = Activation(leaves, None, rng)
                out_mask = [isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree.flatten(outputs)[0]]
            else:
                leaves = tree.as_leaves(inputs, mask)
                with torch.enable_grad():
                    outputs = shard.forward.run(model, leaves, device)
                self._saved[(s, m)] = Activation(leaves, outputs)
                out_mask = tree.grad_mask(outputs)
        t = self._span(action, "compute", t)
        payload = (tree.detach(outputs), out_mask)
        if s + 1 < self.spec.num_stages:
            message = Message(MessageKind.ACTIVATION, step, s + 1, m, payload)
            self.endpoint.send(self.spec.rank_of_stage[s + 1], message)
        elif self._loss is not None:
            self._outputs[m] = payload  # its loss is computed here when its backward needs the gradient
        else:
            self.endpoint.send(COORDINATOR, Message(MessageKind.OUTPUT, step, s, m, payload))
        self._span(action, "send", t)

    def _backward(self, step: int, action: Action) -> None:
        s, m = action.stage, action.microbatch
        shard, runtime = self.shards[s], self.runtimes[s]
        t = time.perf_counter()
        if (
            self._loss is not None
            and s == self.spec.num_stages - 1
            and (step, MessageKind.GRAD, s, m) not in self._pending
        ):
            self._compute_losses(step, s)
            t = self._span(action, "loss", t)
        grads = self._wait(step, MessageKind.GRAD, s, m).payload
        t = self._span(action, "idle", t)
        grads = [runtime.move_tensor(g) if isinstance(g, torch.Tensor) else None for g in grads]
        saved = self._saved.pop((s, m))
        model = self.executables[(s, TRAIN)]
        t = self._span(action, "recv", t)
        with self._autocast(runtime.torch_device):
            _, input_grads = shard.backward.run(model, None, saved, runtime.torch_device, grads, None)
        t = self._span(action, "compute", t)
        if input_grads is None or all(g is None for g in input_grads):
            if s == 0:
                return
            input_grads = [None] * len(tree.flatten(saved.inputs)[0])
        payload = [g.detach() if isinstance(g, torch.Tensor) else None for g in input_grads]
        if s > 0:
            self.endpoint.send(self.spec.rank_of_stage[s - 1], Message(MessageKind.GRAD, step, s - 1, m, payload))
        else:
            self.endpoint.send(COORDINATOR, Message(MessageKind.INPUT_GRAD, step, s, m, payload))
        self._span(action, "send", t)

    def _compute_losses(self, step: int, s: int) -> None:
        """The losses of the outputs kept so far, in microbatch order, as the coordinator would compute them.

        Each loss's gradient with respect to the output becomes this stage's pending gradient and the
        loss goes to the coordinator. With a schedule that runs every forward first (gpipe) this
        happens at the first backward, so the losses still come after all forwards.
        """
        plan = self._loss
        assert plan is not None
        loss_module = self.shards[s].forward_loss
        for m in sorted(self._outputs):
            outputs, mask = self._outputs.pop(m)
            outputs = tree.map_tensors(lambda t: t.to(plan.device) if t.device != plan.device else t, outputs)
            leaves = tree.as_leaves(outputs, mask)
            try:
                plan.scaler, grads, loss = loss_module.run(
                    plan.head, plan.optimizer, leaves, plan.labels[m], plan.criterion, plan.device, plan.scaler
                )
            except Exception as exc:
                raise _LossError(exc) from exc
            if grads is None:
                grads = [None] * len(tree.flatten(leaves)[0])
            grads = [g.detach() if isinstance(g, torch.Tensor) else None for g in grads]
            self._pending[(step, MessageKind.GRAD, s, m)] = Message(MessageKind.GRAD, step, s, m, grads)
            self.endpoint.send(COORDINATOR, Message(MessageKind.LOSS, step, s, m, loss))

    def _span(self, action: Action, part: str, start: float) -> float:
        """Record ``part`` (idle, recv, loss, compute or send) of ``action`` from ``start`` until now; returns now."""
        now = time.perf_counter()
        self._parts.append((f"{action} {part}", start, now))
        return now

    def _wait(self, step: int, kind: str, stage: int, microbatch: int) -> Message:
        key = (step, kind, stage, microbatch)
        until = deadline(self.spec.timeout)
        while key not in self._pending:
            message = self.endpoint.recv(remaining(until))
            if message is None:
                what = "activation" if kind == MessageKind.ACTIVATION else "gradient"
                raise PipeTimeoutError(
                    f"stage {stage} waited {self.spec.timeout:.1f} s for the {what} of microbatch {microbatch}; "
                    "raise PipeStrategy(timeout=...) if a stage legitimately takes that long"
                )
            if message.kind == MessageKind.ABORT and message.step >= step:
                raise _Abort
            if message.kind == MessageKind.STOP:
                self._stop = True
                raise _Abort
            if message.kind == MessageKind.CALL:
                self._call(message)
                continue
            self._pending[(message.step, message.kind, message.stage, message.microbatch)] = message
        return self._pending.pop(key)

    def _forget(self, step: int) -> None:
        self._aborted = max(self._aborted, step)
        self._pending = {k: v for k, v in self._pending.items() if k[0] > step}
        self._saved.clear()
        self._outputs.clear()

    @contextlib.contextmanager
    def _autocast(self, device: torch.device) -> Iterator[None]:
        if self.spec.autocast is None:
            yield
            return
        with torch.autocast(**self.spec.autocast.for_device(device.type)):
            yield

    # control calls (``call_<name>``), run on the worker between steps
    def call_apply_grads(self, scale: float) -> None:
        """Add the last step's gradients, times ``scale``, to ``p.grad`` (the strategy's backward)."""
        self._grads.apply(scale)

    def call_discard_grads(self) -> None:
        self._grads.discard()

    def call_train(self, mode: bool) -> None:
        for shard in self.shards.values():
            shard.module.train(mode)

    def call_runtime_hook(self, name: str, args: tuple[Any, ...]) -> None:
        """Call ``runtime.<name>(module, *args)`` for each shard of this rank."""
        for index, shard in self.shards.items():
            hook = getattr(self.runtimes[index], name)
            if name in ("train_epoch_begin", "train_validation_begin"):
                hook(shard.module)
            elif name == "get_pending_result":
                hook(shard.module, *args)
            elif name == "initialize_module":
                hook(shard.module, *args)
            else:  # pre/post step hooks: (trainer, module, batch_idx, batch[, outputs])
                hook(args[0], shard.module, *args[1:])

    def call_execution_trace(self, reset: bool = False) -> list[StageTrace]:
        """A copy of each shard's backend trace; ``reset`` zeroes the counts afterwards."""
        traces = [copy.deepcopy(trace) for trace in self.traces.values()]
        if reset:
            for trace in self.traces.values():
                trace.reset()
        return traces

    def call_ping(self) -> int:
        return self.rank

"""`StageActions`: a stage worker's compute in a step: forward, backward, its I and W halves, the last stage's loss.

Each action takes its input from the worker's inbox, runs the shard's executor module on the shard's
runtime and backend, and sends its result on: an activation to the next stage (or the coordinator), a
gradient to the previous stage (or the coordinator). Between a microbatch's forward and its backward the
activation is held here; the worker's memory accounting measures it.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from typing import Any

import torch

from lightning_pipe.backends import StageExecutable
from lightning_pipe.backends.registry import EAGER
from lightning_pipe.base import tree
from lightning_pipe.base.errors import ConfigurationError, StageError
from lightning_pipe.comm.base import COORDINATOR, Endpoint, Message, MessageKind
from lightning_pipe.engine.executors import Activation, BackwardModule, recompute
from lightning_pipe.engine.messages import EVAL, TRAIN, StageSpec, StepPlan
from lightning_pipe.engine.replicas import DataParallel
from lightning_pipe.engine.split_backward import WeightGradient, backward_input, backward_weight
from lightning_pipe.engine.stage_inbox import StageInbox, StepAborted
from lightning_pipe.engine.stage_losses import LossFailed, StageLosses
from lightning_pipe.engine.stage_memory import StageMemory
from lightning_pipe.engine.step_result import Record
from lightning_pipe.engine.versions import WorkerVersions
from lightning_pipe.rng import StageRandom
from lightning_pipe.runtime import BaseRuntime
from lightning_pipe.schedule import Action, Kind

_NO_AUTOCAST = contextlib.nullcontext()
_SPLIT_BACKENDS = (EAGER, "inductor")  # backends whose backward `backward_input` splits into I and W


class StepFailed(Exception):
    """A step failed on this worker; ``error`` is what the coordinator raises.

    A `StageError` naming the action, or the user's own exception where the criterion failed on the last stage.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class StageActions:
    """Runs a step's actions on a worker's shards, in the order its inbox finds them ready."""

    def __init__(
        self,
        spec: StageSpec,
        inbox: StageInbox,
        shards: dict[int, Any],
        runtimes: dict[int, BaseRuntime],
        executables: dict[tuple[int, str], StageExecutable],
        random: dict[int, StageRandom],
        memory: StageMemory,
        versions: WorkerVersions,
    ) -> None:
        self.spec = spec
        self.inbox = inbox
        self.endpoint: Endpoint = inbox.endpoint
        self.shards = shards
        self.runtimes = runtimes
        self.executables = executables
        self.random = random
        self.memory = memory
        self.versions = versions
        self._saved: dict[tuple[int, int], Activation] = {}
        self._weight_work: dict[tuple[int, int], WeightGradient] = {}  # I done, W pending
        self._initialized: set[int] = set()  # stages whose runtime initialized their module
        self._parts: list[Record] = []  # this step's action parts (see lightning_pipe.pipeline.timeline)
        self._label = ""  # the running action's text (``1F0``)
        self.losses = StageLosses(inbox, shards)  # the step's losses, where this rank takes them

    def run(self, step: int, plan: StepPlan, replicas: DataParallel | None) -> tuple[list[Record], list[Record]]:
        """The step's actions, then (training) the replicas' gradient average; its records and their parts.

        Raises `StepAborted` when the coordinator dropped the step, `StepFailed` when it failed here.
        """
        records: list[Record] = []
        action: Action | None = None
        training, set_aside = plan.mode != EVAL, plan.mode == TRAIN
        self._parts = []
        idle_since = time.perf_counter()
        if training:
            self.memory.stash.reset()
        try:
            if set_aside and replicas is not None:
                replicas.begin()  # torchft: the step's quorum (a joining group heals here, before its forwards)
            if self.versions.active:
                self.versions.start(plan.update_every, plan.optimizer, plan.shared)
            ready = self._ready
            order = (
                self.inbox.dataflow(step, plan.actions, ready)
                if plan.dataflow
                else self.inbox.in_order(step, plan.actions, ready)
            )
            whole = replicas is not None and not replicas.splits  # FSDP frees a block's parameters after its backward
            if whole and any(a.kind is Kind.BACKWARD_INPUT for a in plan.actions):
                raise ConfigurationError(
                    "this schedule splits backwards into input and weight halves (zero-bubble, zbv, dualpipev), which "
                    "a stage sharded with FSDP cannot run (it frees a block's gathered parameters after its backward): "
                    "use schedule='1f1b', 'gpipe', 'interleaved-1f1b' or 'looped-bfs' with FSDP; or hold each stage "
                    "whole in its replicas: data_parallel='ddp', and a configure_model without fully_shard calls"
                )
            early = self._early_input_grad(plan) if set_aside and not whole else None
            last = self.spec.num_stages - 1
            recomputes = bool(self.memory.recompute[last]) if last in self.shards else False
            self.losses.begin(plan, last, recomputes or whole, early)  # (FSDP: `StageLosses.begin`)
            for action in order:  # each action's inputs are here: its record times the work, not the wait
                start = time.perf_counter()
                self._label = label = str(action)  # its text once: each of its parts' names starts with it
                self._parts.append((f"{label} idle", idle_since, start))  # waiting for its inputs
                if action.kind is Kind.FORWARD:
                    self._forward(step, action, training)
                elif action == early:
                    self._backward_input(step, action, held=False)  # the previous stage goes on during W
                    self._backward_weight(action)
                elif action.kind is Kind.BACKWARD:
                    self._backward(step, action)
                elif action.kind is Kind.BACKWARD_INPUT:
                    self._backward_input(step, action)
                else:
                    self._backward_weight(action)
                idle_since = time.perf_counter()
                records.append((label, start, idle_since))
            if set_aside and replicas is not None:
                start = time.perf_counter()
                replicas.reduce(self.shards)
                self._parts.append((f"{action} reduce", start, time.perf_counter()))  # after the last action
            for index, shard in self.shards.items():
                self.runtimes[index].get_pending_result(shard.module, True)
            for loss in self.losses.messages:
                self.endpoint.send(COORDINATOR, loss)
        except (StepAborted, StepFailed):
            raise
        except LossFailed as failed:  # the user's criterion: its own exception, not a StageError
            raise StepFailed(failed.error) from failed.error
        except Exception as exc:
            rank = self.spec.rank
            error = StageError(
                action.stage if action else rank,
                action.microbatch if action else None,
                str(action) if action else None,
                f"{type(exc).__name__}: {exc}",
                traceback.format_exc(),
                self.endpoint.host(rank),
            )
            raise StepFailed(error) from exc
        return records, self._parts

    def forget(self) -> None:
        """Drop what a step that ended early left: held activations, pending weight gradients, outputs."""
        self._saved.clear()
        self._weight_work.clear()
        self.losses.forget()
        self.memory.stash.reset()

    def _ready(self, step: int, action: Action, first: bool, cap: int) -> bool:
        """Whether ``action``'s inputs arrived (a forward not ``first``: and fewer than ``cap`` activations held)."""
        key = (action.stage, action.microbatch)
        if action.kind is Kind.FORWARD:
            arrived = self.inbox.arrived(step, MessageKind.ACTIVATION, *key)
            return arrived and (first or len(self._saved) < cap)
        if action.kind is Kind.BACKWARD_WEIGHT:
            return key in self._weight_work
        if self.losses.in_backward(*key):  # its gradient is its loss's: no message
            return key in self._saved
        return self.inbox.arrived(step, MessageKind.GRAD, *key) and key in self._saved

    def _forward(self, step: int, action: Action, training: bool) -> None:
        s, m = action.stage, action.microbatch
        shard, runtime = self.shards[s], self.runtimes[s]
        model = self.executables[(s, TRAIN if training else EVAL)]
        t = time.perf_counter()
        inputs, mask = self.inbox.wait(step, MessageKind.ACTIVATION, s, m).payload
        inputs = runtime.convert_batch(inputs)
        device = runtime.torch_device
        if s not in self._initialized:
            self._initialized.add(s)
            runtime.initialize_module(shard.module, inputs, None)
        t = self._span("recv", t)
        stage_rng = self.random[s]
        stash = self.memory.stash
        with self._autocast(device), stage_rng.drawing(training):  # the stage's own generators
            if not training:
                with torch.no_grad():
                    outputs = shard.forward.run(model, inputs, device)
                out_mask = [False] * len(tree.flatten(outputs)[0])
            elif self.memory.recompute[s]:
                leaves = tree.as_leaves(inputs, mask)
                state = stage_rng.snapshot()  # the recomputation replays this forward's draws
                with torch.no_grad():
                    outputs = shard.forward.run(self._model(s, m), leaves, device)
                self._saved[(s, m)] = Activation(leaves, None, state)
                stash.hold((s, m), self.memory.size(s, self._saved[(s, m)], True))
                out_mask = [isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree.flatten(outputs)[0]]
            else:
                leaves = tree.as_leaves(inputs, mask)
                with torch.enable_grad():
                    outputs = shard.forward.run(self._model(s, m), leaves, device)
                self._saved[(s, m)] = Activation(leaves, outputs)
                stash.hold((s, m), self.memory.size(s, self._saved[(s, m)], False))
                out_mask = tree.grad_mask(outputs)
        t = self._span("compute", t)
        if s + 1 < self.spec.num_stages:
            message = Message(MessageKind.ACTIVATION, step, s + 1, m, (tree.detach(outputs), out_mask))
            self.endpoint.send(self.spec.rank_of_stage[s + 1], message)
        elif self.losses.plan is not None:
            if self.losses.after_forward(step, s, m, outputs, out_mask):
                self._span("loss", t)
            return
        else:
            message = Message(MessageKind.OUTPUT, step, s, m, (tree.detach(outputs), out_mask))
            self.endpoint.send(COORDINATOR, message)
        self._span("send", t)

    def _early_input_grad(self, plan: StepPlan) -> Action | None:
        """The rank's last backward of a training step, to run as ``I`` then ``W``, where that is the same.

        Nothing on this rank waits for its last weight gradient, while the previous stage waits for its
        input gradient: sent before the weight gradients are computed, the pipeline's drain is shorter
        by one weight gradient per stage (`split_backward`: the same gradients). Between ``I`` and ``W`` the
        gradients at the weights' boundary nodes are kept: the action's transient peak is up to one
        microbatch's worth of them above a plain backward's. Only for stages with a previous stage, whose
        backward is the default executor (`BackwardModule`) on eager or inductor stages (eager's autograd graph
        is split where the weights' paths leave the input's, inductor's by its own ``I`` and ``W`` graphs).
        """
        backwards = [a for a in plan.actions if a.kind is Kind.BACKWARD]
        if not backwards or backwards[-1].stage == 0:
            return None
        last = backwards[-1]
        default = type(self.shards[last.stage].backward) is BackwardModule
        splits = all(b.name in _SPLIT_BACKENDS for b in self.executables[(last.stage, TRAIN)].chain.backends)
        return last if default and splits else None

    def _backward_with_loss(self, step: int, s: int, m: int) -> None:
        """``B`` of the last stage that takes its microbatch's loss (`StageLosses`): one backward through both."""
        saved = self._saved.pop((s, m))
        t = time.perf_counter()
        loss = self.losses.of_backward(step, s, m, saved.outputs)
        t = self._span("loss", t)
        with self._autocast(self.runtimes[s].torch_device):
            self.memory.measure_auto(s, self._model(s, m), saved)
            self.losses.backpropagate(s, loss)
        self.memory.stash.release((s, m))
        t = self._span("compute", t)
        self._send_input_grads(step, s, m, saved, tree.grads_of(saved.inputs))
        self._span("send", t)

    def _backward(self, step: int, action: Action) -> None:
        s, m = action.stage, action.microbatch
        if self.losses.in_backward(s, m):
            self._backward_with_loss(step, s, m)
            return
        shard, runtime = self.shards[s], self.runtimes[s]
        t = time.perf_counter()
        grads = self.inbox.wait(step, MessageKind.GRAD, s, m).payload
        grads = [runtime.move_tensor(g) if isinstance(g, torch.Tensor) else None for g in grads]
        saved = self._saved.pop((s, m))
        t = self._span("recv", t)
        model = self._model(s, m)
        with self._autocast(runtime.torch_device):
            self.memory.measure_auto(s, model, saved)
            _, input_grads = shard.backward.run(model, None, saved, runtime.torch_device, grads, None)
        if self.versions.active:
            self.versions.backward_done(s, m)
        self.memory.stash.release((s, m))
        t = self._span("compute", t)
        self._send_input_grads(step, s, m, saved, input_grads)
        self._span("send", t)

    def _backward_input(self, step: int, action: Action, held: bool = True) -> None:
        """``I``: the gradient of the stage input now; the graph stays for the weight gradient ``W``.

        ``held=False``: ``W`` follows at once (`_early_input_grad`), so what ``I`` keeps for it is transient
        within the backward, as a plain backward's gradients are; the stash counts neither.
        """
        s, m = action.stage, action.microbatch
        shard, runtime = self.shards[s], self.runtimes[s]
        t = time.perf_counter()
        grads = self.inbox.wait(step, MessageKind.GRAD, s, m).payload
        grads = [runtime.move_tensor(g) if isinstance(g, torch.Tensor) else None for g in grads]
        saved = self._saved[(s, m)]
        model = self._model(s, m)
        memory = self.memory
        if held:  # its own action: the timeline shows I's parts (within a B, the B's span covers both halves)
            t = self._span("recv", t)
        with self._autocast(runtime.torch_device):
            outputs = saved.outputs
            if outputs is None:  # checkpointed: the recomputed graph is kept until W
                outputs = saved.outputs = recompute(model, saved)
                if held:
                    graph = memory.size(s, saved, False) - memory.size(s, Activation(saved.inputs), True)
                    memory.stash.hold((s, m), graph)
            memory.measure_auto(s, model, saved)
            input_grads, work = backward_input(
                tree.flatten(outputs)[0], grads, tree.flatten(saved.inputs)[0], shard.module.parameters()
            )
        self._weight_work[(s, m)] = work
        if held:
            memory.stash.hold((s, m), work.nbytes())
            memory.stash.note(s, "split", work.nbytes())
            t = self._span("compute", t)
        self._send_input_grads(step, s, m, saved, input_grads)
        if held:
            self._span("send", t)

    def _backward_weight(self, action: Action) -> None:
        """``W``: the parameter gradients left pending by ``I``; frees the microbatch's stash."""
        s, m = action.stage, action.microbatch
        work = self._weight_work.pop((s, m))
        t = time.perf_counter()
        with self._autocast(self.runtimes[s].torch_device):
            backward_weight(work)
        if action.kind is Kind.BACKWARD_WEIGHT:
            self._span("compute", t)
        del self._saved[(s, m)]
        self.memory.stash.release((s, m))

    def _model(self, s: int, m: int) -> torch.nn.Module:
        """What runs stage ``s`` for microbatch ``m``: its module, or (async) the module on m's weight version."""
        return self.versions.model(s, m) if self.versions.active else self.executables[(s, TRAIN)]

    def _span(self, part: str, start: float) -> float:
        """Record ``part`` (recv, loss, compute or send) of the running action from ``start`` until now; returns now."""
        now = time.perf_counter()
        self._parts.append((f"{self._label} {part}", start, now))
        return now

    def _send_input_grads(
        self, step: int, s: int, m: int, saved: Activation, input_grads: list[torch.Tensor | None] | None
    ) -> None:
        if input_grads is None or all(g is None for g in input_grads):
            if s == 0:
                return
            input_grads = [None] * len(tree.flatten(saved.inputs)[0])
        payload = [g.detach() if isinstance(g, torch.Tensor) else None for g in input_grads]
        if s > 0:
            self.endpoint.send(self.spec.rank_of_stage[s - 1], Message(MessageKind.GRAD, step, s - 1, m, payload))
        else:
            self.endpoint.send(COORDINATOR, Message(MessageKind.INPUT_GRAD, step, s, m, payload))

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.spec.autocast is None:
            return _NO_AUTOCAST  # several times per action: a generator-based context manager costs more
        return torch.autocast(**self.spec.autocast.for_device(device.type))

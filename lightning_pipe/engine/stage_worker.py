"""`StageWorker`: a rank's event loop. Runs its actions in order as their inputs arrive."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from lightning_pipe.backends import build_executables
from lightning_pipe.base.errors import StageError
from lightning_pipe.checkpoint.stage_part import StageCheckpoint
from lightning_pipe.comm.base import COORDINATOR, Endpoint, Message, MessageKind
from lightning_pipe.engine.messages import ASYNC, TRAIN, StageSpec, StepPlan
from lightning_pipe.engine.quorum_replicas import QuorumReplicas
from lightning_pipe.engine.replicas import DataParallel, StageReplicas
from lightning_pipe.engine.stage_actions import StageActions, StepFailed
from lightning_pipe.engine.stage_inbox import StageInbox, StepAborted
from lightning_pipe.engine.stage_memory import StageMemory
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.engine.stage_shards import StageShards
from lightning_pipe.engine.state_calls import StageStateCalls
from lightning_pipe.engine.step_result import Records
from lightning_pipe.engine.tensor_replicas import TensorStageReplicas, has_dtensors
from lightning_pipe.engine.versions import WorkerVersions
from lightning_pipe.rng import StageRandom, run_seed
from lightning_pipe.runtime import BaseRuntime, runtime_registry
from lightning_pipe.weights import Materialized

_IDLE_POLL = 1.0  # seconds between checks while waiting for the next step


class StageWorker:
    """Holds one or more shards on a device, serves steps, control calls and stop requests.

    Made of parts, each owning its state: ``inbox`` (the messages: inputs that arrived, what waits
    for the next step), ``actions`` (a step's compute and the activations it holds), ``state`` (the
    shards' parameters, gradients, optimizer and generators as the coordinator reaches them), ``memory``
    (the stash meter and which stages recompute) and ``versions`` (the weight versions of an
    asynchronous run). A control call is a method of ``protocol`` (`StageProtocol`), which hands it to
    the part that owns what it touches.
    """

    def __init__(self, spec: StageSpec, endpoint: Endpoint) -> None:
        self.spec = spec
        self.endpoint = endpoint
        self.rank = spec.rank
        self.shards = {shard.index: shard for shard in spec.shards}
        chosen = {i: spec.runtime.get(i) if isinstance(spec.runtime, dict) else spec.runtime for i in self.shards}
        self.runtimes: dict[int, BaseRuntime] = {
            index: chosen[index] or runtime_registry.create(shard.device) for index, shard in self.shards.items()
        }
        #: what this worker read from a checkpoint or weights, and what it initialised (`weights.Materialized`)
        self.materialized = Materialized()
        if spec.init is not None:  # tensors without values (a model built on meta), a resumed run's: made here
            self.materialized = spec.init.apply(
                [(s.module, self.runtimes[i].torch_device) for i, s in self.shards.items()]
            )
            spec.init = None  # made: the values it held (a checkpoint hook's) are the shards' now
        for index, shard in self.shards.items():
            shard.module = self.runtimes[index].move_module(shard.module)
            shard.module._pipe_runtime = self.runtimes[index]
        # each shard's forward per mode, run by its backend; executor modules get these as their model
        devices = {index: runtime.torch_device for index, runtime in self.runtimes.items()}
        executables, traces = build_executables(self.shards.values(), spec.backend, devices)
        seed = run_seed(spec.seed)
        random = {index: StageRandom(seed, index, devices[index], s.module) for index, s in self.shards.items()}
        self.inbox = StageInbox(endpoint, self.rank, spec.timeout, self._call)
        self.versions = WorkerVersions(self.shards.values())
        self.memory = StageMemory(spec, self.shards, self.runtimes, self.versions)
        self.state = StageStateCalls(self.rank, self.shards, random, self.runtimes, traces)
        self.actions = StageActions(
            spec, self.inbox, self.shards, self.runtimes, executables, random, self.memory, self.versions
        )
        self.checkpoints = StageCheckpoint(self.shards, self.state)
        self.state.before_change = self.checkpoints.staged  # a step or a load waits for a checkpoint's copy
        self.replicas: DataParallel | None = None  # launched mode: the stage over its replicas
        self.protocol = StageProtocol(self.rank, self.state, self.memory, self.versions, self.checkpoints)
        self._failed: int | None = None  # a step that failed here, until the coordinator's abort says it knows

    def replicate(self, group: Any) -> None:
        """Average this worker's gradients over ``group`` (its stages' data-parallel group) after each step: with
        DDP, or where a tensor parallel plan made its parameters DTensors (DDP takes none) by all-reducing them."""
        modules = {i: s.module for i, s in self.shards.items()}
        if has_dtensors(modules.values()):
            self.replicas = TensorStageReplicas(modules, group)
            return
        devices = {index: runtime.torch_device for index, runtime in self.runtimes.items()}
        self.replicas = StageReplicas(modules, group, devices)

    def join_quorum(self, manager: Any) -> None:
        """Average this worker's gradients over torchft's quorum of replica groups after each step (``manager``: its
        ``start_quorum``, ``allreduce``, ``should_commit``); its optimizer steps only where the step committed."""
        replicas = QuorumReplicas({i: s.module for i, s in self.shards.items()}, manager)
        self.replicas = replicas
        self.state.commits = replicas.should_step

    def sharded(self, shards: StageShards) -> None:
        """This worker's stages are sharded over their replicas with FSDP2 (``shards``: ``fully_shard`` applied to
        their modules before this worker made their tensors real, so each holds only its shard); gradients are
        reduce-scattered once per step. Before any optimizer is built."""
        self.replicas = shards
        self.state.regather()

    # event loop
    def serve(self) -> None:
        """Wait for messages until STOP; the seed's event loop over the stage's inbox."""
        if self.spec.options.get("num_threads"):  # this thread's intra-op pool (it is per thread once set)
            torch.set_num_threads(self.spec.options["num_threads"])
        while not self.inbox.stopped:
            message = self.inbox.next(_IDLE_POLL)
            if message is None:
                continue
            if message.kind == MessageKind.STOP:
                return
            if message.kind == MessageKind.STEP:
                self._run_step(message.step, message.payload)
            elif message.kind in (MessageKind.CALL, MessageKind.POST):
                self._call(message)
            elif message.kind == MessageKind.ABORT:
                self._forget(message.step)
            else:
                self.inbox.store(message)

    def _call(self, message: Message) -> None:
        """Run a CALL and reply with its result or error; run a POST and reply only with its error."""
        name, args = message.payload
        posted = message.kind == MessageKind.POST
        if posted and self._failed is not None:
            return  # sent before the coordinator heard of the failure (an optimizer step after the failed step)
        try:
            result: Any = self.protocol.serve(name)(*args)
            if posted:
                return
            reply = Message(MessageKind.REPLY, message.step, payload=(True, result))
        except Exception as exc:  # reported to the coordinator, which raises it
            error = StageError(self.rank, None, name, repr(exc), traceback.format_exc(), self.endpoint.host(self.rank))
            failed = Message(MessageKind.POST_FAILED, message.step, payload=error)
            reply = failed if posted else Message(MessageKind.REPLY, message.step, payload=(False, error))
        self.endpoint.send(COORDINATOR, reply)

    # a step
    def _run_step(self, step: int, plan: StepPlan) -> None:
        set_aside = plan.mode == TRAIN
        self.inbox.asynchronous = self.versions.active = plan.mode == ASYNC
        outcome: Message | None = None
        if set_aside:
            self.state.grads.begin()
        try:
            records, parts = self.actions.run(step, plan, self.replicas)
            outcome = Message(MessageKind.DONE, step, payload=(Records(records), Records(parts)))
        except StepAborted:
            self._forget(step)
        except StepFailed as failed:
            outcome = Message(MessageKind.ERROR, step, payload=failed.error)
            self._forget(step)
        finally:
            if set_aside:
                # before telling the coordinator: once it hears DONE, Lightning may zero p.grad
                self.state.grads.end()
        if outcome is not None:
            if outcome.kind == MessageKind.ERROR:
                self._failed = step
            self.endpoint.send(COORDINATOR, outcome)

    def _forget(self, step: int) -> None:
        if self._failed is not None and step >= self._failed:
            self._failed = None  # the coordinator aborted a step after the failure: it knows
        if self.versions.active:  # stages of this process waiting on a weight shared with this one stop too
            self.versions.drop_run()
        self.inbox.forget(step)
        self.actions.forget()

"""`StageWorker`: a rank's event loop. Runs its actions in order as their inputs arrive."""

from __future__ import annotations

import collections
import contextlib
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from lightning_pipe import tree
from lightning_pipe.backends import build_executables
from lightning_pipe.backends.registry import EAGER
from lightning_pipe.comm.base import COORDINATOR, Endpoint, Message, MessageKind
from lightning_pipe.engine.plan import ASYNC, EVAL, TRAIN, LossPlan, StageSpec, StepPlan
from lightning_pipe.engine.replicas import StageReplicas
from lightning_pipe.engine.split_backward import WeightGradient, backward_input, backward_weight
from lightning_pipe.engine.stage_inbox import Key, StageInbox, StepAborted
from lightning_pipe.engine.stage_memory import StageMemoryCalls
from lightning_pipe.engine.stage_state import StageStateCalls
from lightning_pipe.engine.stash import StashMeter, signature
from lightning_pipe.engine.versions import StageVersions, stage_versions
from lightning_pipe.errors import StageError
from lightning_pipe.executors import Activation, BackwardModule, output_grads, recompute
from lightning_pipe.grads import GradStash
from lightning_pipe.rng import StageRandom, run_seed
from lightning_pipe.runtime import BaseRuntime, runtime_registry
from lightning_pipe.schedule import Action, Kind

_IDLE_POLL = 1.0  # seconds between checks while waiting for the next step


class _LossError(Exception):
    """The criterion failed on the last stage: the coordinator re-raises ``error`` itself, unwrapped."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class StageWorker(StageInbox, StageStateCalls, StageMemoryCalls):
    """Holds one or more shards on a device, serves steps, control calls and stop requests."""

    def __init__(self, spec: StageSpec, endpoint: Endpoint) -> None:
        self.spec = spec
        self.endpoint = endpoint
        self.rank = spec.rank
        self.shards = {shard.index: shard for shard in spec.shards}
        chosen = {i: spec.runtime.get(i) if isinstance(spec.runtime, dict) else spec.runtime for i in self.shards}
        self.runtimes: dict[int, BaseRuntime] = {
            index: chosen[index] or runtime_registry.create(shard.device) for index, shard in self.shards.items()
        }
        for index, shard in self.shards.items():
            shard.module = self.runtimes[index].move_module(shard.module)
            shard.module._pipe_runtime = self.runtimes[index]
        # each shard's forward per mode, run by its backend; executor modules get these as their model
        devices = {index: runtime.torch_device for index, runtime in self.runtimes.items()}
        self.executables, self.traces = build_executables(self.shards.values(), spec.backend, devices)
        seed = run_seed(spec.seed)
        self.random = {index: StageRandom(seed, index, devices[index], s.module) for index, s in self.shards.items()}
        self._pending: dict[Key, Message] = {}
        self._later: collections.deque[Message] = collections.deque()
        self._saved: dict[tuple[int, int], Activation] = {}
        self._weight_work: dict[tuple[int, int], WeightGradient] = {}  # I done, W pending
        self.stash = StashMeter()
        self._init_recompute()  # per stage: recompute its forward in the backward (checkpoint=)
        self._versions: dict[int, StageVersions] = {}  # ASYNC: per stage, kept across runs
        self._asynchronous = False
        self._grads = GradStash(p for shard in self.shards.values() for p in shard.module.parameters())
        self._aborted = -1
        self._failed: int | None = None  # a step that failed here, until the coordinator's abort says it knows
        self._stop = False
        self._initialized: set[int] = set()
        self._parts: list[tuple[str, float, float]] = []  # this step's action parts (see lightning_pipe.trace)
        self._loss: LossPlan | None = None  # set when this rank computes the step's losses
        self._outputs: dict[int, Any] = {}  # last stage: outputs awaiting their loss, by microbatch
        self._losses: list[Message] = []  # last stage: this step's losses, sent with its end (one wake-up)
        self.replicas: StageReplicas | None = None  # launched mode: gradients averaged over the stage's replicas

    def replicate(self, group: Any) -> None:
        """Average this worker's gradients over ``group`` (its stages' data-parallel group) after each step."""
        devices = {index: runtime.torch_device for index, runtime in self.runtimes.items()}
        self.replicas = StageReplicas({i: s.module for i, s in self.shards.items()}, group, devices)

    # event loop
    def serve(self) -> None:
        """Wait for messages until STOP; the seed's event loop over the stage's inbox."""
        if self.spec.options.get("num_threads"):  # this thread's intra-op pool (it is per thread once set)
            torch.set_num_threads(self.spec.options["num_threads"])
        while not self._stop:
            message = self._later.popleft() if self._later else self.endpoint.recv(_IDLE_POLL)
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
            elif message.step > self._aborted:
                self._pending[(message.step, message.kind, message.stage, message.microbatch)] = message

    def _call(self, message: Message) -> None:
        """Run a CALL and reply with its result or error; run a POST and reply only with its error."""
        name, args = message.payload
        posted = message.kind == MessageKind.POST
        if posted and self._failed is not None:
            return  # sent before the coordinator heard of the failure (an optimizer step after the failed step)
        try:
            result: Any = getattr(self, f"call_{name}")(*args)
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
        records: list[tuple[str, float, float]] = []
        action: Action | None = None
        training, set_aside = plan.mode != EVAL, plan.mode == TRAIN
        self._asynchronous = plan.mode == ASYNC
        outcome: Message | None = None
        self._parts, self._loss, self._outputs, self._losses = [], plan.loss, {}, []
        idle_since = time.perf_counter()
        if set_aside:
            self._grads.begin()
        if training:
            self.stash.reset()
        try:
            if self._asynchronous:
                self._start_async(plan)
            order = self._dataflow(step, plan.actions) if plan.dataflow else self._in_order(step, plan.actions)
            early = self._early_input_grad(plan) if set_aside else None
            for action in order:  # each action's inputs are here: its record times the work, not the wait
                start = time.perf_counter()
                self._parts.append((f"{action} idle", idle_since, start))  # waiting for its inputs
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
                records.append((str(action), start, idle_since))
            if set_aside and self.replicas is not None:
                start = time.perf_counter()
                self.replicas.reduce(self.shards)
                self._parts.append((f"{action} reduce", start, time.perf_counter()))  # after the last action
            for index, shard in self.shards.items():
                self.runtimes[index].get_pending_result(shard.module, True)
            for loss in self._losses:
                self.endpoint.send(COORDINATOR, loss)
            outcome = Message(MessageKind.DONE, step, payload=(records, self._parts))
        except StepAborted:
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
            if set_aside:
                # before telling the coordinator: once it hears DONE, Lightning may zero p.grad
                self._grads.end()
        if outcome is not None:
            if outcome.kind == MessageKind.ERROR:
                self._failed = step
            self.endpoint.send(COORDINATOR, outcome)

    def _forward(self, step: int, action: Action, training: bool) -> None:
        s, m = action.stage, action.microbatch
        shard, runtime = self.shards[s], self.runtimes[s]
        model = self.executables[(s, TRAIN if training else EVAL)]
        t = time.perf_counter()
        inputs, mask = self._wait(step, MessageKind.ACTIVATION, s, m).payload
        inputs = runtime.convert_batch(inputs)
        device = runtime.torch_device
        if s not in self._initialized:
            self._initialized.add(s)
            runtime.initialize_module(shard.module, inputs, None)
        t = self._span(action, "recv", t)
        stage_rng = self.random[s]
        with self._autocast(device), stage_rng.drawing(training):  # the stage's own generators
            if not training:
                with torch.no_grad():
                    outputs = shard.forward.run(model, inputs, device)
                out_mask = [False] * len(tree.flatten(outputs)[0])
            elif self.recompute[s]:
                leaves = tree.as_leaves(inputs, mask)
                state = stage_rng.snapshot()  # the recomputation replays this forward's draws
                with torch.no_grad():
                    outputs = shard.forward.run(self._model(s, m), leaves, device)
                self._saved[(s, m)] = Activation(leaves, None, state)
                self.stash.hold((s, m), self._stash_size(s, self._saved[(s, m)], True))
                out_mask = [isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree.flatten(outputs)[0]]
            else:
                leaves = tree.as_leaves(inputs, mask)
                with torch.enable_grad():
                    outputs = shard.forward.run(self._model(s, m), leaves, device)
                self._saved[(s, m)] = Activation(leaves, outputs)
                self.stash.hold((s, m), self._stash_size(s, self._saved[(s, m)], False))
                out_mask = tree.grad_mask(outputs)
        t = self._span(action, "compute", t)
        payload = (tree.detach(outputs), out_mask)
        if s + 1 < self.spec.num_stages:
            message = Message(MessageKind.ACTIVATION, step, s + 1, m, payload)
            self.endpoint.send(self.spec.rank_of_stage[s + 1], message)
        elif self._loss is not None:
            self._outputs[m] = payload
            if not self._loss.after_all_forwards or len(self._outputs) == len(self._loss.labels):
                t = self._span(action, "send", t)
                self._compute_losses(step, s)
                self._span(action, "loss", t)
                return
        else:
            self.endpoint.send(COORDINATOR, Message(MessageKind.OUTPUT, step, s, m, payload))
        self._span(action, "send", t)

    def _early_input_grad(self, plan: StepPlan) -> Action | None:
        """The rank's last backward of a training step, to run as ``I`` then ``W``, where that is the same.

        Nothing on this rank waits for its last weight gradient, while the previous stage waits for its
        input gradient: sent before the weight gradients are computed, the pipeline's drain is shorter
        by one weight gradient per stage (`split_backward`: the same gradients). Between ``I`` and ``W`` the
        gradients at the weights' boundary nodes are kept: the action's transient peak is up to one
        microbatch's worth of them above a plain backward's. Only for stages with a previous stage, whose
        backward is the default executor (`BackwardModule`) on eager modules (a compiled backward cannot
        run twice on one graph).
        """
        backwards = [a for a in plan.actions if a.kind is Kind.BACKWARD]
        if not backwards or backwards[-1].stage == 0:
            return None
        last = backwards[-1]
        default = type(self.shards[last.stage].backward) is BackwardModule
        eager = all(b.name == EAGER for b in self.executables[(last.stage, TRAIN)].chain.backends)
        return last if default and eager else None

    def _backward(self, step: int, action: Action) -> None:
        s, m = action.stage, action.microbatch
        shard, runtime = self.shards[s], self.runtimes[s]
        t = time.perf_counter()
        grads = self._wait(step, MessageKind.GRAD, s, m).payload
        grads = [runtime.move_tensor(g) if isinstance(g, torch.Tensor) else None for g in grads]
        saved = self._saved.pop((s, m))
        t = self._span(action, "recv", t)
        with self._autocast(runtime.torch_device):
            self._measure_auto(s, m, saved)
            _, input_grads = shard.backward.run(self._model(s, m), None, saved, runtime.torch_device, grads, None)
        if self._asynchronous:
            self._versions[s].backward_done(m)
        self.stash.release((s, m))
        t = self._span(action, "compute", t)
        self._send_input_grads(step, s, m, saved, input_grads)
        self._span(action, "send", t)

    def _backward_input(self, step: int, action: Action, held: bool = True) -> None:
        """``I``: the gradient of the stage input now; the graph stays for the weight gradient ``W``.

        ``held=False``: ``W`` follows at once (`_early_input_grad`), so what ``I`` keeps for it is transient
        within the backward, as a plain backward's gradients are; the stash counts neither.
        """
        s, m = action.stage, action.microbatch
        shard, runtime = self.shards[s], self.runtimes[s]
        grads = self._wait(step, MessageKind.GRAD, s, m).payload
        grads = [runtime.move_tensor(g) if isinstance(g, torch.Tensor) else None for g in grads]
        saved = self._saved[(s, m)]
        with self._autocast(runtime.torch_device):
            outputs = saved.outputs
            if outputs is None:  # checkpointed: the recomputed graph is kept until W
                outputs = saved.outputs = recompute(self._model(s, m), saved)
                if held:
                    graph = self._stash_size(s, saved, False) - self._stash_size(s, Activation(saved.inputs), True)
                    self.stash.hold((s, m), graph)
            self._measure_auto(s, m, saved)
            input_grads, work = backward_input(
                tree.flatten(outputs)[0], grads, tree.flatten(saved.inputs)[0], shard.module.parameters()
            )
        self._weight_work[(s, m)] = work
        if held:
            self.stash.hold((s, m), work.nbytes())
            self.stash.note(s, "split", work.nbytes())
        self._send_input_grads(step, s, m, saved, input_grads)

    def _backward_weight(self, action: Action) -> None:
        """``W``: the parameter gradients left pending by ``I``; frees the microbatch's stash."""
        s, m = action.stage, action.microbatch
        work = self._weight_work.pop((s, m))
        with self._autocast(self.runtimes[s].torch_device):
            backward_weight(work)
        del self._saved[(s, m)]
        self.stash.release((s, m))

    def _stash_size(self, s: int, activation: Activation, checkpointed: bool) -> int:
        params = list(self.shards[s].module.parameters())
        if self._asynchronous:  # the stashed weight versions are weights, not activations
            params += self._versions[s].weights()
        return self.stash.measure(signature(s, checkpointed, activation.inputs), activation, params)

    def _model(self, s: int, m: int) -> torch.nn.Module:
        """What runs stage ``s`` for microbatch ``m``: its module, or (async) the module on m's weight version."""
        return self._versions[s].model(m) if self._asynchronous else self.executables[(s, TRAIN)]

    def _start_async(self, plan: StepPlan) -> None:
        """Per-stage weight versions and optimizers, kept across asynchronous runs with the same optimizer."""
        first = next(iter(self._versions.values()), None)
        if first is None or first.factory is not plan.optimizer:
            self._versions = stage_versions(self.shards.values(), plan.update_every, plan.optimizer)
        for versions in self._versions.values():
            versions.start_run(plan.update_every, plan.shared)

    def _compute_losses(self, step: int, s: int) -> None:
        """The losses of the outputs kept so far, in microbatch order, as the coordinator would compute them.

        Each loss's gradient with respect to the output becomes this stage's pending gradient and the
        loss goes to the coordinator. A microbatch's loss follows its forward; with a schedule that
        computes every loss after all forwards (gpipe) they follow the last forward.
        """
        plan = self._loss
        assert plan is not None
        loss_module = self.shards[s].forward_loss
        for m in sorted(self._outputs):
            outputs, mask = self._outputs.pop(m)
            outputs = tree.to_device(outputs, plan.device)
            leaves = tree.as_leaves(outputs, mask)
            try:
                plan.scaler, grads, loss = output_grads(
                    loss_module,
                    plan.head,
                    plan.optimizer,
                    leaves,
                    plan.labels[m],
                    plan.criterion,
                    plan.device,
                    plan.scaler,
                )
            except Exception as exc:
                raise _LossError(exc) from exc
            self._pending[(step, MessageKind.GRAD, s, m)] = Message(MessageKind.GRAD, step, s, m, grads)
            self._losses.append(Message(MessageKind.LOSS, step, s, m, loss))

    def _span(self, action: Action, part: str, start: float) -> float:
        """Record ``part`` (recv, loss, compute or send) of ``action`` from ``start`` until now; returns now."""
        now = time.perf_counter()
        self._parts.append((f"{action} {part}", start, now))
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

    def _forget(self, step: int) -> None:
        if self._failed is not None and step >= self._failed:
            self._failed = None  # the coordinator aborted a step after the failure: it knows
        self._aborted = max(self._aborted, step)
        if self._asynchronous:  # stages of this process waiting on a weight shared with this one stop too
            for versions in self._versions.values():
                versions.drop_run()
        self._pending = {k: v for k, v in self._pending.items() if k[0] > step}
        self._saved.clear()
        self._weight_work.clear()
        self._outputs.clear()
        self.stash.reset()

    @contextlib.contextmanager
    def _autocast(self, device: torch.device) -> Iterator[None]:
        if self.spec.autocast is None:
            yield
            return
        with torch.autocast(**self.spec.autocast.for_device(device.type)):
            yield

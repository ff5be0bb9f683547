"""The training loader's place in its epoch across a restart: kept where the loader can keep it, said once where not.

Lightning saves a loader's position when the loader has ``state_dict`` (torchdata's ``StatefulDataLoader``). Under a
distributed sampler (launched mode) Lightning splits torch's ``RandomSampler`` with a ``DistributedSampler`` but any
other, torchdata's stateful ``RandomSampler`` included, with its stateless ``DistributedSamplerWrapper``: a resumed
loader skips the batches it read, but of a new permutation (torchdata iterates the sampler when the loader is made and
again when its state is loaded, each time drawing one). `stateful_split` gives such a loader torchdata's
``StatefulDistributedSampler``: the order ``DistributedSampler`` gives a plain shuffled DataLoader (same seed and
epoch), and a position the checkpoint holds. A loader without ``state_dict`` starts its epoch over: `say_where_resumed`
says so once.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def training_loader(lightning_module: Any, loader: Any) -> Any:
    """``loader`` as the training loop reads it (`stateful_split`, `say_where_resumed`); another stage's as it is."""
    trainer = lightning_module.trainer if lightning_module is not None else None
    if trainer is None or trainer.state.stage != RunningStage.TRAINING:
        return loader
    loader = stateful_split(loader, RunningStage.TRAINING)
    say_where_resumed(trainer, loader)
    return loader


def stateful_split(loader: Any, mode: Any = None) -> Any:
    """``loader`` with torchdata's ``StatefulDistributedSampler`` where Lightning wrapped a torchdata ``RandomSampler``
    in its stateless ``DistributedSamplerWrapper`` (same replicas, rank, seed); else ``loader`` as it is."""
    stateful = sys.modules.get("torchdata.stateful_dataloader")
    if stateful is None:  # no torchdata loader in this process
        return loader
    wrapper = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not isinstance(wrapper, DistributedSamplerWrapper):
        wrapper = getattr(loader, "sampler", None)
    if not isinstance(wrapper, DistributedSamplerWrapper):
        return loader
    inner = getattr(wrapper.dataset, "_sampler", None)
    if not isinstance(inner, stateful.sampler.RandomSampler) or not isinstance(loader, stateful.StatefulDataLoader):
        return loader
    sampler = stateful.sampler.StatefulDistributedSampler(
        loader.dataset, num_replicas=wrapper.num_replicas, rank=wrapper.rank, shuffle=True, seed=wrapper.seed,
        drop_last=wrapper.drop_last,
    )  # fmt: skip
    return _update_dataloader(loader, sampler, mode)


def say_where_resumed(trainer: Any, loader: Any) -> None:
    """Once, at a resume in the middle of an epoch with a training loader that keeps no position: the epoch's batches
    start over from its first, and what to use instead."""
    fit_loop = trainer.fit_loop
    progress = fit_loop.epoch_loop.batch_progress
    if not fit_loop.restarting or progress.current.ready == 0 or progress.is_last_batch:
        return
    if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
        return
    rank_zero_warn(
        f"PipeStrategy: resuming in the middle of epoch {fit_loop.epoch_progress.current.processed} (after batch "
        f"{progress.current.ready}) with a {type(loader).__name__} that keeps no position: the epoch starts over from "
        "its first batch, so the resumed run does not see the batches the uninterrupted run would. Use a loader with "
        "state_dict/load_state_dict (torchdata's StatefulDataLoader: `pip install torchdata`, "
        "`from torchdata.stateful_dataloader import StatefulDataLoader`), whose position the checkpoint keeps"
    )

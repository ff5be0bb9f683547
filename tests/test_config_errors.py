"""Bad configuration fails before any work, with a message naming the argument and the fix."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
from helpers import QUIET, Classifier, dataset, loader, mlp
from torch import nn

from lightning_pipe import ConfigurationError, Partitioner, PartitionError, PipeStrategy, ScheduleError


def fit(strategy: PipeStrategy, module: Any = None, data: Any = None) -> None:
    L.Trainer(**QUIET, max_steps=1, strategy=strategy).fit(module or Classifier(), data or loader())


def test_more_stages_than_layers() -> None:
    with pytest.raises(PartitionError, match=r"stages=9 but the pipelined module has only 7 layers; pass stages <= 7"):
        fit(PipeStrategy(stages=9))


def test_balance_that_does_not_sum_to_layer_count() -> None:
    with pytest.raises(PartitionError, match=r"partition=\[3, 3\] sums to 6 but the model has 7 layers; .*sums to 7"):
        fit(PipeStrategy(stages=2, partition=[3, 3]))
    with pytest.raises(PartitionError, match=r"partition=\[3, 2, 2\] has 3 entries but stages=2"):
        fit(PipeStrategy(stages=2, partition=[3, 2, 2]))


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'; available: .*1f1b.*gpipe"):
        PipeStrategy(schedule="zigzag")
    with pytest.raises(PartitionError, match=r"unknown partition method 'random'; available: uniform, params"):
        PipeStrategy(partition="random")
    with pytest.raises(ConfigurationError, match=r"no runtime is registered for device type 'npu'; registered: cpu"):
        PipeStrategy(runtime="npu")
    with pytest.raises(ConfigurationError, match=r"'sometimes'; available: auto, always, except_last, never"):
        PipeStrategy(checkpoint="sometimes")


def test_microbatches_larger_than_the_batch() -> None:
    with pytest.raises(ConfigurationError, match=r"microbatches=8\) is larger than the batch \(4 rows\)"):
        fit(PipeStrategy(stages=2, microbatches=8), data=loader(batch_size=4))


def test_uneven_batches_are_split_with_the_remainder_spread() -> None:
    """10 rows in 4 microbatches run as 3, 3, 2, 2 rows; a short last batch runs with fewer microbatches."""
    module = Classifier()
    with pytest.warns(UserWarning, match="a batch of 2 rows is smaller than microbatches=4"):
        L.Trainer(**QUIET, max_epochs=1, strategy=PipeStrategy(stages=2, microbatches=4)).fit(
            module, loader(dataset(rows=22), batch_size=10)
        )


def test_module_name_that_does_not_exist() -> None:
    with pytest.raises(ConfigurationError, match=r"module='encoder'.*no such submodule; its children are: model"):
        fit(PipeStrategy(stages=2, module="encoder"))


def test_a_custom_partitioner_needs_an_nn_sequential() -> None:
    """Any other module is traced (tests/test_traced*.py) unless the user's own Partitioner splits it."""

    class Wrapped(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(8, 3)  # type: ignore[assignment]

    class Mine(Partitioner):
        pass

    with pytest.raises(PartitionError, match="not an nn.Sequential"):
        fit(PipeStrategy(stages=1, partition=Mine("uniform")), Wrapped())
    fit(PipeStrategy(stages=1), Wrapped())  # the default partitioner traces it


def test_bad_numbers() -> None:
    with pytest.raises(ConfigurationError, match="stages=0"):
        PipeStrategy(stages=0)
    with pytest.raises(ConfigurationError, match="microbatches=0"):
        PipeStrategy(microbatches=0)
    with pytest.raises(ConfigurationError, match="devices has 1 entries but stages=2"):
        PipeStrategy(stages=2, devices=["cpu"])
    with pytest.raises(ConfigurationError, match="timeout=0"):
        PipeStrategy(timeout=0)


def test_manual_optimization_is_refused() -> None:
    class Manual(Classifier):
        def __init__(self) -> None:
            super().__init__(mlp())
            self.automatic_optimization = False

    with pytest.raises(ConfigurationError, match="automatic optimization only"):
        fit(PipeStrategy(stages=2), Manual())

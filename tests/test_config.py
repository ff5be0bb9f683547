"""`PipeConfig`: the strategy's arguments, checked once and frozen; it and `PipeStrategy.__init__` agree."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.strategy.pipe_config import PipeConfig

LIGHTNINGS_OWN = {"accelerator", "checkpoint_io", "precision_plugin"}  # handed to Lightning's base class


def test_every_keyword_of_the_strategy_is_a_field_with_the_same_default() -> None:
    keywords = {
        name: parameter.default
        for name, parameter in inspect.signature(PipeStrategy.__init__).parameters.items()
        if name != "self" and name not in LIGHTNINGS_OWN
    }
    fields = {f.name: f.default for f in dataclasses.fields(PipeConfig) if f.init}
    assert keywords == fields


def test_the_config_is_checked_once_frozen_and_what_the_parts_read() -> None:
    strategy = PipeStrategy(stages=2, split_points=None, schedule="async", devices=["cpu", "cpu"], timeout=5)
    config = strategy.config
    assert (config.asynchronous, config.stage_devices, config.timeout) == (True, ["cpu", "cpu"], 5.0)
    assert strategy.builder.config is config and strategy.steps.timeout == 5.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout = 1.0  # type: ignore[misc]
    assert PipeConfig.of({"split_points": ["a", "b"]}).stages == 3  # stages implied by the split points
    assert PipeConfig.of({"transport": "rpc", "token": "s"}).transport_options == {"token": "s"}
    with pytest.raises(ConfigurationError, match="microbatches=0"):
        PipeConfig.of({"microbatches": 0})

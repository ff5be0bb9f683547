"""Combining the per-microbatch results of a step into what Lightning expects from one step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from lightning_pipe.base.microbatch import gather


def combine_training(outputs: Sequence[Any], losses: Sequence[Any], weights: Sequence[float]) -> Any:
    """``training_step`` result: the weighted loss sum (detached), other dict entries averaged."""
    if all(o is None for o in outputs):
        return None
    total = sum(loss for loss in losses if isinstance(loss, torch.Tensor))
    if not isinstance(total, torch.Tensor):
        total = torch.tensor(0.0)
    dicts = [o for o in outputs if isinstance(o, Mapping)]
    if not dicts:
        return total
    present = [(o, w) for o, w in zip(outputs, weights, strict=True) if isinstance(o, Mapping)]
    combined = {k: v for k, v in _mean_dict(present).items() if k != "loss"}
    return {"loss": total, **combined}


def combine_eval(outputs: Sequence[Any], weights: Sequence[float]) -> Any:
    """``validation_step`` / ``test_step`` result: weighted mean of numbers, dicts per key."""
    present = [(o, w) for o, w in zip(outputs, weights, strict=True) if o is not None]
    if not present:
        return None
    if all(isinstance(o, Mapping) for o, _ in present):
        return _mean_dict(present)
    if all(_scalar(o) for o, _ in present):
        return _mean(present)
    return gather([o for o, _ in present])


def combine_predict(outputs: Sequence[Any]) -> Any:
    """``predict_step`` result: per-microbatch predictions concatenated in batch order."""
    present = [o for o in outputs if o is not None]
    return gather(present) if present else None


def _scalar(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.numel() == 1) or (
        isinstance(value, (int, float)) and not isinstance(value, bool)
    )


def weighted_mean(values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum(v * w) / sum(w)`` over the values of weight > 0; equal weights where all are 0.

    Values of weight 0 are left out rather than multiplied by 0: a mean over nothing is NaN, and NaN * 0
    is NaN. Where only microbatches of weight 0 gave a value (logged it, returned it), those count equally.
    """
    if not any(w > 0 for w in weights):
        weights = [1.0] * len(values)
    total = sum(weights)
    terms = [v * (w / total) for v, w in zip(values, weights, strict=True) if w > 0]
    return cast(torch.Tensor, sum(terms[1:], terms[0]))


def _mean(pairs: Sequence[tuple[Any, float]]) -> Any:
    values = [v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v, _ in pairs]
    return weighted_mean(values, [w for _, w in pairs])


def _mean_dict(pairs: Sequence[tuple[Mapping[str, Any], float]]) -> dict[str, Any]:
    keys = list(pairs[-1][0].keys())
    result: dict[str, Any] = {}
    for key in keys:
        items = [(o[key], w) for o, w in pairs if key in o]
        if all(_scalar(v) for v, _ in items):
            result[key] = _mean(items)
        elif all(isinstance(v, torch.Tensor) and v.dim() > 0 for v, _ in items):
            result[key] = gather([v for v, _ in items])
        else:
            result[key] = items[-1][0]
    return result

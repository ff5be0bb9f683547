"""HuggingFace models' key/value cache: a pipelined model is called with ``use_cache=False``.

A ``transformers`` model whose config says ``use_cache=True`` (the default of GPT-2, Llama, T5, ...)
builds a cache object (``DynamicCache``, ``EncoderDecoderCache``) inside its forward, even in
training, and hands it to every layer, which appends its keys and values. The cache serves
generation one token at a time; training never reads it, and an object that every layer changes
cannot be cut into stages. So a call that does not set ``use_cache`` is traced and run with
``use_cache=False``, as HuggingFace does itself for BART given ``labels`` and under gradient
checkpointing: the loss, the logits and the gradients are the model's, ``past_key_values`` is ``None``.
"""

from __future__ import annotations

import inspect

from torch import nn

from lightning_pipe.partition.signature import CallArgs, class_forward


def builds_kv_cache(module: nn.Module) -> bool:
    """Whether calls that leave ``use_cache`` out make ``module`` build a key/value cache."""
    config = getattr(module, "config", None)
    return bool(getattr(config, "use_cache", False)) and "use_cache" in _parameters(module).parameters


def without_kv_cache(module: nn.Module, call: CallArgs) -> CallArgs:
    """``call`` with ``use_cache=False`` unless it sets ``use_cache`` itself (call only if `builds_kv_cache`)."""
    try:
        bound = _parameters(module).bind(*call.args, **call.kwargs)
    except TypeError:
        return call  # Signature.of names the mismatch
    if bound.arguments.get("use_cache") is not None:
        return call
    if "use_cache" in bound.arguments and "use_cache" not in call.kwargs:  # use_cache=None given by position
        bound.arguments["use_cache"] = False
        return CallArgs(bound.args, bound.kwargs)
    return CallArgs(call.args, {**call.kwargs, "use_cache": False})


def _parameters(module: nn.Module) -> inspect.Signature:
    return inspect.signature(class_forward(module))

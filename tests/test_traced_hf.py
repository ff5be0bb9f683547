"""HuggingFace models called with ``labels=``, and what they build inside forward (loss modules, masks, shifted
labels, key/value caches): split into stages they train as the unsplit model (tiny configs, no hub access)."""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from processes import leftover_processes
from test_traced import assert_transparent, one_thread  # noqa: F401 (an autouse fixture: one intra-op thread)
from test_traced_strategy import Wrapper, assert_pipelined, assert_same_run, fit
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from traced_models import LossInForward

from lightning_pipe import PipeStrategy, TraceError
from lightning_pipe.comm.rpc import RpcCommunicator
from lightning_pipe.engine import StageProtocol
from lightning_pipe.partition.tracer import CallArgs
from lightning_pipe.pipeline.pipeline import Pipeline

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
VOCAB, ROWS, LENGTH = 40, 8, 10
USE_CACHE = "called with use_cache=False"


def bert(**config: Any) -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **config,
    )  # fmt: skip


def t5() -> Any:
    return transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip


def tokens(rows: int = ROWS, length: int = LENGTH, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask that pads the end of every third row."""
    ids = torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[::3, -3:] = 0
    return ids, mask


def hf_loss(output: Any, target: Any) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output["loss"]


def last_stage_code(pipe: Pipeline) -> str:
    return pipe.shards[-1].module.code()


# trained by a Lightning Trainer: the losses, gradients and parameters of a plain run (same seed, same data)
@pytest.mark.parametrize("split_points", [None, ["bert.encoder.layer.2"]])
def test_bert_sequence_classification_with_labels(split_points: list[str] | None) -> None:
    torch.manual_seed(0)
    ids, mask = tokens(rows=16)
    labels = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(1))

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        ids, mask, labels = batch
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss  # CrossEntropyLoss() made in forward

    piped = Wrapper(transformers.BertForSequenceClassification(bert(num_labels=3)), step)
    plain = copy.deepcopy(piped)
    data = DataLoader(TensorDataset(ids, mask, labels), batch_size=8)
    strategy = PipeStrategy(stages=2, microbatches=4, split_points=split_points)
    got = fit(piped, data, strategy)
    assert_same_run(piped, plain, got, fit(plain, data))
    assert_pipelined(strategy, 2)


@pytest.mark.parametrize("split_points", [None, ["decoder"]])
def test_t5_conditional_generation_with_labels(split_points: list[str] | None) -> None:
    torch.manual_seed(0)
    ids, mask = tokens(rows=16)
    labels = torch.randint(1, VOCAB, (16, 6), generator=torch.Generator().manual_seed(1))

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        ids, mask, labels = batch
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss  # decoder inputs: labels shifted

    piped = Wrapper(transformers.T5ForConditionalGeneration(t5()), step)
    plain = copy.deepcopy(piped)
    data = DataLoader(TensorDataset(ids, mask, labels), batch_size=8)
    strategy = PipeStrategy(stages=2, microbatches=4, split_points=split_points)
    with pytest.warns(UserWarning, match=USE_CACHE):
        got = fit(piped, data, strategy)
    assert_same_run(piped, plain, got, fit(plain, data))
    assert_pipelined(strategy, 2)


# through a Pipeline: gradients after one step and parameters after three equal the unsplit model's
@pytest.mark.parametrize(
    ("problem", "function"),
    [("regression", "mse_loss"), ("multi_label_classification", "binary_cross_entropy_with_logits")],
)
def test_bert_regression_and_multi_label_losses(problem: str, function: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if problem == "regression":  # num_labels=1: MSELoss() made in forward
        model, labels = transformers.BertForSequenceClassification(bert(num_labels=1)), torch.randn(ROWS, generator=g)
    else:  # float labels, one column per label: BCEWithLogitsLoss() made in forward
        model = transformers.BertForSequenceClassification(bert(num_labels=3, problem_type=problem))
        labels = torch.randint(0, 2, (ROWS, 3), generator=g).float()
    ids, mask = tokens()
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    pipe = assert_transparent(model, (), kwargs, torch.zeros(ROWS), hf_loss, stages=2, partition="uniform")
    assert model.config.problem_type == problem
    # the loss module the forward builds is traced inline: the stage calls the function, not a module
    assert f"torch.nn.functional.{function}(" in last_stage_code(pipe)


GPT2_CONFIG = dict(
    vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=4, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)
LLAMA_LIKE = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=32,
)  # fmt: skip
CAUSAL_LMS = {  # configs as they come (use_cache=True), and where the second stage starts
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_CONFIG)), "transformer.h.2"),
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_LIKE)), "model.layers.2"),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LLAMA_LIKE)), "model.layers.2"),
}


@pytest.mark.parametrize("name", list(CAUSAL_LMS))
def test_causal_lm_with_labels_padding_and_the_default_cache(name: str) -> None:
    """The causal mask is built in forward from the padding mask, the labels are shifted in forward, and the
    config's ``use_cache=True`` would build a key/value cache in forward: it is called without one."""
    torch.manual_seed(0)
    make, split_point = CAUSAL_LMS[name]
    model = make()
    assert model.config.use_cache
    ids, mask = tokens()
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    with pytest.warns(UserWarning, match=USE_CACHE):
        assert_transparent(model, (), kwargs, torch.zeros(ROWS), hf_loss, stages=2, split_points=[split_point])
    # evaluation without labels on shorter sequences: the masks are built for the new length
    model.eval()
    short = {"input_ids": ids[:, :7], "attention_mask": mask[:, :7]}
    with pytest.warns(UserWarning, match=USE_CACHE):
        with Pipeline(model, stages=2, split_points=[split_point], sample=CallArgs((), short)) as pipe:
            pipe.coordinator.stages.call(StageProtocol.train, False)
            out = pipe.forward((), microbatches=2, kwargs=short)
    assert set(out) == {"logits"}  # no past_key_values
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], model(**short).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss", ["weighted", "constant", "multi_label", "mse"])
def test_loss_modules_built_in_forward(loss: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randint(0, 6, (ROWS,), generator=g)
    pipe = assert_transparent(
        LossInForward(), (x,), {"labels": y, "loss": loss}, y, hf_loss, stages=2, partition="uniform"
    )
    code = last_stage_code(pipe)
    assert "torch.nn.functional." in code and "Loss" not in code
    if loss == "weighted":  # the model's buffer is read by the stage, not copied into the code
        assert "weight = class_weights" in code
    if loss == "constant":  # the weight tensor made in forward is a constant the stage holds
        assert "= self._v0_train_tensor_constant0" in code and "weight = _tensor_constant0" in code


# transport="rpc": the generated code and the constants it reads travel to the worker processes
@pytest.fixture(scope="module")
def pool() -> Iterator[RpcCommunicator]:
    communicator = RpcCommunicator(workers=2, keep_alive=True, threads=1).start(timeout=120)
    try:
        yield communicator
    finally:
        communicator.close()
        assert leftover_processes() == [], "worker processes left behind"


def assert_worker_grads(got: dict[str, Any], ref: nn.Module) -> None:
    """The workers' gradients, under their stages' keys, equal the unsplit model's; no parameter is missing."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    assert {id(want[name]) for name in got} == {id(p) for p in ref.parameters()}
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name].grad, rtol=1e-5, atol=1e-5, msg=name)


def test_rpc_stages_run_the_inlined_loss_and_its_constants(pool: RpcCommunicator) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randint(0, 6, (ROWS,), generator=g)
    model = LossInForward()
    ref = copy.deepcopy(model)
    with Pipeline(model, stages=2, partition="uniform", transport=pool, timeout=60) as pipe:
        pipe.train_step((x,), y, hf_loss, microbatches=2, kwargs={"labels": y, "loss": "mse"})
        # a way of calling it first seen now: traced here, its code and the weight tensor it makes in forward
        # (a constant of the trace) sent to the workers; the gradients add up on the workers
        pipe.train_step((x,), y, hf_loss, microbatches=2, kwargs={"labels": y, "loss": "constant"})
        assert pipe.partitioner.variants[1][True].constants
        got = pipe.grads()
    for loss in ("mse", "constant"):
        for a, b in zip(x.chunk(2), y.chunk(2), strict=True):
            (ref(a, labels=b, loss=loss)["loss"] / 2).backward()
    assert_worker_grads(got, ref)


@pytest.mark.slow  # the workers import transformers' T5
def test_rpc_t5_with_labels(pool: RpcCommunicator) -> None:
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(t5())
    ids, mask = tokens()
    labels = torch.randint(1, VOCAB, (ROWS, 6), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the use_cache note
        with Pipeline(model, stages=2, split_points=["decoder"], transport=pool, timeout=60) as pipe:
            pipe.train_step((), torch.zeros(ROWS), hf_loss, microbatches=2, kwargs=kwargs)
            got = pipe.grads()
    for half in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):
        (ref(**{k: v[half] for k, v in kwargs.items()}).loss / 2).backward()
    # the embedding that encoder, decoder and head share: one copy in each worker, gradients summed
    assert pipe.tied == [[(0, "encoder.embed_tokens.weight"), (1, "lm_head.weight")]]
    assert_worker_grads(got, ref)


# what still cannot be traced says why and what to do
def test_an_explicit_cache_inside_a_split_point_names_use_cache() -> None:
    model = CAUSAL_LMS["llama"][0]()
    ids, mask = tokens()
    call = CallArgs((), {"input_ids": ids, "labels": ids, "use_cache": True})  # the user asks for the cache
    with pytest.raises(TraceError) as caught:
        Pipeline(model, stages=2, split_points=["model.layers.2"]).build(call)
    message = str(caught.value)
    # the layer's cache keyword depends on the transformers version (past_key_value, past_key_values, cache)
    named = re.search(r"'model\.layers\.0' is called with (\w+) = a transformers\.cache_utils\.DynamicCache", message)
    assert named is not None, message
    assert named[1] in inspect.signature(model.model.layers[0].forward).parameters
    assert "split point 'model.layers.2' is inside it" in message
    assert "call the HuggingFace model with use_cache=False" in message


def test_outputs_collected_by_hooks_are_refused_and_the_model_keeps_its_hooks() -> None:
    """HF models collect ``output_hidden_states`` with forward hooks that they install on the first such call: the
    split model would return the example's hidden states on every call, so tracing refuses, and the hooks it
    made the model install are gone again."""
    model = transformers.BertForSequenceClassification(bert(num_labels=3)).eval()
    ids, mask = tokens()
    call = {"input_ids": ids, "attention_mask": mask, "output_hidden_states": True}
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    with pytest.raises(TraceError, match=r"(?s)side channel.*call the model without them"):
        Pipeline(model, stages=2, partition="uniform").build(CallArgs((), call))
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    assert len(model(**call).hidden_states) == 1 + 4  # the embeddings and each layer, once


class Box:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class Boxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Takes() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](x, Box(self.layers[0](x, Box(x))))


class Takes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, box: Box) -> torch.Tensor:
        return self.linear(box.x) + x


class FreshLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return nn.Linear(4, 2)(x)  # new weights on every call


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (Boxed, r"(?s)'layers.0' is called with positional argument 1 = a test_traced_hf.Box.*pass tensors"),
        (FreshLayer, r"(?s)parameter is not a member.*created inside forward.*create it in __init__"),
    ],
)
def test_what_cannot_be_traced_says_why(model: type[nn.Module], expected: str) -> None:
    with pytest.raises(TraceError, match=expected):
        Pipeline(model(), stages=2, partition="uniform").build(torch.randn(2, 4))

"""One config: `PipeStrategy`'s signature, `Pipeline`'s, the argument check and docs/usage.md's table come from one
definition (`PipelineSettings` and `PipeConfig`, a field with its docstring per argument), and a test fails when they
disagree (issue 39, point 4)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from dataclasses import dataclass

import pytest
from torch import nn

from lightning_pipe import ConfigurationError, Pipeline, PipeStrategy
from lightning_pipe.pipeline.settings import PipelineSettings, signature_of
from lightning_pipe.strategy.arguments import check_arguments, check_memory_arguments
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.tensor_parallel import check_tensor_parallel_arguments

LIGHTNINGS_OWN = ["accelerator", "checkpoint_io", "precision_plugin"]


def field_docs(cls: type) -> dict[str, str]:
    """Each field of a dataclass defined in ``cls``'s own body -> the docstring under it ("" where none)."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            docs[node.target.id] = str(after.value.value) if is_doc else ""  # type: ignore[union-attr]
    return docs


def config_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(PipeConfig) if f.init]


def test_the_strategys_signature_is_the_configs_fields() -> None:
    parameters = inspect.signature(PipeStrategy).parameters
    assert list(parameters) == [*config_fields(), *LIGHTNINGS_OWN]
    for field in dataclasses.fields(PipeConfig):
        assert parameters[field.name].default == field.default, field.name


def test_the_pipelines_signature_is_the_shared_settings() -> None:
    parameters = list(inspect.signature(Pipeline).parameters)
    shared = PipelineSettings.names()
    assert parameters[1 : 1 + len(shared)] == shared and parameters[0] == "module"
    assert set(shared) < set(config_fields()), "every shared setting is an argument of the strategy too"


def test_every_argument_is_one_field_with_its_docstring() -> None:
    documented = {**field_docs(PipelineSettings), **field_docs(PipeConfig)}
    assert sorted(documented) == sorted(config_fields()), "each argument is defined once, in one of the two classes"
    undocumented = [name for name, doc in documented.items() if len(doc.split()) < 3]
    assert not undocumented, f"fields without a docstring: {undocumented}"
    assert not set(field_docs(PipelineSettings)) & set(field_docs(PipeConfig)), "a field defined twice"


def test_the_docs_table_lists_the_config() -> None:
    sys.path.insert(0, str(inspect.getfile(sys.modules[__name__]).rsplit("/", 1)[0]))
    from test_arguments_by_mode import docs_rows

    assert list(docs_rows()) == [*config_fields(), *LIGHTNINGS_OWN], (
        "docs/usage.md's argument table lists PipeConfig's fields in their order, then Lightning's three"
    )


def test_the_checks_take_the_config() -> None:
    for check in (check_arguments, check_memory_arguments, check_tensor_parallel_arguments):
        assert list(inspect.signature(check).parameters) == ["config"], check.__name__


def test_an_unknown_argument_names_the_closest() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'microbatch'; did you mean 'microbatches'"):
        PipeStrategy(microbatch=4)
    with pytest.raises(ConfigurationError, match="unexpected keyword argument 'virtual_stage'"):  # the transport's
        Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), stages=2, virtual_stage=2)


def test_a_new_field_is_an_argument_everywhere() -> None:
    """What adding an option takes: one field with its docstring; the signature follows."""

    @dataclass(frozen=True)
    class Grown(PipeConfig):
        spill: bool = False
        """Spill stashed activations to host memory."""

    assert list(signature_of(Grown, positional=1).parameters)[-1] == "spill"
    assert field_docs(Grown) == {"spill": "Spill stashed activations to host memory."}
    assert Grown.from_keywords("PipeStrategy", {"spill": True}).spill is True

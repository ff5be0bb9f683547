"""Where a stage's initial tensors come from: a checkpoint or pretrained weights, read one tensor at a time.

`TorchFileSource` (a ``torch.save`` file, mapped), `DcpSource` (a torch.distributed.checkpoint folder) and
`SafetensorsSource` (one file, or a sharded ``save_pretrained`` folder) each read only the keys, and for a
sharded target the chunks, that a stage asks for. `open_source` picks one by what ``path`` is; `Prefixed`
reads another namespace (a Lightning checkpoint's ``"model.3.weight"`` for a stage's ``"3.weight"``).
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.base.pages import PAGE, can_give_back, give_back
from lightning_pipe.weights.keys import visible

PathLike = str | os.PathLike[str]
MODEL = "state_dict"  # the key of the module's tensors in a Lightning checkpoint
DCP_METADATA = ".metadata"  # the file torch.distributed.checkpoint writes into every checkpoint folder
SAFETENSORS_INDEX = "model.safetensors.index.json"


class WeightSource:
    """Tensors by key; `get` returns one without reading the others (the caller copies what it keeps)."""

    def keys(self) -> Collection[str]:
        raise NotImplementedError

    def get(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """Several tensors at once (a source may batch the reads)."""
        return {key: self.get(key) for key in keys}

    def read_shard(self, key: str, target: torch.Tensor) -> bool:
        """Fill ``target`` (a DTensor: this process's shard of ``key``) reading only that shard; False where this
        source cannot, or holds ``key`` in another shape (the caller then reads it whole, with `get`)."""
        return False

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def release(self, tensor: torch.Tensor) -> None:
        """The caller copied ``tensor`` (a value `get` returned) and will not read it again."""

    def close(self) -> None:
        """Drop what the source holds open (file mappings); a source is not read after this."""

    def describe(self) -> str:
        return type(self).__name__


class TorchFileSource(WeightSource):
    """A ``torch.save`` file mapped into memory; ``section`` is the key of its state dict (``"state_dict"`` in a
    Lightning checkpoint), ``None`` for a file that is a state dict."""

    def __init__(self, path: PathLike, section: str | None = MODEL, weights_only: bool | None = None) -> None:
        self.path = Path(path)
        load: dict[str, Any] = {"map_location": "cpu", "mmap": True}
        if weights_only is not None:
            load["weights_only"] = weights_only
        try:
            self.content: Any = torch.load(self.path, **load)
        except pickle.UnpicklingError as error:  # never retried unsafely: the caller allows it, by an argument
            if weights_only is False:
                raise
            raise ConfigurationError(unsafe_file_message(self.path, error)) from error
        state = self.content.get(section) if section is not None and isinstance(self.content, dict) else None
        self.tensors: Mapping[str, Any] = state if isinstance(state, Mapping) else self.content
        self._mapped = mapped_ranges(self.path)  # where the file lies in this process's memory

    def keys(self) -> Collection[str]:
        return self.tensors.keys()

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def release(self, tensor: torch.Tensor) -> None:
        """Give the pages of a copied tensor back: a mapped file's pages that were read count as this process's
        memory until the mapping goes, so a stage reading its tensors one after the other would otherwise hold
        a second copy of its stage (torch offers no way to unmap part of a mapped checkpoint)."""
        forget_pages(tensor, self._mapped)

    def close(self) -> None:
        self.content = self.tensors = {}
        self._mapped = []

    def describe(self) -> str:
        return f"the checkpoint file {self.path}"


class DcpSource(WeightSource):
    """A torch.distributed.checkpoint folder; keys are DCP's flattened keys (``"state_dict.model.3.weight"``)."""

    def __init__(self, path: PathLike) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(path)
        self.metadata = FileSystemReader(self.path).read_metadata().state_dict_metadata
        self._tensors = {k: m for k, m in self.metadata.items() if isinstance(m, TensorStorageMetadata)}

    def keys(self) -> Collection[str]:
        return self.metadata.keys()

    def get(self, key: str) -> torch.Tensor:
        return self.read([key])[key]

    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        missing = [k for k in keys if k not in self._tensors]
        if missing:
            raise KeyError(f"{self.describe()} has no tensor {missing[0]!r}")
        targets = {k: torch.empty(self._tensors[k].size, dtype=self._tensors[k].properties.dtype) for k in keys}
        self.load_into(targets)
        return targets

    def read_shard(self, key: str, target: torch.Tensor) -> bool:
        stored = self._tensors.get(key)
        if stored is None or tuple(stored.size) != tuple(target.shape):
            return False
        self.load_into({key: target})  # DCP reads the saved chunks that overlap this shard, nothing else
        return True

    def load_into(self, targets: dict[str, Any]) -> None:
        """Fill ``targets`` in place (tensors, DTensors: each reads only its own chunks; other values too)."""
        import torch.distributed.checkpoint as dcp

        if targets:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(targets, checkpoint_id=self.path, no_dist=True)

    def objects(self, prefix: str) -> dict[str, Any]:
        """The values that are not tensors under ``prefix`` (flattened keys), read as they were saved."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        wanted = {
            k: None for k, m in self.metadata.items() if k.startswith(prefix) and isinstance(m, BytesStorageMetadata)
        }
        self.load_into(wanted)
        return wanted

    def describe(self) -> str:
        return f"the distributed checkpoint {self.path}"


class SafetensorsSource(WeightSource):
    """HuggingFace safetensors: a file, or a folder of shards with ``model.safetensors.index.json``."""

    def __init__(self, path: PathLike) -> None:
        try:
            from safetensors import safe_open
        except ImportError as error:  # pragma: no cover - safetensors comes with transformers
            raise ConfigurationError(
                f"reading {path} needs the safetensors package: pip install safetensors"
            ) from error
        self.path = Path(path)
        self._open = safe_open
        self.files = _safetensors_files(self.path)
        self._where: dict[str, Path] = {}
        for file, keys in self.files.items():
            for key in keys:
                self._where[key] = file
        self._handles: dict[Path, Any] = {}

    def keys(self) -> Collection[str]:
        return self._where.keys()

    def get(self, key: str) -> torch.Tensor:
        file = self._where[key]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = self._open(str(file), framework="pt", device="cpu")
        return handle.get_tensor(key)

    def close(self) -> None:
        self._handles = {}

    def describe(self) -> str:
        return f"the safetensors weights {self.path}"


def _safetensors_files(path: Path) -> dict[Path, list[str]]:
    """Each safetensors file of ``path`` and the keys it holds (from the index, else from each file's header)."""
    index = path / SAFETENSORS_INDEX if path.is_dir() else None
    if index is not None and index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files: dict[Path, list[str]] = {}
        for key, name in weight_map.items():
            files.setdefault(path / name, []).append(key)
        return files
    candidates = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not candidates:
        raise ConfigurationError(f"{path} holds no .safetensors file and no {SAFETENSORS_INDEX}")
    return {file: _header_keys(file) for file in candidates}


def _header_keys(file: Path) -> list[str]:
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [key for key in header if key != "__metadata__"]


class Prefixed(WeightSource):
    """``source`` read under other names: key ``k`` here is ``prefix + k`` there."""

    def __init__(self, source: WeightSource, prefix: str) -> None:
        self.source, self.prefix = source, prefix
        self._keys = [k[len(prefix) :] for k in source.keys() if k.startswith(prefix)]

    def keys(self) -> Collection[str]:
        return self._keys

    def get(self, key: str) -> torch.Tensor:
        return self.source.get(self.prefix + key)

    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        got = self.source.read([self.prefix + k for k in keys])
        return {k[len(self.prefix) :]: v for k, v in got.items()}

    def read_shard(self, key: str, target: torch.Tensor) -> bool:
        return self.source.read_shard(self.prefix + key, target)

    def release(self, tensor: torch.Tensor) -> None:
        self.source.release(tensor)

    def close(self) -> None:
        self.source.close()

    def describe(self) -> str:
        return f"{self.source.describe()} (keys under {self.prefix!r})" if self.prefix else self.source.describe()


def is_distributed_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a folder written by torch.distributed.checkpoint."""
    return (Path(path) / DCP_METADATA).is_file()


def open_source(path: PathLike, weights_only: bool | None = None) -> WeightSource:
    """The source for ``path``: a DCP folder, safetensors (a file or a folder), or a ``torch.save`` file."""
    where = visible(path, "the checkpoint or weights")
    if is_distributed_checkpoint(where):
        return DcpSource(where)
    if where.is_dir() or where.suffix == ".safetensors":
        return SafetensorsSource(where)
    return TorchFileSource(where, weights_only=weights_only)


def unsafe_file_message(path: Path, error: BaseException) -> str:
    """Why ``path`` was not opened with ``weights_only=True``, and the explicit argument that allows it."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"torch.load(weights_only=True) cannot open {path}: it holds pickled objects that are not tensors ({reason}). "
        "Opening it with weights_only=False runs the code pickled in it: do so only for a file you trust, and "
        "say so explicitly: trainer.fit(..., ckpt_path=..., weights_only=False) for a checkpoint, "
        "PipeStrategy(weights=..., weights_only=False) for weights (or torch.serialization.add_safe_globals "
        "for the classes it names)"
    )


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps the file ``path`` (Linux's /proc/self/maps; else none)."""
    try:
        target = os.path.realpath(path)
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == target and "p" in fields[1]:  # a private mapping of it
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def forget_pages(tensor: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """Drop the resident pages of a tensor that lies in one of the ``mapped`` ranges of a file (Linux; a no-op
    for anything else): the next read, if any, reads the file again. Pages shared with neighbouring tensors
    are dropped too, and read again when those are read."""
    if not can_give_back() or tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first, last = start - start % PAGE, end + (-end) % PAGE
    if any(low <= first and last <= high for low, high in mapped):
        give_back(first, last)

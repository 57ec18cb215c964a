"""Steps of TorchTitan's own manager (DCP's ``.metadata`` and ``.distcp`` files; a job
switched to ckptstore): recognised, and read as plain data (pickle beyond that only with
``allow_pickle``)."""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from ...errors import CheckpointError, PickleNotAllowedError
from .._common import MANIFEST
from .._stock import WeightsOnlyRefusal, torch_load

#: Globals a DCP ``.metadata`` file may name: the classes of DCP's metadata modules (defined
#: there), the torch dtypes, and these.
_META_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_META_GLOBALS = {
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}
_DCP_METADATA = ".metadata"
_HF_INDEX = "model.safetensors.index.json"


def _pickle_refused(where: str, what: str) -> PickleNotAllowedError:
    return PickleNotAllowedError(
        f"{where}: {what}; reading it needs pickle beyond torch.load(weights_only=True): set "
        "allow_pickle=True in the checkpoint config only for checkpoints you trust (unpickling "
        "runs code chosen by whoever wrote them)"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` (a pickle) read with only the globals DCP metadata is made of."""

    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _META_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if module in _META_CLASS_MODULES:
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
        raise _pickle_refused(self.where, f"the DCP metadata names {module}.{name}, which DCP metadata is not made of")


class _StockReader(FileSystemReader):
    """DCP's file reader for a step of TorchTitan's own manager; its ``.metadata`` is
    unpickled with :class:`_MetadataUnpickler` (plain pickle with ``allow_pickle``)."""

    def __init__(self, path: str, allow_pickle: bool) -> None:
        super().__init__(path)
        self._dir = str(path)
        self._allow_pickle = allow_pickle

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        path = os.path.join(self._dir, _DCP_METADATA if rank is None else f"__{rank}{_DCP_METADATA}")
        try:
            with open(path, "rb") as f:
                md = pickle.load(f) if self._allow_pickle else _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged pickle raises many kinds
            raise CheckpointError(f"{path}: cannot read the DCP metadata: {e!r}") from e
        if not hasattr(md, "state_dict_metadata") or not isinstance(md.state_dict_metadata, dict):
            raise CheckpointError(f"{path}: not DCP metadata ({type(md).__name__})")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _StockPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor values read with
    ``torch.load(weights_only=True)`` (DCP's own uses ``weights_only=False``); a value that
    needs more is refused unless ``allow_pickle``."""

    def __init__(self, allow_pickle: bool, where: str) -> None:
        super().__init__()
        self._allow_pickle = allow_pickle
        self._where = where

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self._allow_pickle:
            return super().load_bytes(read_item, value)
        fqn = read_item.dest_index.fqn
        try:
            obj = torch_load(value)
        except WeightsOnlyRefusal as e:
            reason = f"state entry {fqn!r} is not plain data ({e.reason})"
            raise _pickle_refused(self._where, reason) from e
        except Exception as e:  # noqa: BLE001 - damaged bytes raise many kinds
            raise CheckpointError(f"{self._where}: state entry {fqn!r} cannot be read: {e!r}") from e
        # The planner's own placement, fed the value just read (re-serialized: plain data).
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return super().load_bytes(read_item, buf)


def _is_stock_step(path: str) -> bool:
    """A step directory of TorchTitan's own manager: DCP's ``.metadata`` (or a Hugging Face
    export's index) and no ckptstore manifest."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return False
    return os.path.isfile(os.path.join(path, _DCP_METADATA)) or os.path.isfile(os.path.join(path, _HF_INDEX))


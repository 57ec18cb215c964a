"""Type stubs of the native module ``ckptstore._ckptstore`` (PyO3)."""

import os
from pathlib import Path
from types import TracebackType
from typing import Any, Iterator, Literal, Mapping, Optional, Sequence, Union

import numpy as np

__version__: str

Target = Literal[
    "as_stored", "f32", "float32", "bf16", "bfloat16", "f16_scaled", "f16_scaled_scalar", "f16_scaled_one"
]
Layout = Union[None, str, Mapping[Union[str, tuple[str, str]], str]]

def save(
    path: Union[str, os.PathLike[str]],
    tensors: Sequence[tuple[str, str, np.ndarray]],
    metadata: Optional[str] = None,
    max_shard_size: Optional[int] = None,
    optimizer: Optional[
        tuple[
            str,
            Sequence[
                tuple[str, str, tuple[str, str, np.ndarray], Optional[tuple[str, str, np.ndarray]]]
            ],
        ]
    ] = None,
    cleanup: str = "inline",
) -> dict[str, Any]:
    """Low-level save: ``(name, wire dtype, array)`` triples, metadata as JSON text, and
    optimizer state as ``(groups JSON, [(param, state, values, scale or None), ...])``;
    the engine builds and checks the optimizer section. ``cleanup``: ``"inline"`` or
    ``"background"``. Use :func:`ckptstore.save`."""

def wait_for_cleanup() -> int:
    """Wait for this process's background cleanups; the number of files they removed."""

def new_checkpoint_id() -> str:
    """A fresh 32-hex-digit checkpoint id for a multi-rank save."""

def check_optimizer_fit(
    live_groups: Sequence[Sequence[tuple[str, Sequence[int]]]],
    saved_groups: Any,  # as the checkpoint has them: the engine checks their form
    *,
    live_class: Optional[str] = None,
    saved_class: Optional[str] = None,
    allow_optimizer_change: bool = False,
) -> None:
    """The optimizer compatibility rule (``ckptstore::optim::check_compatible``). Use
    :func:`ckptstore.check_optimizer_fit`."""

def write_part(
    path: Union[str, os.PathLike[str]],
    checkpoint_id: str,
    rank: int,
    items: Sequence[tuple[str, str, np.ndarray, Optional[tuple[Sequence[int], Sequence[int]]]]],
    max_shard_size: Optional[int] = None,
) -> bytes:
    """Low-level write_part: ``(name, wire dtype, array, (global_shape, offsets) or None)``
    items. Use :func:`ckptstore.write_part`."""

def commit(
    path: Union[str, os.PathLike[str]],
    checkpoint_id: str,
    parts: Optional[Sequence[bytes]] = None,
    world_size: Optional[int] = None,
    timeout: Optional[float] = None,
    metadata: Optional[str] = None,
    optimizer: Optional[str] = None,
    layout: str = "auto",
) -> dict[str, Any]:
    """Low-level commit (metadata and optimizer section as JSON text; ``layout``:
    ``"auto"``, ``"flat"`` or ``"two_level"``, else ``InvalidArgumentError``). Use
    :func:`ckptstore.commit`."""

class StepLease:
    """A shared hold on a committed step of a :class:`CheckpointManager` root: garbage
    collection keeps the step while it is held."""

    @property
    def step(self) -> int: ...
    @property
    def path(self) -> Path:
        """The step's directory."""
    @property
    def held(self) -> bool: ...
    def release(self) -> None:
        """Let the step go (idempotent)."""
    def __enter__(self) -> "StepLease": ...
    def __exit__(self, *args: Any) -> Literal[False]: ...

class CheckpointManager:
    """The engine's checkpoint manager over ``root`` (``ROOT/step-<step>/``). Use
    :class:`ckptstore.CheckpointManager` or :class:`ckptstore.torch.CheckpointManager`."""

    def __init__(
        self,
        root: Union[str, os.PathLike[str]],
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
    ) -> None: ...
    @property
    def root(self) -> Path: ...
    def step_dir(self, step: int) -> Path: ...
    def steps(self) -> list[int]: ...
    def latest(self) -> Optional[int]: ...
    def list(self) -> list[dict[str, Any]]:
        """``{"step", "path", "committed", "bytes"}`` per step directory or leftover."""
    def gc(self) -> dict[str, Any]:
        """``{"deleted", "in_use", "interrupted_removed", "swept"}``."""
    def lease(self, step: int) -> StepLease: ...
    def save(
        self,
        step: int,
        tensors: Sequence[tuple[str, str, np.ndarray]],
        metadata: Optional[str] = None,
        max_shard_size: Optional[int] = None,
        optimizer: Optional[
            tuple[
                str,
                Sequence[
                    tuple[str, str, tuple[str, str, np.ndarray], Optional[tuple[str, str, np.ndarray]]]
                ],
            ]
        ] = None,
    ) -> dict[str, Any]:
        """Low-level save of one step (the arguments of :func:`save`), then retention."""

class MappedCheckpoint:
    """The base object of arrays over a mapped checkpoint: keeps the mapping alive."""

class OwnedBuffer:
    """The base object of arrays returned by ``load_optimizer``: owns their buffer."""

class Checkpoint:
    """An open checkpoint (ckptstore directory, ``.safetensors`` file, Hugging Face
    sharded directory or ``s3://`` URL): its shards mapped read-only, downloaded, or, with
    ``lazy=True`` on an object store, fetched by ranged GETs when read."""

    def __init__(self, path: Union[str, os.PathLike[str]], *, lazy: bool = False) -> None: ...
    @property
    def resident(self) -> bool:
        """Whether the shard bytes are in memory (False: opened lazily from a store)."""
    @property
    def is_local(self) -> bool: ...
    def metadata_json(self) -> str:
        """The manifest's user metadata as JSON text."""
    def shape_of(self, name: str) -> tuple[str, list[int]]:
        """``(wire dtype, shape)`` of a global or whole tensor."""
    def verify_regions(self, regions: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> None:
        """Check the CRC32 of everything these boxes read (``ChecksumError``), once each."""
    def byte_ranges(
        self, regions: Sequence[tuple[str, Sequence[int], Sequence[int]]]
    ) -> list[tuple[Path, int, int]]:
        """``(shard file, begin, end)`` of the bytes these boxes read (empty when lazy);
        of a two-level checkpoint, the parts' shard files included."""
    def read_into(
        self, requests: Sequence[tuple[str, Sequence[int], Sequence[int], np.ndarray]]
    ) -> None:
        """Copy each box ``(name, offsets, shape)`` into its writable, C-contiguous 1-D
        uint8 array of exactly the box's bytes, CRC-checked first; in parallel."""
    def verify_received(
        self, requests: Sequence[tuple[str, Sequence[int], Sequence[int], np.ndarray]]
    ) -> None:
        """Check each buffer (bytes received from elsewhere) against the CRC32s of the one
        whole stored chunk its box is (``ChecksumError``); the stored bytes are not read."""
    def fill_into(
        self, requests: Sequence[tuple[str, Sequence[int], Sequence[int], np.ndarray]]
    ) -> None:
        """``read_into`` in one pass: each block CRC-checked as it is copied. On
        ``ChecksumError`` the arrays are partly written: for fresh destinations only."""
    def keys(self) -> list[str]:
        """Tensor names, in manifest (or header) order."""
    def __len__(self) -> int: ...
    def __contains__(self, name: str) -> bool: ...
    def __iter__(self) -> Iterator[str]: ...
    def __getitem__(self, name: str) -> np.ndarray:
        """Read-only zero-copy array over the mapped bytes (``TensorNotFoundError``, a
        ``KeyError``, if absent). Stays valid after the checkpoint is closed."""
    def get(self, name: str, *, verify: bool = False, raw: bool = False) -> np.ndarray:
        """``ck[name]``, optionally CRC-checked first; ``raw=True``: the bytes as 1-D uint8."""
    def read(
        self, names: Optional[Sequence[str]] = None, *, verify: bool = True, raw: bool = False
    ) -> dict[str, np.ndarray]:
        """Zero-copy read-only arrays for many tensors, CRCs checked in parallel first."""
    def read_region(
        self, name: str, offsets: Sequence[int], shape: Sequence[int]
    ) -> np.ndarray:
        """The box ``[offsets, offsets + shape)`` of a global (or whole) tensor in a fresh
        writable array, every chunk read CRC-checked."""
    def chunks(
        self, name: str, within: Optional[tuple[Sequence[int], Sequence[int]]] = None
    ) -> list[tuple[list[int], list[int]]]:
        """How ``name`` is stored: ``(offsets, shape)`` boxes of its global index space
        (of a two-level checkpoint, loading every part index holding one); ``within``: the
        boxes meeting that box only, loading only the parts that hold it."""
    def grid_cells(
        self, name: str, within: Optional[Sequence[tuple[Sequence[int], Sequence[int]]]] = None
    ) -> Optional[list[tuple[list[int], list[int]]]]:
        """A two-level checkpoint's global: the ``(offsets, shape)`` cells of its chunk
        grid, from the root manifest alone (no part index read), each inside one stored
        chunk; with ``within`` (boxes ``(offsets, shape)``), only the cells that intersect
        one of them, each once, row-major. None for flat globals and whole tensors;
        ``TensorNotFoundError`` if absent."""
    @property
    def two_level(self) -> bool:
        """Whether the chunk entries live in part indexes read on first use (``parts``)."""
    def parts_read(self) -> tuple[int, int]:
        """``(part indexes read so far, their bytes)``; ``(0, 0)`` for a flat checkpoint."""
    def globals(self) -> dict[str, tuple[str, list[int]]]:
        """The global tensors (stored in chunks): name -> (wire dtype, global shape)."""
    def info(self, name: str) -> dict[str, Any]:
        """``dtype`` (wire name), ``shape``, ``nbytes``, ``shard``, ``file``, ``crc32``."""
    @property
    def metadata(self) -> dict[str, Any]:
        """User metadata stored with the checkpoint."""
    @property
    def kind(self) -> Literal["ckptstore", "safetensors", "hf-sharded"]: ...
    @property
    def checkpoint_id(self) -> Optional[str]: ...
    @property
    def path(self) -> Path:
        """The directory opened (a single file's directory)."""
    @property
    def shard_files(self) -> list[Path]:
        """Paths of the shard files, in shard order."""
    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data."""
    @property
    def has_optimizer(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    def verify(self) -> dict[str, Any]:
        """Check every header and every tensor's CRC32; ``{"tensors", "bytes", "checksummed"}``."""
    def load_optimizer(
        self,
        layout: Layout = None,
        *,
        counters: Sequence[str] = (),
        raw: bool = False,
        release: bool = False,
    ) -> dict[str, Any]:
        """The optimizer state in fresh writable arrays, converted to ``layout``:
        ``{"param_groups": [...], "param_shapes": {...}, "state": {param: {state: array | F16Scaled}}}``."""
    def fill_and_verify(
        self,
        fills: Sequence[tuple[str, np.ndarray]],
        verify: Sequence[str] = (),
        *,
        release: bool = False,
    ) -> None:
        """One parallel pass: copy each named tensor into its ``uint8`` destination with its
        CRC32 checked on the way, and check the CRC32 of the ``verify`` tensors."""
    def copy_into_unchecked(
        self, pairs: Sequence[tuple[str, np.ndarray]], *, release: bool = False
    ) -> None:
        """Copy each named tensor's stored bytes into its ``uint8`` destination of exactly
        its byte length (no CRC check: ``verify_tensors`` / ``fill_and_verify`` first)."""
    def copy_ranges_into_unchecked(self, items: Sequence[tuple[str, int, np.ndarray]]) -> None:
        """For each ``(name, offset, dst)``, copy the tensor's stored bytes ``[offset,
        offset + len(dst))`` into the ``uint8`` array ``dst`` (no CRC check: verify first)."""
    def copy_into(self, pairs: Sequence[tuple[str, np.ndarray]], *, release: bool = False) -> None:
        """The old name of :meth:`copy_into_unchecked`."""
    def copy_ranges_into(self, items: Sequence[tuple[str, int, np.ndarray]]) -> None:
        """The old name of :meth:`copy_ranges_into_unchecked`."""
    def optimizer_plan(self) -> Optional[dict[str, Any]]:
        """The optimizer section, checked, without reading any state (None without one)."""
    def close(self) -> None:
        """Release this object's hold on the mapping (arrays keep theirs)."""
    def __enter__(self) -> "Checkpoint": ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> Literal[False]: ...

def RegionReader(path: Union[str, os.PathLike[str]]) -> Checkpoint:
    """The old region reader: ``Checkpoint(path, lazy=True)``, which has all its methods."""

def publish_dir(staging: str, target: str) -> None:
    """``ckptstore.atomic.publish_dir``."""

def remove_dir(target: str) -> bool:
    """``ckptstore.atomic.remove_dir``."""

def sweep_leftovers(parent: str) -> int:
    """``ckptstore.atomic.sweep_leftovers``."""

def fsync_dir(path: str) -> None:
    """``ckptstore.atomic.fsync_dir``."""

def make_dirs(path: str) -> None:
    """``ckptstore.atomic.make_dirs``."""

def write_file(location: str, name: str, data: bytes) -> None:
    """``ckptstore.atomic.write_file``."""

def copy_files(src_dir: str, location: str, files: Sequence[tuple[str, int, int]]) -> None:
    """``ckptstore.atomic.copy_files``."""

def state_target(
    param: str,
    state: str,
    wire: str,
    state_shape: Sequence[int],
    param_shape: Sequence[int],
    layout: Layout,
    counters: Sequence[str] = (),
) -> Target:
    """The target ``layout`` gives this state by the loaders' rule
    (``ckptstore::optim::StateLayout::target``; global shapes for a sharded state)."""

def state_absbits(param: str, state: str, wire: str, array: np.ndarray) -> int:
    """The largest ``|x|`` of a floating-point state (or one shard of it) as FP32 bits
    (an infinity or NaN: at least ``0x7f800000``); shards fold with ``max``."""

def convert_state(
    param: str,
    state: str,
    wire: str,
    array: np.ndarray,
    target: str,
    *,
    absmax_bits: Optional[int] = None,
) -> Any:
    """The state in ``target`` in fresh arrays (``ckptstore::optim::StateValue::convert``):
    an array, or an ``F16Scaled`` whose scale comes from ``absmax_bits`` when given."""

def round_state(
    param: str,
    state: str,
    src: np.ndarray,
    target: str,
    out: np.ndarray,
    *,
    absmax_bits: Optional[int] = None,
) -> None:
    """The float32 values the state holds in ``target`` (``convert_state`` read back), from
    the 1-D float32 ``src`` into the fresh 1-D float32 ``out``, in one fused engine pass."""

def f16_scaled_to_f32(q: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """``float32(q) * scale`` into the float32 ``out`` (``F16Scaled.to_float32``)."""

def dtype_table() -> list[tuple[str, Optional[str], int, bool]]:
    """``(wire name, numpy type string or None for BF16, item size, floating-point)`` for
    every dtype a numpy array can hold: the package's one dtype table."""

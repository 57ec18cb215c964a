"""Checkpoint directories put in place, removed and cleaned in one step, and small files
written durably: the one implementation every ckptstore module uses (the framework
integrations among them), run by the Rust engine through the same file-system seam that its
crash simulation enumerates (format-spec/durability.md §Directories).

- :func:`publish_dir` makes a fully written ``staging`` directory visible as ``target``:
  one rename when ``target`` is missing, else one atomic exchange
  (``renameat2(RENAME_EXCHANGE)``) followed by the removal of the old directory, then the
  parent directory's fsync. ``target`` names the old directory or the new one at every
  instant and after any crash, never neither. Where the file system cannot exchange, two
  renames through a hidden ``.<name>.ckpt-old-<id>`` sibling are the fallback, and
  :func:`sweep_leftovers` puts the old directory back after a crash between them.
- :func:`remove_dir` renames ``target`` to a hidden ``.<name>.ckpt-trash-<id>`` sibling,
  fsyncs the parent, then deletes it: whole or gone, never half-deleted under its name.
- :func:`sweep_leftovers` removes (or restores) what a crash left of either; run it where
  no publish into that directory is in flight (at start-up, say).
- :func:`make_dirs` makes a directory and its missing parents, each new entry durable, also
  where other hosts make the same directory at the same moment through a shared file
  system's client caches (``os.makedirs(exist_ok=True)`` fails there: format-spec/
  durability.md, "On a shared file system").
- :func:`fsync_dir` and :func:`write_file` (a temporary file, fsync, rename, directory
  fsync; one PUT on an ``s3://`` prefix) for the small files beside checkpoints, such as a
  ``latest`` pointer.
- :func:`copy_files` copies files whose size and CRC32 were recorded into a directory or an
  ``s3://`` prefix, each checked as it streams and published whole (the tiered manager's
  persist step: committed local files into the persistent tier).

Errors are :class:`ckptstore.CheckpointIOError` (also ``OSError``) naming the operation
and the path. ``staging`` and ``target`` must be on one file system, and ``staging``'s own
files durable already (a committed ckptstore checkpoint is).
"""

from __future__ import annotations

import os
from typing import Iterable, Tuple, Union

from . import _ckptstore

__all__ = ["publish_dir", "remove_dir", "sweep_leftovers", "fsync_dir", "make_dirs", "write_file", "copy_files"]

_Path = Union[str, "os.PathLike[str]"]


def publish_dir(staging: _Path, target: _Path) -> None:
    """Make the directory ``staging`` visible as ``target``, replacing what ``target``
    names, in one step; durable when it returns."""
    _ckptstore.publish_dir(os.fspath(staging), os.fspath(target))


def remove_dir(target: _Path) -> bool:
    """Remove the directory ``target`` whole or not at all; ``False`` when it is missing."""
    return _ckptstore.remove_dir(os.fspath(target))


def sweep_leftovers(parent: _Path) -> int:
    """Delete (or restore) what interrupted publishes and removals left in ``parent``;
    how many entries."""
    return _ckptstore.sweep_leftovers(os.fspath(parent))


def fsync_dir(path: _Path) -> None:
    """Flush the entries of the directory ``path`` to stable storage."""
    _ckptstore.fsync_dir(os.fspath(path))


def make_dirs(path: _Path) -> None:
    """Make the directory ``path`` and its missing parents (nothing if it is one), each new
    entry durable; beside other hosts making it at once on a shared file system too."""
    _ckptstore.make_dirs(os.fspath(path))


def write_file(location: _Path, name: str, data: Union[bytes, str]) -> None:
    """Write the small file ``name`` in the directory (or ``s3://`` prefix) ``location``
    durably and atomically: readers see the old content or the new, never a torn one."""
    if isinstance(data, str):
        data = data.encode()
    _ckptstore.write_file(os.fspath(location), name, bytes(data))


def copy_files(src_dir: _Path, location: _Path, files: Iterable[Tuple[str, int, int]]) -> None:
    """Copy ``files`` (``(name, size, crc32)``, as their writer recorded them) from the
    directory ``src_dir`` into the directory or ``s3://`` prefix ``location`` (a directory is
    created if missing), in parallel; each file is checked against its size and CRC32 while
    it streams and published whole, then the new names are made durable. A file that differs
    raises :class:`ckptstore.ChecksumError` (or ``CheckpointIOError`` for its size) and is
    not published; the files copied before it stay. Copy the files a commit's rendezvous
    waits for (part descriptors) in a second call, after the ones they name."""
    _ckptstore.copy_files(
        os.fspath(src_dir), os.fspath(location), [(str(n), int(s), int(c)) for n, s, c in files]
    )

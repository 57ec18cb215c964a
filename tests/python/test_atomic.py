"""ckptstore.atomic: the one publish / remove / sweep of checkpoint directories and durable
small-file write that every Python module uses (the crash enumeration of the same engine
functions is tests/publish_crash.rs)."""

import os

import pytest

import ckptstore
from ckptstore import atomic


def _dir(path, body):
    os.makedirs(path)
    with open(os.path.join(path, "f"), "w") as f:
        f.write(body)


def _read(path):
    with open(os.path.join(path, "f")) as f:
        return f.read()


def test_publish_onto_missing_then_over_existing(tmp_path):
    staging, target = tmp_path / "staging", tmp_path / "target"
    _dir(staging, "one")
    atomic.publish_dir(staging, target)
    assert _read(target) == "one" and not staging.exists()
    _dir(staging, "two")
    atomic.publish_dir(str(staging), str(target))
    assert _read(target) == "two"
    assert sorted(os.listdir(tmp_path)) == ["target"], "the replaced directory is deleted"


def test_publish_of_a_missing_staging_names_it_and_keeps_the_target(tmp_path):
    _dir(tmp_path / "target", "kept")
    with pytest.raises(ckptstore.CheckpointIOError, match="staging") as e:
        atomic.publish_dir(tmp_path / "staging", tmp_path / "target")
    assert isinstance(e.value, OSError)
    assert _read(tmp_path / "target") == "kept"


def test_remove_dir_whole_and_missing(tmp_path):
    _dir(tmp_path / "t", "x")
    assert atomic.remove_dir(tmp_path / "t") is True
    assert os.listdir(tmp_path) == []
    assert atomic.remove_dir(tmp_path / "t") is False


def test_sweep_restores_a_displaced_directory_and_deletes_trash(tmp_path):
    # What a crash leaves: the fallback publish between its two renames (the old directory
    # displaced, no target), a removal before its delete, and an old copy beside its target.
    _dir(tmp_path / ".a.ckpt-old-0123456789abcdef", "old a")
    _dir(tmp_path / ".b.ckpt-trash-0123456789abcdef", "gone")
    _dir(tmp_path / "c", "new c")
    _dir(tmp_path / ".c.ckpt-old-fedcba9876543210", "old c")
    _dir(tmp_path / ".d.ckpt-old-xyz", "not ours: no 16-hex id")
    assert atomic.sweep_leftovers(tmp_path) == 3
    assert sorted(os.listdir(tmp_path)) == [".d.ckpt-old-xyz", "a", "c"]
    assert _read(tmp_path / "a") == "old a" and _read(tmp_path / "c") == "new c"
    assert atomic.sweep_leftovers(tmp_path / "missing") == 0


def test_write_file_and_fsync_dir(tmp_path):
    atomic.write_file(tmp_path, "latest", "global_step7")
    atomic.write_file(tmp_path, "latest", b"global_step8")
    assert (tmp_path / "latest").read_text() == "global_step8"
    assert os.listdir(tmp_path) == ["latest"], "no temporary file is left"
    atomic.fsync_dir(tmp_path)
    with pytest.raises(ckptstore.CheckpointIOError, match="missing"):
        atomic.fsync_dir(tmp_path / "missing")


def _sums(d, names):
    import zlib

    return [(n, (d / n).stat().st_size, zlib.crc32((d / n).read_bytes())) for n in names]


def test_copy_files_checks_each_file_against_its_record(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "shard.bin").write_bytes(os.urandom(3 << 20))
    (src / "part.json").write_bytes(b'{"rank": 0}')
    (src / "empty").write_bytes(b"")
    files = _sums(src, ["shard.bin", "part.json", "empty"])
    atomic.copy_files(src, tmp_path / "dst", files)  # the directory is made
    for n, _, _ in files:
        assert (tmp_path / "dst" / n).read_bytes() == (src / n).read_bytes()
    # A byte changed since the record: refused, nothing published under its name.
    (src / "late.bin").write_bytes(b"x" * 100)
    rec = _sums(src, ["late.bin"])
    (src / "late.bin").write_bytes(b"x" * 99 + b"y")
    with pytest.raises(ckptstore.ChecksumError, match="late.bin"):
        atomic.copy_files(src, tmp_path / "dst", rec)
    with pytest.raises(ckptstore.CheckpointIOError, match="recorded 101"):
        atomic.copy_files(src, tmp_path / "dst", [("late.bin", 101, rec[0][2])])
    with pytest.raises(ckptstore.CheckpointIOError, match="missing"):
        atomic.copy_files(src, tmp_path / "dst", [("missing", 1, 0)])
    assert sorted(n for n in os.listdir(tmp_path / "dst") if not n.startswith(".")) == [
        "empty", "part.json", "shard.bin"]


def test_make_dirs_makes_the_missing_parents_once_beside_other_makers_and_refuses_a_file(tmp_path):
    """``make_dirs`` (the engine's, as every save prepares its directory): the missing
    parents made, nothing when the directory is there, eight threads making one directory
    at once all succeed; a file in the way is a CheckpointIOError naming the path."""
    from concurrent.futures import ThreadPoolExecutor

    target = tmp_path / "a" / "b" / "c"
    atomic.make_dirs(target)
    assert target.is_dir()
    (target / "kept").write_text("x")
    atomic.make_dirs(target)
    assert (target / "kept").read_text() == "x"
    many = tmp_path / "m" / "n"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: atomic.make_dirs(many), range(8)))
    assert many.is_dir() and os.listdir(tmp_path / "m") == ["n"]
    (tmp_path / "f").write_text("a file")
    with pytest.raises(ckptstore.CheckpointIOError, match=r"create directory .*/f: File exists"):
        atomic.make_dirs(tmp_path / "f")


def test_publish_over_a_file_replaces_it_and_leaves_nothing_behind(tmp_path):
    """A framework's own checkpoint file where a checkpoint directory goes (Lightning's
    ``last.ckpt`` after the switch): replaced in one step, and the file deleted afterwards
    (before, the exchanged file stayed behind under the staging directory's name)."""
    (tmp_path / "last.ckpt").write_bytes(b"PK\x03\x04 a torch.save file")
    _dir(tmp_path / ".stage", "new")
    atomic.publish_dir(tmp_path / ".stage", tmp_path / "last.ckpt")
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert _read(tmp_path / "last.ckpt") == "new"

"""A flaky network to object storage (issue 27 §2): saves, whole opens, lazy region reads,
the manager layout (``ckpt ls`` / ``ckpt gc`` / ``ckpt verify`` on ``s3://``), torch saves and
the multi-rank write_part + commit, each through a fault-injecting proxy
(tests/python/flaky_proxy.py) between the client and a real S3 server (s3s-fs on loopback).

The fault model (see flaky_proxy.py): per request, a scripted or seeded decision among
pass, 503 SlowDown, 500 InternalError, connection reset after n response-body bytes, reset
mid-upload, a lost response (the server acted, the client got a reset), a truncated body
that keeps its true Content-Length, a well-framed short body, a flipped body byte, a latency
spike, and a stalled connection. Fault moments are decided by request counts (the n-th
request a rule matches) or by a hash of (seed, request identity, attempt), never by
wall-clock races; the randomized cases print their seed (``CKPT_FLAKY_SEED`` overrides it).

What every test asserts:

* a transient fault within the retry budget (``CKPT_S3_MAX_RETRIES``,
  ``CKPT_S3_RETRY_TIMEOUT_S``) is retried (the proxy saw the repeated request) and the
  operation succeeds, its data bit for bit;
* past the budget the operation raises one :class:`ckptstore.CheckpointError` whose message
  names the object as ``s3://bucket/key``; the previous committed checkpoint still opens and
  verifies bit for bit afterwards, read through a direct client to s3s-fs (bypassing the
  proxy), and no manifest names a shard that is missing or incomplete;
* a truncated or damaged body is an error (transport error, short read, or CRC mismatch),
  never returned as checked data, and never written into a caller's buffer.

Found here and fixed (the tests keep them fixed): no request timeout below the built-in
120 s (now ``CKPT_S3_REQUEST_TIMEOUT_S``); a lost answer to the manifest PUT deleted the
shards of the manifest it had committed (the writer now reads the manifest back and
deletes its files only when its own manifest is not there); the error of a failed manifest
PUT named a temporary object (the store seam names ``PUT`` and the final key); invalid
``CKPT_S3_*`` values were silently replaced by the defaults (now ``InvalidArgumentError``
naming the variable); a lost CompleteMultipartUpload answer failed the save (an object of
the uploaded size under the key is now taken as completed); a cut answer body of a LIST or
CreateMultipartUpload was not retried (``object_store`` retries bodies of object GETs only;
the engine now retries them within the same budget); the Python checkpoint manager refused
``s3://`` roots (one manager over every store now).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import numpy as np
import pytest

import ckptstore
import ckpt_helpers as h
import flaky_proxy as fp
from flaky_proxy import PASS, Rule, SeededMix, match

KEY, SECRET = "ckpttestkey", "ckpttestsecret0123456789"
BUCKET = "bkt"
ENV_KEYS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
            "AWS_ALLOW_HTTP", "CKPT_S3_MAX_RETRIES", "CKPT_S3_RETRY_TIMEOUT_S",
            "CKPT_S3_REQUEST_TIMEOUT_S")
RETRIES = 3  # the budget of the tests that expect success


class Net:
    """The server, the proxy in front of it, and helpers to look past the proxy."""

    def __init__(self, data: str, port: int, proxy: fp.FlakyProxy) -> None:
        self.data, self.port, self.proxy = data, port, proxy
        self.direct_url = f"http://127.0.0.1:{port}"

    @contextlib.contextmanager
    def direct(self) -> Iterator[None]:
        """Talk to s3s-fs itself (no faults, no retries needed)."""
        old = os.environ["AWS_ENDPOINT_URL"]
        os.environ["AWS_ENDPOINT_URL"] = self.direct_url
        try:
            yield
        finally:
            os.environ["AWS_ENDPOINT_URL"] = old

    def objects(self, prefix: str) -> List[str]:
        """The object names directly under ``prefix`` (s3s-fs keeps a bucket as a directory)."""
        d = Path(self.data, BUCKET, prefix)
        return sorted(p.name for p in d.iterdir() if p.is_file()) if d.is_dir() else []

    def manifest_id(self, prefix: str) -> Optional[str]:
        p = Path(self.data, BUCKET, prefix, "ckpt-manifest.json")
        if not p.is_file():
            return None
        m = re.search(rb'"checkpoint_id"\s*:\s*"([0-9a-f]{32})"', p.read_bytes())
        return m.group(1).decode() if m else None

    def assert_intact(self, prefix: str, tensors: Dict[str, np.ndarray], cid: Optional[str] = None) -> None:
        """The checkpoint committed under ``prefix`` opens and verifies through a direct
        client, holds exactly ``tensors`` bit for bit, and (``cid``) is that checkpoint."""
        with self.direct():
            ck = ckptstore.open(f"s3://{BUCKET}/{prefix}")
            ck.verify()
            if cid is not None:
                assert ck.checkpoint_id == cid
            assert sorted(ck.keys()) == sorted(tensors)
            got = ck.read()
            for k, v in tensors.items():
                assert got[k].tobytes() == np.ascontiguousarray(v).tobytes(), k
        names = self.objects(prefix)
        # Every shard the manifest names is there (open checked sizes and header CRCs).
        assert "ckpt-manifest.json" in names


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    data = tempfile.mkdtemp()
    os.mkdir(os.path.join(data, BUCKET))
    try:
        proc, port = h.start_s3s_fs(data, KEY, SECRET)
    except h.S3sFsError as e:
        pytest.fail(str(e), pytrace=False)
    proxy = fp.FlakyProxy(("127.0.0.1", port)).start()
    old = {k: os.environ.get(k) for k in ENV_KEYS}
    try:
        yield Net(data, port, proxy)
    finally:
        proxy.stop()
        h.restore_env(old)
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(autouse=True)
def through_proxy(net: Net) -> Iterator[fp.FlakyProxy]:
    """Every test starts with the client on the proxy, no faults, RETRIES retries."""
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update({
        "AWS_ENDPOINT_URL": net.proxy.url,
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "CKPT_S3_MAX_RETRIES": str(RETRIES),
    })
    net.proxy.set()
    yield net.proxy
    net.proxy.set()


def retries(n: int) -> None:
    os.environ["CKPT_S3_MAX_RETRIES"] = str(n)


def always(a: fp.Action):
    return lambda n, r: a


def tensors(seed: int, n: int = 50_000) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal(n, dtype=np.float32),
        "m": rng.standard_normal((64, 33)).astype(np.float16),
        "ids": np.arange(seed, seed + 100, dtype=np.int64),
    }


_prefixes = iter(range(10**6))


def fresh(tag: str) -> str:
    return f"{tag}/{next(_prefixes)}"


def url(prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}"


def base(net: Net, tag: str, seed: int = 1):
    """A committed checkpoint under a fresh prefix, saved without faults."""
    prefix, t = fresh(tag), tensors(seed)
    info = ckptstore.save(url(prefix), t)
    net.proxy.set()
    return prefix, t, info["checkpoint_id"]


def matched(proxy: fp.FlakyProxy, when) -> int:
    """How many logged requests ``when`` matches."""
    return sum(1 for r in list(proxy.log) if when(r))


def assert_names(e: BaseException, prefix: str, name: str) -> None:
    """One ckptstore error naming the object as s3://bucket/prefix/name... (the bucket and
    the key)."""
    assert isinstance(e, ckptstore.CheckpointError), repr(e)
    msg = str(e)
    want = f"s3://{BUCKET}/{prefix}/{name}"
    assert want in msg, f"{want!r} not in {msg!r}"


# ---- fault catalogues ------------------------------------------------------------------

TRANSIENT_UPLOAD = {
    "503-slowdown": fp.status(503),
    "500": fp.status(500),
    "reset-mid-upload": fp.reset_request(1000),
    "lost-response": fp.lose_response(),
    "latency": fp.delay(0.3),
}
TRANSIENT_DOWNLOAD = {
    "503-slowdown": fp.status(503),
    "500": fp.status(500),
    "reset-mid-body": fp.reset(100),
    "truncated-keeps-length": fp.truncate(100),
    "lost-response": fp.lose_response(),
    "latency": fp.delay(0.3),
}
# Repeated on every attempt, these exhaust any budget.
HARD_UPLOAD = {"503-slowdown": fp.status(503), "500": fp.status(500),
               "reset-mid-upload": fp.reset_request(1000)}
HARD_DOWNLOAD = {"503-slowdown": fp.status(503), "reset-mid-body": fp.reset(100),
                 "truncated-keeps-length": fp.truncate(100)}


# ---- save --------------------------------------------------------------------------------

SAVE_TARGETS = {
    "probe-list": match("GET", kind="list"),
    "shard-put": match("PUT", "shard-*"),
    "manifest-put": match("PUT", "ckpt-manifest.json"),
}


@pytest.mark.parametrize("target", sorted(SAVE_TARGETS))
@pytest.mark.parametrize("fault", sorted(TRANSIENT_UPLOAD))
def test_save_retries_a_transient_fault(net, through_proxy, target, fault):
    prefix, _, _ = base(net, "save-t")
    when = SAVE_TARGETS[target]
    ckptstore.save(url(prefix), tensors(3))  # the same save without faults: the baseline
    baseline = matched(through_proxy, when)
    new = tensors(2)
    through_proxy.set(Rule(when, [TRANSIENT_UPLOAD[fault]]))
    info = ckptstore.save(url(prefix), new)
    assert len(through_proxy.faults()) == 1, through_proxy.summary()
    # The faulty request was sent once more (a latency spike needs no retry).
    assert matched(through_proxy, when) == baseline + (fault != "latency"), through_proxy.summary()
    net.assert_intact(prefix, new, info["checkpoint_id"])


@pytest.mark.parametrize("target", ["probe-list", "shard-put"])
@pytest.mark.parametrize("fault", sorted(HARD_UPLOAD))
def test_save_past_the_budget_fails_cleanly_and_keeps_the_previous(net, through_proxy, target, fault):
    prefix, old, old_id = base(net, "save-h")
    retries(1)
    through_proxy.set(Rule(SAVE_TARGETS[target], always(HARD_UPLOAD[fault])))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.save(url(prefix), tensors(2))
    faulty = through_proxy.faults()
    assert len(faulty) == 2, through_proxy.summary()  # 1 try + 1 retry
    if target == "probe-list":
        assert f"s3://{BUCKET}/{prefix}" in str(ei.value)
    else:
        assert_names(ei.value, prefix, "shard-")
    assert net.manifest_id(prefix) == old_id
    net.assert_intact(prefix, old, old_id)
    # The failed save deleted what it wrote: only the old checkpoint's objects remain.
    assert all(old_id in n or n == "ckpt-manifest.json" for n in net.objects(prefix)), net.objects(prefix)


def test_save_manifest_put_past_the_budget_commits_nothing(net, through_proxy):
    """The manifest PUT refused on every attempt (the server never sees it): the old
    checkpoint stays committed and the new shards are deleted."""
    prefix, old, old_id = base(net, "save-m")
    retries(1)
    through_proxy.set(Rule(SAVE_TARGETS["manifest-put"], always(fp.status(503))))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.save(url(prefix), tensors(2))
    assert through_proxy.count("PUT", "ckpt-manifest.json") == 2
    msg = str(ei.value)
    assert f"s3://{BUCKET}/{prefix}/" in msg and "ckpt-manifest.json" in msg, msg
    net.assert_intact(prefix, old, old_id)
    assert all(old_id in n or n == "ckpt-manifest.json" for n in net.objects(prefix))


def test_save_errors_name_the_final_key_and_the_request(net, through_proxy):
    prefix, _, _ = base(net, "save-n")
    retries(0)
    through_proxy.set(Rule(SAVE_TARGETS["manifest-put"], always(fp.status(503))))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.save(url(prefix), tensors(2))
    assert str(ei.value).startswith(f"PUT s3://{BUCKET}/{prefix}/ckpt-manifest.json:"), str(ei.value)
    through_proxy.set(Rule(SAVE_TARGETS["shard-put"], always(fp.status(503))))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.save(url(prefix), tensors(3))
    assert re.match(rf"PUT s3://{BUCKET}/{re.escape(prefix)}/shard-[0-9a-f]{{32}}-\d+\.safetensors:",
                    str(ei.value)), str(ei.value)
    cid = ckptstore.new_checkpoint_id()
    through_proxy.set(Rule(match("PUT", "part-*"), always(fp.status(503))))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.write_part(url(prefix), cid, 0, {"w": np.zeros(4, np.float32)})
    assert str(ei.value).startswith(f"PUT s3://{BUCKET}/{prefix}/part-{cid}-r0.json:"), str(ei.value)


def test_lost_manifest_put_response_leaves_an_openable_checkpoint(net, through_proxy):
    prefix, old, old_id = base(net, "save-l")
    new = tensors(2)
    retries(1)
    through_proxy.set(Rule(SAVE_TARGETS["manifest-put"], always(fp.lose_response())))
    try:
        ckptstore.save(url(prefix), new)
    except ckptstore.CheckpointError:
        pass  # the client cannot know; either checkpoint may be the committed one
    committed = net.manifest_id(prefix)
    net.assert_intact(prefix, new if committed != old_id else old, committed)


# ---- multipart save (a shard over one 16 MiB part) -----------------------------------------

BIG_N = 17 << 18  # 17 MiB of f32: two parts
MULTIPART = {
    "create-upload-503": (match(kind="create-upload"), fp.status(503)),
    "journal-put-503": (match("PUT", ".ckpt-tmp-upload-*"), fp.status(503)),
    "part-reset-mid-upload": (match(kind="put-part"), fp.reset_request(100_000)),
    "part-500": (match(kind="put-part"), fp.status(500)),
    "part-lost-response": (match(kind="put-part"), fp.lose_response()),
    "complete-503": (match(kind="complete-upload"), fp.status(503)),
}


@pytest.fixture(scope="module")
def big() -> Dict[str, np.ndarray]:
    return {"big": np.arange(BIG_N, dtype=np.float32), "b": np.ones(7, np.int32)}


@pytest.mark.parametrize("case", sorted(MULTIPART))
def test_multipart_save_retries_a_transient_fault(net, through_proxy, big, case):
    prefix = fresh("mp-t")
    when, a = MULTIPART[case]
    ckptstore.save(url(prefix), big)  # the baseline
    baseline = matched(through_proxy, when)
    through_proxy.set(Rule(when, [a]))
    info = ckptstore.save(url(prefix), big)
    assert len(through_proxy.faults()) == 1
    assert matched(through_proxy, when) == baseline + 1, through_proxy.summary()
    net.assert_intact(prefix, big, info["checkpoint_id"])
    assert not [n for n in net.objects(prefix) if n.startswith(".ckpt-tmp-")], net.objects(prefix)


def test_multipart_save_past_the_budget_aborts_its_upload(net, through_proxy, big):
    prefix, old, old_id = base(net, "mp-h")
    retries(1)
    through_proxy.set(Rule(match(kind="put-part"), always(fp.status(500))))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.save(url(prefix), big)
    assert_names(ei.value, prefix, "shard-")
    assert through_proxy.count(kind="abort-upload") == 1, through_proxy.summary()
    net.assert_intact(prefix, old, old_id)
    # Upload aborted, journal and shard deleted: only the old checkpoint is left.
    assert all(old_id in n or n == "ckpt-manifest.json" for n in net.objects(prefix)), net.objects(prefix)


def test_multipart_save_survives_a_lost_complete_response(net, through_proxy, big):
    prefix = fresh("mp-l")
    through_proxy.set(Rule(match(kind="complete-upload"), [fp.lose_response()]))
    info = ckptstore.save(url(prefix), big)
    net.assert_intact(prefix, big, info["checkpoint_id"])
    assert not [n for n in net.objects(prefix) if n.startswith(".ckpt-tmp-")]


# ---- whole open --------------------------------------------------------------------------

OPEN_TARGETS = {
    "manifest-get": match("GET", "ckpt-manifest.json"),
    "shard-get": match("GET", "shard-*"),
}


@pytest.mark.parametrize("target", sorted(OPEN_TARGETS))
@pytest.mark.parametrize("fault", sorted(TRANSIENT_DOWNLOAD))
def test_open_retries_a_transient_fault(net, through_proxy, target, fault):
    prefix, t, cid = base(net, "open-t")
    ckptstore.open(url(prefix))
    baseline = matched(through_proxy, OPEN_TARGETS[target])
    through_proxy.set(Rule(OPEN_TARGETS[target], [TRANSIENT_DOWNLOAD[fault]]))
    ck = ckptstore.open(url(prefix))
    assert ck.checkpoint_id == cid
    ck.verify()
    got = ck.read()
    for k, v in t.items():
        assert got[k].tobytes() == v.tobytes()
    assert len(through_proxy.faults()) == 1
    assert matched(through_proxy, OPEN_TARGETS[target]) == baseline + (fault != "latency"), \
        through_proxy.summary()


@pytest.mark.parametrize("target", sorted(OPEN_TARGETS))
@pytest.mark.parametrize("fault", sorted(HARD_DOWNLOAD))
def test_open_past_the_budget_fails_naming_the_key(net, through_proxy, target, fault):
    prefix, t, cid = base(net, "open-h")
    retries(1)
    through_proxy.set(Rule(OPEN_TARGETS[target], always(HARD_DOWNLOAD[fault])))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.open(url(prefix))
    assert_names(ei.value, prefix, "ckpt-manifest.json" if target == "manifest-get" else "shard-")
    assert len(through_proxy.faults()) >= 2, through_proxy.summary()
    net.assert_intact(prefix, t, cid)


def test_open_a_short_or_damaged_body_is_never_checked_data(net, through_proxy):
    """A well-framed short body is refused naming the key; a flipped byte is a CRC error
    for verify and every checked read, naming the tensor and the object."""
    prefix, t, cid = base(net, "open-c")
    through_proxy.set(Rule(match("GET", "shard-*"), [fp.short(1000)]))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.open(url(prefix))
    assert_names(ei.value, prefix, "shard-")
    through_proxy.set(Rule(match("GET", "ckpt-manifest.json"), [fp.short(50)]))
    with pytest.raises(ckptstore.CorruptCheckpointError) as ei:
        ckptstore.open(url(prefix))
    assert_names(ei.value, prefix, "ckpt-manifest.json")
    through_proxy.set(Rule(match("GET", "ckpt-manifest.json"), [fp.corrupt(40)]))
    with pytest.raises(ckptstore.ChecksumError) as ei:
        ckptstore.open(url(prefix))
    assert_names(ei.value, prefix, "ckpt-manifest.json")
    # A byte of tensor "w" (its data starts after the header; 1000 is well inside it).
    through_proxy.set(Rule(match("GET", "shard-*"), [fp.corrupt(5000)]))
    ck = ckptstore.open(url(prefix))
    for check in (ck.verify, lambda: ck.read(), lambda: ck.get("w", verify=True)):
        with pytest.raises(ckptstore.ChecksumError) as ei:
            check()
        assert_names(ei.value, prefix, "shard-")
        assert '"w"' in str(ei.value)
    net.assert_intact(prefix, t, cid)


# ---- lazy open and region reads ---------------------------------------------------------

def lazy(prefix: str):
    """``ckptstore.open(url, lazy=True)``: the manifest and shard headers at open, every
    read a ranged GET (CRC-checked into fresh arrays)."""
    return ckptstore.open(url(prefix), lazy=True)


def read_box(ck, name: str, off: int, n: int, itemsize: int = 4) -> np.ndarray:
    out = np.full(n * itemsize, 0xAA, np.uint8)
    ck.read_into([(name, [off], [n], out)])
    return out


@pytest.mark.parametrize("fault", sorted(TRANSIENT_DOWNLOAD))
def test_lazy_reads_retry_a_transient_fault(net, through_proxy, fault):
    prefix, t, cid = base(net, "lazy-t")
    a = TRANSIENT_DOWNLOAD[fault]
    # Every shard GET of a lazy open and three reads (the header GET at open, a region
    # into a buffer, a fresh region, a whole tensor): each faulted once, then retried.
    through_proxy.set(Rule(match("GET", "shard-*"), lambda n, r: a if n % 2 == 1 or fault == "latency" else PASS))
    ck = lazy(prefix)
    assert ck.checkpoint_id == cid and not ck.resident
    assert read_box(ck, "w", 35_000, 1000).tobytes() == t["w"][35_000:36_000].tobytes()
    assert ck.read_region("m", [3, 0], [10, 33]).tobytes() == t["m"][3:13].tobytes()
    assert ck["ids"].tobytes() == t["ids"].tobytes()
    # Four faulty GETs, each retried once (a latency spike: just slow).
    assert len(through_proxy.faults()) == 4, through_proxy.summary()
    assert through_proxy.count("GET", "shard-*") == (4 if fault == "latency" else 8), through_proxy.summary()


@pytest.mark.parametrize("fault", sorted(HARD_DOWNLOAD))
def test_lazy_reads_past_the_budget_fail_and_leave_the_buffer(net, through_proxy, fault):
    prefix, t, cid = base(net, "lazy-h")
    retries(1)
    ck = lazy(prefix)
    through_proxy.set(Rule(match("GET", "shard-*"), always(HARD_DOWNLOAD[fault])))
    out = np.full(4000, 0xAA, np.uint8)
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ck.read_into([("w", [100], [1000], out)])
    assert_names(ei.value, prefix, "shard-")
    assert (out == 0xAA).all(), "a failed read wrote into the destination"
    assert len(through_proxy.faults()) >= 2
    for read in (lambda: ck["w"], lambda: ck.read_region("w", [0], [10])):
        with pytest.raises(ckptstore.CheckpointError) as ei:
            read()
        assert_names(ei.value, prefix, "shard-")
    through_proxy.set(Rule(match("GET", "shard-*"), always(HARD_DOWNLOAD[fault])))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        lazy(prefix)  # the header GET at open
    assert_names(ei.value, prefix, "shard-")
    through_proxy.set()
    assert read_box(ck, "w", 100, 1000).tobytes() == t["w"][100:1100].tobytes()
    net.assert_intact(prefix, t, cid)


def test_lazy_reads_of_a_damaged_or_short_body_are_errors(net, through_proxy):
    prefix, t, _ = base(net, "lazy-c")
    ck = lazy(prefix)
    for a, err in ((fp.corrupt(10), ckptstore.ChecksumError), (fp.short(10), ckptstore.CheckpointError)):
        reads = [
            lambda: ck.verify_regions([("w", [100], [1000])]),
            lambda: ck.read_into([("w", [100], [1000], out)]),
            lambda: ck.read_region("w", [100], [1000]),
            lambda: ck["w"],
            lambda: ck.read(["w"]),
            ck.verify,
        ]
        for read in reads:
            out = np.full(4000, 0xAA, np.uint8)
            through_proxy.set(Rule(match("GET", "shard-*"), [a]))
            with pytest.raises(err) as ei:
                read()
            assert_names(ei.value, prefix, "shard-")
            assert (out == 0xAA).all()
    through_proxy.set()
    assert read_box(ck, "w", 100, 1000).tobytes() == t["w"][100:1100].tobytes()
    ck.verify()


# ---- the multi-rank write_part + commit ---------------------------------------------------

ROWS = 4000


def global_w() -> np.ndarray:
    return (np.arange(ROWS * 8, dtype=np.float32) * 0.5).reshape(ROWS, 8)


def write_both(prefix: str, cid: str) -> List[bytes]:
    g = global_w()
    half = ROWS // 2
    return [
        ckptstore.write_part(url(prefix), cid, 0, {"w": ckptstore.Chunk(g[:half], g.shape, (0, 0)),
                                                   "step": np.array(7, np.int64)}),
        ckptstore.write_part(url(prefix), cid, 1, {"w": ckptstore.Chunk(g[half:], g.shape, (half, 0))}),
    ]


def multirank(net: Net, tag: str):
    prefix, cid = fresh(tag), ckptstore.new_checkpoint_id()
    ckptstore.commit(url(prefix), cid, write_both(prefix, cid))
    net.proxy.set()
    return prefix, cid


def assert_multirank(net: Net, prefix: str, cid: str) -> None:
    with net.direct():
        ck = ckptstore.open(url(prefix))
        ck.verify()
        assert ck.checkpoint_id == cid
        assert ck.read_region("w", [0, 0], [ROWS, 8]).tobytes() == global_w().tobytes()


MR_TARGETS = {
    "part-head": match("HEAD", "part-*"),
    "shard-put": match("PUT", "shard-*"),
    "part-put": match("PUT", "part-*"),
    "commit-shard-head": match("HEAD", "shard-*"),
    "commit-header-get": match("GET", "shard-*"),
    "manifest-put": match("PUT", "ckpt-manifest.json"),
}
MR_FAULTS = {"503-slowdown": fp.status(503), "reset": fp.reset_request(0), "truncated": fp.truncate(10)}


@pytest.mark.parametrize("target", sorted(MR_TARGETS))
@pytest.mark.parametrize("fault", sorted(MR_FAULTS))
def test_multirank_retries_a_transient_fault(net, through_proxy, target, fault):
    prefix, old_id = multirank(net, "mr-t")
    cid = ckptstore.new_checkpoint_id()
    through_proxy.set(Rule(MR_TARGETS[target], [MR_FAULTS[fault]]))
    info = ckptstore.commit(url(prefix), cid, write_both(prefix, cid))
    assert info["checkpoint_id"] == cid
    assert len(through_proxy.faults()) == 1, through_proxy.summary()
    assert_multirank(net, prefix, cid)
    assert old_id not in "".join(net.objects(prefix))  # the commit swept the old one


@pytest.mark.parametrize("target", ["shard-put", "part-put", "commit-header-get", "manifest-put"])
def test_multirank_past_the_budget_commits_nothing(net, through_proxy, target):
    prefix, old_id = multirank(net, "mr-h")
    retries(1)
    cid = ckptstore.new_checkpoint_id()
    through_proxy.set(Rule(MR_TARGETS[target], always(fp.status(503))))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.commit(url(prefix), cid, write_both(prefix, cid))
    if target in ("shard-put", "commit-header-get"):
        assert_names(ei.value, prefix, f"shard-{cid}-r")
    else:  # the bucket and prefix as a URL, the key in the request's text (see the xfail below)
        final = f"part-{cid}-r0.json" if target == "part-put" else "ckpt-manifest.json"
        msg = str(ei.value)
        assert f"s3://{BUCKET}/{prefix}/" in msg and f"{prefix}/{final}" in msg, msg
    assert net.manifest_id(prefix) == old_id
    assert_multirank(net, prefix, old_id)


def test_multirank_rendezvous_commit_retries_its_listing(net, through_proxy):
    prefix, _ = multirank(net, "mr-r")
    cid = ckptstore.new_checkpoint_id()
    write_both(prefix, cid)
    through_proxy.set(Rule(match("GET", kind="list"), [fp.status(503), fp.lose_response()]),
                      Rule(match("GET", "part-*"), [fp.truncate(5)]))
    ckptstore.commit(url(prefix), cid, world_size=2, timeout=5)
    assert len(through_proxy.faults()) == 3, through_proxy.summary()
    assert_multirank(net, prefix, cid)


def test_multirank_lost_manifest_response_keeps_an_openable_checkpoint(net, through_proxy):
    """A multi-rank commit whose manifest PUT response is lost (retries exhausted) deletes no
    shard of the committed manifest: whichever manifest is committed opens."""
    prefix, old_id = multirank(net, "mr-l")
    retries(0)
    cid = ckptstore.new_checkpoint_id()
    parts = write_both(prefix, cid)
    through_proxy.set(Rule(MR_TARGETS["manifest-put"], [fp.lose_response()]))
    # The manifest landed and its answer was lost: the commit reads back what is there,
    # finds its own manifest, and succeeds (as a single-writer save does).
    ckptstore.commit(url(prefix), cid, parts)
    assert net.manifest_id(prefix) == cid != old_id
    assert_multirank(net, prefix, cid)


# ---- response bodies that object_store does not retry ----------------------------------------

def test_a_cut_list_answer_past_the_budget_fails_naming_the_prefix(net, through_proxy):
    prefix, t, _ = base(net, "body0")
    retries(0)
    through_proxy.set(Rule(match("GET", kind="list"), [fp.truncate(20)]))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.save(url(prefix), tensors(3))
    assert f"s3://{BUCKET}/{prefix}" in str(ei.value)
    net.assert_intact(prefix, t)


@pytest.mark.parametrize("case", ["save-probe-list", "ckpt-ls", "rendezvous-list", "create-upload"])
def test_a_cut_list_or_upload_response_body_is_retried(net, through_proxy, ckpt_bin, big, case):
    prefix, t, _ = base(net, "body")
    cut = [fp.truncate(20)]
    if case == "save-probe-list":
        through_proxy.set(Rule(match("GET", kind="list"), cut))
        ckptstore.save(url(prefix), t)
    elif case == "ckpt-ls":
        through_proxy.set(Rule(match("GET", kind="list"), cut))
        p = run_ckpt(ckpt_bin, "ls", url(prefix))
        assert p.returncode == 0, p.stderr
    elif case == "rendezvous-list":
        cid = ckptstore.new_checkpoint_id()
        write_both(prefix, cid)
        through_proxy.set(Rule(match("GET", kind="list"), cut))
        ckptstore.commit(url(prefix), cid, world_size=2, timeout=5)
    else:
        through_proxy.set(Rule(match(kind="create-upload"), [fp.reset(20)]))
        ckptstore.save(url(prefix), big)
    assert len(through_proxy.faults()) == 1


# ---- the manager layout: ckpt ls / gc / verify on s3:// ------------------------------------

def step_prefix(root: str, step: int) -> str:
    return f"{root}/step-{step:08d}"


def run_ckpt(ckpt_bin, *args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([str(ckpt_bin), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def manager_root(net: Net, steps=(1, 2, 3)):
    root = fresh("mgr")
    data = {s: tensors(10 + s, 5000) for s in steps}
    for s in steps:
        ckptstore.save(url(step_prefix(root, s)), data[s])
    net.proxy.set()
    return root, data


MGR_FAULTS = {
    "list-503": (match("GET", kind="list"), fp.status(503)),
    "list-lost-response": (match("GET", kind="list"), fp.lose_response()),
    "manifest-get-reset": (match("GET", "ckpt-manifest.json"), fp.reset(10)),
    "delete-many-500": (match(kind="delete-many"), fp.status(500)),
    "delete-many-latency": (match(kind="delete-many"), fp.delay(0.3)),
}


@pytest.mark.parametrize("case", sorted(MGR_FAULTS))
def test_manager_ls_and_gc_retry_a_transient_fault(net, through_proxy, ckpt_bin, case):
    root, data = manager_root(net)
    when, a = MGR_FAULTS[case]
    through_proxy.set(Rule(when, [a]))
    ls = run_ckpt(ckpt_bin, "ls", url(root), "--json")
    assert ls.returncode == 0, ls.stderr
    assert json.loads(ls.stdout)["latest"] == 3
    through_proxy.set(Rule(when, [a]))
    gc = run_ckpt(ckpt_bin, "gc", url(root), "--keep", "1", "--json")
    assert gc.returncode == 0, gc.stderr
    assert sorted(json.loads(gc.stdout)["deleted"]) == [1, 2]
    assert net.manifest_id(step_prefix(root, 1)) is None
    net.assert_intact(step_prefix(root, 3), data[3])
    v = run_ckpt(ckpt_bin, "verify", url(step_prefix(root, 3)))
    assert v.returncode == 0, v.stderr


def test_manager_past_the_budget_fails_naming_the_root_and_keeps_the_steps(net, through_proxy, ckpt_bin):
    root, data = manager_root(net)
    retries(1)
    through_proxy.set(Rule(match("GET", kind="list"), always(fp.status(503))))
    for args in (["ls", url(root)], ["gc", url(root), "--keep", "1"]):
        p = run_ckpt(ckpt_bin, *args)
        assert p.returncode != 0
        assert f"s3://{BUCKET}/{root}" in p.stderr, p.stderr
    # gc whose deletes all fail: nothing committed is damaged, the newest step opens.
    through_proxy.set(Rule(match(kind="delete-many"), always(fp.status(500))),
                      Rule(match("DELETE"), always(fp.status(500))))
    p = run_ckpt(ckpt_bin, "gc", url(root), "--keep", "1")
    assert p.returncode != 0 and f"s3://{BUCKET}/{root}/step-" in p.stderr, p.stderr
    for s in (1, 2, 3):
        if net.manifest_id(step_prefix(root, s)) is not None:
            net.assert_intact(step_prefix(root, s), data[s])
    net.assert_intact(step_prefix(root, 3), data[3])
    # ckpt verify of a damaged download: exit 1 naming the object, never "ok".
    through_proxy.set(Rule(match("GET", "shard-*"), always(fp.corrupt(3000))))
    v = run_ckpt(ckpt_bin, "verify", url(step_prefix(root, 3)))
    assert v.returncode == 1, (v.stdout, v.stderr)
    assert f"s3://{BUCKET}/{step_prefix(root, 3)}/shard-" in v.stdout + v.stderr


def test_python_manager_save_and_restore_on_s3(net, through_proxy):
    """The one manager on an object store, through Python: retention after each save under
    a transient fault, the steps and their URLs, leases, and a restore of the latest."""
    root = fresh("pymgr")
    mgr = ckptstore.CheckpointManager(url(root), keep_last=1)
    assert mgr.root == url(root) and mgr.step_dir(7) == url(step_prefix(root, 7))
    t = tensors(5)
    through_proxy.set(Rule(match("PUT", "shard-*"), [fp.status(503)]))
    mgr.save(1, t)
    mgr.save(2, t)
    assert len(through_proxy.faults()) == 1
    assert mgr.steps() == [2] and mgr.latest() == 2
    assert [(e["step"], e["path"], e["committed"]) for e in mgr.list()] == [
        (2, url(step_prefix(root, 2)), True)]
    net.assert_intact(step_prefix(root, 2), t)
    with mgr.lease(2) as lease:
        assert lease.path == url(step_prefix(root, 2))
        ck = ckptstore.open(lease.path)
        assert all(np.array_equal(ck[k], v) for k, v in t.items())
    with pytest.raises(ckptstore.CheckpointNotFoundError):
        mgr.lease(1)


def test_torch_manager_async_saves_and_restore_on_s3(net, through_proxy):
    """ckptstore.torch.CheckpointManager on s3://: background saves (one hit by a reset
    connection, retried) keep the newest two, and restore_latest gives back the last step's
    model and optimizer bit for bit."""
    torch = pytest.importorskip("torch")
    import ckptstore.torch as ct

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    root = fresh("torchmgr")
    through_proxy.set(Rule(match("PUT", "shard-*"), [fp.reset_request(100)]))
    with ct.CheckpointManager(url(root), keep_last=2) as mgr:
        for step in range(1, 5):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, model, opt, extra={"step": step})
        mgr.wait()
        assert mgr.steps() == [3, 4]
    assert len(through_proxy.faults()) == 1
    model2 = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    mgr2 = ct.CheckpointManager(url(root), keep_last=2)
    assert mgr2.restore_latest(model2, opt2, return_extra=True) == (4, {"step": 4})
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[k][name], sb[k][name])


def test_torch_save_load_under_faults(net, through_proxy):
    torch = pytest.importorskip("torch")
    import ckptstore.torch as ct

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    prefix = fresh("torch")
    through_proxy.set(Rule(match("PUT", "shard-*"), [fp.reset_request(100)]),
                      Rule(match("PUT", "ckpt-manifest.json"), [fp.status(503)]))
    ct.save(url(prefix), model, opt, extra={"epoch": 3})
    assert len(through_proxy.faults()) == 2
    through_proxy.set(Rule(match("GET", "shard-*"), [fp.truncate(200)]),
                      Rule(match("GET", "ckpt-manifest.json"), [fp.status(500)]))
    model2 = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    assert ct.load(url(prefix), model2, opt2)["epoch"] == 3
    assert len(through_proxy.faults()) == 2
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    # A damaged download is refused, the live model untouched.
    through_proxy.set(Rule(match("GET", "shard-*"), always(fp.corrupt(400))))
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ckptstore.ChecksumError):
        ct.load(url(prefix), model2, opt2)
    assert all(torch.equal(a, p) for a, p in zip(before, model2.parameters()))


# ---- the retry settings at their edges ----------------------------------------------------

def _open_with_503s(net, proxy, n_faults: int):
    prefix, t, cid = base(net, "edge")
    proxy.set(Rule(match("GET", "ckpt-manifest.json"), {i: fp.status(503) for i in range(1, n_faults + 1)}))
    return prefix, t, cid


@pytest.mark.parametrize("n", [0, 1, 3])
def test_max_retries_n_tolerates_n_faults_in_a_row_and_not_n_plus_1(net, through_proxy, n):
    retries(n)
    prefix, t, cid = _open_with_503s(net, through_proxy, n)
    assert ckptstore.open(url(prefix)).checkpoint_id == cid
    assert through_proxy.count("GET", "ckpt-manifest.json") == n + 1
    through_proxy.set(Rule(match("GET", "ckpt-manifest.json"), {i: fp.status(503) for i in range(1, n + 2)}))
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.open(url(prefix))
    assert_names(ei.value, prefix, "ckpt-manifest.json")
    assert through_proxy.count("GET", "ckpt-manifest.json") == n + 1


def test_max_retries_unset_means_more_than_three(net, through_proxy):
    os.environ.pop("CKPT_S3_MAX_RETRIES")
    prefix, _, cid = _open_with_503s(net, through_proxy, 4)
    assert ckptstore.open(url(prefix)).checkpoint_id == cid
    assert through_proxy.count("GET", "ckpt-manifest.json") == 5


def test_retry_timeout_zero_disables_retries(net, through_proxy):
    retries(10)
    os.environ["CKPT_S3_RETRY_TIMEOUT_S"] = "0"
    prefix, _, _ = _open_with_503s(net, through_proxy, 1)
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.open(url(prefix))
    assert_names(ei.value, prefix, "ckpt-manifest.json")
    assert through_proxy.count("GET", "ckpt-manifest.json") == 1


def test_retry_timeout_bounds_a_persistent_fault(net, through_proxy):
    """With a huge retry count, CKPT_S3_RETRY_TIMEOUT_S=1 ends the retries: no retry
    starts later than 1 s after the first attempt (the last backoff is at most ~2 s)."""
    prefix, _, _ = base(net, "edge")
    retries(1000)
    os.environ["CKPT_S3_RETRY_TIMEOUT_S"] = "1"
    through_proxy.set(Rule(match("GET", "ckpt-manifest.json"), always(fp.status(503))))
    t0 = time.monotonic()
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.open(url(prefix))
    took = time.monotonic() - t0
    assert_names(ei.value, prefix, "ckpt-manifest.json")
    assert took >= 1.0
    assert took < 20, took
    assert 2 <= through_proxy.count("GET", "ckpt-manifest.json") < 100


@pytest.mark.parametrize("var,value", [("CKPT_S3_MAX_RETRIES", "-1"),
                                       ("CKPT_S3_MAX_RETRIES", "three"),
                                       ("CKPT_S3_MAX_RETRIES", "1.5"),
                                       ("CKPT_S3_RETRY_TIMEOUT_S", "soon"),
                                       ("CKPT_S3_RETRY_TIMEOUT_S", "-2"),
                                       ("CKPT_S3_REQUEST_TIMEOUT_S", "0"),
                                       ("CKPT_S3_REQUEST_TIMEOUT_S", "inf")])
def test_invalid_retry_settings_are_refused(net, through_proxy, var, value):
    prefix, _, _ = base(net, "edge")
    os.environ[var] = value
    with pytest.raises(ckptstore.InvalidArgumentError, match=var):
        ckptstore.open(url(prefix))


@pytest.mark.parametrize("var,value", [("CKPT_S3_RETRY_TIMEOUT_S", "1.5"),
                                       ("CKPT_S3_REQUEST_TIMEOUT_S", "0.75"),
                                       ("CKPT_S3_MAX_RETRIES", " 3 "),
                                       ("CKPT_S3_MAX_RETRIES", "")])
def test_valid_edge_settings_are_taken(net, through_proxy, var, value):
    """Seconds may be decimals; surrounding blanks are ignored; an empty value is unset."""
    prefix, t, _ = base(net, "edge-ok")
    os.environ[var] = value
    ck = ckptstore.open(url(prefix))
    assert sorted(ck.keys()) == sorted(t)


# ---- a stalled connection ------------------------------------------------------------------

# The proxy holds a stalled request for STALL_S (it lets go at once when the test ends);
# with CKPT_S3_REQUEST_TIMEOUT_S=1 the operation must end well before that, within BOUND_S
# (a 1 s timeout, a retry and the rest of the operation, with a wide margin for a loaded
# 2-core machine): without the timeout it would wait out the stall (or the 120 s default).
STALL_S = 40.0
BOUND_S = 20.0


def test_a_stalled_download_times_out_within_the_configured_bound(net, through_proxy):
    prefix, _, _ = base(net, "stall")
    retries(0)
    os.environ["CKPT_S3_REQUEST_TIMEOUT_S"] = "1"
    through_proxy.set(Rule(match("GET", "shard-*"), [fp.stall(STALL_S)]))
    t0 = time.monotonic()
    with pytest.raises(ckptstore.CheckpointError) as ei:
        ckptstore.open(url(prefix))
    took = time.monotonic() - t0
    assert took < BOUND_S, f"a stalled GET held the open for {took:.1f} s"
    assert_names(ei.value, prefix, "shard-")
    assert "timed out" in str(ei.value).lower() or "timeout" in str(ei.value).lower()


def test_a_stalled_upload_times_out_and_is_retried(net, through_proxy):
    prefix, _, _ = base(net, "stall")
    retries(1)
    os.environ["CKPT_S3_REQUEST_TIMEOUT_S"] = "1"
    new = tensors(9)
    through_proxy.set(Rule(match("PUT", "shard-*"), [fp.stall(STALL_S)]))
    t0 = time.monotonic()
    info = ckptstore.save(url(prefix), new)
    took = time.monotonic() - t0
    assert took < BOUND_S, f"a stalled PUT held the save for {took:.1f} s"
    net.assert_intact(prefix, new, info["checkpoint_id"])


# ---- a seeded random mix -------------------------------------------------------------------

MIX = [
    (fp.status(503), 3), (fp.status(500), 2), (fp.reset(64), 2), (fp.truncate(64), 2),
    (fp.reset_request(256), 2), (fp.lose_response(), 2), (fp.delay(0.05), 2),
]


BODY_UNRETRIED = ("complete-upload", "delete-many")


def _known_gaps(r: fp.Request, a: fp.Action) -> fp.Action:
    """Keep the mix off what no retry can mend: a cut body of a CompleteMultipartUpload or
    bulk-delete answer, and a lost CompleteMultipartUpload answer, become a 503 (the
    engine's read-back handles one lost answer, tests above; not every mix of them)."""
    if r.kind() in BODY_UNRETRIED and a.kind in ("reset", "truncate") and a.arg >= 0:
        return fp.status(503)
    if r.kind() == "complete-upload" and a == fp.lose_response():
        return fp.status(503)
    return a


def _seeds() -> List[int]:
    env = os.environ.get("CKPT_FLAKY_SEED")
    return [int(env)] if env else [20270127, 4242]


@pytest.mark.parametrize("seed", _seeds())
def test_a_seeded_mix_of_faults(net, through_proxy, seed):
    """Every request attempt draws a fault with probability 0.3 from MIX, at most 2 faulty
    attempts in a row per request (within RETRIES=3): every operation must succeed, bit for
    bit, and every committed state must open through a direct client. (The mix leaves out
    what is not transient: damaged bytes, short bodies, stalls; the scripted tests above
    cover those. ``_known_gaps`` keeps it off the findings above.)"""
    print(f"flaky mix seed {seed} (rerun with CKPT_FLAKY_SEED={seed})")
    prefix, root = fresh("mix"), fresh("mixmgr")
    mr = fresh("mixmr")
    through_proxy.set(mix=SeededMix(seed, 0.3, MIX, limit=2, adjust=_known_gaps))
    for i in range(3):
        t = tensors(100 + i, 20_000)
        info = ckptstore.save(url(prefix), t)
        ck = ckptstore.open(url(prefix))
        assert ck.checkpoint_id == info["checkpoint_id"]
        got = ck.read()
        assert all(got[k].tobytes() == v.tobytes() for k, v in t.items())
        lz = lazy(prefix)
        assert read_box(lz, "w", 1000 + i, 500).tobytes() == t["w"][1000 + i:1500 + i].tobytes()
        cid = ckptstore.new_checkpoint_id()
        ckptstore.commit(url(mr), cid, write_both(mr, cid))
        ckptstore.save(url(step_prefix(root, i + 1)), t)
        net.assert_intact(prefix, t, info["checkpoint_id"])
        assert_multirank(net, mr, cid)
    assert len(through_proxy.faults()) > 5, through_proxy.summary()
    print(f"seed {seed}: {len(through_proxy.faults())} faults in {len(through_proxy.log)} requests")

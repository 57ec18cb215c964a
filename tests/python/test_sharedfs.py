"""Checkpoints on a real distributed file system (issue 52): three namespace hosts share a
GlusterFS replica-3 volume through FUSE, each host's client caching as an NFS client does
(gluster_hosts.NFS_LIKE: md-cache and the negative-lookup cache at 10 s, no invalidation
upcalls). Skipped, with the reason, where GlusterFS or namespaces are missing, unless
``CKPT_REQUIRE_GLUSTER`` is set (.ci/run installs Debian's packages and sets it).

- The volume is one file system seen from every host, and its caches are those of the
  issue: a name one host looked up and missed stays missing there after another host
  made it, until the directory is listed.
- ``ckptstore.torch.distributed.save`` of an FSDP2 model from 3 hosts onto the volume, then
  ``load`` on 2 of them: bit-identical. (Before the step directory was made by the
  coordinator alone, every rank's ``os.makedirs`` raced the others' through the caches and
  failed: ``FileNotFoundError``.)
- The tiered manager (test_tiers.py's jobs) with its persistent tier on the volume: saved,
  persisted, a host lost and replaced and every local tier lost: restored from the volume
  bit-identical; a byte of the persisted copy flipped: the same error on every rank.
- The tiered manager with its local tier on the volume by mistake: refused on every rank.
- The file rendezvous commit, its committer's cache holding the other parts as missing;
  ``ckpt verify`` and ``ckpt consolidate`` of it from the other hosts.
- ``ckpt gc`` on one host beside a reader's lease on another.
- Nothing left behind when the cluster closes (daemons, mounts, bricks, namespaces).
- A host lost in the middle of a save (its brick with it): the survivors raise, nothing is
  committed, and a restart on a survivor and a new host restores the step before,
  bit-identical.

Each job runs this file as a script (``python test_sharedfs.py job NAME SHARED``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import dist_helpers as dh
import netns_cluster as nc
import pytest
from netns_fixtures import make_cluster  # noqa: F401 - the fixture

HERE = Path(__file__).resolve()
CKPT = os.environ.get("CKPT_BIN") or str(HERE.parents[2] / "target" / "release" / "ckpt")  # the CLI
JOB_S = 240  # upper bound for one torch job on a loaded 2-core machine (a failure bound only)


def new_volume(make_cluster, **kw):
    """A 3-host cluster and a GlusterFS volume across its hosts (``kw``: gluster_hosts.Volume's
    options), mounted in each at the same path (``SHAREDFS`` in every job's environment)."""
    import gluster_hosts as gl

    why = gl.skip_reason()
    if why:
        if os.environ.get("CKPT_REQUIRE_GLUSTER"):
            pytest.fail(f"GlusterFS cannot run here (CKPT_REQUIRE_GLUSTER is set): {why}")
        pytest.skip(f"GlusterFS cannot run here: {why}")
    c = make_cluster(3)
    v = gl.Volume(c, [0, 1, 2], c.base / "gluster", str(c.base / "sharedfs"), **kw)
    return c, v


@pytest.fixture
def volume(make_cluster):
    """:func:`new_volume` with the NFS-like client caches."""
    return new_volume(make_cluster)


def on(c, i, code: str):
    """Run Python ``code`` in host i; its stdout (it must succeed)."""
    r = c.run(i, [sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_volume_is_shared_and_caches_a_missed_name_like_an_nfs_client(volume):
    c, v = volume
    m = v.mount
    on(c, 0, f"open('{m}/a', 'w').write('from host 0')")
    assert on(c, 1, f"print(open('{m}/a').read())") == "from host 0"
    assert on(c, 2, f"import os; print(os.path.exists('{m}/a'))") == "True"
    # Host 1 misses a name; host 0 makes it; host 1 still misses it (its negative-lookup
    # cache, 10 s), until it lists the directory.
    look = f"import os; print(os.path.exists('{m}/b'))"
    assert on(c, 1, look) == "False"
    on(c, 0, f"open('{m}/b', 'w').write('x')")
    assert on(c, 1, look) == "False"
    assert on(c, 1, f"import os; os.listdir('{m}'); print(os.path.exists('{m}/b'))") == "True"
    # The root namespace sees no mount there.
    assert not os.path.exists(os.path.join(m, "a"))


def needs_torch():
    for mod in ("torch", "ckptstore"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed")


def results(j):
    j.check(timeout=JOB_S)
    out = [nc.job_result(j.output(r)) for r in range(j.world)]
    assert all(o is not None for o in out), j.tails()
    return out


def job(c, v, name, hosts=None):
    return c.start([sys.executable, str(HERE), "job", name, str(c.shared)], hosts=hosts, env={"SHAREDFS": v.mount})


def test_distributed_save_from_three_hosts_loads_on_two_others_bit_identical(volume):
    needs_torch()
    c, v = volume
    out = results(job(c, v, "save"))
    assert [o["saved"] for o in out] == [True] * 3, out
    out = results(job(c, v, "load", hosts=[1, 2]))
    for o in out:
        assert o["differ"] == [] and o["compared"] > 0, out


def test_tiered_persistent_tier_on_the_volume_with_a_host_lost_then_a_damaged_copy(make_cluster):
    """The tiered manager of test_tiers.py (3 hosts, ``replicas=1``, ``persist_every=2``)
    with its persistent tier on the volume: steps 1-3 saved, step 2 persisted by every
    host's first rank (rank 0 made the tier's root and the step's directory; before, the
    hosts made both at once, raced through their caches and failed with ``File exists``).
    Then host 1 is lost (its brick with it; ``network.ping-timeout`` 3 s) and replaced by a
    new machine that mounts the volume as a client, and every local tier is gone: every
    rank restores step 2 from the volume, bit-identical. Then one byte of a persisted shard
    is flipped on the volume: every rank raises the same error naming the damage, its state
    unchanged."""
    import gluster_hosts as gl

    needs_torch()
    c, v = new_volume(make_cluster, options={**gl.NFS_LIKE, "network.ping-timeout": "3"})
    tiers = HERE.with_name("test_tiers.py")
    env = {"TIERS_PERSISTENT": f"{v.mount}/persistent", "SHAREDFS": v.mount}

    def tiers_job(name):
        return c.start([sys.executable, str(tiers), "job", name, str(c.shared)], env=env)

    results(tiers_job("save"))
    listing = on(c, 2, f"import os; print(sorted(n for n in os.listdir('{v.mount}/persistent') if n[0] != '.'))")
    assert listing == "['step-00000002']", listing
    c.lose_host(1, wipe_local=True)
    c.replace_host(1)
    v.mount_client(1, server=0)
    for i in (0, 2):
        for p in c.local_dir(i).iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    out = results(tiers_job("restore"))
    for o in out:
        assert o["step"] == 2 and o["tier"] == "persistent", out
        assert o["differ"] == [] and o["compared"] > 0 and o["extra"] == {"step": 2}, out
        assert o["warnings"] == [], o  # no host remembers step 3: step 2 is the newest known
    shard = on(c, 0, f"import glob; print(sorted(glob.glob('{v.mount}/persistent/step-00000002/shard-*'))[0])")
    on(c, 0, f"f = open('{shard}', 'r+b'); f.seek(-1, 2); b = f.read(1); f.seek(-1, 2); "
             f"f.write(bytes([b[0] ^ 0x40])); f.close()")
    for i in range(3):
        for p in c.local_dir(i).iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    out = results(tiers_job("restore-or-error"))
    assert len({tuple(o["error"]) for o in out}) == 1, out  # the same error on every rank
    for o in out:
        assert o["error"][0] == "CheckpointError" and "no step can be restored" in o["error"][1], o
        assert "step 2: persistent tier" in o["error"][1] and "checksum mismatch in tensor" in o["error"][1], o
        assert o["unchanged"] is True, o


def test_a_host_lost_mid_save_leaves_the_last_whole_step_for_a_restart_with_a_new_host(make_cluster):
    """Step 2 saved on 3 hosts; step 3's save holds host 2 after its shards, before its part
    descriptor (the engine's pause seam), and host 2 is lost there (link down, every process
    killed: its brick and its client with it). The volume keeps its quorum (2 of 3 bricks;
    ``network.ping-timeout`` 3 s, as a job on a shared file system would set it); the two
    survivors raise (the coordinator never gets rank 2's part: nothing of step 3 is
    committed). Host 2 is replaced by a new machine that mounts the volume as a client
    (cold caches). A restart on hosts 1 and 2 takes the newest step that opens whole,
    decided by its rank 0 (step 2), and restores it bit-identical."""
    import gluster_hosts as gl

    needs_torch()
    c, v = new_volume(make_cluster, options={**gl.NFS_LIKE, "network.ping-timeout": "3"})
    assert [o["saved"] for o in results(job(c, v, "save"))] == [True] * 3
    j = job(c, v, "save_held")
    assert nc.wait_file(c.shared / "before-part", JOB_S), j.tails()
    c.lose_host(2)
    assert j.wait(timeout=JOB_S, ranks=[0, 1]) == [0, 0], j.tails()
    for r in (0, 1):
        o = nc.job_result(j.output(r))
        assert o is not None and o["raised"] is not None, j.tails()
    c.replace_host(2)
    v.mount_client(2, server=0)
    out = results(job(c, v, "restart", hosts=[1, 2]))
    for o in out:
        assert o["step"] == 2 and o["step3"] == "CheckpointNotFoundError", out
        assert o["differ"] == [] and o["compared"] > 0 and o["extra"] == {"step": 2}, out


def test_the_file_rendezvous_commits_though_the_committer_cached_every_part_as_missing(volume):
    """The file rendezvous (``ckptstore.commit(world_size=, timeout=)``) on the volume: host 0
    writes its part, then looks up the other two parts' names before they exist (its client
    now caches them as missing, 10 s at least), and only then do hosts 1 and 2 write theirs;
    looked up again, they are still missing there (measured). The commit, started after both
    were written, with an 8 s timeout, sees them by listing the directory (a new name shows in
    a listing at once) and commits; hosts 1 and 2 open the checkpoint, verify every CRC and
    read the tensor the three parts tiled. A rendezvous that looked the parts up by name
    would have waited past its timeout for names its cache said were missing."""
    import uuid

    c, v = volume
    cid = uuid.uuid4().hex
    out = results(c.start([sys.executable, str(HERE), "job", "rendezvous", str(c.shared)],
                          env={"SHAREDFS": v.mount, "CID": cid}))
    assert out[0]["missed"][:2] == [False, False] and out[0]["error"] is None, out
    for i in (1, 2):
        got = on(c, i, f"import ckptstore; ck = ckptstore.open('{v.mount}/rv'); ck.verify(); "
                       f"print(ck['w'].ravel().tolist(), ck.checkpoint_id)")
        assert got == f"{[float(x) for x in range(24)]} {cid}", got
    # The shell tools from other hosts: verify on host 1, consolidate on host 2, read on host 0.

    r = c.run(1, [CKPT, "verify", f"{v.mount}/rv"])
    assert r.returncode == 0, r.stdout + r.stderr
    r = c.run(2, [CKPT, "consolidate", f"{v.mount}/rv", "--out", f"{v.mount}/rv-whole"])
    assert r.returncode == 0, r.stdout + r.stderr
    got = on(c, 0, f"import ckptstore; print(ckptstore.open('{v.mount}/rv-whole')['w'].ravel().tolist())")
    assert got == str([float(x) for x in range(24)]), got


def test_ckpt_gc_on_one_host_keeps_the_step_a_reader_on_another_host_holds(volume):
    """A manager root on the volume (steps 1-3 saved from host 0). Host 1 holds a lease on
    step 1 (a shared lock on the step's lock file; GlusterFS holds such locks across
    clients); ``ckpt gc --keep 1`` on host 2 deletes step 2 and keeps step 1 as in use; once
    host 1 lets go, the next gc deletes it. Step 3 stays and verifies from host 1."""
    c, v = volume

    root = f"{v.mount}/mgr"
    on(c, 0, "import ckptstore, numpy as np; m = ckptstore.CheckpointManager('" + root + "')\n"
             "for s in (1, 2, 3): m.save(s, {'w': np.full(64, s, np.float32)})")
    held, release = c.shared / "lease-held", c.shared / "lease-release"
    reader = c.popen(1, [sys.executable, "-c",
                         "import ckptstore, os, sys, time\n"
                         f"with ckptstore.CheckpointManager('{root}').lease(1):\n"
                         f"    open('{held}', 'w').close()\n"
                         f"    while not os.path.exists('{release}'): time.sleep(0.02)\n"])
    try:
        assert nc.wait_file(held, JOB_S), "the reader on host 1 never held step 1"
        r = c.run(2, [CKPT, "gc", root, "--keep", "1", "--json"])
        assert r.returncode == 0, r.stdout + r.stderr
        got = json.loads(r.stdout)
        assert got["deleted"] == [2] and got["in_use"] == [1], got
    finally:
        release.write_text("1")
        reader.wait(timeout=JOB_S)
    assert reader.returncode == 0
    r = c.run(2, [CKPT, "gc", root, "--keep", "1", "--json"])
    assert r.returncode == 0 and json.loads(r.stdout)["deleted"] == [1], r.stdout + r.stderr
    assert c.run(1, [CKPT, "verify", f"{root}/step-00000003"]).returncode == 0
    assert on(c, 0, f"import ckptstore; print(ckptstore.CheckpointManager('{root}').steps())") == "[3]"


def test_a_local_tier_on_the_volume_is_refused_on_every_rank(volume):
    """The tiered manager's local tier pointed at the shared volume by mistake: the three
    hosts see one another's marker files there, which made them one "host" (whose loss loses
    every copy); now every rank refuses it, naming the directory and what belongs there."""
    needs_torch()
    c, v = volume
    out = results(job(c, v, "local_on_volume"))
    for o in out:
        assert o["error"] is not None and o["error"][0] == "InvalidArgumentError", out
        assert f"the local tier '{v.mount}/tiers-local' is shared between machines" in o["error"][1], o
        assert "ranks [0, 1, 2]" in o["error"][1] and "3 different machines" in o["error"][1], o
    assert on(c, 0, f"import os; print(os.listdir('{v.mount}/tiers-local'))") == "[]"  # markers gone


def test_closing_the_cluster_leaves_no_daemon_mount_brick_or_namespace(make_cluster):
    """What the fixtures do after every test, passed or failed (``c.close``): with the volume
    in use (a host lost and a new one mounted as a client among them), no glusterd,
    glusterfsd or client process, no mount, no brick directory and no namespace is left."""
    import subprocess

    c, v = new_volume(make_cluster)
    on(c, 0, f"open('{v.mount}/x', 'w').write('in use')")
    c.lose_host(2)
    c.replace_host(2)
    v.mount_client(2, server=0)
    assert on(c, 2, f"print(open('{v.mount}/x').read())") == "in use"
    base, names = str(c.base), [h.ns for h in c.hosts]
    c.close()

    def leftovers():
        procs = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if base in cmd:
                procs.append(cmd)
        mounts = [ln for ln in open("/proc/self/mountinfo") if base in ln]
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return procs, mounts, [n for n in names if n in netns], os.path.exists(base)

    import time

    end = time.monotonic() + 10  # killed processes are reaped by their parent (a failure bound)
    while leftovers() != ([], [], [], False) and time.monotonic() < end:
        time.sleep(0.1)
    assert leftovers() == ([], [], [], False)


# ---- the jobs (run in the hosts) -----------------------------------------------------------


def _rendezvous_job(rank: int, shared: str) -> None:
    import ckptstore
    import numpy as np

    d, cid = os.path.join(os.environ["SHAREDFS"], "rv"), os.environ["CID"]
    full = np.arange(24, dtype=np.float32).reshape(6, 4)
    part = {"w": ckptstore.Chunk(full[2 * rank:2 * rank + 2], (6, 4), (2 * rank, 0))}
    ready = Path(shared) / "rv-ready"
    if rank == 0:
        os.mkdir(d)
        ckptstore.write_part(d, cid, 0, part)
        missed = [os.path.exists(os.path.join(d, f"part-{cid}-r{r}.json")) for r in (1, 2)]
        ready.write_text("1")
        for r in (1, 2):  # the commit starts once every part is written
            assert nc.wait_file(Path(shared) / f"rv-wrote-{r}", JOB_S)
        # What this host's cache says now (measured: missing, both; not asserted, as it ages).
        missed += [os.path.exists(os.path.join(d, f"part-{cid}-r{r}.json")) for r in (1, 2)]
        try:
            ckptstore.commit(d, cid, world_size=3, timeout=8)
            nc._result({"missed": missed, "error": None})
        except Exception as e:  # noqa: BLE001 - recorded for the test
            nc._result({"missed": missed, "error": f"{type(e).__name__}: {e}"})
    else:
        assert nc.wait_file(ready, JOB_S)
        ckptstore.write_part(d, cid, rank, part)
        (Path(shared) / f"rv-wrote-{rank}").write_text("1")
        nc._result({"wrote": True})


def _job_main(name: str, shared: str) -> None:
    from datetime import timedelta

    if name == "rendezvous":  # no process group: the file rendezvous alone
        _rendezvous_job(int(os.environ["RANK"]), shared)
        return

    import ckptstore.torch.distributed as cd
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A job that loses a host fails its collectives at this timeout (no FIN comes back).
    timeout = timedelta(seconds=20 if name == "save_held" else 120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    path = os.path.join(os.environ["SHAREDFS"], "ck", "step2")
    expect = Path(shared) / "expect.pt"
    if name == "save":
        m, o = nc._fsdp_model(world, seed=0)
        nc._fsdp_train(m, o, 1, 2, rank)
        cd.save(path, m, o, extra={"step": 2})
        full = nc._fsdp_gather(m, o)
        if rank == 0:
            torch.save(full, expect)
        nc._result({"saved": True})
    elif name == "save_held":
        if os.environ["CLUSTER_HOST"] == "2":  # held after its shards, before its part
            os.environ["CKPTSTORE_TEST_PAUSE"] = "before-part"
            os.environ["CKPTSTORE_TEST_PAUSE_DIR"] = shared
        m, o = nc._fsdp_model(world, seed=0)
        nc._fsdp_train(m, o, 1, 3, rank)
        try:
            cd.save(path.replace("step2", "step3"), m, o, extra={"step": 3})
            nc._result({"raised": None})
        except Exception as e:  # noqa: BLE001 - recorded for the test
            nc._result({"raised": type(e).__name__, "msg": str(e)[:400]})
        sys.stdout.flush()
        os._exit(0)  # no exit_together: host 2 is gone
    elif name in ("load", "restart"):
        import ckptstore
        from ckptstore.torch.internal import decided_once

        def opens(s: int):
            try:
                ckptstore.open(path.replace("step2", f"step{s}"))
                return None
            except Exception as e:  # noqa: BLE001 - its name is the answer
                return type(e).__name__

        step = 2
        if name == "restart":  # the newest step that opens whole, as rank 0 sees the volume
            step = decided_once(lambda: next((s for s in (3, 2) if opens(s) is None), None), what="the newest step")
        m, o = nc._fsdp_model(world, seed=1)
        nc._fsdp_train(m, o, 1, 1, rank)
        extra = cd.load(path.replace("step2", f"step{step}"), m, o)
        got, want = nc._fsdp_gather(m, o), torch.load(expect)
        differ = sorted(set(got) ^ set(want)) + sorted(
            k for k in set(got) & set(want) if not torch.equal(nc._bits(got[k]), nc._bits(want[k])))
        nc._result({"differ": differ, "compared": len(want), "extra": extra, "step": step, "step3": opens(3)})
    elif name == "local_on_volume":
        from ckptstore.torch.tiered import CheckpointManager

        try:
            CheckpointManager(os.path.join(os.environ["SHAREDFS"], "tiers-local"), None).close()
            nc._result({"error": None})
        except Exception as e:  # noqa: BLE001 - recorded for the test
            nc._result({"error": (type(e).__name__, str(e))})
    dh.exit_together(rank, world)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "job":
        _job_main(sys.argv[2], sys.argv[3])

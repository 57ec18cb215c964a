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

Each job runs this file as a script (``python test_sharedfs.py job NAME SHARED``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import dist_helpers as dh
import netns_cluster as nc
import pytest
from netns_fixtures import make_cluster  # noqa: F401 - the fixture

HERE = Path(__file__).resolve()
JOB_S = 240  # upper bound for one torch job on a loaded 2-core machine (a failure bound only)


@pytest.fixture
def volume(make_cluster):
    """A 3-host cluster and a GlusterFS volume across its hosts, mounted in each at the
    same path (``SHAREDFS`` in every job's environment)."""
    import gluster_hosts as gl

    why = gl.skip_reason()
    if why:
        if os.environ.get("CKPT_REQUIRE_GLUSTER"):
            pytest.fail(f"GlusterFS cannot run here (CKPT_REQUIRE_GLUSTER is set): {why}")
        pytest.skip(f"GlusterFS cannot run here: {why}")
    c = make_cluster(3)
    v = gl.Volume(c, [0, 1, 2], c.base / "gluster", str(c.base / "sharedfs"))
    return c, v


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


# ---- the jobs (run in the hosts) -----------------------------------------------------------


def _job_main(name: str, shared: str) -> None:
    from datetime import timedelta

    import ckptstore.torch.distributed as cd
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
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
    elif name == "load":
        m, o = nc._fsdp_model(world, seed=1)
        nc._fsdp_train(m, o, 1, 1, rank)
        extra = cd.load(path, m, o)
        got, want = nc._fsdp_gather(m, o), torch.load(expect)
        differ = sorted(set(got) ^ set(want)) + sorted(
            k for k in set(got) & set(want) if not torch.equal(nc._bits(got[k]), nc._bits(want[k])))
        nc._result({"differ": differ, "compared": len(want), "extra": extra})
    dh.exit_together(rank, world)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "job":
        _job_main(sys.argv[2], sys.argv[3])

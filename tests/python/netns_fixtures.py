"""pytest fixture for hosts made of network namespaces (netns_cluster.Cluster).

    from netns_fixtures import make_cluster  # noqa: F401  (a fixture, found by name)

    def test_x(make_cluster):
        c = make_cluster(3)          # closed at teardown, also when the test failed

Skips, with netns_cluster.skip_reason()'s reason, where namespaces cannot be made (not root,
no iproute2, `ip netns add` refused in a container, ...).
"""

from __future__ import annotations

import pytest

import netns_cluster as nc


@pytest.fixture
def make_cluster(tmp_path):
    why = nc.skip_reason()
    if why:
        pytest.skip(f"cannot make hosts from network namespaces here: {why}")
    made = []

    def make(hosts: int, **kw) -> nc.Cluster:
        kw.setdefault("base_dir", tmp_path)
        c = nc.Cluster(hosts, **kw)
        made.append(c)
        return c

    yield make
    errors = []
    for c in made:
        try:
            c.close()
        except Exception as e:  # noqa: BLE001 - every cluster is closed, the first error raised
            errors.append(e)
    if errors:
        raise errors[0]

"""The namespace cluster (cluster/local_cluster.py) leaves nothing behind: on SIGTERM, SIGHUP
or Ctrl-C to ``python -m msrl.cluster.local_cluster``, and when its owner dies without stopping
it, every process it started (the head's and the nodes' Ray processes, their workers and agents),
its network namespaces, its bridge and its temp dir are gone -- checked by pid and by name (the
names carry the owner's pid), never by looking at the machine's other processes."""

from __future__ import annotations

import glob
import signal
import subprocess
import sys
import tempfile

import pytest
from procs import EVENT_TIMEOUT_S, descendants, popen, stop_tree, wait_for

pytest.importorskip("ray")

from msrl.cluster.actor_manager import process_running  # noqa: E402
from msrl.cluster.local_cluster import unavailable  # noqa: E402

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no multi-node cluster on this machine: {WHY}")


def _made(owner: int) -> list[str]:
    """What a cluster owned by ``owner`` made that is still there: namespaces, bridges, temp dirs."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    return ([n for n in ns if n.startswith(f"msrl-{owner}-")]
            + [w.strip(":") for w in links.split() if w.startswith(f"m{owner}k")]
            + glob.glob(f"{tempfile.gettempdir()}/msrl-cluster-{owner}-*"))


@pytest.mark.parametrize("end", ["SIGTERM", pytest.param("SIGHUP", marks=pytest.mark.slow),
                                 pytest.param("owner SIGKILLed", marks=pytest.mark.slow)])
def test_the_namespace_cluster_leaves_nothing_behind(end):
    proc = popen([sys.executable, "-m", "msrl.cluster.local_cluster", "--nodes", "2", "--cpus", "1"],
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("cluster up"):
                break
        assert seen and seen[-1].startswith("cluster up"), "".join(seen)[-3000:]
        pids = descendants(proc.pid)  # its Ray processes (head and node), workers, agents, janitor
        assert len(pids) >= 8 and _made(proc.pid)
        sig = {"SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP, "owner SIGKILLed": signal.SIGKILL}[end]
        proc.send_signal(sig)
        proc.wait(timeout=EVENT_TIMEOUT_S)
        wait_for(lambda: not [p for p in pids if process_running(p)] and not _made(proc.pid),
                 f"the cluster of pid {proc.pid} torn down after {end} (left: "
                 f"{[p for p in pids if process_running(p)]}, {_made(proc.pid)})")
    finally:
        stop_tree(proc)


def test_two_clusters_made_at_once_never_share_a_subnet():
    """Two clusters made before either has put an address on its bridge (two test workers at
    once: both saw the same ``10.211.k.0/24`` free, and neither one's nodes could join) take
    different subnets; a stopped cluster's subnet is free again."""
    from msrl.cluster.local_cluster import LocalCluster

    first, second = LocalCluster(nodes=2), LocalCluster(nodes=2)
    try:
        assert first.k != second.k
        assert first.node_ips[0] != second.node_ips[0]
        k = first.k
        first.stop()
        third = LocalCluster(nodes=2)
        try:
            assert third.k == k
        finally:
            third.stop()
    finally:
        first.stop()
        second.stop()
    assert _made(first.owner) == []

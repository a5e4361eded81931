"""The learner across two hosts: FSDP2 ranks under `torchrun --nnodes 2`, one node per simulated host (network
namespaces joined by a veth pair, tests/hosts_support.py), gloo over the veth. The same rank program as the one-host
test (dist_worker.py) trains one step per scenario; its weights, gathers and metrics must equal the single process's
within the same float tolerance (test_distributed.py's comparison, reused)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hosts_support import TwoHosts, available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=str(available()))]
HERE = Path(__file__).parent
WORKER = HERE / "dist_worker.py"


def _one_host_test():
    spec = importlib.util.spec_from_file_location("dgrpo_test_distributed", HERE / "test_distributed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torchrun_node(hosts: TwoHosts, rank: int, model: Path, out: Path) -> list[str]:
    """`torchrun --nnodes 2` for node `rank` (0: host a, also the rendezvous), as a user runs it on each machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
            "--nproc-per-node", "1", "--master-addr", hosts.a.address, "--master-port", "29511",
            str(WORKER), str(model), str(out)]


@pytest.fixture(scope="module")
def two_node_run(launcher, tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("nodes")
    with TwoHosts("torchrun") as hosts:
        procs = []
        for rank, host in enumerate((hosts.a, hosts.b)):
            # gloo binds the interface it is told: each node's end of the link (the hostname resolves to neither).
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": host.veth}
            with open(out / f"node{rank}.log", "w") as log:
                procs.append(subprocess.Popen(host.command(torchrun_node(hosts, rank, tiny_model, out)), env=env,
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        try:
            codes = [p.wait(timeout=420) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
    logs = "\n".join((out / f"node{r}.log").read_text()[-3000:] for r in (0, 1))
    assert codes == [0, 0], logs
    return out


@pytest.mark.parametrize("scenario", ["padded", "packed"])
def test_two_torchrun_nodes_on_two_hosts_equal_one_process(two_node_run, tiny_model, scenario):
    _one_host_test().test_two_gloo_ranks_equal_one_process(two_node_run, tiny_model, scenario)

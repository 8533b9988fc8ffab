"""The network preflight of multi-node runs: two "nodes" (processes) on this machine meet, time an
all-reduce sweep and a ping-pong, and write preflight.json; a host that cannot be resolved and a
link under the floor each fail, naming the node and its interface. A node that cannot connect
(a port nobody serves) is tested on the Slurm test cluster, one task per node
(``test_slurm.py::test_preflight_names_the_node_that_cannot_connect``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from detscale.cluster.slurm import preflight_step
from detscale.cluster.torchrun import pick_port


def _nodes(endpoints: list[str], timeout: float = 6.0, *extra: str) -> tuple[list[int], list[str]]:
    """Run one preflight process per endpoint (node rank = position); exit codes and output."""
    procs = [subprocess.Popen([sys.executable, "-m", "detscale.cluster.preflight", f"--endpoint={endpoint}",
                               f"--nodes={len(endpoints)}", f"--node-rank={rank}", "--hosts=alpha,beta",
                               f"--timeout={timeout}", *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, endpoint in enumerate(endpoints)]
    outs = [p.communicate(timeout=120) for p in procs]
    return [p.returncode for p in procs], [o[0] + o[1] for o in outs]


def test_two_nodes_meet_and_record_the_network(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{pick_port(None)}"
    out = tmp_path / "run" / "preflight.json"
    codes, texts = _nodes([endpoint, endpoint], 60.0, f"--out={out}")
    assert codes == [0, 0], texts
    record = json.loads(out.read_text())
    assert [n["rank"] for n in record["nodes"]] == [0, 1]
    assert {n["interface"] for n in record["nodes"]} == {"lo"} and record["nodes"][1]["address"] == "127.0.0.1"
    assert [row["bytes"] for row in record["allreduce"]] == [1 << 16, 1 << 20, 1 << 23]
    assert all(row["bus_gbps"] > 0 for row in record["allreduce"])
    assert len(record["links"]) == 1 and record["links"][0]["gbps"] > 0 and record["passed"] is True
    assert "preflight: 2 nodes met at" in texts[0] and "GB/s" in texts[0]


def test_an_unresolvable_rendezvous_host_and_a_slow_link_are_named() -> None:
    port = pick_port(None)
    codes, texts = _nodes([f"127.0.0.1:{port}", f"no-such-host.invalid:{port}"], 3.0)
    assert codes == [3, 3]
    assert "node rank 1" in texts[1] and "cannot resolve the rendezvous host 'no-such-host.invalid'" in texts[1]
    endpoint = f"127.0.0.1:{pick_port(None)}"
    codes, texts = _nodes([endpoint, endpoint], 60.0, "--min-gbps=100000")
    assert codes[0] == 3 and "below the floor of 100000 GB/s" in texts[0] and "(interface lo)" in texts[0], texts


def test_preflight_step_is_one_task_per_node_meeting_on_the_first() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    cmd = preflight_step(2, "/r/preflight.json", 60, 1.5, 29600, env=env, python="py", resolve=lambda n: f"{n}.ib")
    assert cmd[:2] == ["srun", "--nodes=2"] and "--ntasks-per-node=1" in cmd and "--kill-on-bad-exit=1" in cmd
    assert cmd[cmd.index("py"):] == ["py", "-m", "detscale.cluster.preflight", "--endpoint=gpu07.ib:29600", "--nodes=2",
                                     "--hosts=gpu07,gpu08", "--timeout=60", "--min-gbps=1.5",
                                     "--out=/r/preflight.json"]

"""The launch of tests/test_nodes.py's wire-bytes test, started in the background when collection ends
(tests/background.py); root only (network namespaces):

    python tests/node_runs.py OUT

2 emulated nodes of 2 ranks behind 1 Gbit/s NICs run :data:`NODE_STEPS` (flat 1-bit LionCub) under
``lioncub.launch.launch``. ``OUT/wire.json`` holds what the test reads: ``ok``, ``launch_id``, each node's
NIC ``tx_bytes`` as the launcher counted them, and the launch's stdout and stderr.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

M, L = 2, 2  # nodes, ranks per node
D = 4_000_003  # parameters: not a multiple of 8·N, so padding travels too

NODE_STEPS = f"""
import datetime, json, os, re, subprocess, time, torch, torch.distributed as dist
from pathlib import Path
from lioncub import Checks, LionCub

D, STEPS = {D}, 4
"""
NODE_STEPS += """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
nic = os.environ["GLOO_SOCKET_IFNAME"]


def retransmitted():  # TCP bytes this node's sockets sent again, by interface: the peer on this node is lo
    lines = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, check=True).stdout.splitlines()
    by_nic = {nic: 0, "lo": 0}
    for head, info in zip(lines[::2], lines[1::2]):  # a socket's line, then its tcp_info line
        local_addr, peer_addr = (a.rsplit(":", 1)[0] for a in head.split()[3:5])
        found = re.search(r"bytes_retrans:(\\d+)", info)
        by_nic["lo" if peer_addr == local_addr else nic] += int(found.group(1)) if found else 0
    by_nic["sockets"] = sum(1 for info in lines[1::2] if "bytes_sent:" in info)
    return by_nic


def counters():  # this node's NIC and loopback: tx/rx bytes and frames, and the tx bytes TCP retransmitted
    keys = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
    path = "/sys/class/net/{}/statistics/{}"
    again = retransmitted()
    return {n: [int(Path(path.format(n, k)).read_text()) for k in keys] + [again[n]] for n in (nic, "lo")}


torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(D))  # not a multiple of 8·N: padding travels too
opt = LionCub([p], lr=1e-3, variant="1bit", checks=Checks(broadcast_init=False))  # same seed: no broadcast
g = torch.Generator().manual_seed(rank)


def step():
    p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def diff(a, b):
    return None if a is None else {n: [y - x for x, y in zip(a[n], b[n])] for n in a}


step()  # warm-up: every gloo connection is up
dist.barrier()
first, t0 = (counters(), time.monotonic()) if local == 0 else (None, 0.0)
sent0 = opt.comm_stats()["total"]["bytes_sent"]
dist.barrier()  # no rank sends a step's bytes before the node's counters are read
for _ in range(STEPS):
    step()
dist.barrier()
last, t1 = (counters(), time.monotonic()) if local == 0 else (None, 0.0)
sockets = retransmitted()["sockets"] if local == 0 else 0  # the parse of ss saw the TCP connections
sent = opt.comm_stats()["total"]["bytes_sent"] - sent0
# An idle window: what the interfaces carry without LionCub (torchrun's agents poll the rendezvous store
# every 0.1 s: node 0's over its loopback, node 1's over both NICs), as a rate to subtract.
dist.barrier()
idle0, i0 = (counters(), time.monotonic()) if local == 0 else (None, 0.0)
time.sleep(1.0 if local == 0 else 1.2)  # the other ranks send their next barrier after node 0 read
idle1, i1 = (counters(), time.monotonic()) if local == 0 else (None, 0.0)
names = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LIONCUB_NODE", "LIONCUB_NNODES")
record = {"sent": sent, "env": {k: os.environ.get(k) for k in names}, "nic": nic,
          "delta": diff(first, last), "window_s": t1 - t0, "idle": diff(idle0, idle1), "idle_s": i1 - i0,
          "sockets": sockets}
print("RESULT " + json.dumps(record))
dist.barrier()
dist.destroy_process_group()
"""


def main(out: Path) -> int:
    from lioncub.launch import LaunchConfig, launch
    from lioncub.launch.preload import MODULES

    from processes import PY

    stdout, stderr = io.StringIO(), io.StringIO()
    config = LaunchConfig(  # torchrun's agents and ranks forked from one interpreter (as lioncub train's)
        [PY, "-c", NODE_STEPS], nnodes=M, nproc_per_node=L, link_rate_bps=1e9, timeout_s=120, preload=MODULES
    )
    result = launch(config, out=stdout, err=stderr)
    traffic = result.node_traffic
    doc = {
        "ok": result.ok,
        "launch_id": result.launch_id,
        "node_tx_bytes": None if traffic is None else [t.tx_bytes for t in traffic],
        "out": stdout.getvalue(),
        "err": stderr.getvalue(),
    }
    (out / "wire.json").write_text(json.dumps(doc))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

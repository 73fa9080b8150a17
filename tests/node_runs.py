"""The launches on emulated nodes of tests/test_fsdp_cli.py and tests/test_nodes.py, one after the other in
ONE interpreter (one zygote for every launch's agents and ranks), started in the background when collection
ends (tests/background.py); root only (network namespaces):

    python tests/node_runs.py OUT

1. ``OUT/fsdp``: tests/fsdp_runs.py's sharded run and its resume (:func:`fsdp_runs.main`; ``runs.json``
   holds each command's exit status and output);
2. ``OUT/two_nodes``: ``lioncub train`` of the tiny GPT on 2 nodes × 2 ranks, ``--topology auto``
   (:data:`TWO_NODES`); ``OUT/two_nodes.json`` its exit status, stdout and stderr;
3. ``OUT/wire.json``: 2 emulated nodes of 2 ranks behind 1 Gbit/s NICs run :data:`NODE_STEPS` (flat 1-bit
   LionCub) under ``lioncub.launch.launch``: ``ok``, ``launch_id``, each node's NIC ``tx_bytes`` as the
   launcher counted them, and the launch's stdout and stderr;
4. ``OUT/failed_rank``: :data:`FAILED_RANK` on 2 nodes of 2 ranks (tests/test_nodes.py), with fresh
   interpreters then forked from a zygote of their own (:func:`failed_rank_launches`): last, as their
   zygote replaces the one of the launches before.

The exit status is the number of parts that failed. One job instead of one per part: each interpreter of
its own costs ~2.5 s of CPU, and each zygote of its own (which a launch whose modules or environment differ
starts) ~3 s more.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import fsdp_runs

if TYPE_CHECKING:
    import background

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


#: ``lioncub train`` on 2 nodes of 2 ranks, the topology left to ``auto`` (tests/test_nodes.py)
TWO_NODES = ["train", "--workload", "gpt", "--size", "tiny", "--variant", "8bit", "--nnodes", "2",
             "--nproc-per-node", "2", "--link", "1gbit", "--steps", "2", "--eval-every", "0", "--no-progress",
             "--topology", "auto"]  # fmt: skip


def job() -> background.Subprocess | None:
    """The background job ``node_runs`` (tests/test_fsdp_cli.py, tests/test_nodes.py); None without the
    privileges to build network namespaces."""
    import background  # the tests' modules: not needed where this file runs the launches
    from emulated_network import netns_usable

    from processes import python_cmd

    if not netns_usable():
        return None
    return background.Subprocess(lambda workdir: python_cmd(__file__, str(workdir)), 600)


def two_nodes(out: Path) -> int:
    """:data:`TWO_NODES` into ``out/two_nodes`` (``lioncub.cli.main`` in this process): its exit status,
    stdout and stderr in ``out/two_nodes.json``."""
    from lioncub import cli

    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = cli.main([*TWO_NODES, "--out", str(out / "two_nodes")])
    doc = {"returncode": code, "out": printed.getvalue(), "err": errors.getvalue()}
    (out / "two_nodes.json").write_text(json.dumps(doc))
    return code


def wire(out: Path) -> int:
    """The launch of :data:`NODE_STEPS`: what tests/test_nodes.py's wire-bytes test reads in
    ``out/wire.json``."""
    from lioncub.launch import LaunchConfig, launch
    from lioncub.launch.preload import MODULES

    from processes import PY

    stdout, stderr = io.StringIO(), io.StringIO()
    # torchrun's agents and ranks forked from one interpreter that imported lioncub train's modules: the
    # zygote of the train runs before this launch
    preload = (*MODULES, "lioncub.train.loop")
    config = LaunchConfig(
        [PY, "-c", NODE_STEPS], nnodes=M, nproc_per_node=L, link_rate_bps=1e9, timeout_s=120, preload=preload
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


#: a rank of 4 that fails on node 1 while the others sleep (tests/test_nodes.py)
FAILED_RANK = "import os, sys, time\nif os.environ['RANK'] == '3':\n    sys.exit(3)\ntime.sleep(60)\n"
#: fresh interpreters; forks of a zygote that imported torchrun (which each agent runs: it imports torch once
#: for both agents, where a zygote of lighter modules left each agent to import it after the fork)
PRELOADS: list[tuple[str, ...]] = [(), ("torch.distributed.run",)]


def failed_rank_path(workdir: Path, preload: tuple[str, ...]) -> Path:
    """Where :func:`failed_rank_launches` put the launch of ``preload``."""
    return workdir / f"{'-'.join(preload) or 'fresh'}.pickle"


def failed_rank_launches(workdir: Path) -> None:
    """:data:`FAILED_RANK` on 2 nodes of 2 ranks, with each of :data:`PRELOADS`: ``workdir/<preload>.pickle``
    holds each launch's result and stderr."""
    from lioncub.launch import LaunchConfig, launch

    from processes import PY

    workdir.mkdir()
    for preload in PRELOADS:
        out, err = io.StringIO(), io.StringIO()
        config = LaunchConfig([PY, "-c", FAILED_RANK], nnodes=2, nproc_per_node=2, link_rate_bps=1e8,
                              timeout_s=90, preload=preload)  # fmt: skip
        result = launch(config, out=out, err=err)
        failed_rank_path(workdir, preload).write_bytes(pickle.dumps((result, err.getvalue())))


def main(out: Path) -> int:
    (out / "fsdp").mkdir()
    failed = fsdp_runs.main(out / "fsdp") != 0
    failed += two_nodes(out) != 0
    failed += wire(out)
    failed_rank_launches(out / "failed_rank")
    return failed


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

"""``lioncub launch [options] -- CMD ...``: run N ranks like torchrun, optionally behind shaped links, or M
emulated nodes of L ranks, each node started by a multi-node torchrun behind one shaped NIC."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from lioncub.cli.options import add_flag
from lioncub.launch import (
    EmulatedNetwork,
    LaunchConfig,
    NetnsError,
    build_command,
    cleanup,
    format_node_traffic,
    format_traffic,
    launch,
    node_commands,
    rank_env,
)
from lioncub.launch.launcher import DEFAULT_LINK_PORT
from lioncub.units import format_rate, parse_rate, parse_size

EPILOG = """\
examples:
  lioncub launch --nproc 4 -- train.py --steps 100          # loopback, no privileges needed
  lioncub launch --nproc 4 --link 1gbit -- -m lioncub.cli train --out runs/x  # a 1 Gbit/s link each (root)
  lioncub launch --nnodes 2 --nproc-per-node 2 --link 1gbit -- train.py   # 2 nodes × 2 ranks, one NIC each
  lioncub launch --cleanup                                  # remove leftovers of killed launches

A .py script or `-m module` runs with this Python interpreter. Rates: 100mbit, 2.5gbit, 1Gbps (bits/s).
With --nproc each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
GLOO_SOCKET_IFNAME, TORCHELASTIC_RESTART_COUNT and LIONCUB_{LAUNCH_ID,LINK_BPS,RESTART_COUNT}. With
--nnodes, torchrun (--rdzv-backend c10d, one agent per node) sets the ranks' variables, GROUP_RANK being
the node; LIONCUB_NODE and LIONCUB_NNODES name the emulated node, and --restarts is torchrun's
--max-restarts.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_flag(parser, "nproc", "launch", given_only=True)  # with --nnodes: refused when given
    add_flag(parser, "nnodes", "launch")
    add_flag(parser, "nproc_per_node", "launch", aliases=("--nproc_per_node",))
    add_flag(parser, "link", "launch", given_only=True)  # None: no shaping
    add_flag(parser, "intra_link", "launch")
    parser.add_argument("--mtu", type=int, default=1500, help="MTU of the emulated links (default 1500)")
    parser.add_argument(
        "--burst",
        metavar="SIZE",
        help="tbf bucket, e.g. 256kb (default: 2 ms at the rate, at least 16kb)",
    )
    add_flag(parser, "timeout", "launch")
    parser.add_argument(
        "--port",
        type=int,
        metavar="P",
        help=f"MASTER_PORT (default: a free port, {DEFAULT_LINK_PORT} under --link)",
    )
    add_flag(parser, "restarts", "launch")
    add_flag(parser, "collective_timeout", "launch", given_only=True)  # None: LIONCUB_PG_TIMEOUT unset
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="time between SIGTERM and SIGKILL when stopping ranks (default 5)",
    )
    parser.add_argument(
        "--preload",
        metavar="MODULES",
        help="fork every rank from one interpreter that imported MODULES once (comma-separated, e.g. "
        "torch,torch._dynamo) instead of starting a fresh one each: for `-m MODULE` under --nproc. Each "
        "rank draws its own random state, as a fresh interpreter does; on a machine with a GPU, or where the "
        "imports leave threads running, every rank starts fresh (with a note)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would run, start nothing")
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help="remove namespaces left by launches whose launcher died, then exit",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="with --cleanup: remove every lioncub namespace, even of running launches",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the program and its arguments")


def _config(args: argparse.Namespace) -> LaunchConfig:
    return LaunchConfig(
        cmd=list(args.cmd),
        nproc=1 if args.nproc is None else args.nproc,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        intra_link_rate_bps=parse_rate(args.intra_link, "--intra-link")
        if args.intra_link is not None
        else None,
        link_rate_bps=parse_rate(args.link) if args.link is not None else None,
        mtu=args.mtu,
        burst_bytes=parse_size(args.burst) if args.burst is not None else None,
        timeout_s=args.timeout or None,
        master_port=args.port,
        restarts=args.restarts,
        grace_s=args.grace,
        env=_collective_timeout_env(args.collective_timeout),
        preload=tuple(m.strip() for m in args.preload.split(",")) if args.preload else (),
    )


def _collective_timeout_env(seconds: float | None) -> dict[str, str]:
    if seconds is None:
        return {}
    if not (0 < seconds < float("inf")):
        raise ValueError(f"--collective-timeout {seconds!r} must be a finite number of seconds > 0")
    return {"LIONCUB_PG_TIMEOUT": f"{seconds:g}"}


def _dry_run_nodes(config: LaunchConfig) -> None:
    spec, intra = config.link_spec(), config.intra_link_spec()
    assert spec is not None and config.nnodes is not None
    net = EmulatedNetwork(config.nnodes, spec, nodes=True, intra_link=intra)
    inside = f"tbf rate {format_rate(intra.rate_bps)} on each node's lo" if intra else "lo unshaped"
    print(
        f"network {net.launch_id}: subnet {net.subnet}, bridge {net.bridge} in {net.bridge_netns}, "
        f"{config.nnodes} nodes × {config.nproc_per_node} ranks, tbf rate {format_rate(spec.rate_bps)} "
        f"burst {spec.burst} B on both ends of every node's veth, MTU {spec.mtu}; {inside}"
    )
    argvs, envs = node_commands(config, net, config.master_port or DEFAULT_LINK_PORT, None)
    for k, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
        changed = {name: v for name, v in env.items() if os.environ.get(name) != v}
        print(
            f"node {k}: "
            + " ".join(f"{name}={shlex.quote(v)}" for name, v in sorted(changed.items()))
            + " "
            + shlex.join(argv)
        )


def _dry_run(config: LaunchConfig) -> None:
    if config.nnodes is not None:
        _dry_run_nodes(config)
        return
    cmd = build_command(config.cmd)
    spec = config.link_spec()
    net = EmulatedNetwork(config.nproc, spec) if spec is not None else None
    if net is not None and spec is not None:
        print(
            f"network {net.launch_id}: subnet {net.subnet}, bridge {net.bridge} in {net.bridge_netns}, "
            f"tbf rate {format_rate(spec.rate_bps)} burst {spec.burst} B on both ends of every veth, "
            f"MTU {spec.mtu}"
        )
    for k in range(config.nproc):
        env = rank_env(
            k,
            config.nproc,
            master_addr=net.master_addr if net else "127.0.0.1",
            master_port=config.master_port or (DEFAULT_LINK_PORT if net else 0),
            ifname=net.ranks[k].ifname if net else "lo",
            launch_id=net.launch_id if net else "lcb?????",
            link_bps=config.link_rate_bps,
            max_restarts=config.restarts,
            extra=config.env,
        )
        changed = {name: v for name, v in env.items() if os.environ.get(name) != v}
        argv = (net.exec_prefix(k) if net else []) + cmd
        print(
            f"rank {k}: "
            + " ".join(f"{name}={shlex.quote(v)}" for name, v in sorted(changed.items()))
            + " "
            + shlex.join(argv)
        )


def _check_combinations(args: argparse.Namespace) -> None:
    """Options that only mean something together with another one."""
    if args.all and not args.cleanup:
        raise ValueError("--all: applies only with --cleanup (lioncub launch --cleanup --all)")
    if args.nnodes is not None and args.nproc is not None:
        raise ValueError(
            f"--nproc {args.nproc} with --nnodes {args.nnodes}: give either --nproc N (N ranks, each its own "
            "node) or --nnodes M --nproc-per-node L (M nodes of L ranks)"
        )
    if args.link is None:
        alone = [
            o for o, given in (("--burst", args.burst is not None), ("--mtu", args.mtu != 1500)) if given
        ]
        if alone:
            raise ValueError(
                f"{', '.join(alone)}: shape the emulated links and apply only with --link RATE "
                "(without --link the ranks run on loopback)"
            )


def run(args: argparse.Namespace) -> int:
    try:
        _check_combinations(args)
        if args.cleanup:
            report = cleanup(all_launches=args.all)
            for launch_id in report.launches:
                print(f"removed launch {launch_id}")
            if report.live:
                print(f"left running launches alone: {', '.join(report.live)} (--all removes them too)")
            if report.orphans:
                print(f"namespaces without a state file: {', '.join(report.orphans)} (--all removes them)")
            if not (report.launches or report.live or report.orphans):
                print("nothing to clean up")
            return 0
        config = _config(args)
        if args.dry_run:
            _dry_run(config)
            return 0
        result = launch(config)
    except (ValueError, NetnsError) as exc:
        print(f"lioncub launch: error: {exc}", file=sys.stderr)
        return 2
    # a failure, timeout or signal was noted as it happened (`[lioncub] rank 1 exited with code 3; stopping
    # ranks 0`): the last line gives the outcome without repeating it
    outcome = result.message if result.ok else f"exit code {result.returncode}"
    note = f"[lioncub] {outcome} after {result.wall_s:.1f} s"
    if result.restarts:
        note += f", {result.restarts} restart(s)"
    print(note, file=sys.stderr)
    if result.traffic:
        print(
            "[lioncub] bytes on each rank's interface during the run (L2, headers included):", file=sys.stderr
        )
        print(format_traffic(result.traffic), file=sys.stderr)
    if result.node_traffic:
        print(
            "[lioncub] bytes on each node's NIC and between its own ranks during the run (L2, headers "
            "included):",
            file=sys.stderr,
        )
        print(format_node_traffic(result.node_traffic), file=sys.stderr)
    return result.returncode

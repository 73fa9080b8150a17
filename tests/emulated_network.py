"""Helpers of the tests that build emulated networks (network namespaces and tc, ``lioncub.launch``): whether
this machine can build one, that a launch left nothing behind, and the TCP payload of interface counters.

Tests marked ``@pytest.mark.root`` are skipped, with what is missing as the reason, where
:func:`netns_missing` says so (``tests/conftest.py``).
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from lioncub.launch import check_privileges, netns

#: Ethernet (14) + IPv4 (20) + TCP with timestamps (32) bytes of header per frame
FRAME_HEADER_BYTES = 66


@functools.cache
def netns_missing() -> str | None:
    """Why this process cannot build an emulated network, or None if it can: what ``lioncub launch --link``
    checks (capabilities CAP_NET_ADMIN and CAP_SYS_ADMIN, as root has them, and the ``ip`` and ``tc``
    tools), and ``ip netns list`` working."""
    try:
        check_privileges()
        netns.list_netns()
    except netns.NetnsError as err:
        return str(err)
    return None


def netns_usable() -> bool:
    return netns_missing() is None


def assert_nothing_left(launch_id: str) -> None:
    """No namespace, interface, qdisc, state file or /etc/netns entry of launch ``launch_id`` remains."""
    assert not [ns for ns in netns.list_netns() if ns.startswith(launch_id)]
    for cmd in (["ip", "-o", "link", "show"], ["tc", "qdisc", "show"]):  # nothing ever in the root namespace
        assert launch_id not in subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert not (netns.state_dir() / f"{launch_id}.json").exists()
    assert not list(Path("/etc/netns").glob(f"{launch_id}*"))


def tcp_payload(frame_bytes: int, frames: int) -> int:
    """The TCP payload of ``frames`` frames of ``frame_bytes`` bytes in all: the bytes less the headers."""
    return frame_bytes - FRAME_HEADER_BYTES * frames

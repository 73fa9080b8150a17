"""What a launch is: :class:`LaunchConfig`, validated once, naming the option at fault."""

from __future__ import annotations

from dataclasses import dataclass, field

from lioncub._validate import is_int, is_number
from lioncub.launch.environment import build_command
from lioncub.launch.netns import MAX_NODES, MAX_RANKS, LinkSpec

__all__ = ["DEFAULT_TIMEOUT_S", "DEVICES", "LaunchConfig"]

#: where the ranks compute: ``auto`` (CUDA if available, else the CPU), ``cpu`` or ``cuda``
DEVICES = ("auto", "cpu", "cuda")
#: how long a job may run, restarts included, where no timeout is given: ``lioncub launch --timeout``'s
#: default and ``lioncub train`` / ``compare``'s (per run), the one value of both
DEFAULT_TIMEOUT_S = 7200.0


@dataclass
class LaunchConfig:
    """What to run and how: ``cmd`` on ``nproc`` ranks, each behind a ``link_rate_bps`` link if given; or on
    ``nnodes`` emulated nodes of ``nproc_per_node`` ranks (``nproc`` becomes their product), each node
    behind one ``link_rate_bps`` NIC, its ranks linked by its loopback (shaped to ``intra_link_rate_bps``
    if given)."""

    cmd: list[str]
    nproc: int = 1
    link_rate_bps: float | None = None  # None: plain loopback, no namespaces
    mtu: int = 1500
    burst_bytes: int | None = None  # tbf bucket; None: 2 ms at the rate, at least 16 KiB
    timeout_s: float | None = DEFAULT_TIMEOUT_S  # whole job, restarts included; None: unbounded
    master_port: int | None = None  # None: 29500 under a link, a free loopback port otherwise
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    grace_s: float = 5.0  # between SIGTERM and SIGKILL
    cwd: str | None = None
    nnodes: int | None = None  # None: one emulated node per rank (--nproc)
    nproc_per_node: int | None = None
    intra_link_rate_bps: float | None = None  # None: the node's loopback, unshaped
    #: modules an interpreter imports once before it forks each rank (:mod:`lioncub.launch.preload`; e.g.
    #: its ``MODULES``, torch); ``()``: each rank is a fresh interpreter. For ``-m MODULE`` and ``-c CODE``;
    #: under ``--nnodes`` torchrun's agents and their ranks are forked (:mod:`lioncub.launch.workers`)
    preload: tuple[str, ...] = ()
    #: with ``preload``, the device the ranks use (``auto``, ``cpu``, ``cuda``): on a machine with a GPU only
    #: ranks on the CPU are forked (:func:`lioncub.launch.preload.gpu_refusal`)
    preload_device: str = "auto"

    def __post_init__(self) -> None:
        if not is_int(self.nproc) or self.nproc < 1:
            raise ValueError(f"--nproc must be an integer >= 1, got {self.nproc!r}")
        if not is_int(self.restarts) or self.restarts < 0:
            raise ValueError(f"--restarts must be an integer >= 0, got {self.restarts!r}")
        if self.timeout_s is not None and not is_number(self.timeout_s, gt=0):
            raise ValueError(
                f"--timeout must be a finite number of seconds > 0 (0 on the command line: no limit), "
                f"got {self.timeout_s!r}"
            )
        if self.master_port is not None and not (is_int(self.master_port) and 1 <= self.master_port <= 65535):
            raise ValueError(f"--port must be an integer within 1..65535, got {self.master_port!r}")
        if not is_number(self.grace_s, ge=0):
            raise ValueError(f"--grace must be a finite number of seconds >= 0, got {self.grace_s!r}")
        if not (is_int(self.mtu) and 68 <= self.mtu <= 65535):
            raise ValueError(f"--mtu must be an integer within 68..65535, got {self.mtu!r}")
        self._check_nodes()
        if self.nnodes is None and self.link_rate_bps is not None and self.nproc > MAX_RANKS:
            raise ValueError(
                f"--nproc: an emulated network (--link) holds 1..{MAX_RANKS} ranks, got {self.nproc}"
            )
        argv = build_command(self.cmd)
        self.link_spec()  # validates rate, MTU and burst
        if not (isinstance(self.preload, tuple) and all(isinstance(m, str) and m for m in self.preload)):
            raise ValueError(f"--preload must be a tuple of module names, got {self.preload!r}")
        if self.preload_device not in DEVICES:
            raise ValueError(f"preload_device must be one of {list(DEVICES)}, got {self.preload_device!r}")
        if self.preload and argv[1:2] not in (["-m"], ["-c"]):
            raise ValueError(f"--preload forks ranks of `-m MODULE ...` or `-c CODE`; got cmd {self.cmd!r}")

    def _check_nodes(self) -> None:
        """Validate --nnodes / --nproc-per-node / --intra-link and set ``nproc`` to the world size."""
        m, ell = self.nnodes, self.nproc_per_node
        if m is None:
            if ell is not None:
                raise ValueError(
                    f"--nproc-per-node {ell}: applies only with --nnodes M (L ranks on each of M emulated "
                    "nodes); for N ranks, each with its own link, use --nproc N"
                )
            if self.intra_link_rate_bps is not None:
                raise ValueError("--intra-link: shapes the link inside a node and applies only with --nnodes")
            return
        if not (is_int(m) and 1 <= m <= MAX_NODES):
            raise ValueError(f"--nnodes must be an integer within 1..{MAX_NODES}, got {m!r}")
        if ell is None:
            raise ValueError(f"--nnodes {m}: needs --nproc-per-node L, the ranks on each node")
        if not (is_int(ell) and ell >= 1):
            raise ValueError(f"--nproc-per-node must be an integer >= 1, got {ell!r}")
        if self.nproc not in (1, m * ell):
            raise ValueError(
                f"--nproc {self.nproc} with --nnodes: the world size is --nnodes × --nproc-per-node = "
                f"{m * ell}; give either --nproc N (one node per rank) or --nnodes M --nproc-per-node L"
            )
        if self.link_rate_bps is None:
            raise ValueError(
                f"--nnodes {m}: emulates nodes behind shaped NICs and needs --link RATE (root); without a "
                "link, use --nproc N (ranks on loopback)"
            )
        intra = self.intra_link_rate_bps
        if intra is not None and not is_number(intra, gt=0):
            raise ValueError(
                f"--intra-link: the rate must be a positive, finite number of bits/s, got {intra!r}"
            )
        self.nproc = m * ell

    def link_spec(self) -> LinkSpec | None:
        """The shaping of each rank's link (with ``nnodes``: each node's NIC); None on loopback."""
        if self.link_rate_bps is None:
            return None
        return LinkSpec(self.link_rate_bps, mtu=self.mtu, burst_bytes=self.burst_bytes)

    def intra_link_spec(self) -> LinkSpec | None:
        """The shaping of each node's loopback (its MTU is lo's own; the bucket holds its 64 KiB frames)."""
        if self.intra_link_rate_bps is None:
            return None
        return LinkSpec(self.intra_link_rate_bps)

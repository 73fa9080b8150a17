"""The settings of a run that commands without torch take too (``lioncub launch``, ``cost``,
``calibrate``): declared here once, torch-free, and used by the run's configuration
(:class:`~lioncub.train.config.ClusterConfig`, :class:`~lioncub.train.config.OptimizerConfig`: each field
is :func:`field` of its name) and by those commands (:func:`lioncub.cli.options.add_flag`, which finds them
in :data:`SHARED` without importing the optimizer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lioncub.optim.config import INNER_MOMENTA
from lioncub.train.settings import Described, described, setting, whole_number

__all__ = ["SHARED", "Layout", "LocalOptions", "field"]


@dataclass
class Layout:
    """The ranks, nodes and links: ``train``, ``compare``, ``launch`` and ``calibrate`` start them,
    ``cost`` prices them (``--nnodes``)."""

    nproc: int = setting(
        1, low=1, metavar="N", commands=("train", "compare", "launch", "calibrate"),
        help="ranks, each its own node under --link (with --nnodes: nodes × ranks per node, not given)",
    )  # fmt: skip
    link: str = setting(
        "loopback", metavar="RATE", commands=("train", "compare", "launch", "calibrate"),
        help="shape every rank's link (with --nnodes each node's NIC), e.g. 1gbit (tbf in network "
        "namespaces: root; faithful up to about 2gbit on a 2-core machine)",
    )  # fmt: skip
    nnodes: int | None = setting(
        None, metavar="M", parse=whole_number(1),
        commands=("train", "compare", "launch", "cost", "calibrate"),
        help="instead of --nproc (cost: --workers): M nodes of --nproc-per-node ranks, each emulated behind "
        "one --link NIC and started by a multi-node torchrun (root; cost prices them); with "
        "--fault-tolerant every node a replica group",
    )  # fmt: skip
    intra_link: str | None = setting(
        None, metavar="RATE", default_text="unshaped", commands=("train", "compare", "launch", "calibrate"),
        help="with --nnodes: shape each node's loopback, which its ranks share",
    )  # fmt: skip


@dataclass
class LocalOptions:
    """Local steps as ``train`` runs them and ``cost`` prices them."""

    local_steps: int | None = setting(
        None, commands=("train", "cost"), owner="LocalSteps", knob="h", metavar="H", parse=whole_number(1),
        help="H local Lion steps per rank, then one outer step (docs/local-steps.md; cost: the times and "
        "bytes per inner step)",
    )  # fmt: skip
    inner_momentum: str = setting(
        INNER_MOMENTA[0], owner="LocalSteps", choices=INNER_MOMENTA, local=True,
        commands=("train", "compare", "cost"),
        help="with local steps: each rank's inner momentum at an outer step (average: an fp32 allreduce of "
        "the inner momenta at each outer step, which cost prices)",
    )  # fmt: skip


#: the shared settings by name (their part: the configuration's part they belong to)
SHARED: dict[str, Described] = described({"cluster": Layout, "optimizer": LocalOptions})

_FIELDS = {f.name: f for cls in (Layout, LocalOptions) for f in dataclasses.fields(cls)}


def field(name: str) -> Any:
    """A configuration's field for the shared setting ``name``: its default and its description, the
    same ``Setting``."""
    f = _FIELDS[name]
    return dataclasses.field(default=f.default, metadata=f.metadata)

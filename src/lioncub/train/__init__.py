"""Training with lioncub: the workloads (a nanoGPT-style char-level GPT and a small ResNet, with offline
data), the training loop of a rank and the driver of a run.

* :mod:`lioncub.train.workloads` -- :func:`make_workload` (the interface a training loop uses);
* :mod:`lioncub.train.gpt`, :mod:`lioncub.train.cnn` -- the models, their param groups and I/O layers;
* :mod:`lioncub.train.data` -- corpora, image sets and step-indexed per-rank samplers;
* :mod:`lioncub.train.fetch` -- preparing the offline data sets (standard library only);
* :mod:`lioncub.train.config` -- :class:`~lioncub.train.config.TrainConfig` (what a run is) and the lr
  schedule;
* :mod:`lioncub.train.loop` -- the training loop of one rank;
* :mod:`lioncub.train.rank` -- a training rank's one entry point (``python -m lioncub.train.rank``, and
  ``lioncub train`` under torchrun): join the job, train, one line when interrupted;
* :mod:`lioncub.train.checkpoint` -- per-rank checkpoints, resume checks, momentum conversion;
* :mod:`lioncub.train.runfiles` -- the files of a run directory that :mod:`lioncub.rundir` (what is
  lioncub's in a directory, what it may delete, one writer at a time) needs by name, registered with it;
* :mod:`lioncub.train.prepare` -- a run directory made ready for a run or a resume, and what a run's end
  leaves; :mod:`lioncub.train.runlog` -- ``log.jsonl``, cut back to its last whole record on resume;
* :mod:`lioncub.train.nodebytes` -- a step's bytes through a node's NIC and inside it (emulated nodes);
* :mod:`lioncub.train.driver` -- a run's checks and the launch of its ranks (what ``lioncub train`` and
  ``lioncub compare`` run), with :mod:`lioncub.train.progress`, its progress display.

The ``lioncub compare`` table and plots are :mod:`lioncub.report.runs` (no torch). The names below are
imported lazily, so that :mod:`lioncub.train.runfiles` (and ``lioncub report``, which needs it) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lioncub.train import runfiles  # noqa: F401  (registers the run directory's files with lioncub.rundir)

if TYPE_CHECKING:  # the lazy names below, for type checkers (tests/test_typing.py: the two lists agree)
    from lioncub.train.workloads import SIZES as SIZES
    from lioncub.train.workloads import CNNWorkload as CNNWorkload
    from lioncub.train.workloads import GPTWorkload as GPTWorkload
    from lioncub.train.workloads import Workload as Workload
    from lioncub.train.workloads import make_workload as make_workload
    from lioncub.train.workloads import workload_names as workload_names

_EXPORTS = ("SIZES", "CNNWorkload", "GPTWorkload", "Workload", "make_workload", "workload_names")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lioncub.train' has no attribute {name!r}")
    return getattr(importlib.import_module("lioncub.train.workloads"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

"""Training workloads for lioncub: a nanoGPT-style char-level GPT and a small ResNet, with offline data.

* :mod:`lioncub.train.workloads` -- :func:`make_workload` (the interface a training loop uses);
* :mod:`lioncub.train.gpt`, :mod:`lioncub.train.cnn` -- the models, their param groups and I/O layers;
* :mod:`lioncub.train.data` -- corpora, image sets and step-indexed per-rank samplers;
* :mod:`lioncub.train.loop` -- the training loop of one rank (``lioncub train`` launches it);
* :mod:`lioncub.train.checkpoint` -- per-rank checkpoints, resume checks, momentum conversion;
* :mod:`lioncub.report.runs` -- the ``lioncub compare`` table and plots (no torch).
"""

from lioncub.train.workloads import SIZES, CNNWorkload, GPTWorkload, Workload, make_workload, workload_names

__all__ = ["SIZES", "CNNWorkload", "GPTWorkload", "Workload", "make_workload", "workload_names"]

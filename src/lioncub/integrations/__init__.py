"""LionCub inside the training frameworks people use: a layer above :mod:`lioncub.optim`.

* :mod:`lioncub.integrations.hf` — :class:`~lioncub.integrations.hf.LionCubTrainer`, a
  ``transformers.Trainer`` that trains with LionCub, and
  :class:`~lioncub.integrations.hf.LionCubCallback` for your own Trainer subclass
  (the ``hf`` extra, docs/install.md);
* :mod:`lioncub.integrations.accelerate` — :func:`~lioncub.integrations.accelerate.prepare`, one call
  after ``accelerator.prepare(...)`` (the ``hf`` extra, docs/install.md);
* :mod:`lioncub.integrations.lightning` — :class:`~lioncub.integrations.lightning.LionCubStrategy`, a
  Lightning ``DDPStrategy`` (the ``lightning`` extra, docs/install.md);
* :mod:`lioncub.integrations.torchft` — :class:`~lioncub.integrations.torchft.ReplicaGroup`: votes
  between replica groups that leave and join, on torchft's lighthouse (the ``ft`` extra, docs/install.md).

Each does the same three things the framework cannot know it has to: it keeps DDP's gradient allreduce
from running (each rank's ``.grad`` stays its local gradient; the ranks vote instead) or overlaps the
vote with the backward pass, it puts every rank's momenta into the checkpoint the framework writes from
rank 0 (``LionCub.consolidate_state_dict``) so that its own resume restores each rank's own, and it
reports LionCub's bytes per step. Importing this package imports no framework; each module raises an
``ImportError`` naming the extra to install when its framework is missing.
"""

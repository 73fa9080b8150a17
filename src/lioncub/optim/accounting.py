"""What :meth:`lioncub.optim.LionCub.comm_stats` reports: bytes, collectives and phase times of the last
step and since construction, split by level for votes laid over nodes, and the skipped steps."""

from __future__ import annotations

from collections.abc import Sequence

from lioncub.collectives import Comm, CommCounter
from lioncub.optim.engine import StepTimes

__all__ = ["Accounting"]


class Accounting:
    """The step accounting of one optimizer.

    Args:
        comm: the optimizer's group (the step check, the flat votes, momentum sync, ...).
        levels: the (intra-node, inter-node) groups of a vote laid over nodes (``()`` for a flat vote):
            their bytes are added to the step's and also reported apart.
    """

    def __init__(self, comm: Comm, levels: Sequence[Comm] = ()) -> None:
        self.comm = comm
        self.levels = tuple(levels)
        self._marks = [c.counter.snapshot() for c in self.levels]
        self._level_last = [CommCounter() for _ in self.levels]
        self._level_total = [CommCounter() for _ in self.levels]
        self._last = (CommCounter(), StepTimes())
        self._total = (CommCounter(), StepTimes())
        self._skipped = (0, 0)  # (last step, total): steps skipped for non-finite gradients
        self._steps = 0  # steps booked since construction (not the step counter a state dict restores)
        self._continues = False  # the next booking is the second part of the last step

    def continue_step(self) -> None:
        """The next :meth:`finish_step` books the second part of the step just booked (local steps: the
        outer step after the inner one): ``"last"`` then holds both parts, the totals count each once."""
        self._continues = True

    def snapshot(self) -> CommCounter:
        """The optimizer group's counter now (pass it to :meth:`finish_step` at the step's end)."""
        return self.comm.counter.snapshot()

    def finish_step(
        self,
        before: CommCounter,
        times: StepTimes,
        *,
        skipped: bool,
        overlapped: tuple[float, float, int] = (0.0, 0.0, 0),
    ) -> None:
        """Book one step: the optimizer group's traffic since ``before``, the node levels' since the last
        step, the ``overlapped`` (bytes sent, received, collectives) posted on the overlap hook's group,
        the phase ``times``, and whether it was ``skipped``. On a GPU the phase times are CUDA event pairs,
        read when :meth:`stats` is called (the step's own work is not waited for here)."""
        delta = self.comm.counter.minus(before)
        for i, comm in enumerate(self.levels):
            level = comm.counter.minus(self._marks[i])
            self._marks[i] = comm.counter.snapshot()
            self._level_total[i].add(level.bytes_sent, level.bytes_recv, level.collectives)
            delta.add(level.bytes_sent, level.bytes_recv, level.collectives)
            if self._continues:
                prev = self._level_last[i]
                level.add(prev.bytes_sent, prev.bytes_recv, prev.collectives)
            self._level_last[i] = level
        delta.add(*overlapped)
        total_c, total_t = self._total
        total_c.add(delta.bytes_sent, delta.bytes_recv, delta.collectives)
        total_t.settle(wait=False)  # the earlier steps' GPU phases that have finished (never waits)
        total_t.add(times)
        if self._continues:
            last_c, last_t = self._last
            delta.add(last_c.bytes_sent, last_c.bytes_recv, last_c.collectives)
            times = times.copy()
            times.add(last_t)
        self._last = (delta, times)
        self.count_skip(skipped)

    def count_skip(self, skipped: bool) -> None:
        """Book whether the last step was skipped (one process books only this; the second part of a step
        adds to its first)."""
        last = int(skipped) | (self._skipped[0] if self._continues else 0)
        self._skipped = (last, self._skipped[1] + int(skipped))
        self._steps += 0 if self._continues else 1
        self._continues = False

    def stats(self) -> dict[str, dict[str, float | int]]:
        """See :meth:`lioncub.optim.LionCub.comm_stats`: ``"total"`` holds the bytes, times and ``steps``
        booked since construction, so that bytes / steps is a rate also after a resume (which restores the
        optimizer's step counter, not these totals)."""
        out: dict[str, dict[str, float | int]] = {}
        for name, (counter, times) in (("last", self._last), ("total", self._total)):
            out[name] = {
                "bytes_sent": counter.bytes_sent,
                "bytes_recv": counter.bytes_recv,
                "collectives": counter.collectives,
                **times.as_dict(),
            }
        for i, level in enumerate(("intra_node", "inter_node")[: len(self.levels)]):
            for name, counter in (("last", self._level_last[i]), ("total", self._level_total[i])):
                out[name][f"{level}_bytes_sent"] = counter.bytes_sent
                out[name][f"{level}_bytes_recv"] = counter.bytes_recv
        out["last"]["skipped_steps"], out["total"]["skipped_steps"] = self._skipped
        out["total"]["steps"] = self._steps
        return out

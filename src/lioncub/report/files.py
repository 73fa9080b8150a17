"""The files of the directories the reports write, as :mod:`lioncub.rundir` needs them by name, registered
with it when this module is imported (by :mod:`lioncub.report`): a comparison's (``lioncub compare
--out``) and the plots' (``lioncub report --out``)."""

from __future__ import annotations

from lioncub.rundir import adopt_run_subdirs, register_legacy

__all__ = ["COMPARE_FILES"]

#: the files of ``lioncub compare``'s report as lioncub wrote them before the record
#: (:func:`lioncub.report.runs.make_report`), adopted by exact name
COMPARE_FILES = (
    "summary.md",
    "summary.json",
    "val_loss_vs_step.png",
    "val_loss_vs_time.png",
    "step_time_split.png",
    "bytes_per_step.png",
    "diagnostics_vs_step.png",
)

# a compare directory of lioncub before the record: its report's files and its marked run directories; a
# plots directory then: nothing (its PNGs are the user's until lioncub writes them again)
register_legacy("compare", COMPARE_FILES, extend=adopt_run_subdirs)
register_legacy("plots")

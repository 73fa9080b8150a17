"""Reports of what ran or would run: training runs side by side (:mod:`~lioncub.report.runs`), a run's
vote diagnostics (:mod:`~lioncub.report.diagnostics`) and the cost model's predictions
(:mod:`~lioncub.report.cost`); the files of the directories they write (:mod:`~lioncub.report.files`,
registered with :mod:`lioncub.rundir` on import). No torch is imported here."""

from lioncub.report import files  # noqa: F401  (registers the compare and plots directories' files)

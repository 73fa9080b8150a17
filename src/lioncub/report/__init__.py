"""Reports of what ran or would run: training runs side by side (:mod:`~lioncub.report.runs`), one run's
summary (:mod:`~lioncub.report.summary`) and vote diagnostics (:mod:`~lioncub.report.diagnostics`), the cost
model's predictions (:mod:`~lioncub.report.cost`), all printed to fit the terminal
(:mod:`~lioncub.report.text`); the files of the directories they write (:mod:`~lioncub.report.files`,
registered with :mod:`lioncub.rundir` on import). No torch is imported here."""

from lioncub.report import files  # noqa: F401  (registers the compare and plots directories' files)

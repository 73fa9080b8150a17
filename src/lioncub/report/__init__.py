"""Reports of what ran or would run: training runs side by side (:mod:`~lioncub.report.runs`), a run's
vote diagnostics (:mod:`~lioncub.report.diagnostics`) and the cost model's predictions
(:mod:`~lioncub.report.cost`)."""

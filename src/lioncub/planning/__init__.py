"""Which variant wins where: the α–β cost model (:mod:`~lioncub.planning.costmodel`, torch-free: the
machine in :mod:`~lioncub.planning.machine`, one level of links in :mod:`~lioncub.planning.flat`, nodes of
several ranks in :mod:`~lioncub.planning.nodes`, questions over variants in
:mod:`~lioncub.planning.queries`, the calibration file in :mod:`~lioncub.planning.calibration`), its
calibration on a real job (:mod:`~lioncub.planning.measure`, fits in :mod:`~lioncub.planning.fit`) and
``variant="auto"`` (:mod:`~lioncub.planning.auto`)."""

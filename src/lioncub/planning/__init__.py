"""Which scheme wins where: the α–β cost model (:mod:`~lioncub.planning.costmodel`, torch-free), its
calibration on a real job (:mod:`~lioncub.planning.calibrate`) and ``variant="auto"``
(:mod:`~lioncub.planning.auto`)."""

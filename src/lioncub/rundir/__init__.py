"""Run directories: which paths are lioncub's, how it opens and writes them, and what it may delete (the
standard library only, so that ``lioncub report`` imports no torch).

lioncub writes into **run directories** (``lioncub train --out``, ``lioncub compare``'s ``OUT/<variant>``),
**compare directories** (``lioncub compare --out``) and **plots directories** (``lioncub report --out``).
Ownership is lioncub's own record, never a guess from names: the marker :data:`MARKER` names the kind and
lists every path lioncub wrote there (:class:`Record`), each file with the SHA-256 of its content where
lioncub writes it whole. A path enters the record *before* it is created (:func:`record`); a recorded path
that is now a link, another kind of entry or other content is the user's, as is everything unrecorded
(:func:`survey`), and a run's record counts for nothing once its ``config.json`` is gone (``rm -r RUN/*``
leaves the dotfiles). A marker of lioncub before the record (no list) is read as listing what that lioncub
always wrote, by exact name, as the package that writes that kind of directory registered it
(:func:`register_legacy`; docs/errors.md lists the names); :func:`claim` stores that list.

:func:`remove_owned` deletes only recorded paths, nothing while anything else is there, ``config.json`` last
and the marker at the very end (an interrupted removal can be run again), never through a link. Every run
file is opened through :func:`open_run_file`: never through a link, and a FIFO, a socket or a device is
refused naming the path (:class:`SpecialFileError`) instead of being opened, so nothing put into a run
directory can make lioncub wait. :func:`write_atomically` writes beside the name and renames into place;
:func:`check_out_path` refuses what can never be an output directory; one writer at a time:
:func:`lock_writer`.

Modules, each importing only those above it:

* :mod:`~lioncub.rundir.files` -- opening run files without blocking, atomic writes, appends;
* :mod:`~lioncub.rundir.marker` -- the record's format (:class:`Record`), the marker and lock file names;
* :mod:`~lioncub.rundir.legacy` -- markers written before the record, as their owners registered them;
* :mod:`~lioncub.rundir.record` -- reading and growing a record, marking a directory, recorded writes;
* :mod:`~lioncub.rundir.survey` -- what a directory holds: lioncub's and the user's;
* :mod:`~lioncub.rundir.removal` -- deleting what lioncub wrote, and nothing else;
* :mod:`~lioncub.rundir.locking` -- one writer per directory (advisory locks);
* :mod:`~lioncub.rundir.outpath` -- what can never be an output directory.

The files of each kind of directory belong to the package that writes them: a training run's to
:mod:`lioncub.train.runfiles`, a comparison's and the plots' to :mod:`lioncub.report.files`.
"""

from lioncub.rundir.files import (
    SpecialFileError,
    fsync_dir,
    open_append,
    open_run_file,
    read_run_file,
    refuse_special,
    regular_file,
    write_atomically,
)
from lioncub.rundir.legacy import adopt_run_subdirs, register_legacy
from lioncub.rundir.locking import DirLock, hold_ranks, holder, lock_writer
from lioncub.rundir.marker import KINDS, LOCK, MARKER, OWN_FILES, RANKS_LOCK, Record, is_marked
from lioncub.rundir.outpath import check_out_path
from lioncub.rundir.record import claim, read_record, record, write_owned, write_record
from lioncub.rundir.removal import remove_owned
from lioncub.rundir.survey import Survey, foreign_entries, survey

__all__ = [
    "KINDS",
    "LOCK",
    "MARKER",
    "OWN_FILES",
    "RANKS_LOCK",
    "DirLock",
    "Record",
    "SpecialFileError",
    "Survey",
    "adopt_run_subdirs",
    "check_out_path",
    "claim",
    "foreign_entries",
    "fsync_dir",
    "hold_ranks",
    "holder",
    "is_marked",
    "lock_writer",
    "open_append",
    "open_run_file",
    "read_record",
    "read_run_file",
    "record",
    "refuse_special",
    "register_legacy",
    "regular_file",
    "remove_owned",
    "survey",
    "write_atomically",
    "write_owned",
    "write_record",
]

"""Suite-wide setup.

* The hypothesis profile (``tests/profiles.py``): ``ci`` when ``$CI`` is set (today's example counts),
  else the smaller ``dev``.
* Background jobs (``tests/background.py``): long, self-contained parts of tests marked
  ``@pytest.mark.background(KEY)`` start one at a time once collection ends, on the core that the mostly
  single-threaded tests leave idle.
* The ranks of ``dist_utils.run_workers`` run in a session-wide pool of worker processes
  (``tests/dist_utils.py``).

The quick local loop: ``./run test -m "not slow"``; everything: ``./run test``.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

import background
from profiles import selected_profile

settings.load_profile(selected_profile())


def pytest_report_header() -> str:
    return f"hypothesis profile: {selected_profile()} (ci when $CI is set, else dev: tests/profiles.py)"


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        background.start_for(session.items)


def pytest_runtest_logfinish() -> None:
    background.pump()


def pytest_sessionfinish() -> None:
    background.stop_all()

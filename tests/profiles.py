"""Hypothesis profiles of the test suite (registered and loaded by ``tests/conftest.py``).

* ``ci`` (selected when the environment variable ``CI`` is set, as CI runs): every property test runs
  the number of examples written next to it, ``@settings(max_examples=examples(300))`` -> 300.
* ``dev`` (the default elsewhere): a quarter of them (at least 10, or all if fewer), for a quick local loop.

``HYPOTHESIS_PROFILE=ci`` (or ``pytest --hypothesis-profile ci``) picks a profile explicitly.
"""

from __future__ import annotations

import os

from hypothesis import settings

#: examples of a profile, in percent of the counts written in the tests
SCALE = {"ci": 100, "dev": 25}

# max_examples=100 is hypothesis's own default (the tests that give no count); the rest is hypothesis's
settings.register_profile("ci", max_examples=100)
settings.register_profile("dev", max_examples=100 * SCALE["dev"] // SCALE["ci"])


def selected_profile() -> str:
    return os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")


def examples(count: int) -> int:
    """``count`` examples scaled to the loaded profile: ``count`` under ``ci``, fewer under ``dev``."""
    percent = settings().max_examples  # the loaded profile's, relative to ci's 100
    return max(min(count, 10), count * percent // 100)

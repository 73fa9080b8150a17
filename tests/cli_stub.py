"""``lioncub ARGV`` in-process with launching refused: every case must be decided at validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lioncub import cli


class Launched(Exception):
    """A CLI case reached the launcher: it was not refused at validation."""


def cli_runner(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[[list[str]], tuple[int, str]]:
    """A function ``ARGV -> (exit code, stderr)`` running ``lioncub ARGV`` in this process; a command
    that reaches the launcher returns -1 instead of launching anything."""
    import lioncub.cli.launch
    import lioncub.launch
    import lioncub.launch.launcher

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise Launched("validation let the command through to the launcher")

    for module in (lioncub.launch, lioncub.cli.launch, lioncub.launch.launcher):
        monkeypatch.setattr(module, "launch", refuse)
    for name in ("RANK", "WORLD_SIZE", "LIONCUB_CALIBRATION"):
        monkeypatch.delenv(name, raising=False)

    def run(argv: list[str]) -> tuple[int, str]:
        capsys.readouterr()
        try:
            rc = cli.main(argv)
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 2
        except Launched:
            rc = -1
        return rc, capsys.readouterr().err

    return run

"""Flags said once: the optimizer's errors carry the option in parts (:class:`lioncub._validate.OptionError`)
and the command line writes it with the setting's flag; every flag that several commands take has one
declaration."""

from __future__ import annotations

import pickle

import pytest

from lioncub._validate import NO_VALUE, Named, OptionError
from lioncub.optim import LocalSteps
from lioncub.optim.arguments import check_local_steps
from lioncub.optim.config import PRESETS
from lioncub.train.config import SETTINGS, TrainConfig
from lioncub.train.settings import flag_message


def _error(make) -> OptionError:
    with pytest.raises(OptionError) as info:
        make()
    return info.value


def test_an_option_error_keeps_the_python_wording_and_its_parts() -> None:
    exc = _error(lambda: LocalSteps(4, outer_lr=0))
    assert str(exc) == "LocalSteps: outer_lr=0 must be a finite number > 0"
    assert (exc.owner, exc.option, exc.value, exc.problem) == (
        "LocalSteps",
        "outer_lr",
        0,
        "must be a finite number > 0",
    )
    assert isinstance(exc, ValueError)
    again = pickle.loads(pickle.dumps(exc))  # a rank's error crosses processes
    assert type(again) is OptionError and str(again) == str(exc) and again.option == "outer_lr"


def test_the_command_line_writes_each_option_by_its_flag() -> None:
    assert flag_message(_error(lambda: LocalSteps(0)), SETTINGS) == (
        "--local-steps 0 must be an int >= 1 (inner steps per outer step)"  # LocalSteps' knob h
    )
    exc = _error(lambda: check_local_steps(4, PRESETS["1bit"], "1bit", "none", 2))
    assert flag_message(exc, SETTINGS) == (
        "--diagnostics-every 2 with --local-steps 4: the ranks vote every 4 steps and the vote diagnostics "
        "describe a vote every step; drop --diagnostics-every (or --local-steps, for the per-step vote)"
    )
    with pytest.raises(ValueError, match=r"^--outer-lr 0\.0 must be a finite number > 0$"):
        TrainConfig.from_values({"local_steps": 4, "outer_lr": 0.0, "eval_every": 40})


def test_an_option_without_a_flag_keeps_the_python_wording() -> None:
    exc = _error(lambda: LocalSteps(4, outer_weight_decay=-1))
    assert (
        flag_message(exc, SETTINGS) == str(exc) == "LocalSteps: outer_weight_decay=-1 must be a number >= 0"
    )
    named = OptionError(
        "LionCub",
        "bucket_mb",
        0,
        "with {other} and {bare}",
        other=Named("Foo", "knob", 1),
        bare=Named("LionCub", "local_steps"),
    )
    assert flag_message(named, SETTINGS) == "--bucket-mb 0 with knob=1 and --local-steps"
    assert str(named) == "bucket_mb=0 with knob=1 and local_steps"


def test_no_message_text_is_parsed() -> None:
    """A problem that reads like ``name=value`` stays as written: only the parts are flags."""
    exc = OptionError("LocalSteps", "outer", "dsm", "unlike outer_lr=2 or h=3", prefix="LocalSteps: ")
    assert flag_message(exc, SETTINGS) == "--outer dsm unlike outer_lr=2 or h=3"
    alone = OptionError("LionCub", "diagnostics_every", NO_VALUE, "off", sep=": ")
    assert (str(alone), flag_message(alone, SETTINGS)) == (
        "diagnostics_every: off",
        "--diagnostics-every: off",
    )

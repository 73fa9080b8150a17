"""Flags said once: the optimizer's errors carry the option in parts (:class:`lioncub._validate.OptionError`)
and the command line writes it with the setting's flag; every flag that several commands take has one
declaration."""

from __future__ import annotations

import argparse
import importlib
import pickle

import pytest

from lioncub._validate import NO_VALUE, Named, OptionError
from lioncub.optim import LocalSteps
from lioncub.optim.arguments import check_local_steps
from lioncub.optim.config import PRESETS
from lioncub.train.config import SETTINGS, TrainConfig
from lioncub.train.settings import flag_message
from lioncub.train.shared import SHARED


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


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, as ``lioncub COMMAND`` builds it."""
    from lioncub.cli import COMMANDS

    out = {}
    for command, (module, _) in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"lioncub {command}")
        importlib.import_module(module).add_arguments(parser)
        out[command] = parser
    return out


def test_a_flag_of_several_commands_is_declared_once() -> None:
    """A flag that two commands take is one description (``cli.options.LAUNCH`` or ``SETTINGS``, added by
    ``add_flag``): the same type, choices, metavar and help everywhere, and one default besides None (a
    command that tells a flag given from one left out); or its reason is in ``options.DISTINCT``."""
    from lioncub.cli.options import DISTINCT, LAUNCH, _help

    described = {d.flag: d for d in [*SETTINGS.values(), *SHARED.values(), *LAUNCH.values()]}
    by_flag: dict[str, dict[str, argparse.Action]] = {}
    for command, parser in _parsers().items():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--version"):
                    by_flag.setdefault(flag, {})[command] = action
    shared = {flag: actions for flag, actions in by_flag.items() if len(actions) > 1}
    assert sorted(set(DISTINCT) - set(shared)) == []  # no reason left for a flag no longer shared
    for flag, actions in shared.items():
        if flag in DISTINCT:
            continue
        assert flag in described, f"{flag} ({sorted(actions)}) is written by hand: declare it once, add_flag"
        d = described[flag]
        for command, action in actions.items():
            assert command in d.setting.commands, (flag, command)
            assert action.help == _help(d), (flag, command)
        kinds = {(type(a), a.type, tuple(a.choices or ()), a.metavar, a.dest) for a in actions.values()}
        assert len(kinds) == 1, (flag, kinds)
        defaults = {repr(a.default) for a in actions.values() if a.default is not None}
        assert len(defaults) <= 1, (flag, defaults)
    # the two: one --nproc-per-node, one --timeout (the job's, calibrate's too)
    assert {"launch", "cost", "calibrate", "train", "compare"} <= set(shared["--nproc-per-node"])
    assert {a.default for a in shared["--timeout"].values()} == {LAUNCH["timeout"].default}


def test_how_a_run_starts_is_checked_beside_the_configuration() -> None:
    """``check_start`` and ``check_auto`` (train/config.py), not the command line's own code: a Python
    caller gets the same refusals, naming the flags."""
    from lioncub.train.config import check_auto, check_start

    ft = TrainConfig.from_values({"fault_tolerant": True, "variant": "1bit", "nproc": 2})
    check_start(ft, resume=True, inside_job=False)  # a fault-tolerant run resumes from its checkpoints
    with pytest.raises(ValueError, match=r"^--fault-tolerant inside a job "):
        check_start(ft, resume=False, inside_job=True)
    check_start(ft.replace(fault_tolerant=False), resume=True, inside_job=True)
    with pytest.raises(ValueError, match=r"^--variant auto with --outer dsm: .* --outer dsm$"):
        check_auto({"outer": "dsm"}, resume=False, inside_job=False)
    with pytest.raises(ValueError, match=r"^--variant auto with --local-steps 4: auto chooses H"):
        check_auto({"local_steps": 4, "outer": None}, resume=False, inside_job=False)
    check_auto({"outer": None, "local_steps": None}, resume=False, inside_job=False)

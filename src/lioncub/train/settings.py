"""One description per setting of a training run (:class:`Setting`), declared on the fields of
:class:`~lioncub.train.config.TrainConfig`'s parts with :func:`setting`.

A setting's name, type and default are its field's; its description adds the help, the allowed values
(the owner's collection -- ``PRESETS``, ``OUTER_RULES``, ``INNER_MOMENTA``, ... -- never a copy), the range,
the flag and the commands that take it, the ``config.json`` version from which it exists and what a
document without it means. From these follow the flags of ``lioncub train`` and ``lioncub compare``
(:mod:`lioncub.cli.options`), the JSON on disk (:func:`nest`, :func:`flat_document`) and the check of each
value (:func:`check_value`). A setting the optimizer owns (``owner``: ``VoteConfig``, ``LocalSteps``, ...) is
checked by building the optimizer's own object instead (:func:`lioncub.train.parts.optimizer_parts`),
whose :class:`~lioncub._validate.OptionError` names the option in parts (its owner, name, value and
problem); :func:`flag_message` writes it with the settings' flags, looking the option up here by its
owner and ``knob`` or its name -- never by reading the text.

``config.json`` is versioned (:data:`CONFIG_VERSION`): version 1 is the flat object of every lioncub
before the parts (a key per setting, those unset left out), version 2 the nested one, version 3 adds
``outer_betas`` (the sign rules' default changed with it). A new setting takes
the next version as its ``since``; a document of an older version lacks it and means its ``absent``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from lioncub._validate import NO_VALUE, Named, OptionError, is_int, is_number
from lioncub.names import CONFIG_VERSION_KEY, config_entries, config_version

__all__ = [
    "CONFIG_VERSION",
    "Described",
    "Setting",
    "check_value",
    "described",
    "flag_message",
    "flat_document",
    "nest",
    "setting",
    "spell",
    "whole_number",
]

#: the version of the ``config.json`` lioncub writes: 1 flat (every run before the parts), 2 nested, 3 with
#: ``outer_betas``
CONFIG_VERSION = 3


def whole_number(minimum: int) -> Callable[[str], int]:
    """A flag's conversion (a setting's ``parse``, an argparse ``type``): a whole number >= ``minimum``."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {value}")
        return value

    return convert


@dataclass(frozen=True)
class Setting:
    """What a field of a run's configuration is, besides its name, type and default (:func:`setting`).

    Args:
        help: what it does, for ``--help`` and the reader of the code (its default is added to the help).
        flag: the option that sets it; ``None``: ``--`` and its name with ``-`` (``--eval-every``).
        commands: the subcommands that take the flag (``()``: none, e.g. what a pilot measured).
        metavar: the flag's value in the usage.
        choices: the allowed values: the owner's collection itself (a tuple, a dict's keys).
        low, high: its range (numbers); ``above``: ``low`` excluded; ``unit``: in the messages
            (``"seconds"``); ``high_text``: ``high`` in the messages.
        default_text: the default in the help when it is a rule, not a value.
        parse: the flag's conversion of its text (default: the field's type).
        owner: the optimizer's object that checks it (``"VoteConfig"``, ``"LocalSteps"``, ...); ``knob``:
            its name there where it differs (``LocalSteps(h=...)``).
        dense_why: refused on the DDP baselines (``32bit``, ``16bit``), which do not use LionCub: why.
        per_step: only for a vote every step (a LionCub variant without local steps).
        local: only with local steps.
        ft_only: only with ``--fault-tolerant``; ``ft_why``: refused with it: why.
        since: the ``config.json`` version from which it exists.
        absent: what a document without it means (a function of the document's settings, flat); None:
            its default.
    """

    help: str
    flag: str | None = None
    commands: tuple[str, ...] = ("train", "compare")
    metavar: str | None = None
    choices: Collection[str] | None = None
    low: float | None = None
    above: bool = False
    high: float | None = None
    high_text: str = ""
    unit: str = ""
    default_text: str | None = None
    parse: Callable[[str], Any] | None = None
    owner: str = ""
    knob: str = ""
    dense_why: str = ""
    per_step: bool = False
    local: bool = False
    ft_only: bool = False
    ft_why: str = ""
    since: int = 1
    absent: Callable[[Mapping[str, Any]], Any] | None = None


def setting(default: Any = dataclasses.MISSING, **description: Any) -> Any:
    """A dataclass field with ``default`` (a list or dict: a fresh copy each time) described by
    :class:`Setting`\\ ``(**description)``."""
    meta = {"setting": Setting(**description)}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Described:
    """A setting with its field: ``name``, the ``part`` of the configuration it belongs to, its ``default``,
    the Python types it takes (``kinds``) and whether ``None`` is one of its values."""

    name: str
    part: str
    default: Any
    kinds: tuple[type, ...]
    nullable: bool
    setting: Setting

    @property
    def flag(self) -> str:
        """The option that sets it, or its name where no flag does (``pilot_steps``)."""
        if self.setting.flag is not None:
            return self.setting.flag
        return "--" + self.name.replace("_", "-") if self.setting.commands else self.name

    @property
    def kind(self) -> type:
        """The type of its values (``str`` for ``str | list[str]``)."""
        return self.kinds[0]


def _kinds(annotation: Any) -> tuple[tuple[type, ...], bool]:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    kinds = tuple(typing.get_origin(a) or a for a in args if a is not type(None))
    return kinds, type(None) in args


def described(parts: Mapping[str, type]) -> dict[str, Described]:
    """Every setting of the dataclasses ``parts`` (``{"run": RunConfig, ...}``), by name, in order."""
    out = {}
    for part, cls in parts.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            kinds, nullable = _kinds(hints[f.name])
            out[f.name] = Described(f.name, part, default, kinds, nullable, f.metadata["setting"])
    return out


def spell(d: Described, value: Any) -> str:
    """``value`` of ``d`` as the user gives it: ``--outer dsm``, ``--overlap``, ``pilot_steps 4``."""
    if d.kind is bool and value is True and d.setting.commands:
        return d.flag
    return f"{d.flag} {value}"


def check_value(d: Described, value: Any) -> None:
    """``ValueError`` naming ``d``'s flag, ``value`` and what is allowed, unless ``value`` is one of
    ``d``'s values: its type, its range, its choices (the owner's, where ``d.setting.owner`` checks them:
    not here)."""
    s = d.setting
    if (value is None and d.nullable) or s.owner:
        return
    if s.choices is not None:
        if not (isinstance(value, str) and value in s.choices):
            raise ValueError(f"{d.flag} {value!r}: allowed values are {list(s.choices)}")
    elif d.kind is int:
        if not is_int(value, None if s.low is None else int(s.low)):
            bound = "" if s.low is None else f" >= {s.low:g}"
            raise ValueError(f"{d.flag} {value!r} must be an integer{bound}")
        if s.high is not None and value > s.high:
            raise ValueError(f"{d.flag} {value} must be at most {s.high_text or s.high}")
    elif d.kind is float:
        if s.high is not None and not is_number(value, ge=s.low, le=s.high):
            raise ValueError(f"{d.flag} {value!r} must be within [{s.low:g}, {s.high:g}]")
        if not (is_number(value, gt=s.low) if s.above else is_number(value, ge=s.low)):
            bound = "" if s.low is None else f" {'>' if s.above else '>='} {s.low:g}"
            unit = f" of {s.unit}" if s.unit else ""
            raise ValueError(f"{d.flag} {value!r} must be a finite number{unit}{bound}")
    elif d.kind is bool and not isinstance(value, bool):
        raise ValueError(f"{d.flag} {value!r} must be true or false")
    elif not isinstance(value, d.kinds):
        names = " or ".join("a JSON object" if k is dict else f"a {k.__name__}" for k in d.kinds)
        raise ValueError(f"{d.flag} {value!r} must be {names}")


def flag_message(exc: OptionError, settings: Mapping[str, Described]) -> str:
    """``exc``'s message as the command line says it: each option it names (:class:`~lioncub._validate.Named`)
    that is one of the optimizer's ``settings`` as its flag (``--outer-lr 0``, ``--diagnostics-every``),
    the owner's prefix (``LocalSteps: ``) dropped; where the option at fault has no flag
    (``outer_weight_decay``), the Python wording, ``str(exc)``. An option is a setting's by its ``knob``
    (``LocalSteps``' ``h``: ``--local-steps``) where the owners agree, else by the setting's name."""
    flagged = [d for d in settings.values() if d.part == "optimizer" and d.setting.commands]
    knobs = {(d.setting.owner, d.setting.knob): d for d in flagged if d.setting.knob}
    names = {d.name: d for d in flagged}

    def lookup(named: Named) -> Described | None:
        return knobs.get((named.owner, named.option)) or names.get(named.option)

    def written(named: Named) -> str:
        d = lookup(named)
        if d is None:
            return named.python()
        return d.flag if named.value is NO_VALUE else spell(d, named.value)

    if lookup(exc.subject) is None:
        return str(exc)
    return exc.render(written, prefix="")


def nest(values: Mapping[str, Any], settings: Mapping[str, Described]) -> dict[str, Any]:
    """The nested ``config.json`` object (version :data:`CONFIG_VERSION`) of the settings ``values``."""
    doc: dict[str, Any] = {CONFIG_VERSION_KEY: CONFIG_VERSION}
    for name, d in settings.items():
        doc.setdefault(d.part, {})[name] = values[name]
    return doc


def flat_document(doc: Mapping[str, Any], settings: Mapping[str, Described]) -> dict[str, Any]:
    """Every setting of a ``config.json`` object by name (:func:`lioncub.names.config_entries`): a setting
    it lacks takes its ``absent`` value where the document is older than the setting or flat (version 1 left
    unset keys out), else its default. A flat document's unknown keys are ignored (as every version did); a
    nested one holds only the settings of its parts (``ValueError`` naming the others) and is of a version
    this lioncub reads."""
    version, given = config_version(doc), config_entries(doc)
    if version > CONFIG_VERSION:
        raise ValueError(
            f"version {version}: written by a newer lioncub (this one reads up to {CONFIG_VERSION})"
        )
    if version > 1:
        parts = {d.part for d in settings.values()}
        unknown = [k for k in doc if k != CONFIG_VERSION_KEY and k not in parts]
        for part in sorted(parts & set(doc)):
            if not isinstance(doc[part], Mapping):
                unknown.append(f"{part} (not an object)")
                continue
            unknown += [f"{part}.{k}" for k in doc[part] if k not in settings or settings[k].part != part]
        if unknown:
            raise ValueError(f"not settings of lioncub (config version {version}): {unknown}")
    defaults = {name: d.default for name, d in settings.items()}
    out = {}
    for name, d in settings.items():
        if name in given:
            out[name] = given[name]
        elif d.setting.absent is not None and (version == 1 or version < d.setting.since):
            out[name] = d.setting.absent({**defaults, **given})
        else:
            out[name] = d.default
    return out

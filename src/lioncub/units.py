"""Parsers for the units users type: link rates (``1gbit``), sizes (``256kb``), parameter counts (``774M``)
and durations (``50us``). Every error names the option and the accepted forms. No torch, no other imports
from lioncub: the cost model, the launcher and the CLIs all build on this.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_rate", "parse_bandwidth", "parse_count", "parse_duration", "parse_rate", "parse_size"]


_RATE_UNITS_ANY_CASE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
#: the bps spellings read (as bits/s): exactly an upper-case prefix + a lower-case "bps"
_RATE_UNITS_EXACT = {"Kbps": 1e3, "Mbps": 1e6, "Gbps": 1e9, "Tbps": 1e12}
_BPS_FAMILY = {"bps", "kbps", "mbps", "gbps", "tbps"}  # compared case-insensitively
_RATE_FORMS = (
    "a positive number with a unit: kbit, mbit, gbit (as in tc, e.g. 100mbit, 2.5gbit) or Kbps, Mbps, Gbps, "
    "Tbps"
)
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_rate(text: str, option: str = "--link") -> float:
    """Parse a link rate such as ``100mbit``, ``2.5gbit`` or ``1Gbps`` into bits per second (SI, 1k = 1000);
    ``option`` names the option in the messages.

    Accepted units, all *bits* per second: tc's ``bit kbit mbit gbit tbit`` in any case, and exactly
    ``Kbps Mbps Gbps Tbps`` (an upper-case prefix, as networking writes bit rates). Every other spelling
    of the ``bps`` family, compared case-insensitively -- ``bps``, ``kbps``, ``mbps``, ``gbps``, ``tbps``,
    ``MBps``, ``KBPS``, ... -- is refused as ambiguous: tc reads all of them as *bytes* per second, other
    tools as bits. The error names the spellings to use instead.
    """
    match = _NUMBER_UNIT.match(text)
    if match is None or not match.group(2):
        raise ValueError(f"{option}: cannot read {text!r} as a rate; expected {_RATE_FORMS}")
    number, unit = float(match.group(1)), match.group(2)
    if unit in _RATE_UNITS_EXACT:
        scale = _RATE_UNITS_EXACT[unit]
    elif unit.lower() in _RATE_UNITS_ANY_CASE:
        scale = _RATE_UNITS_ANY_CASE[unit.lower()]
    elif unit.lower() in _BPS_FAMILY:
        prefix = unit[:-3]
        instead = f"{prefix.lower()}bit or {prefix.upper()}bps" if prefix else "bit"
        raise ValueError(
            f"{option}: {text!r} is ambiguous (tc reads {unit!r} as bytes per second, other tools as bits); "
            f"write {instead} for bits per second (the bps spellings read as bits are exactly Kbps, Mbps, "
            "Gbps, Tbps)"
        )
    else:
        raise ValueError(f"{option}: unknown unit {unit!r} in {text!r}; expected {_RATE_FORMS}")
    rate = number * scale
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(
            f"{option}: the rate must be positive and finite, got {text!r}; expected {_RATE_FORMS}"
        )
    return rate


_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2}


def parse_size(text: str, option: str = "--burst") -> int:
    """Parse a byte size such as ``256kb``, ``1mb`` or ``65536`` (1 kb = 1024 bytes, as in tc)."""
    match = _NUMBER_UNIT.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{option}: cannot read {text!r} as a size; expected bytes or a unit b, kb, mb")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or int(value) <= 0:
        raise ValueError(f"{option}: the size must be a positive, finite number of bytes, got {text!r}")
    return int(value)


def format_rate(bps: float) -> str:
    """``1e8`` -> ``'100mbit'``; used in messages."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


_NUMBER_UNIT_EXP = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-zµ]*)\s*$")
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_count(text: str, option: str = "--params") -> int:
    """``"774M"`` → 774_000_000, ``"1.5B"`` → 1_500_000_000 (K, M, B/G, T; SI); a plain integer too."""
    match = _NUMBER_UNIT_EXP.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _COUNT_UNITS:
        raise ValueError(
            f"{option}: cannot read {text!r} as a parameter count; expected e.g. 774M, 25M, 1.5B or 125000000"
        )
    value = float(match.group(1)) * _COUNT_UNITS[unit]
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"{option}: the count must be a finite number >= 1, got {text!r}")
    return round(value)


def parse_duration(text: str, option: str = "--latency") -> float:
    """``"50us"`` → 5e-05 s; units s, ms, us (µs), ns; a bare ``0`` is allowed."""
    match = _NUMBER_UNIT_EXP.match(str(text))
    unit = match.group(2) if match else None
    if match is not None and unit == "" and float(match.group(1)) == 0:
        return 0.0
    if match is None or unit not in _DURATION_UNITS:
        raise ValueError(f"{option}: cannot read {text!r} as a duration; expected e.g. 50us, 1ms, 0.2s or 0")
    seconds = float(match.group(1)) * _DURATION_UNITS[unit]
    if not math.isfinite(seconds):
        raise ValueError(
            f"{option}: the duration must be finite, got {text!r}; expected e.g. 50us, 1ms, 0.2s or 0"
        )
    return seconds


def parse_bandwidth(text: str, option: str = "--bandwidth") -> float:
    """``"1gbit"`` → 125e6 bytes/s (tc-style rates, see :func:`parse_rate`)."""
    return parse_rate(str(text), option) / 8

"""How a run is named in tables, legends, summaries and ``lioncub compare --variants``, from its
configuration (:func:`run_label`), and back (:func:`parse_run_name`). Torch-free.

* A vote every step: ``VARIANT[@TOPOLOGY][+overlap]`` -- ``1bit``, ``1bit@hierarchical``, ``8bit+overlap``.
* Local steps (``docs/local-steps.md``): ``RULE[@TOPOLOGY]/hH[/lrX]`` -- ``1bit/h16`` (a 1-bit vote every 16
  steps), ``8bit/h16/lr2`` (outer lr 2), ``dsm/h16`` and ``diloco/h16`` (the fp32 mean of the
  pseudo-gradients), ``diloco-16bit/h16`` (its bf16 mean). RULE is the variant for the ``vote`` rule, else
  the outer rule, with ``-16bit`` for the 16-bit exchange.

A run directory of ``lioncub compare`` is named :func:`run_dir_name` (``/`` becomes ``_``: no variant,
topology or rule has a ``_``, so :func:`name_of_run_dir` turns it back).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["OVERLAP_SUFFIX", "name_of_run_dir", "parse_run_name", "run_dir_name", "run_label"]

#: a LionCub variant's vote overlapped with the backward pass
OVERLAP_SUFFIX = "+overlap"
#: the outer rules that average the pseudo-gradients, named instead of their 32-bit variant
_DENSE_RULES = ("dsm", "diloco")


def run_label(config: Mapping[str, Any]) -> str:
    """The name of the run configured by ``config`` (a ``config.json`` object: ``variant``, ``topology``,
    ``overlap``, ``local_steps``, ``outer``, ``outer_lr``)."""
    name = str(config.get("variant", "?"))
    h = config.get("local_steps")
    outer = config.get("outer") or "vote"
    if h and outer in _DENSE_RULES:
        name = outer if name == "32bit" else f"{outer}-{name}"
    topology = config.get("topology")
    if topology not in (None, "flat"):
        name += f"@{topology}"
    if h:
        name += f"/h{h}"
        if config.get("outer_lr") is not None:
            name += f"/lr{float(config['outer_lr']):g}"
    return name + OVERLAP_SUFFIX if config.get("overlap") else name


def parse_run_name(name: str) -> dict[str, Any]:
    """The configuration fields that ``name`` sets (``variant``; ``topology``, ``overlap``, ``local_steps``,
    ``outer``, ``outer_lr`` where it names them); ``ValueError`` naming the part that is not understood.
    Whether the variant or topology exists is the configuration's check."""
    fields: dict[str, Any] = {}
    text = name
    if text.endswith(OVERLAP_SUFFIX):
        fields["overlap"] = True
        text = text.removesuffix(OVERLAP_SUFFIX)
    head, *parts = text.split("/")
    head, at, topology = head.partition("@")
    if at:
        fields["topology"] = topology
    fields["variant"] = head
    if not parts:
        return fields
    h_text, *rest = parts
    if not (h_text.startswith("h") and h_text[1:].isdigit() and int(h_text[1:]) >= 1):
        raise ValueError(f"{name!r}: after '/' comes hH, the local steps per outer step (e.g. 1bit/h16)")
    fields["local_steps"] = int(h_text[1:])
    rule, dash, wire = head.partition("-")
    if rule in _DENSE_RULES:
        fields["outer"], fields["variant"] = rule, wire if dash else "32bit"
    if len(rest) > 1 or (rest and not rest[0].startswith("lr")):
        raise ValueError(f"{name!r}: after /hH may come only /lrX, the outer lr (e.g. 1bit/h16/lr2)")
    if rest:
        try:
            fields["outer_lr"] = float(rest[0][2:])
        except ValueError:
            raise ValueError(f"{name!r}: /lrX needs a number X (e.g. /lr0.7)") from None
    return fields


def run_dir_name(name: str) -> str:
    """The directory of the run ``name`` in a ``lioncub compare`` report: ``/`` becomes ``_``."""
    return name.replace("/", "_")


def name_of_run_dir(directory: str) -> str:
    """The run name of a ``lioncub compare`` run directory (inverse of :func:`run_dir_name`)."""
    return directory.replace("_", "/")

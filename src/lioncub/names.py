"""How a run is named in tables, legends, summaries and ``lioncub compare --variants``, from its
configuration (:func:`run_label`), and back (:func:`parse_run_name`); and the settings a ``config.json``
object holds, nested or flat (:func:`config_entries`). Torch-free.

* A vote every step: ``VARIANT[@TOPOLOGY][/plus][+overlap]`` -- ``1bit``, ``1bit@hierarchical``,
  ``8bit+overlap``; ``1bit/plus`` is the one-bit vote with the papers' zero rule (``--zero-vote plus``).
* A run whose nodes shard the model (``--fsdp``, docs/shards.md): its name and ``+fsdp`` -- ``1bit+fsdp``,
  ``1bit/h4+fsdp``.
* Local steps (``docs/local-steps.md``): ``RULE[@TOPOLOGY]/hH[/lrX][/bB1:B2][/keep|/average][/plus]`` --
  ``1bit/h16`` (a 1-bit vote every 16 steps), ``8bit/h16/lr2`` (outer lr 2), ``1bit/h4/b0.9:0.99`` (outer
  betas), ``dsm/h16`` and ``diloco/h16`` (the fp32 mean of the pseudo-gradients), ``diloco-16bit/h16``
  (its bf16 mean), ``diloco/h16/keep`` (each rank's inner momentum kept across outer steps; ``/average``:
  averaged; without either: reset, the default).
  RULE is the variant for the default rule (``vote``); every other outer rule is named
  (:data:`lioncub.optim.config.OUTER_RULE_FACTS`), followed by ``-VARIANT`` where the variant is not
  ``32bit`` (``diloco-16bit``; a rule of its own that votes, ``RULE-1bit``): no two rules share a name.

A name spells out only what differs from the defaults; :func:`parse_run_name` also takes the defaults
spelt out (``/reset``, ``/split``), which override ``lioncub compare``'s ``--inner-momentum`` and
``--zero-vote`` for that run. A run directory of ``lioncub compare`` is named :func:`run_dir_name` (``/``
becomes ``_``: no variant, topology or rule has a ``_``, so :func:`name_of_run_dir` turns it back).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lioncub.optim.config import DEFAULT_OUTER, INNER_MOMENTA, OUTER_RULE_FACTS, ZERO_VOTES

__all__ = [
    "CONFIG_VERSION_KEY",
    "FSDP_SUFFIX",
    "GRAMMAR",
    "OVERLAP_SUFFIX",
    "PEER_VARIANTS",
    "config_entries",
    "config_version",
    "name_of_run_dir",
    "parse_run_name",
    "run_dir_name",
    "run_label",
]

#: a LionCub variant's vote overlapped with the backward pass
OVERLAP_SUFFIX = "+overlap"
#: a run whose nodes shard the model over their ranks (FSDP2) and vote on the shards
FSDP_SUFFIX = "+fsdp"
#: variants trained as DDP + Lion, as users run today (gradient allreduce in fp32 / 16-bit)
BASELINES = ("32bit", "16bit")
#: variants that run another project's optimizer in lioncub's harness: torchft's own DiLoCo (Lion inside,
#: Nesterov SGD outside), with ``--fault-tolerant --local-steps H``; named ``torchft-diloco/hH``
PEER_VARIANTS = ("torchft-diloco",)
#: the outer rules a run name spells (every one but the default), longest first: a name's head is the rule,
#: or ``RULE-VARIANT`` (``RULE`` alone: the 32-bit exchange)
_NAMED_RULES = sorted((r for r in OUTER_RULE_FACTS if r != DEFAULT_OUTER), key=len, reverse=True)
#: the key of a nested ``config.json``'s version (:mod:`lioncub.train.settings`); a flat one has none
CONFIG_VERSION_KEY = "version"


def config_version(doc: Mapping[str, Any]) -> int:
    """The version of a ``config.json`` object: its :data:`CONFIG_VERSION_KEY`, 1 for a flat one."""
    version = doc.get(CONFIG_VERSION_KEY)
    return version if isinstance(version, int) and not isinstance(version, bool) else 1


def config_entries(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a ``config.json`` object holds, by name: a nested one's parts merged (version 2 on:
    ``{"version": 2, "run": {...}, "optimizer": {...}, "cluster": {...}}``), a flat one's keys (version 1)."""
    if config_version(doc) == 1:
        return dict(doc)
    return {k: v for part in doc.values() if isinstance(part, Mapping) for k, v in part.items()}


def run_label(config: Mapping[str, Any]) -> str:
    """The name of the run configured by ``config`` (a ``config.json`` object, nested or flat: its
    ``variant``, ``topology``, ``overlap``, ``local_steps``, ``outer``, ``outer_lr``, ``outer_betas``,
    ``inner_momentum``, ``zero_vote``, ``fsdp``); a run ``--variant auto`` chose (``chosen_by``):
    ``auto (NAME)``."""
    config = config_entries(config)
    if config.get("chosen_by"):
        rest = {k: v for k, v in config.items() if k != "chosen_by"}
        return f"{config['chosen_by']} ({run_label(rest)})"
    name = str(config.get("variant", "?"))
    h = config.get("local_steps")
    outer = config.get("outer") or DEFAULT_OUTER
    if name in PEER_VARIANTS:  # its outer rule and inner momenta are its own
        lr = config.get("outer_lr")
        return name + (f"/h{h}" if h else "") + (f"/lr{float(lr):g}" if h and lr is not None else "")
    if h and outer != DEFAULT_OUTER:  # every rule but the default is named: no two rules share a name
        name = outer if name == "32bit" else f"{outer}-{name}"
    topology = config.get("topology")
    if topology not in (None, "flat"):
        name += f"@{topology}"
    if h:
        name += f"/h{h}"
        if config.get("outer_lr") is not None:
            name += f"/lr{float(config['outer_lr']):g}"
        if config.get("outer_betas") is not None:
            name += "/b" + ":".join(f"{float(b):g}" for b in config["outer_betas"])
        if config.get("inner_momentum") not in (None, INNER_MOMENTA[0]):
            name += f"/{config['inner_momentum']}"
    if config.get("zero_vote") not in (None, ZERO_VOTES[0]):  # recorded for the one-bit votes only
        name += f"/{config['zero_vote']}"
    name += OVERLAP_SUFFIX if config.get("overlap") else ""
    return name + FSDP_SUFFIX if config.get("fsdp") else name


#: what may follow ``NAME``, in this order (each part after a ``/``)
GRAMMAR = (
    "after NAME may come, in this order: /hH (H local steps per outer step, e.g. 1bit/h16), then with it "
    f"/lrX (the outer lr, e.g. 1bit/h16/lr2), /bB1:B2 (the outer betas, e.g. 1bit/h4/b0.9:0.99) and "
    f"/{'|/'.join(INNER_MOMENTA)} (the inner momentum at an "
    f"outer step; default {INNER_MOMENTA[0]}), and /{'|/'.join(ZERO_VOTES)} (the one-bit votes' zero rule; "
    f"default {ZERO_VOTES[0]})"
)


def parse_run_name(name: str) -> dict[str, Any]:
    """The configuration fields that ``name`` sets (``variant``; ``topology``, ``overlap``, ``fsdp``,
    ``local_steps``, ``outer``, ``outer_lr``, ``outer_betas``, ``inner_momentum``, ``zero_vote`` where it
    names them);
    ``ValueError`` naming the part that is not understood (:data:`GRAMMAR`). Whether the variant or
    topology exists, and whether the zero rule applies to the variant, is the configuration's check."""
    fields: dict[str, Any] = {}
    text = name
    if text.endswith(FSDP_SUFFIX):
        fields["fsdp"] = True
        text = text.removesuffix(FSDP_SUFFIX)
    if text.endswith(OVERLAP_SUFFIX):
        fields["overlap"] = True
        text = text.removesuffix(OVERLAP_SUFFIX)
    head, *parts = text.split("/")
    head, at, topology = head.partition("@")
    if at:
        fields["topology"] = topology
    fields["variant"] = head
    if parts and parts[-1] in ZERO_VOTES:
        fields["zero_vote"] = parts.pop()
    if not parts:
        return fields
    h_text, *rest = parts
    if not (h_text.startswith("h") and h_text[1:].isdigit() and int(h_text[1:]) >= 1):
        raise ValueError(f"{name!r}: {h_text!r} is not understood: {GRAMMAR}")
    fields["local_steps"] = int(h_text[1:])
    for rule in _NAMED_RULES:
        if head == rule or head.startswith(rule + "-"):
            fields["outer"], fields["variant"] = rule, head.removeprefix(rule).removeprefix("-") or "32bit"
            break
    if rest and rest[-1] in INNER_MOMENTA:
        fields["inner_momentum"] = rest.pop()
    if rest and rest[-1].startswith("b"):
        try:
            betas = [float(b) for b in rest.pop()[1:].split(":")]
        except ValueError:
            betas = []
        if len(betas) != 2:
            raise ValueError(f"{name!r}: /bB1:B2 needs two numbers (e.g. /b0.9:0.99)")
        fields["outer_betas"] = betas
    if len(rest) > 1 or (rest and not rest[0].startswith("lr")):
        raise ValueError(f"{name!r}: {'/'.join(rest)!r} is not understood: {GRAMMAR}")
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

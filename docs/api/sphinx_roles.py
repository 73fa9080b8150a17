"""A griffe extension for the API reference (mkdocs.yml): lioncub's docstrings cross-reference in Sphinx's
roles (``:class:`~lioncub.optim.lion.Lion```, ``:func:`x```, ``:mod:`y```), which Markdown would show as
they are typed; each becomes a code span of the name (the last dotted part under ``~``, as Sphinx shows it),
and RST's double backticks Markdown's single ones."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const|py:\w+):`(~?)([^`]+)`")


def _name(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def markdown(text: str) -> str:
    """``text`` with the roles as code spans."""
    return ROLE.sub(_name, text)


class SphinxRoles(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)

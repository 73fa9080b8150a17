"""Warnings that name the user's line, not lioncub's or the framework's (issue 48, item 6):
:func:`lioncub.integrations.callers.user_stacklevel`, which the integrations' warnings use, walked through a
stand-in framework (a package written to a temporary folder) that calls lioncub back."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import lioncub.integrations
from lioncub.integrations.callers import user_stacklevel

#: a framework's entry point that reaches lioncub through frames of its own (as Trainer.train reaches a
#: callback: a method, a helper, the hook)
FRAMEWORK = """
def fit(hook):
    return _run(hook)

def _run(hook):
    return hook()
"""
#: lioncub's side: a hook that warns with the stacklevel of user_stacklevel(*FRAMEWORKS)
HOOK = """
def setup():
    warnings.warn("max_steps is not a multiple of h", stacklevel=user_stacklevel(*FRAMEWORKS))
"""


@pytest.fixture
def framework(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The package ``fakeframework`` (in ``tmp_path``), imported; removed from ``sys.modules`` after."""
    (tmp_path / "fakeframework").mkdir()
    (tmp_path / "fakeframework" / "__init__.py").write_text(FRAMEWORK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fakeframework", raising=False)
    import fakeframework

    yield fakeframework
    sys.modules.pop("fakeframework", None)


def _lioncub_hook(frameworks: tuple[str, ...]) -> object:
    """:data:`HOOK` as code of lioncub's (its file is in lioncub.integrations' folder, as hf.py is)."""
    where = Path(lioncub.integrations.__file__).parent / "hook_of_the_test.py"
    namespace = {"warnings": warnings, "user_stacklevel": user_stacklevel, "FRAMEWORKS": frameworks}
    exec(compile(HOOK, str(where), "exec"), namespace)
    return namespace["setup"]


def test_a_framework_callback_warning_names_the_user_line(framework: ModuleType) -> None:
    hook = _lioncub_hook(("fakeframework",))
    with pytest.warns(UserWarning, match="not a multiple") as caught:
        line = sys._getframe().f_lineno + 1
        framework.fit(hook)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]
    # the framework's frames are skipped only when named: else the warning names the framework's line
    with pytest.warns(UserWarning) as caught:
        framework.fit(_lioncub_hook(()))
    assert [(Path(w.filename).name, Path(w.filename).parent.name, w.lineno) for w in caught] == [
        ("__init__.py", "fakeframework", FRAMEWORK.splitlines().index("    return hook()") + 1)
    ]

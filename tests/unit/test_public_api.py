"""The public API, pinned: every name that ``datadist``, ``ems`` and ``llm_datadist``
export, with the signature of every public function, class constructor and method and the
values of public enums.  A change to it must be deliberate: regenerate the snapshot with
``DATADIST_API_SNAPSHOT=write python -m pytest tests/unit/test_public_api.py`` and review
the diff."""
from __future__ import annotations

import enum
import importlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Dict

SNAPSHOT = Path(__file__).with_name("public_api.json")
PACKAGES = ("datadist", "ems", "llm_datadist")


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "<no signature>"


def _own_and_inherited(cls: type) -> Dict[str, Any]:
    """The members ``cls`` defines or inherits from a class of these packages (what its
    users reach through it; builtins' members are not this API)."""
    members: Dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        if base is cls or base.__module__.split(".", 1)[0] in PACKAGES:
            members.update(vars(base))
    return members


def _describe(obj: Any) -> Any:
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return {"enum": {m.name: repr(m.value) for m in obj}}
    if isinstance(obj, type):
        members: Dict[str, Any] = {"__init__": _signature(obj)}
        for name, member in sorted(_own_and_inherited(obj).items()):
            if name.startswith("_"):
                continue
            if isinstance(member, property):
                members[name] = "property"
            elif isinstance(member, (staticmethod, classmethod)):
                members[name] = _signature(member.__func__)
            elif callable(member):
                members[name] = _signature(member)
        return {"class": members}
    if callable(obj):
        return {"function": _signature(obj)}
    return {"value": type(obj).__name__}


def current() -> Dict[str, Any]:
    api = {}
    for pkg in PACKAGES:
        module = importlib.import_module(pkg)
        api[pkg] = {name: _describe(getattr(module, name)) for name in sorted(module.__all__)}
    return api


def test_public_api_matches_the_snapshot() -> None:
    api = current()
    if os.environ.get("DATADIST_API_SNAPSHOT") == "write":
        SNAPSHOT.write_text(json.dumps(api, indent=1, sort_keys=True) + "\n")
    want = json.loads(SNAPSHOT.read_text())
    for pkg in PACKAGES:
        assert sorted(api[pkg]) == sorted(want[pkg]), f"{pkg}: exported names changed"
        for name in api[pkg]:
            assert api[pkg][name] == want[pkg][name], f"{pkg}.{name} changed"

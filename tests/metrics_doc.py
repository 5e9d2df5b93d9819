"""The metric families docs/operations.md documents, and those an endpoint serves, in one
spelling (the exposition's sample names: counters end in ``_total``), so tests can check
that the two agree."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Set

__all__ = ["documented_families", "served_families"]

OPERATIONS_MD = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def documented_families(prefix: str = "") -> Set[str]:
    """The names in the first column of the metric tables, starting with ``prefix``."""
    names = set(re.findall(r"^\| `((?:datadist|ems)_[a-z_]+)` \|", OPERATIONS_MD.read_text(), re.MULTILINE))
    return {n for n in names if n.startswith(prefix)}


def served_families(text: str) -> Set[str]:
    """The families of an exposition (Prometheus' text format), counters with ``_total``."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name + "_total" if f.type == "counter" else f.name for f in text_string_to_metric_families(text)}

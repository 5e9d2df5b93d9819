"""The project's benchmark: ``python -m datadist.bench`` (also ``datadist-bench``).

``core`` runs the standard workloads through the public API, ``plan`` times validation and
planning alone, ``record`` is the one JSON row schema both benches (this one and
``python -m ems.bench``) print, ``plot`` draws a run.  Importing this package loads none of
them: ``ems.bench`` needs the record schema only.
"""
from __future__ import annotations

from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run the bench with ``argv`` (default: the command line); returns the exit status."""
    from .core import main as run
    return run(argv)

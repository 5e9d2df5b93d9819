"""``python -m datadist.bench`` as a user runs it, for the bench workload tests."""
from __future__ import annotations

import subprocess
import sys

from ems_helpers import ENV

__all__ = ["run_bench"]


def run_bench(*args: str, timeout: float = 50) -> subprocess.CompletedProcess:
    """Run the bench with ``args`` in a child interpreter (the tests' import roots on its
    path); output captured as text."""
    return subprocess.run([sys.executable, "-m", "datadist.bench", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)

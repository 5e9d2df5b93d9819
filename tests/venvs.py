"""Virtual environments made from the environment running the tests, seeing its packages.

``python -m venv --system-site-packages`` links a new environment to the *base*
interpreter's site-packages.  Run from inside a virtual environment (python's own, uv's or
conda's) that is not the environment that made it: the new one would not see the torch the
tests run with, and would install a second one.  :func:`make` builds an environment whose
``sys.path`` holds, in this order: its own site-packages (so what is installed into it wins,
and a test can prove the installed copy is what imports), the site directories of the
environment running this code, then the base interpreter's.

Also a command: ``python tests/venvs.py DIR`` makes ``DIR`` (``.ci/vllm-env`` uses it).
"""
from __future__ import annotations

import site
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import List

__all__ = ["make", "parent_site_dirs"]

#: The file in the new environment's site-packages that adds the parent's directories as site
#: directories: appended to ``sys.path`` after the new environment's own, their ``.pth``
#: files run (an editable install of this project in the parent stays importable; a copy
#: installed into the new environment is found first).
PTH_NAME = "_parent_environment.pth"


def parent_site_dirs() -> List[str]:
    """The site-packages directories of the running environment that its base interpreter
    does not already provide, in ``sys.path`` order."""
    paths = sysconfig.get_paths()
    wanted = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    base = {str(Path(p).resolve()) for p in _base_site_dirs()}
    out: List[str] = []
    for d in wanted:
        real = str(Path(d).resolve())
        if Path(d).is_dir() and real not in base and real not in out:
            out.append(real)
    return out


def _base_site_dirs() -> List[str]:
    if sys.prefix == sys.base_prefix:
        return []
    vars_ = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix, "installed_base": sys.base_prefix,
             "installed_platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(vars=vars_)
    return [paths["purelib"], paths["platlib"]]


def make(path: Path, timeout_s: float = 300.0) -> Path:
    """Make a virtual environment at ``path`` that sees this environment's packages after its
    own; returns its ``python``.  Its pip, setuptools and wheel are this environment's (a
    pip of its own, from ``ensurepip``, only where this environment has none, as in a venv
    that uv made): a pip running there installs into the new environment, and builds with
    the build tools the tests were installed with rather than older bundled copies.
    Raises ``subprocess.CalledProcessError`` (with the command's output) when the
    interpreter cannot make one."""
    path = Path(path)
    _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(path)], timeout_s)
    python = path / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout_s)
    dirs = [d for d in parent_site_dirs() if Path(d).resolve() != Path(purelib).resolve()]
    (Path(purelib) / PTH_NAME).write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    if subprocess.run([str(python), "-c", "import pip"], capture_output=True, timeout=timeout_s).returncode != 0:
        _run([str(python), "-m", "ensurepip", "--default-pip"], timeout_s)
    return python


def _run(cmd: List[str], timeout_s: float) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout_s).stdout.strip()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/venvs.py DIR")
    print(make(Path(sys.argv[1])))

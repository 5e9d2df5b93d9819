"""What pip installs: the wheel and the sdist build, the wheel installs into a fresh virtual
environment (using the torch of the environment running the tests, never replacing it), and
the installed packages import and run their doctor there.  The same from the machine's
Python, a venv, or a uv-made venv (:mod:`venvs`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import venvs

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


#: The venv must see what it installed, not a source tree on PYTHONPATH.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _ok(cmd: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=CLEAN_ENV, **kw)
    assert proc.returncode == 0, f"{cmd}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    return proc


def test_wheel_and_sdist_install_into_a_fresh_venv(tmp_path: Path) -> None:
    # Built and installed with the new environment's own pip: the environment running the
    # tests may have none (uv makes venvs without pip).
    py = str(venvs.make(tmp_path / "venv"))
    venv = tmp_path / "venv"
    torch_before = _ok([py, "-c", "import torch; print(torch.__version__)"]).stdout
    dist = tmp_path / "dist"
    _ok([py, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)])
    _ok([py, "setup.py", "-q", "sdist", "-d", str(dist)], cwd=ROOT)
    wheel = next(dist.glob("datadist-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("datadist/py.typed", "ems/py.typed", "llm_datadist/__init__.py", "LICENSE",
                   "datadist/engine/_native.pyi", "ems/pool/_keyset.pyi"):  # the C extensions' stubs
        assert any(n.endswith(needed) for n in names), needed
    assert any(n.startswith("datadist/engine/_native") and n.endswith(".so") for n in names)
    sdist = next(dist.glob("datadist-*.tar.gz"))
    in_sdist = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    sources = {str(f.relative_to(ROOT)) for f in (ROOT / "datadist/engine/csrc").iterdir()
               if f.suffix in (".c", ".h")}
    assert sources and sources <= in_sdist, sources - in_sdist  # every C source and the header they share
    _ok([py, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "from-sdist"),
         str(sdist)])  # the sdist alone builds the extension

    _ok([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])
    out = _ok([py, "-c", "import datadist, ems, llm_datadist, torch; print(datadist.__file__); print(torch.__version__)"],
              cwd=tmp_path).stdout.split()
    assert out[0].startswith(str(venv)), out  # the installed copy, not the source tree
    assert out[1] == torch_before.strip()     # torch untouched
    facts = json.loads(_ok([py, "-m", "datadist", "--json"], cwd=tmp_path).stdout)
    assert facts["native_extension"] == "ok"
    meta = _ok([py, "-m", "pip", "show", "datadist"]).stdout
    assert "Apache-2.0" in meta and "Requires: numpy, torch" in meta


def test_a_made_environment_sees_the_running_one_after_its_own(tmp_path: Path) -> None:
    """The torch of the environment running the tests is found; a package installed into the
    new environment shadows the running environment's copy."""
    py = str(venvs.make(tmp_path / "venv"))
    torch_file = _ok([py, "-c", "import torch; print(torch.__file__)"]).stdout.strip()
    import torch
    assert Path(torch_file).resolve() == Path(torch.__file__).resolve()
    site = _ok([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(site) / "pytest.py").write_text("WHO = 'the new environment'\n")
    assert _ok([py, "-c", "import pytest; print(pytest.WHO)"]).stdout.strip() == "the new environment"

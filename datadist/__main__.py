"""``python -m datadist``: what this installation can do here (a doctor).

Prints the version, whether the C extension loads, which copy executor runs, the transports
and the devices this machine offers, and which ``llm_datadist`` an import would give.
``--json`` prints the same as one object.  Exit code 0 when the package is usable here.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any, Dict, List, Optional

from . import __version__


def report() -> Dict[str, Any]:
    """The facts :func:`main` prints."""
    out: Dict[str, Any] = {"version": __version__, "python": sys.version.split()[0]}
    try:
        from .engine import native  # noqa: F401

        out["native_extension"] = "ok"
    except ImportError as exc:
        out["native_extension"] = f"missing: {exc}"
    from .engine import cuda
    from .engine.core import npu_probe
    from .engine.executor import executor

    out["executor"] = executor()
    import torch
    import torch.distributed as dist

    out["torch"] = torch.__version__
    devices = ["cpu"]
    if cuda.available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    sees_npu, npu_problem = npu_probe()
    if sees_npu:
        devices += [f"npu:{i}" for i in range(torch.npu.device_count())]  # type: ignore[attr-defined]
    out["devices"] = devices
    transports = ["shm", "tcp"]
    if dist.is_available():
        transports += [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()))
                       if ok]
        if sees_npu and _has_hccl():
            transports.append("hccl")
    out["transports"] = transports
    out["npu"] = _npu_path(sees_npu, npu_problem, "hccl" in transports)
    spec = importlib.util.find_spec("llm_datadist")
    out["llm_datadist"] = spec.origin if spec else None
    return out


def _has_hccl() -> bool:
    """Whether torch_npu offers its HCCL process group (imported already by the probe)."""
    try:
        import torch_npu

        return hasattr(torch_npu._C._distributed_c10d, "ProcessGroupHCCL")
    except (ImportError, AttributeError):
        return False


def _npu_path(sees: bool, problem: Optional[str], hccl: bool) -> str:
    """What an NPU engine here does with its caches, in a sentence."""
    if problem is not None:
        return f"unusable: {problem}"
    if not sees:
        return "none (torch_npu not installed or sees no NPU)"
    links = ("links between NPU engines use hccl (device to device; transfer_backend auto picks it)" if hccl else
             "torch_npu lacks ProcessGroupHCCL: links between NPU engines stage through host memory")
    return f"caches in NPU device memory (torch_npu); {links}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m datadist", description=__doc__.split("\n")[0])
    ap.add_argument("--version", action="version", version=f"datadist {__version__}")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    facts = report()
    if args.json:
        print(json.dumps(facts))
    else:
        for key, value in facts.items():
            print(f"{key:17s} {', '.join(value) if isinstance(value, list) else value}")
    return 0 if facts["native_extension"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

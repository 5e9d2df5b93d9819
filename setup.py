"""Build script: three Python packages (``llm_datadist`` is CANN's import name for
``datadist``) plus two small C extensions: datadist.engine._native
executes coalesced copy plans (memcpy runs, cross-memory attach, socket scatter/gather
with deadlines) with the GIL released; ems.pool._keyset is the key set the pool daemon
publishes in shared memory so clients answer ``exists`` without a round trip.
"""
import glob

from setuptools import Extension, find_packages, setup

setup(
    name="datadist",
    version="0.1.0",
    description="llm_datadist-compatible KV-cache transfer and an EMS-compatible context-caching pool",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    packages=find_packages(include=["datadist", "datadist.*", "ems", "ems.*", "llm_datadist", "llm_datadist.*"]),
    package_data={"datadist": ["py.typed", "engine/_native.pyi"], "ems": ["py.typed", "pool/_keyset.pyi"],
                  "llm_datadist": ["py.typed"]},
    # The only Python version this project is tested on.
    python_requires=">=3.11",
    # torch: any build the user has (CPU, CUDA, Ascend's); nothing here pins or replaces it.
    # Ascend's torch_npu must match that torch exactly, so it is installed by hand
    # (docs/ascend.md), never pulled in here.
    install_requires=["numpy", "torch"],
    extras_require={
        "redis": ["redis>=5"],
        "plot": ["matplotlib"],
        "progress": ["tqdm"],
        "metrics": ["prometheus_client>=0.17"],
        # setuptools and wheel: test_wheel builds the wheel without build isolation (offline);
        # ninja: the fake NPU's C++ extension (torch.utils.cpp_extension) builds with it.
        "test": ["pytest", "pytest-timeout", "hypothesis", "redis>=5", "matplotlib", "tqdm", "radon", "mypy",
                 "setuptools>=64", "wheel", "ninja", "prometheus_client>=0.17"],
    },
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
        "Typing :: Typed",
    ],
    ext_modules=[
        Extension(
            "datadist.engine._native",
            sources=sorted(glob.glob("datadist/engine/csrc/*.c")),
            depends=["datadist/engine/csrc/native.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden"],
            libraries=["pthread"],
        ),
        Extension(
            "ems.pool._keyset",
            sources=["ems/pool/_keyset.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
        ),
    ],
    entry_points={
        "console_scripts": [
            "ems-server=ems.server:main",
            "datadist-bench=datadist.bench:main",
        ]
    },
)

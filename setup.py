"""Build script: two Python packages plus two small C extensions: datadist.engine._native
executes coalesced copy plans (memcpy runs, cross-memory attach, socket scatter/gather
with deadlines) with the GIL released; ems.pool._keyset is the key set the pool daemon
publishes in shared memory so clients answer ``exists`` without a round trip.
"""
from setuptools import Extension, find_packages, setup

setup(
    name="datadist",
    version="0.1.0",
    description="llm_datadist-compatible KV-cache transfer and an EMS-compatible context-caching pool",
    packages=find_packages(include=["datadist", "datadist.*", "ems", "ems.*", "llm_datadist", "llm_datadist.*"]),
    python_requires=">=3.9",
    install_requires=["numpy", "torch", "pyzmq"],
    extras_require={
        "npu": ["torch_npu"],
        "redis": ["redis>=5"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "redis>=5"],
    },
    ext_modules=[
        Extension(
            "datadist.engine._native",
            sources=["datadist/engine/_native.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
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

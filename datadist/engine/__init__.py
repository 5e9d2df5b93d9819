"""The block engine: layout (plans), native (executors), memory (arenas and pools),
registry (owned caches and keys), wire (link protocol), link, agent and core (the engine).

Users never import this package; ``ems`` uses ``layout`` and ``native`` for its copies.
"""
__all__: list[str] = []

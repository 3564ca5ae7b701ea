"""``yafsdp inspect``: the layout and memory report of a source.

Owns ``InspectReport`` and its parts (``build``): the planned layout, per-buffer
shard rows and the memory model's figures, as frozen dataclasses the report layer
renders. It may import ``memory``, ``sources``, ``engine``, ``errors``.
"""

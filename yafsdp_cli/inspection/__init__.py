"""``yafsdp inspect``: the layout and memory report of a source.

Owns ``InspectReport`` and its parts (``build``): the planned layout, per-buffer
shard rows and the memory model's figures, as frozen dataclasses the report layer
renders, and a training checkpoint's own optimizer state beside the model's
(``stored``). It may import ``memory``, ``schemes``, ``sources``, ``engine``, ``errors``.
"""

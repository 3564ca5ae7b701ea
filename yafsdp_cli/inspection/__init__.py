"""``yafsdp inspect``: the layout and memory report of a source.

Owns ``InspectReport`` and its parts (``build``): the planned layout, per-buffer
shard rows and the memory model's figures, as frozen dataclasses the report layer
renders, a training checkpoint's own optimizer state beside the model's
(``stored``), and the first line's comparison of the flat layout with the best
other sharding scheme (``headline``). It may import ``memory``, ``schemes``,
``sources``, ``engine``, ``errors``.
"""

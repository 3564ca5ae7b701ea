"""The engine: layouts and the conversion of live modules.

Owns the flat-buffer layout (``layout``: entries, alignment, padding, shards; its
invariants in one note), what it is planned from (``records``: names, shapes and
dtypes; ``units``; ``filters``; ``module_spec`` for live modules; ``dtypes``), the
planner (``plan``), the runtimes that put a module on flat buffers (``flat``,
``flat_buffer``: one process; ``sharded``: one shard per rank) and the shared
training step (``train_step``, ``inputs``) that verify and profiling both run, and
what a fine-tuning step trains, as text (``finetune``: ``--lora``, ``--quantize``). It
may import only ``errors`` and ``fileio``; everything else in the package imports it.
"""

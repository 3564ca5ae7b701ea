"""Rendering: Rich tables, JSON documents and markdown from the library's results.

This layer computes nothing; it turns bytes into GiB and dataclasses into text.

One view per result: ``inspect_view`` (with ``fsdp`` and ``bars``), ``verify_view``,
``profile_view``, ``plan_view``, ``checkpoint_view`` and ``gate_view``; the HTML
pages (``html_pages``, ``html_base``, ``html_charts``, ``html_layout``); and what they all
share (``formatting``, and ``fit_table``: every terminal table laid out for the
console's width, 60 columns or 200, no column below its shortest form). It may
import every library room; only ``cli`` imports it.
"""

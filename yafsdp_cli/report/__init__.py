"""Rendering: Rich tables, JSON documents and markdown from the library's results.

This layer computes nothing; it turns bytes into GiB and dataclasses into text.
"""

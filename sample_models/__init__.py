"""Small sample models for yafsdp's demo and tests (see models.py and build.py)."""

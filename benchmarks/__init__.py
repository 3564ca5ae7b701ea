"""Performance bars of PRODUCT.md, each measured beside its floor (``make bench``)."""

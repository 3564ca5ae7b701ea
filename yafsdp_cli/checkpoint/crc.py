"""CRC-32 as the checkpoints store it: fast over data, and free over runs of zeros.

``crc32(data, crc)`` is zlib's CRC-32 (the polynomial, the value and the
``crc32:%08x`` text are zlib's, so every file reads the same with or without
``isal``). Where the ``isal`` package is installed its hardware-backed CRC-32 is
used; it gives the same numbers. Throughput on an AMD EPYC with PCLMULQDQ and
VPCLMULQDQ, 256 MiB of random bytes in 4 MiB pieces, Python 3.11, median of 5
(``python -m benchmarks.run copy_methods`` sets isal's against zlib's in a copy):

    isal.crc32 30.7 GB/s, zlib_ng.crc32 25.5, xxh3_64 19.8, crc32c 11.1,
    zlib.crc32 4.9 (system zlib 1.2.13)

CRC-32 through isal is as fast as the fastest other digest and needs no new format
version, so it wins. ``crc32_zeros(crc, n)`` extends a CRC by ``n`` zero bytes
without reading them: a hole in a sparse file, or the padding of a flat buffer;
``crc32_combine(a, b, n)`` is the CRC of two pieces one after the other (``n`` the
second's length), so pieces can be checksummed in whatever order they are copied.

The algebra (a fact about CRCs, not code from elsewhere): in zlib's reflected
representation, feeding ``n`` zero bytes multiplies the register by ``x**(8n)``
modulo the CRC polynomial. The register is the CRC with its bits inverted, so
``crc32(zeros(n), c) == ~(~c * x**(8n) mod P)`` and
``crc32(a + b) == crc32(a) * x**(8 len(b)) mod P ^ crc32(b)``.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

try:  # the same CRC-32, computed with PCLMULQDQ: 6x zlib's speed here
    from isal.isal_zlib import crc32 as _fast_crc32
    from isal.isal_zlib import crc32_combine as _fast_combine
except ImportError:  # pragma: no cover - isal is a dependency; this keeps zlib as a floor
    _fast_crc32 = _fast_combine = None

_POLY = 0xEDB88320  # CRC-32 (IEEE 802.3), reflected
_ONE = 1 << 31  # the polynomial 1 in the reflected representation
_MASK = 0xFFFFFFFF


def crc32(data, crc: int = 0) -> int:
    """zlib.crc32, hardware-backed when ``isal`` is installed."""
    if _fast_crc32 is not None:
        return _fast_crc32(data, crc)
    return zlib.crc32(data, crc)


def backend() -> str:
    return "isal" if _fast_crc32 is not None else "zlib"


def _multiply(a: int, b: int) -> int:
    """a(x) * b(x) mod P(x), both reflected (bit 31 is x**0)."""
    product, bit = 0, _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@lru_cache(maxsize=64)
def _x_to_2_to(k: int) -> int:
    """x**(2**k) mod P."""
    return _ONE >> 1 if k == 0 else _multiply(_x_to_2_to(k - 1), _x_to_2_to(k - 1))


@lru_cache(maxsize=4096)
def _x_to_8n(n: int) -> int:
    """x**(8 * n) mod P, by squaring: n zero bytes multiply the register by this."""
    result, k = _ONE, 3  # x**8 == x**(2**3)
    while n:
        if n & 1:
            result = _multiply(_x_to_2_to(k), result)
        n >>= 1
        k += 1
    return result


def crc32_zeros(crc: int, n: int) -> int:
    """``crc32(bytes(n), crc)`` without the bytes: microseconds for any ``n``."""
    if n <= 0:
        return crc
    return _multiply(_x_to_8n(n), crc ^ _MASK) ^ _MASK


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``crc32(a + b)`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    if _fast_combine is not None and _fast_crc32 is not None:
        return _fast_combine(crc_a, crc_b, len_b)
    if len_b <= 0:
        return crc_a
    return _multiply(_x_to_8n(len_b), crc_a) ^ crc_b

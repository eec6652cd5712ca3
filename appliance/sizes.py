"""Byte sizes, one parser and one formatter for the whole project: the config's sizes ("14GiB", "512 MiB", "8GB",
4096), the kernel's fdinfo sizes ("7342084 KiB"), and the sizes messages show.

A size is a whole number of bytes from 0 to MAX_BYTES: "inf", "1e400" and "nan" are not sizes (float arithmetic
would turn them into an OverflowError far from the config key that holds them), nor is anything beyond an
exbibyte, which no device has.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
         "T": 10**12, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
MAX_BYTES = 1 << 60
MAX_DIGITS = 40  # a size's number has no more (MAX_BYTES has 19 digits); thousands of them would make int() raise
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)")


def parse_size(value: object) -> int | None:
    """Bytes of a size: an int, or a number with an optional unit (decimal K/M/G/T[B] or binary KiB/MiB/GiB/TiB,
    in any case); None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value.strip())):
        factor = UNITS.get(match[2].upper())
        if factor is None or len(match[1]) > MAX_DIGITS:
            return None
        # exact decimal arithmetic: a float lost bytes past 2**53 ("8192.764G" was 8192763999999 bytes) and
        # rounded a size just past MAX_BYTES down onto it; a fraction of a byte is dropped
        size = math.floor(Fraction(match[1]) * factor)
    else:
        return None
    return size if 0 <= size <= MAX_BYTES else None


def format_size(size: int) -> str:
    """A size as messages show it: "4.5 GiB", "800.0 MiB", "12 B"."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor:
            return f"{size / factor:.1f} {unit}"
    return f"{size} B"

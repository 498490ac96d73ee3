"""A rate limit as declared (``rate="100/m"``): how many claims in any window of a period."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d*)\s*([smh])\s*\Z")


class Rate(NamedTuple):
    """At most ``limit`` rows claimed in any window of ``seconds``."""

    limit: int
    seconds: float

    def __str__(self) -> str:
        for unit, length in PERIODS.items():
            if self.seconds == length:
                return f"{self.limit}/{unit}"
        return f"{self.limit}/{self.seconds:g}s"


def parse_rate(value: Any) -> Rate:
    """``"100/m"``, ``"5/s"``, ``"1000/h"`` or ``"10/30s"`` (per 30 seconds) as a Rate;
    ValueError saying what is wanted."""
    found = _RATE.match(value) if isinstance(value, str) else None
    if found is None or int(found[1]) < 1 or found[2] == "0":
        raise ValueError(f"{value!r} is not a rate: write N/s, N/m, N/h or N/<k>s with "
                         "N >= 1, e.g. '100/m'")
    return Rate(int(found[1]), int(found[2] or 1) * PERIODS[found[3]])


def is_rate(value: Any) -> bool:
    try:
        parse_rate(value)
    except ValueError:
        return False
    return True

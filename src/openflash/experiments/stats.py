"""Seed statistics: mean, spread and a Student-t 95% interval (the studies have 3-12 samples per point)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

# Two-sided 97.5% quantiles of Student's t by degrees of freedom (df > 30: the normal 1.96 is within 4%).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("a t interval needs at least 2 samples")
    if df > 30:
        return 1.96
    return _T975[max(k for k in _T975 if k <= df)]  # between tabulated values: the smaller df (wider interval)


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    std: float  # sample standard deviation (the spread over seeds): 0 for one sample
    ci_low: float  # 95% interval of the mean (nan for one sample)
    ci_high: float

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(values: list[float]) -> Summary:
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return Summary(n, mean, 0.0, math.nan, math.nan)
    std = statistics.stdev(values)
    half = t975(n - 1) * std / math.sqrt(n)
    return Summary(n, mean, std, mean - half, mean + half)

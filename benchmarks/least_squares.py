"""The least-squares line the memory benchmarks fit to their samples: RSS over parameters
(bench_rss_scale, bench_rss_budget) and each metric over steps (soak). No torch: the
benchmarks' parent processes import it and stay small."""
from __future__ import annotations


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Slope and intercept of the least-squares line of ys against xs; the slope is 0 where the
    xs do not spread (fewer than two distinct points), and both are 0 with no points."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx

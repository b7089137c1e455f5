"""PromQL for the dashboard's panels: rates summed by labels, ratios of rates and histogram
quantiles, every selector restricted to the dashboard's ``$job`` variable."""

from __future__ import annotations

JOB = 'job=~"$job"'
RATE = "[$__rate_interval]"


def rate(metric: str, by: str, selector: str = "") -> str:
    labels = ", ".join(s for s in (JOB, selector) if s)
    return f"sum by ({by}) (rate({metric}{{{labels}}}{RATE}))"


def ratio(numerator: str, denominator: str, by: str) -> str:
    return f"{rate(numerator, by)} / {rate(denominator, by)}"


def quantiles(histogram: str, by: str = "", selector: str = "") -> tuple[tuple[str, str], ...]:
    """p50, p90 and p99 of a histogram, per ``by`` label when given."""
    keys = f"le, {by}" if by else "le"
    legend = f" {{{{{by}}}}}" if by else ""
    return tuple(
        (
            f"histogram_quantile({q}, {rate(histogram + '_bucket', keys, selector)})",
            f"p{round(q * 100)}{legend}",
        )
        for q in (0.5, 0.9, 0.99)
    )

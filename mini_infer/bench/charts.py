"""The chart helpers: a PNG of one or more panels, each grouped bars or log-log lines, or of points over time
(matplotlib, Agg: no display needed)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Series:
    """One plotted series: a y per label (bars) or per x (lines), with each point's min-max as an error bar."""

    label: str
    y: list[float]
    x: list | None = None
    low: list[float] | None = None
    high: list[float] | None = None
    style: str = "-o"

    @classmethod
    def spread(cls, label: str, summaries: list[dict], **kwargs) -> Series:
        """The medians of summaries (report.summarize), each with its min-max."""
        return cls(label, [s["median"] for s in summaries], low=[s["min"] for s in summaries],
                   high=[s["max"] for s in summaries], **kwargs)


@dataclass(frozen=True, slots=True)
class Panel:
    ylabel: str
    labels: list  # the x tick labels: the bar groups, or the x values ticked on a line panel
    series: list[Series]
    lines: bool = False  # lines over numeric x on log-log axes instead of bars
    xlabel: str = ""
    width: float = 1.0  # relative to the figure's other panels
    fontsize: int | None = None  # of the tick labels


def chart(path: Path, title: str, panels: list[Panel]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 + 3 * sum(p.width for p in panels), 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": [p.width for p in panels]})
    for ax, panel in zip(axes[0], panels):
        bar_width = 0.8 / len(panel.series)
        for i, s in enumerate(panel.series):
            yerr = None if s.low is None else [[y - lo for y, lo in zip(s.y, s.low)],
                                               [hi - y for y, hi in zip(s.y, s.high)]]
            if panel.lines:
                ax.errorbar(s.x, s.y, yerr=yerr, fmt=s.style, capsize=3, label=s.label)
            else:
                offset = (i - (len(panel.series) - 1) / 2) * bar_width
                ax.bar([j + offset for j in range(len(s.y))], s.y, bar_width, yerr=yerr, capsize=3, label=s.label)
        if panel.lines:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        positions = panel.labels if panel.lines else list(range(len(panel.labels)))
        ax.set_xticks(positions, [str(label) for label in panel.labels], fontsize=panel.fontsize)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        if len(panel.series) > 1:
            ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scatter(path: Path, title: str, series: list[tuple[str, list[float], list[float]]], xlabel: str,
            ylabel: str) -> None:
    """Points (x, y) of each labelled series on one linear panel, y from 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, xs, ys in series:
        ax.scatter(xs, ys, s=4, alpha=0.6, label=label)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

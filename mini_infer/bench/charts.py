"""PNG charts of a benchmark report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from mini_infer.bench.parallel import peak_bytes, rank_label
from mini_infer.bench.roofline import Ceilings, DecodeCost, roofline


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_chart(report: dict, path: Path) -> None:
    """Output tokens/s against batch size: each system's median with its min-max range, the roofline dashed
    (drawn at every batch size in the range, so its knee shows)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = report["config"]["batch_sizes"]
    cost, ceilings = DecodeCost(**report["decode_cost"]), Ceilings(**report["ceilings"])
    line = [roofline(cost, ceilings, b) for b in range(sizes[0], sizes[-1] + 1)]
    ax.plot([p.batch_size for p in line], [p.tok_s for p in line], "k--", label="roofline")
    for name, system in report["systems"].items():
        results = system["results"]
        if not results:
            continue
        medians = [r["tok_s"]["median"] for r in results]
        spread = [[m - r["tok_s"]["min"] for m, r in zip(medians, results)],
                  [r["tok_s"]["max"] - m for m, r in zip(medians, results)]]
        ax.errorbar([r["batch_size"] for r in results], medians, yerr=spread, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens / s")
    config = report["config"]
    ax.set_title(f"{Path(config['model']).name}, {config['dtype']}, {config['prompt_len']} prompt + "
                 f"{config['max_new_tokens']} new tokens, {report['machine']['torch_threads']} threads", fontsize=9)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def workload_chart(report: dict, path: Path) -> None:
    """Output tokens/s per system, beside request latency p50 and p99."""
    plt = _pyplot()
    ran = {name: s["summary"] for name, s in report["systems"].items() if s["summary"] is not None}
    fig, (rate_ax, latency_ax) = plt.subplots(1, 2, figsize=(9, 4))
    names = list(ran)
    rate_ax.bar(names, [ran[n]["output_tok_s"]["median"] for n in names], color="tab:blue")
    rate_ax.set_ylabel("output tokens / s")
    _paired_bars(latency_ax, names, ("p50", [ran[n]["latency_p50_s"]["median"] for n in names]),
                 ("p99", [ran[n]["latency_p99_s"]["median"] for n in names]), "request latency (s)")
    config = report["config"]
    _save(plt, fig, path, f"random workload: {config['num_requests']} requests, {Path(config['model']).name}, "
                          f"{config['dtype']}")


def _paired_bars(ax, labels: list[str], left: tuple[str, list], right: tuple[str, list], ylabel: str,
                 fontsize: int | None = None) -> None:
    """Two bars per label, side by side, with a legend."""
    positions = range(len(labels))
    ax.bar([p - 0.2 for p in positions], left[1], 0.4, label=left[0])
    ax.bar([p + 0.2 for p in positions], right[1], 0.4, label=right[0])
    ax.set_xticks(list(positions), labels, fontsize=fontsize)
    ax.set_ylabel(ylabel)
    ax.legend()


def _save(plt, fig, path: Path, title: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parallel_chart(report: dict, path: Path) -> None:
    """Output tokens/s per layout, beside each rank's parameter bytes and peak memory."""
    plt = _pyplot()
    layouts = report["layouts"]
    fig, (rate_ax, memory_ax) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1, 2]})
    names = [lay["name"] for lay in layouts]
    medians = [lay["tok_s"]["median"] for lay in layouts]
    spread = [[m - lay["tok_s"]["min"] for m, lay in zip(medians, layouts)],
              [lay["tok_s"]["max"] - m for m, lay in zip(medians, layouts)]]
    rate_ax.bar(names, medians, yerr=spread, capsize=3, color="tab:blue")
    rate_ax.set_ylabel("output tokens / s")
    ranks = [(lay["name"], rank) for lay in layouts for rank in lay["ranks"]]
    _paired_bars(memory_ax, [f"{name}\n{rank_label(rank)}" for name, rank in ranks],
                 ("parameters", [rank["param_bytes"] / 1e6 for _, rank in ranks]),
                 ("peak memory", [peak_bytes(rank) / 1e6 for _, rank in ranks]), "MB per rank", fontsize=7)
    config = report["config"]
    _save(plt, fig, path, f"parallel layouts: batch {config['batch_size']}, {config['max_new_tokens']} new "
                          f"tokens, {Path(config['model']).name}, {config['dtype']}")


def feature_chart(report: dict, path: Path) -> None:
    """The two settings side by side: TTFT p50/p99 (shared-prefix) or streams' ITL p50/p99 (long-prompt)."""
    plt = _pyplot()
    settings = report["settings"]
    names = list(settings)
    fig, ax = plt.subplots(figsize=(6, 4))
    kind = "ttft" if report["workload"] == "shared-prefix" else "itl"
    _paired_bars(ax, names, ("p50", [1000 * settings[n][f"{kind}_p50_s"] for n in names]),
                 ("p99", [1000 * settings[n][f"{kind}_p99_s"] for n in names]),
                 "time to first token (ms)" if kind == "ttft" else "inter-token latency of the streams (ms)")
    _save(plt, fig, path, f"{report['workload']}: {Path(report['config']['model']).name}, {report['config']['dtype']}")

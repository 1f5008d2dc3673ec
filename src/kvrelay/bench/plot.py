"""`--plot out.png`: latency CDFs per load level, and throughput against load.

matplotlib is the optional extra `kvrelay[bench]`. The panel titles are also written into the
PNG's text metadata ("Panels"), so a reader (or a test) can tell what the picture holds.
"""

from __future__ import annotations

import numpy as np

PANELS = ("TTFT CDF", "TPOT CDF", "E2E latency CDF", "Throughput vs load")


def _load_x(entries: list[dict]) -> tuple[list[float], str]:
    """The swept quantity: concurrency, or request rate (inf drawn past the largest finite one)."""
    concs = [e["load"]["max_concurrency"] for e in entries]
    if len(set(concs)) > 1 and None not in concs:
        return [float(c) for c in concs], "max concurrency"
    rates = [e["load"]["request_rate"] for e in entries]
    finite = [r for r in rates if r is not None]
    top = (max(finite) * 2) if finite else 1.0
    return [r if r is not None else top for r in rates], "request rate (req/s; inf drawn last)"


def check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'kvrelay[bench]'") from e


def plot_runs(entries: list[dict], path: str) -> list[str]:
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(
        axes.flat[:3], (("ttft", PANELS[0]), ("tpot", PANELS[1]), ("e2e", PANELS[2]))
    ):
        for e in entries:
            values = np.sort(
                [r[key] for r in e["requests"] if r.get(key) is not None and r.get("error") is None]
            )
            if values.size:
                ax.step(
                    values * 1000,
                    np.arange(1, values.size + 1) / values.size,
                    where="post",
                    label=e["load"]["label"],
                )
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if len(entries) > 1:
            ax.legend(fontsize=7)
    ax = axes.flat[3]
    x, xlabel = _load_x(entries)
    order = np.argsort(x)
    xs = np.asarray(x)[order]
    out = np.asarray([e["summary"]["output_throughput"] for e in entries])[order]
    good = np.asarray([e["summary"]["goodput"] for e in entries])[order]
    ax.plot(xs, out, "o-", label="output tok/s")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("output tokens/s")
    ax.set_title(PANELS[3])
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(xs, good, "s--", color="tab:green", label="goodput req/s")
    twin.set_ylabel("goodput (req/s)")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": "kvrelay bench", "Panels": "; ".join(PANELS)})
    plt.close(fig)
    return list(PANELS)

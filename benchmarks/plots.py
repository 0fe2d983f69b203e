"""PNG plots of a suite's results: round-trip latency against size, one line per method."""

from __future__ import annotations

from typing import Any

from roundtrip import size_label

LABELS = {"raw": "raw CuPy calls (no safety)", "cupy_ipc": "cupy_ipc (handle bytes)",
          "mp": "cupy_ipc.multiprocessing", "pool": "cupy_ipc.multiprocessing, shareable pool",
          "vmm": "cupy_ipc.multiprocessing, virtual memory",
          "torch": "torch.multiprocessing", "staging": "host staging",
          "bare": "bare queue message", "cupy_ipc-nosync": "cupy_ipc, ordering off",
          "cupy_ipc-nokeep": "cupy_ipc, keep-alive off", "cupy_ipc-unsafe": "cupy_ipc, both off"}


def draw_roundtrip(rows: list[dict[str, Any]], path: str, title: str) -> bool:
    """Fresh and re-sent panels, log-log; returns False (and draws nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots: matplotlib is not installed; no PNG written", flush=True)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, resent in zip(axes, (False, True)):
        for method, label in LABELS.items():
            pts = sorted((r["bytes"], r["median_us"]) for r in rows
                         if r["method"] == method and (r["resent"] == resent or method == "bare"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                        linestyle=":" if method == "bare" else "-")
        ax.set_xscale("log", base=2)
        sizes = sorted({r["bytes"] for r in rows})
        ax.set_xticks(sizes, [size_label(n) for n in sizes])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("buffer size")
        ax.set_title("re-sent buffer" if resent else "fresh buffer")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("round trip per message, median (µs)")
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

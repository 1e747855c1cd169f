"""One PNG per model of a peers run: throughput and TTFT p50 against concurrent streams.

Each engine gets a line for its in-process async engine and a dashed one for its HTTP server,
where it has them. The files are named `peers-KIND-MODEL.png` (e.g. `peers-avx512-bf16-b.png`),
so that runs on different kinds of machine do not overwrite each other's plots.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.peers.report import CONCURRENCIES, PeerResult


def plot_name(kind: str, model: str) -> str:
    """The file name of `model`'s plot ("b: SmolLM2-135M-Instruct" -> peers-KIND-b.png)."""
    return f"peers-{kind}-{model.split(':')[0]}.png"


def write_plots(results: Sequence[PeerResult], folder: Path, kind: str) -> list[Path]:
    """The plots of `results` in `folder`, one per model (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: skipping the plots", file=sys.stderr)
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for model in dict.fromkeys(r.model for r in results):
        fig, (tput, ttft) = plt.subplots(1, 2, figsize=(10, 4))
        for r in (r for r in results if r.model == model):
            lines = {
                r.engine: [
                    (c, r.async_tok_s(c), r.latency_ms(c, "ttft_ms")) for c in CONCURRENCIES
                ],
                f"{r.engine} (HTTP)": [
                    (c, r.serve_tok_s(c), r.serve_latency_ms(c, "ttft_ms")) for c in CONCURRENCIES
                ],
            }
            for label, line in lines.items():
                points = [p for p in line if p[1] is not None]
                if not points:
                    continue
                style = "--" if label.endswith("(HTTP)") else "-"
                xs = [p[0] for p in points]
                tput.plot(xs, [p[1] for p in points], style, marker="o", label=label)
                ttft.plot(xs, [p[2] for p in points], style, marker="o", label=label)
        for ax, title in ((tput, "output tokens/s"), (ttft, "TTFT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(model)
        fig.tight_layout()
        path = folder / plot_name(kind, model)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written

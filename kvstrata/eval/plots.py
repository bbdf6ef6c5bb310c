"""PNG plots of the evaluations (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from kvstrata.bench.plots import plt, save_figure


def perplexity_segments(results: list[dict], path: Path) -> None:
    figure, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([s["to"] for s in r["segments"]], [s["perplexity"] for s in r["segments"]], marker="o",
                label=f"{r['label']} (ppl {r['perplexity']})")
    ax.set_xlabel("position (end of 256-token segment)")
    ax.set_ylabel("perplexity")
    ax.legend()
    save_figure(figure, path)


def agreement_bars(results: list[dict], path: Path) -> None:
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [r["label"] for r in results]
    left.bar(labels, [r["agreement"] for r in results], color="#3a6ea5")
    left.set_ylabel("greedy agreement")
    left.set_ylim(0, 1.05)
    right.bar(labels, [r["kl"] for r in results], color="#a55a3a")
    right.set_ylabel("mean KL (nats)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=20)
    save_figure(figure, path)


def needle_heatmaps(results: list[dict], lengths: list[int], depths: list[float], path: Path) -> None:
    figure, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        accuracy = {(c["length"], c["depth"]): c["accuracy"] for c in r["grid"]}
        grid = [[accuracy[(length, depth)] for length in lengths] for depth in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"{r['label']}: accuracy {r['accuracy']}")
        figure.colorbar(image, ax=ax)
    save_figure(figure, path)

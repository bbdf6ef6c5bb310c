"""PNG plots of the benchmarks."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def save_figure(figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def roofline(report: dict, path: Path) -> None:
    """Achieved GFLOP/s against arithmetic intensity, under this machine's roof."""
    peak, bandwidth = report["gemm_gflops"], report["read_bandwidth_gbs"]
    weights = report["decode_read_bytes"]
    decode, prefill = report["flops_per_token_decode"], report["flops_per_token_prefill"]
    prompt_len = report["workload"]["prompt_len"]
    # x: FLOPs per weight byte of one step; y: achieved FLOP rate.
    points = {
        "decode, batch 1": (decode / weights, decode / (report["decode_step_ms"] / 1000) / 1e9),
        f"prefill, {prompt_len} tokens": (prefill * prompt_len / weights, report["prefill_tokens_per_s"] * prefill / 1e9),
    }
    if "concurrent_tokens_per_s" in report:
        batch, per_token = report["workload"]["concurrent"], report["flops_per_token_concurrent"]
        points[f"{batch} requests together"] = (
            per_token * batch / weights, report["concurrent_tokens_per_s"] * per_token / 1e9
        )
    figure, ax = plt.subplots(figsize=(7, 4.5))
    intensities = [0.05, peak / bandwidth, 1e4]
    ax.plot(intensities, [min(peak, bandwidth * x) for x in intensities], color="black", label="roof")
    for label, (x, y) in points.items():
        ax.scatter([x], [y], s=60, label=f"{label}: {y:.1f} GFLOP/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per weight byte)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=8)
    save_figure(figure, path)


def throughput(results: list[dict], path: Path) -> None:
    labels = [r.get("scheduler", r["system"]) for r in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(labels, [r["total_tokens_per_s"] for r in results], color="#3a6ea5")
    left.set_ylabel("total tokens/s")
    width = 0.25
    for i, (key, name) in enumerate((("p50_ttft_ms", "TTFT p50"), ("p50_tpot_ms", "TPOT p50"), ("p50_e2e_ms", "E2E p50"))):
        right.bar([x + i * width for x in range(len(results))], [r[key] for r in results], width, label=name)
    right.set_xticks([x + width for x in range(len(results))], labels)
    right.set_yscale("log")
    right.set_ylabel("ms")
    right.legend(fontsize=8)
    save_figure(figure, path)


def sarathi(report: dict, path: Path) -> None:
    panels = [key for key in ("per_token_cost", "piggyback", "pd_sweep", "chunk_overhead") if key in report]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.8), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = report[key]
        if key == "per_token_cost":
            batches = [r["batch"] for r in rows]
            ax.plot(batches, [r["prefill_ms_per_token"] for r in rows], marker="o", label="prefill")
            ax.plot(batches, [r["decode_ms_per_token"] for r in rows], marker="o", label="decode")
            ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms per token", title="Fig. 3 analogue")
        elif key == "piggyback":
            decodes = [r["decodes"] for r in rows]
            ax.plot(decodes, [r["decode_only_ms_per_token"] for r in rows], marker="o", label="decode-only")
            ax.plot(decodes, [r["piggybacked_ms_per_decode"] for r in rows], marker="o", label="piggybacked")
            ax.set(xlabel="decodes in the step", ylabel="ms per decode token", title="Table 2 analogue")
        elif key == "pd_sweep":
            ratios = [r["pd_ratio"] for r in rows]
            for series in [k for k in rows[0] if k.endswith("_tokens_per_s")]:
                ax.plot(ratios, [r[series] for r in rows], marker="o", label=series.removesuffix("_tokens_per_s"))
            ax.set(xscale="log", xlabel="prefill:decode ratio", ylabel="tokens/s", title="Fig. 9 analogue")
        else:
            ax.plot([r["chunk_size"] for r in rows], [r["slowdown_vs_one_piece"] for r in rows], marker="o",
                    label="prefill time / one piece")
            ax.set(xscale="log", xlabel="chunk size", ylabel="relative prefill time", title="Fig. 13 analogue")
        ax.legend(fontsize=7)
    save_figure(figure, path)

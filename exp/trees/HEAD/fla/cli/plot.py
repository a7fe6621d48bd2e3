"""PNG plots of the command line: the training loss curve and the benchmark's time vs
sequence length. matplotlib is imported lazily with the Agg backend (no display)."""
from __future__ import annotations

import math
from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _smooth(values: list[float]) -> list[float]:
    """Trailing mean over ~1/30 of the run (no lag from the first, high losses)."""
    w = max(1, len(values) // 30)
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def loss_curve(history: list[dict], path: str | Path, *, title: str,
               baseline_bits: float | None = None) -> Path:
    """Training loss (per step, and smoothed) and validation loss in bits per byte
    against tokens seen. ``history`` rows: ``{"step", "tokens", "loss"}`` or
    ``{"step", "tokens", "val_loss"}`` (losses in nats per token)."""
    plt = _pyplot()
    train = [(r["tokens"], r["loss"] / math.log(2)) for r in history if "loss" in r]
    val = [(r["tokens"], r["val_loss"] / math.log(2)) for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        x = [t / 1e6 for t, _ in train]
        y = [v for _, v in train]
        ax.plot(x, y, color="tab:blue", alpha=0.25, linewidth=0.8)
        ax.plot(x, _smooth(y), color="tab:blue", linewidth=1.6, label="train (smoothed)")
    if val:
        ax.plot([t / 1e6 for t, _ in val], [v for _, v in val], "o-", color="tab:orange",
                linewidth=1.6, markersize=4, label="validation")
    if baseline_bits is not None:
        ax.axhline(baseline_bits, color="gray", linestyle="--", linewidth=1,
                   label=f"unigram baseline ({baseline_bits:.2f})")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("loss (bits per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    top = max([v for _, v in train[len(train) // 20:]] + [v for _, v in val]
              + ([baseline_bits] if baseline_bits else []), default=None)
    if top is not None:
        ax.set_ylim(bottom=0, top=top * 1.15)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def bench_curve(rows: list[dict], path: str | Path, *, title: str) -> Path:
    """Time (ms, log scale) against sequence length (log scale), one line per
    (library, mode). ``rows``: ``{"T", "mode", "ours_ms", "ref_ms"}``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    modes = sorted({r["mode"] for r in rows})
    colors = {"fwd": "tab:blue", "fwdbwd": "tab:red"}
    for mode in modes:
        for side, style in (("ours_ms", "o-"), ("ref_ms", "s--")):
            pts = sorted((r["T"], r[side]) for r in rows if r["mode"] == mode and r.get(side))
            if not pts:
                continue
            label = ("fla" if side == "ours_ms" else "reference") + \
                (" fwd" if mode == "fwd" else " fwd+bwd")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                    color=colors.get(mode, None), label=label, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("time (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path

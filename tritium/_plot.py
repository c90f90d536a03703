"""PNG charts for `python -m tritium demo` and `bench`, when matplotlib is importable.

matplotlib is an optional extra (`pip install tritium[plots]`): every function returns the path
it wrote, or None when matplotlib is missing, and the callers then keep their CSV/markdown
output and say so. The Agg backend is selected before pyplot is imported (no display needed).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _ema(values, alpha: float = 0.1):
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def loss_curves(path: Path, curves: dict, evals: dict, title: str) -> Optional[Path]:
    """curves: name -> per-step train losses; evals: name -> [(step, held-out loss)]."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for color, (name, losses) in zip(colors, curves.items()):
        steps = range(1, len(losses) + 1)
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, _ema(losses), color=color, linewidth=1.8, label=f"{name} train (EMA)")
        pts = evals.get(name) or []
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], "o--", color=color,
                    markersize=5, linewidth=1, label=f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=10)
    finite = [v for losses in curves.values() for v in losses if v == v and abs(v) != float("inf")]
    if finite:  # the first steps (~ln 256) would flatten the interesting part
        tail = sorted(finite)
        ax.set_ylim(tail[0] * 0.95, min(tail[-1], tail[0] + 3 * (tail[len(tail) // 2] - tail[0])
                                        + 0.5) * 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def speedup_bars(path: Path, title: str, rows: list) -> Optional[Path]:
    """Horizontal bars, one per (case, variant, speedup) row, grouped by case (a header label
    per group); tritium's variants in one color, the others in grey; a line at 1.0."""
    plt = _pyplot()
    if plt is None:
        return None
    order = list(dict.fromkeys(c for c, _, _ in rows))
    rows = sorted(rows, key=lambda r: order.index(r[0]))
    ys, labels, headers, y = [], [], set(), 0.0
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.24 * (len(rows) + 2 * len(order))), dpi=110)
    last_case = None
    for case, variant, value in rows:
        if case != last_case:
            y += 0.6 if last_case is not None else 0.0
            headers.add(len(ys))
            ys.append(y)
            labels.append(case)
            y += 1.0
            last_case = case
        color = "tab:orange" if "tritium" in variant.lower() else "tab:grey"
        ax.barh(y, value, height=0.8, color=color)
        ax.text(value, y, f" {value:.2f}x", va="center", fontsize=7)
        ys.append(y)
        labels.append(variant)
        y += 1.0
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=7)
    for i, tick in enumerate(ax.get_yticklabels()):
        if i in headers:
            tick.set_fontweight("bold")
            tick.set_fontsize(8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_ylim(y, -1.0)
    ax.set_xlabel("speedup over the baseline (x), same run")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

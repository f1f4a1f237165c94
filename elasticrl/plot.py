"""``elasticrl plot DIR``: PNG curves of a run's ``metrics.jsonl``.

One figure per group of metrics (the keys' prefix before ``/``, e.g. ``eval``, ``time``,
``sync``), each metric on its own axis against ``step``. Non-numeric values (the sync
transport's name) are skipped. Files are written atomically into ``DIR/plots/``.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from elasticrl import run_folder as rf

PER_FIGURE = 6


def series(rows: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Metric -> (steps, values), numeric finite values only."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        step = row.get("step")
        if not isinstance(step, (int, float)):
            continue
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                xs, ys = out.setdefault(key, ([], []))
                xs.append(step)
                ys.append(value)
    return out


def plot_run(run_dir: Path) -> list[Path]:
    """Write ``run_dir/plots/<group>.png`` for every metric group; return the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = run_dir / rf.METRICS
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no metrics here; pass the --output folder of a run")
    data = series(rf.metric_rows(run_dir))
    if not data:
        raise ValueError(f"{metrics}: no numeric metrics to plot")
    groups: dict[str, list[str]] = {}
    for key in data:
        groups.setdefault(key.split("/")[0] if "/" in key else "train", []).append(key)
    out_dir = run_dir / rf.PLOTS
    out_dir.mkdir(exist_ok=True)
    written = []
    for group, keys in sorted(groups.items()):
        for part in range(0, len(keys), PER_FIGURE):
            chunk = keys[part:part + PER_FIGURE]
            cols = min(3, len(chunk))
            rows = -(-len(chunk) // cols)
            fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
            for ax, key in zip(axes.flat, chunk):
                xs, ys = data[key]
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, linewidth=1.2)
                ax.set_title(key, fontsize=9)
                ax.set_xlabel("step", fontsize=8)
                ax.grid(alpha=0.3)
            for ax in list(axes.flat)[len(chunk):]:
                ax.axis("off")
            fig.tight_layout()
            name = group if part == 0 else f"{group}_{part // PER_FIGURE + 1}"
            final = out_dir / f"{name}.png"
            tmp = out_dir / f".{name}.tmp.png"
            fig.savefig(tmp, dpi=100)
            plt.close(fig)
            os.replace(tmp, final)
            written.append(final)
    return written

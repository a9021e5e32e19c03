"""Learning curves of a run directory as PNG."""

from __future__ import annotations

import csv
import math
import pathlib

__all__ = ["plot_run", "return_series"]


def return_series(columns: list[str]) -> list[tuple[str, str]]:
    """The training-return curves a run's plot draws, as ``(label, metrics column)``: the
    per-type returns ``charts/<type>_return`` when the run has them, else the summed
    ``charts/episodic_return``."""
    per_type = [c for c in columns if c.startswith("charts/") and c.endswith("_return") and c != "charts/episodic_return"]
    return [(c.removeprefix("charts/").removesuffix("_return") + " return", c) for c in per_type] or [
        ("episodic return", "charts/episodic_return")]


def plot_run(run_dir: str | pathlib.Path, out: str | pathlib.Path | None = None) -> pathlib.Path:
    """Plots episodic return (per iteration, and its 10-iteration moving mean) and evaluation
    returns against env steps. Multi-agent runs whose ``metrics.csv`` holds per-type returns
    (``charts/<type>_return``, e.g. Tag's taggers and runners) plot those instead of the summed
    return, in which opposing types cancel out.

    Args:
        run_dir: a run directory with ``metrics.csv``.
        out: PNG path; default ``run_dir/learning_curve.png``.

    Returns:
        the PNG's path.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.csv``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = pathlib.Path(run_dir)
    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))

    def col(name: str) -> list[tuple[float, float]]:
        pts = []
        for r in rows:
            v = r.get(name, "")
            if v not in ("", None) and math.isfinite(float(v)):
                pts.append((float(r["env_steps"]), float(v)))
        return pts

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    series = return_series(list(rows[0].keys()) if rows else [])
    colors = ["tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    k = 10
    for (label, name), color in zip(series, colors * 4):
        train = col(name)
        if not train:
            continue
        xs, ys = zip(*train)
        ax.plot(xs, ys, color=color, alpha=0.3, lw=1, label=f"{label} (per iteration)")
        smooth = [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, color=color, lw=2, label=f"{label}, moving mean ({k} iterations)")
    ev = col("eval/mean_return")
    if ev:
        xs, ys = zip(*ev)
        ax.plot(xs, ys, "o-", color="tab:orange", label="evaluation (deterministic)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no episode finished and no evaluation yet: nothing to label
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    target = pathlib.Path(out) if out is not None else run_dir / "learning_curve.png"
    fig.savefig(target)
    plt.close(fig)
    return target

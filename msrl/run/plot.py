"""Learning curves of a run directory as PNG.

A run draws its curve in a background process (:func:`plot_in_background`) that the run does
not wait for: matplotlib's import and the drawing take ~1.5-3 s on a 2-core machine, longer
than a short run's training, and the result line does not wait for a picture. ``msrl plot
RUN_DIR`` draws it again in the foreground.
"""

from __future__ import annotations

import csv
import math
import os
import pathlib
import subprocess
import sys

from msrl.errors import InputError

__all__ = ["plot_run", "return_series", "plot_in_background", "wait_for_background_plots"]

#: the background plot processes this process started and has not waited for
_BACKGROUND: list[subprocess.Popen] = []


#: a self-play run's outcomes of the learning policy against its opponents (``ppo_selfplay``)
SELFPLAY_RATES = (("win rate", "selfplay/win_rate"), ("draw rate", "selfplay/draw_rate"), ("loss rate", "selfplay/loss_rate"))


def return_series(columns: list[str]) -> list[tuple[str, str]]:
    """The training curves a run's plot draws, as ``(label, metrics column)``: a self-play run's
    win, draw and loss rates against its opponents (its summed return is 0 in a zero-sum game);
    the per-type returns ``charts/<type>_return`` when the run has them; else the summed
    ``charts/episodic_return``."""
    if all(c in columns for _, c in SELFPLAY_RATES):
        return list(SELFPLAY_RATES)
    per_type = [c for c in columns if c.startswith("charts/") and c.endswith("_return") and c != "charts/episodic_return"]
    return [(c.removeprefix("charts/").removesuffix("_return") + " return", c) for c in per_type] or [
        ("episodic return", "charts/episodic_return")]


def plot_run(run_dir: str | pathlib.Path, out: str | pathlib.Path | None = None) -> pathlib.Path:
    """Plots episodic return (per iteration, and its 10-iteration moving mean) and evaluation
    returns against env steps. Multi-agent runs whose ``metrics.csv`` holds per-type returns
    (``charts/<type>_return``, e.g. Tag's taggers and runners) plot those instead of the summed
    return, in which opposing types cancel out; self-play runs plot the learning policy's win,
    draw and loss rates (:func:`return_series`).

    Args:
        run_dir: a run directory with ``metrics.csv``.
        out: PNG path; default ``run_dir/learning_curve.png``.

    Returns:
        the PNG's path.

    The PNG is written to a temporary file beside ``out`` and renamed over it: a reader never
    sees half a picture, and a failure leaves the previous curve in place.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.csv``.
        msrl.InputError: ``metrics.csv`` holds no iteration yet (nothing is written: an
            earlier curve is kept).
    """
    run_dir = pathlib.Path(run_dir)
    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.csv")
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("env_steps") not in ("", None)]
    # an offline algorithm's run: its progress in gradient steps (its budget's unit)
    x_key = "gradient_steps" if rows and rows[0].get("gradient_steps") not in ("", None) else "env_steps"
    if not rows:
        raise InputError(f"{path} holds no iteration yet: nothing to plot (an earlier learning curve is kept)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def col(name: str) -> list[tuple[float, float]]:
        pts = []
        for r in rows:
            v = r.get(name, "")
            if v not in ("", None) and math.isfinite(float(v)):
                pts.append((float(r[x_key]), float(v)))
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
    ax.set_xlabel(x_key.replace("_", " "))
    ax.set_ylabel("share of games" if series == list(SELFPLAY_RATES) else "return")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no episode finished and no evaluation yet: nothing to label
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    target = pathlib.Path(out) if out is not None else run_dir / "learning_curve.png"
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, target)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return target


def plot_in_background(run_dir: str | pathlib.Path) -> subprocess.Popen:
    """Starts ``python -m msrl.run.plot RUN_DIR`` (:func:`plot_run`) in a process of its own
    session, which the caller need not wait for: it outlives ``msrl train`` and is not stopped
    by the terminal's Ctrl-C. It holds none of this process's output streams (``msrl train |
    tee log`` ends with ``msrl train``); where it fails, it writes the reason as one line to
    ``RUN_DIR/learning_curve.txt`` instead of the picture.

    Returns:
        the process (also kept for :func:`wait_for_background_plots`).
    """
    proc = subprocess.Popen([sys.executable, "-m", "msrl.run.plot", str(run_dir)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _BACKGROUND.append(proc)
    return proc


def wait_for_background_plots(timeout_s: float | None = None) -> list[int]:
    """Waits for the background plot processes this process started (:func:`plot_in_background`).

    Returns:
        their exit statuses, in the order they were started.

    Raises:
        subprocess.TimeoutExpired: one did not end within ``timeout_s`` seconds (it is left running).
    """
    codes = []
    while _BACKGROUND:
        codes.append(_BACKGROUND[0].wait(timeout_s))
        _BACKGROUND.pop(0)
    return codes


if __name__ == "__main__":  # the background process of plot_in_background
    try:
        plot_run(sys.argv[1])
    except Exception as e:  # one line where the picture would be
        (pathlib.Path(sys.argv[1]) / "learning_curve.txt").write_text(
            f"the learning curve was not drawn ({type(e).__name__}: {e}); msrl plot {sys.argv[1]} draws it\n")
        sys.exit(1)

"""Statistics and chart of a soak run, as pure functions of its sample lines.

Why this module exists: `benchmarks.soak` decides from a few hundred samples
whether a long job leaks threads, file descriptors or memory, or slows down.
Those decisions must be checkable without a cluster, so everything here takes
the ``soak_sample`` dicts that `benchmarks.soak` prints (and nothing else) and
returns plain dicts; `write_chart` draws the same samples.

A sample (one JSON line, every ``--interval`` seconds)::

    {"kind": "soak_sample", "setup": "hybrid_sync", "t_s": 65.0,
     "train_start_s": 6.8, "first_epoch_end_s": 21.3, "steps": 896, "examples": 917504,
     "progress_t_s": 63.1, "examples_per_sec": 14880.2,
     "tasks": {"chief": {"threads": 61, "rss_mb": 590.2, "fds": 40}, "worker:0": ..., ...}}

``t_s`` counts from the chief's start; ``train_start_s`` is when `model.fit`
began and ``first_epoch_end_s`` when its first epoch ended (None before);
``steps``/``examples``/``progress_t_s`` are the chief's latest progress line
(cumulative, at the end of an epoch); ``tasks`` holds every live task.

Definitions (see also benchmarks/README.md, "Soak"):

* warm-up: the first epoch (tracing, connecting to every server: tens of
  seconds on a loaded box) plus ``warmup_s``; it ends at
  ``first_epoch_end_s + warmup_s``.
* training end: the chief's last progress line (the chief may take a while
  to leave `model.fit` and exit; those samples are not training).
* post-warm-up samples: from the end of warm-up to the end of training.
* growth of threads, fds and RSS, per task: median over the first 25% of its
  post-warm-up samples -> median over the last 10%, in % of the first;
  per role (chief, worker, ps) the maximum over the role's tasks.
* ``rss_growth_pct_per_hour``: least-squares slope of RSS over the
  post-warm-up samples / mean RSS x 3600 x 100 (linear extrapolation).
* throughput windows: the first and the last 5 minutes after warm-up if
  at least 15 minutes of training follow the warm-up, else the first and the
  last quarter of that period; examples/s in a window from the chief's
  cumulative example count, interpolated linearly between progress lines.
"""

import math
import os
import statistics
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

ROLES = ("chief", "worker", "ps")
METRICS = ("threads", "fds", "rss_mb")
TARGETS = {"threads_growth_pct": 5.0, "fds_growth_pct": 5.0, "rss_growth_pct_per_hour": 5.0,
           "throughput_ratio": 0.95}
FIRST_FRACTION = 0.25
LAST_FRACTION = 0.10
MIN_POST_SAMPLES = 4
WINDOW_S = 300.0
FIXED_WINDOWS_FROM_S = 900.0
GROWTH_DEFINITION = (
    "per task: median of the first 25% of post-warm-up samples -> median of the last 10%, "
    "% of the first; per role: max over its tasks. rss_growth_pct_per_hour: least-squares "
    "slope over post-warm-up samples / mean RSS x 3600 x 100")


def role_of(task: str) -> str:
    """``"worker:1"`` -> ``"worker"``; ``"chief"`` -> ``"chief"``."""
    return task.split(":", 1)[0]


def rate_of_latest(points: Sequence[Tuple[float, float]]) -> Optional[float]:
    """Examples/s between the two latest ``(t_s, examples)`` progress points."""
    if len(points) < 2:
        return None
    (t1, e1), (t2, e2) = points[-2], points[-1]
    return (e2 - e1) / (t2 - t1) if t2 > t1 else None


def train_start(samples: Sequence[dict]) -> Optional[float]:
    """When training began (``t_s`` axis), from the first sample that knows it."""
    for s in samples:
        if s.get("train_start_s") is not None:
            return s["train_start_s"]
    return None


def warmup_end(samples: Sequence[dict], warmup_s: float) -> float:
    """End of the warm-up: end of the first epoch + `warmup_s`.

    Falls back to the start of training, then to the chief's start, while
    those are unknown.
    """
    for s in samples:
        if s.get("first_epoch_end_s") is not None:
            return s["first_epoch_end_s"] + warmup_s
    start = train_start(samples)
    return (start if start is not None else 0.0) + warmup_s


def post_warmup(samples: Sequence[dict], warmup_s: float) -> List[dict]:
    """Samples from the end of warm-up to the end of training (last progress line)."""
    begin = warmup_end(samples, warmup_s)
    points = progress_points(samples)
    end = points[-1][0] if points else math.inf
    return [s for s in samples if begin <= s["t_s"] <= end]


def progress_points(samples: Sequence[dict]) -> List[Tuple[float, float]]:
    """Distinct ``(t_s, cumulative examples)`` points, training start as ``(start, 0)``."""
    points = {}
    start = train_start(samples)
    if start is not None:
        points[start] = 0.0
    for s in samples:
        if s.get("progress_t_s") is not None:
            points[s["progress_t_s"]] = float(s["examples"])
    return sorted(points.items())


def examples_at(points: Sequence[Tuple[float, float]], t: float) -> float:
    """Cumulative examples at `t`, linear between progress points, clamped at the ends."""
    if t <= points[0][0]:
        return points[0][1]
    for (t1, e1), (t2, e2) in zip(points[:-1], points[1:]):
        if t <= t2:
            return e1 + (e2 - e1) * (t - t1) / (t2 - t1)
    return points[-1][1]


def window_rate(points: Sequence[Tuple[float, float]], a: float, b: float) -> Optional[float]:
    """Examples/s over ``[a, b]`` (clipped to the progress points' span); None if empty."""
    if len(points) < 2:
        return None
    a, b = max(a, points[0][0]), min(b, points[-1][0])
    if b <= a:
        return None
    return (examples_at(points, b) - examples_at(points, a)) / (b - a)


def throughput_windows(samples: Sequence[dict], warmup_s: float) -> dict:
    """Examples/s in the first and the last window after warm-up, and their ratio."""
    points = progress_points(samples)
    begin = warmup_end(samples, warmup_s)
    end = points[-1][0] if points else begin
    span = end - begin
    if span >= FIXED_WINDOWS_FROM_S:
        width, label = WINDOW_S, "first/last 5 min after warm-up"
    else:
        width, label = span / 4.0, "first/last quarter after warm-up (under 15 min of it)"
    first = window_rate(points, begin, begin + width) if span > 0 else None
    last = window_rate(points, end - width, end) if span > 0 else None
    return {"throughput_windows": label, "window_seconds": round(max(width, 0.0), 1),
            "examples_per_sec_first": _round(first, 1), "examples_per_sec_last": _round(last, 1),
            "throughput_ratio": _round(last / first, 4) if first and last is not None else None,
            "examples_per_sec_after_warmup": _round(window_rate(points, begin, end), 1)}


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0


def _pct(first: float, last: float) -> Optional[float]:
    return round(100.0 * (last - first) / first, 3) if first else None


def _round(x: Optional[float], digits: int) -> Optional[float]:
    return None if x is None else round(x, digits)


def task_growth(post: Sequence[dict], task: str) -> Optional[dict]:
    """Growth figures of one task over post-warm-up samples; None if too few samples."""
    series = [(s["t_s"], s["tasks"][task]) for s in post if task in s.get("tasks", {})]
    n = len(series)
    if n < MIN_POST_SAMPLES:
        return None
    k_first = max(1, math.ceil(n * FIRST_FRACTION))
    k_last = max(1, math.ceil(n * LAST_FRACTION))
    out = {"samples": n}
    for metric in METRICS:
        values = [v[metric] for _, v in series]
        first = statistics.median(values[:k_first])
        last = statistics.median(values[-k_last:])
        name = metric.replace("_mb", "")
        out[f"{name}_first"] = round(first, 1)
        out[f"{name}_last"] = round(last, 1)
        out[f"{name}_growth_pct"] = _pct(first, last)
    times = [t for t, _ in series]
    rss = [v["rss_mb"] for _, v in series]
    mean = statistics.fmean(rss)
    out["rss_growth_pct_per_hour"] = (
        round(_slope(times, rss) / mean * 3600 * 100, 3) if mean > 0 else None)
    return out


def role_growth(per_task: Dict[str, Optional[dict]]) -> Dict[str, dict]:
    """Per role, the maximum of every growth figure over the role's tasks."""
    out = {}
    keys = ("threads_growth_pct", "fds_growth_pct", "rss_growth_pct", "rss_growth_pct_per_hour")
    for role in ROLES:
        tasks = {t: g for t, g in per_task.items() if role_of(t) == role}
        if not tasks:
            continue
        rec = {}
        for key in keys:
            vals = [(g[key], t) for t, g in tasks.items() if g is not None and g[key] is not None]
            rec[key] = max(vals)[0] if vals else None
            if key == "threads_growth_pct" and vals:
                worst = max(vals)[1]
                rec["threads_first_last"] = [tasks[worst]["threads_first"],
                                             tasks[worst]["threads_last"]]
                rec["worst_task"] = worst
        out[role] = rec
    return out


def _all_within(values: Iterable[Optional[float]], limit: float) -> Optional[bool]:
    values = list(values)
    if not values or any(v is None for v in values):
        return None
    return all(v <= limit for v in values)


def summarize(samples: Sequence[dict], setup: str, warmup_s: float,
              minutes_requested: Optional[float] = None,
              task_deaths: Sequence[dict] = (), failure: Optional[str] = None) -> dict:
    """The ``soak_summary`` line of one setup.

    Args:
        samples: The setup's ``soak_sample`` dicts, in time order.
        setup: Setup name.
        warmup_s: Warm-up after the start of training, seconds.
        minutes_requested: Training minutes asked for.
        task_deaths: ``{"role", "t_s", "exit_code"}`` of every task that died.
        failure: Why the setup stopped early (None if it ran to its end).

    Returns:
        The summary: growth per role (`GROWTH_DEFINITION`), throughput windows,
        verdicts against `TARGETS` (None where there were too few samples)
        and ``completed`` (no death, no failure).
    """
    samples = [s for s in samples if s.get("setup", setup) == setup]
    begin = warmup_end(samples, warmup_s)
    post = post_warmup(samples, warmup_s)
    tasks = sorted({t for s in post for t in s.get("tasks", {})})
    per_task = {t: task_growth(post, t) for t in tasks}
    roles = role_growth(per_task)
    thr = throughput_windows(samples, warmup_s)
    points = progress_points(samples)
    start = train_start(samples)
    last = samples[-1] if samples else {}
    verdicts = {
        "threads_growth_ok": _all_within((r["threads_growth_pct"] for r in roles.values()),
                                         TARGETS["threads_growth_pct"]),
        "fds_growth_ok": _all_within((r["fds_growth_pct"] for r in roles.values()),
                                     TARGETS["fds_growth_pct"]),
        "rss_growth_ok": _all_within((r["rss_growth_pct_per_hour"] for r in roles.values()),
                                     TARGETS["rss_growth_pct_per_hour"]),
        "throughput_ok": (None if thr["throughput_ratio"] is None
                          else thr["throughput_ratio"] >= TARGETS["throughput_ratio"]),
    }
    completed = not task_deaths and failure is None
    return {
        "kind": "soak_summary", "setup": setup, "completed": completed, "failure": failure,
        "minutes": round((points[-1][0] - start) / 60.0, 2) if points and start is not None
        else 0.0,
        "minutes_requested": minutes_requested,
        "warmup_minutes": round(warmup_s / 60.0, 3),
        "steps": last.get("steps", 0), "examples": last.get("examples", 0),
        "samples": len(samples), "post_warmup_samples": len(post),
        "train_start_s": start,
        "first_epoch_end_s": next((s["first_epoch_end_s"] for s in samples
                                   if s.get("first_epoch_end_s") is not None), None),
        "warmup_end_s": round(begin, 2),
        "growth_definition": GROWTH_DEFINITION,
        "growth": roles, "growth_per_task": per_task,
        **thr,
        "targets": dict(TARGETS), "verdicts": verdicts,
        "targets_met": completed and all(v is True for v in verdicts.values()),
        "task_deaths": list(task_deaths),
        "model_dir": model_dir_summary(post),
    }


def model_dir_summary(post: Sequence[dict]) -> Optional[dict]:
    """Files and MiB of the model_dir (checkpoints) after warm-up: max and last.

    With keep-N retention both stay flat once N checkpoints exist; None when
    the setup wrote no checkpoints.
    """
    dirs = [s["model_dir"] for s in post if s.get("model_dir")]
    if not dirs:
        return None
    return {"max_files": max(d["files"] for d in dirs), "last_files": dirs[-1]["files"],
            "max_mb": max(d["mb"] for d in dirs), "last_mb": dirs[-1]["mb"]}


def role_series(samples: Sequence[dict], metric: str) -> Dict[str, Tuple[List[float], List[float]]]:
    """Per role, ``(minutes, max of `metric` over the role's live tasks)``."""
    out: Dict[str, Tuple[List[float], List[float]]] = {}
    for s in samples:
        per_role: Dict[str, float] = {}
        for task, values in s.get("tasks", {}).items():
            role = role_of(task)
            per_role[role] = max(per_role.get(role, values[metric]), values[metric])
        for role, value in per_role.items():
            xs, ys = out.setdefault(role, ([], []))
            xs.append(s["t_s"] / 60.0)
            ys.append(value)
    return out


def write_chart(samples: Sequence[dict], path: str, warmup_s: Dict[str, float]) -> str:
    """Writes the soak chart (PNG): examples/s, threads and RSS per role, per setup.

    Three panels sharing the x axis (minutes since the chief started);
    one colour per setup, one line style per role (max over its tasks); a
    dotted vertical line marks each setup's end of warm-up.

    Args:
        samples: ``soak_sample`` dicts of one or more setups.
        path: Where to write the PNG (directories are created).
        warmup_s: Warm-up seconds per setup.

    Returns:
        `path`.

    Raises:
        ImportError: matplotlib is not installed (``pip install -e .[bench]``).
    """
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

    setups = list(dict.fromkeys(s["setup"] for s in samples))
    styles = {"chief": ":", "worker": "-", "ps": "--"}
    fig = Figure(figsize=(10, 10))
    axes = fig.subplots(3, 1, sharex=True)
    for i, setup in enumerate(setups):
        color = f"C{i}"
        mine = [s for s in samples if s["setup"] == setup]
        rates = {s["progress_t_s"]: s["examples_per_sec"] for s in mine
                 if s.get("examples_per_sec") is not None}  # At the epoch ends they describe.
        axes[0].plot([t / 60.0 for t in sorted(rates)], [rates[t] for t in sorted(rates)],
                     color=color, marker=".", label=setup)
        for ax, metric in ((axes[1], "threads"), (axes[2], "rss_mb")):
            for role, (rx, ry) in sorted(role_series(mine, metric).items()):
                ax.plot(rx, ry, color=color, linestyle=styles.get(role, "-."),
                        label=f"{setup} {role}")
        end = warmup_end(mine, warmup_s.get(setup, 0.0)) / 60.0
        for ax in axes:
            ax.axvline(end, color=color, linestyle=":", linewidth=0.8, alpha=0.6)
    axes[0].set_ylabel("examples/s")
    axes[0].set_title("Soak: throughput, threads and RSS per role (max over a role's tasks); "
                      "dotted vertical: end of warm-up", fontsize=10)
    axes[1].set_ylabel("threads")
    axes[2].set_ylabel("RSS MiB")
    axes[2].set_xlabel("minutes since the chief started")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, ncol=2, loc="best")
    axes[0].set_ylim(bottom=0)
    fig.tight_layout()
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def format_summary(summary: dict) -> str:
    """A few human-readable lines of a summary (stderr)."""
    v = summary["verdicts"]
    lines = [f"{summary['setup']}: {'completed' if summary['completed'] else 'NOT completed'} "
             f"({summary['minutes']} min, {summary['steps']} steps"
             f"{'; ' + summary['failure'] if summary['failure'] else ''})"]
    for role, g in summary["growth"].items():
        lines.append(f"  {role:6s} threads {g['threads_growth_pct']}% "
                     f"{g.get('threads_first_last', '')}  fds {g['fds_growth_pct']}%  "
                     f"RSS {g['rss_growth_pct']}% ({g['rss_growth_pct_per_hour']}%/h)")
    lines.append(f"  examples/s {summary['examples_per_sec_first']} -> "
                 f"{summary['examples_per_sec_last']} (x{summary['throughput_ratio']}; "
                 f"{summary['throughput_windows']})")
    lines.append(f"  verdicts: {v}; deaths: {summary['task_deaths'] or 'none'}")
    return "\n".join(lines)

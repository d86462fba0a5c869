"""The soak run's figures, verdict, printed report and plot (benchmark/soak.py)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def median_of(samples: list[dict[str, Any]], key: str) -> float | None:
    vals = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(vals) if vals else None


def line_fit(samples: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    """Least squares ``key`` = slope * hours + intercept (None: too few samples)."""
    pts = [(s["t_s"] / 3600, s[key]) for s in samples if s.get(key) is not None]
    mt = sum(t for t, _ in pts) / max(1, len(pts))
    var = sum((t - mt) ** 2 for t, _ in pts)
    if len(pts) < 3 or var == 0:
        return None
    mv = sum(v for _, v in pts) / len(pts)
    slope = sum((t - mt) * (v - mv) for t, v in pts) / var
    return slope, mv - slope * mt


def slope_per_hour(samples: list[dict[str, Any]], key: str) -> float | None:
    fit = line_fit(samples, key)
    return None if fit is None else fit[0]


def figures(soak: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The run's figures from a finished ``Soak`` (benchmark/soak.py)."""
    warm = args.warmup_minutes * 60
    load = [s for s in soak.samples if s["phase"] == "load"]
    after = [s for s in load if s["t_s"] >= warm]
    idle = [s for s in soak.samples if s["phase"] == "idle"]
    first, last = after[:3], after[-3:]
    f: dict[str, Any] = {
        "references_s": round(soak.references_s, 1),
        "load_minutes": round(soak.load_s / 60, 2),
        "drain_s": round(soak.drain_s, 1),
        "warmup_minutes": args.warmup_minutes,
        "served": dict(sorted(soak.served.items())),
        "errors": {
            c: soak.errors[c] for c in ("expected_4xx", "unexpected_4xx", "5xx", "lost", "wrong")
        },
        "error_samples": soak.error_samples,
        "rss_mb_start": soak.before.get("rss_mb"),
        "rss_mb_warmup_end": median_of(first, "rss_mb"),
        "rss_mb_last_load": median_of(last, "rss_mb"),
        "rss_mb_end": median_of(idle, "rss_mb"),
        "rss_mb_max": max((s["rss_mb"] for s in soak.samples if s["rss_mb"]), default=None),
        "rss_slope_mb_per_hour": slope_per_hour(after, "rss_mb"),
        "pages_slope_per_hour": slope_per_hour(after, "pages_in_use"),
        "pages_in_use_max": max((s["pages_in_use"] or 0 for s in soak.samples), default=None),
        "pages_in_use_end": idle[-1]["pages_in_use"] if idle else None,
        "total_pages": next((s["total_pages"] for s in soak.samples if s["total_pages"]), None),
        "drained": soak.idle is not None,
        "preemptions": idle[-1]["preemptions"] if idle else None,
        "slope_window_minutes": round((after[-1]["t_s"] - after[0]["t_s"]) / 60, 2)
        if len(after) > 1
        else 0.0,
    }
    f["rss_judged"] = (
        f["rss_mb_warmup_end"] is not None and f["slope_window_minutes"] >= args.rss_judge_minutes
    )
    for key in ("fds", "threads"):
        f[f"{key}_warmup_end"] = median_of(first, key)
        f[f"{key}_end"] = median_of(idle, key)
        f[f"{key}_max"] = max((s[key] for s in soak.samples if s[key] is not None), default=None)
    return f


FD_SLACK, THREAD_SLACK = 16, 8  # sockets closing, a worker pool's threads come and go


def verdict(f: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Why the run fails (empty: it passes)."""
    why = []
    e = f["errors"]
    for cls in ("lost", "wrong", "5xx", "unexpected_4xx"):
        if e[cls]:
            why.append(f"{e[cls]} {cls}")
    if not f["served"].get("total"):
        why.append("no request served")
    if not f["drained"] or f["pages_in_use_end"] != 0:
        why.append(f"{f['pages_in_use_end']} KV pages in use at the end (idle)")
    base = f["rss_mb_warmup_end"]
    if f["rss_judged"]:
        top = max(v for v in (f["rss_mb_last_load"], f["rss_mb_end"], base) if v is not None)
        if top - base > args.max_rss_growth:
            why.append(
                f"RSS grew {top - base:.1f} MB after the warm-up (limit {args.max_rss_growth:g})"
            )
        slope = f["rss_slope_mb_per_hour"]
        if slope is not None and slope > args.max_rss_slope:
            why.append(f"RSS slope {slope:.1f} MB/hour (limit {args.max_rss_slope:g})")
    for key, slack in (("fds", FD_SLACK), ("threads", THREAD_SLACK)):
        b, end = f[f"{key}_warmup_end"], f[f"{key}_end"]
        if b is not None and end is not None and end > b + slack:
            why.append(f"{key}: {end:g} at the end, {b:g} after the warm-up")
    return why


def print_report(f: dict[str, Any], label: str, why: list[str]) -> None:
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\n{label}: {f['load_minutes']} minutes of load, warm-up {f['warmup_minutes']:g}")
    print("served:  " + ", ".join(f"{k} {v}" for k, v in f["served"].items()))
    print("errors:  " + ", ".join(f"{k} {v}" for k, v in f["errors"].items()))
    print(
        f"RSS MB:  start {fmt(f['rss_mb_start'])}, after warm-up {fmt(f['rss_mb_warmup_end'])},"
        f" last load {fmt(f['rss_mb_last_load'])}, end (idle) {fmt(f['rss_mb_end'])}, max "
        f"{fmt(f['rss_mb_max'])}; slope {fmt(f['rss_slope_mb_per_hour'])} MB/hour over "
        f"{f['slope_window_minutes']} min" + ("" if f["rss_judged"] else " (not judged: too short)")
    )
    print(
        f"pages:   max {f['pages_in_use_max']} of {f['total_pages']}, end {f['pages_in_use_end']}"
        f", slope {fmt(f['pages_slope_per_hour'])}/hour; preemptions {f['preemptions']}"
    )
    print(
        f"fds:     after warm-up {fmt(f['fds_warmup_end'], 'g')}, end {fmt(f['fds_end'], 'g')}, "
        f"max {fmt(f['fds_max'], 'g')}; threads: {fmt(f['threads_warmup_end'], 'g')}, "
        f"{fmt(f['threads_end'], 'g')}, max {fmt(f['threads_max'], 'g')}"
    )
    print("PASS" if not why else "FAIL: " + "; ".join(why))


def plot(samples: list[dict[str, Any]], f: dict[str, Any], label: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = samples
    t = [s["t_s"] / 60 for s in pts]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    rss, pages, misc = axes
    rss.plot(t, [s["rss_mb"] for s in pts], marker=".", lw=1)
    after = [s for s in pts if s["phase"] == "load" and s["t_s"] >= f["warmup_minutes"] * 60]
    fit = line_fit(after, "rss_mb")
    if fit is not None:
        ends = [after[0]["t_s"] / 3600, after[-1]["t_s"] / 3600]
        rss.plot(
            [h * 60 for h in ends],
            [fit[0] * h + fit[1] for h in ends],
            color="k",
            lw=1,
            ls=":",
            label="least squares after the warm-up",
        )
        rss.legend(loc="lower right")
    rss.set(
        ylabel="RSS (MB)",
        title=f"soak, {label}: {f['served'].get('total', 0)} requests, "
        f"RSS slope {f['rss_slope_mb_per_hour'] or 0:.1f} MB/hour after the warm-up",
    )
    pages.plot(t, [s["pages_in_use"] for s in pts], marker=".", lw=1, color="tab:orange")
    pages.set(ylabel=f"KV pages in use (of {f['total_pages']})")
    misc.plot(t, [s["fds"] for s in pts], marker=".", lw=1, label="open fds")
    misc.plot(t, [s["threads"] for s in pts], marker=".", lw=1, label="threads")
    misc.set(ylabel="count", xlabel="minutes since the load started")
    misc.legend(loc="upper left")
    for ax in axes:
        ax.axvspan(0, f["warmup_minutes"], color="0.9", label="warm-up")
        ax.axvline(f["load_minutes"], color="0.5", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Simulation reports: one row per (policy, capacity), printed as a table or JSON lines, plotted as hit rate vs
capacity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefixlab.errors import InvalidInputError
from prefixlab.sim.metrics import SimResult

BYTES_PER_GB = 10**9  # decimal gigabytes, as the Marconi simulator counts its 1/2/5 GB budgets


def gb_to_bytes(capacity_gb: float) -> int:
    """Bytes of `capacity_gb` decimal GB, rounded (0.3 GB is 300000000 B, not 299999999)."""
    return round(capacity_gb * BYTES_PER_GB)


# (row key, column header, format) of the comparison table.
TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("capacity_gb", "capacity GB", "{:g}"),
    ("token_hit_rate", "token hit %", "{:.2f}"),
    ("request_hit_rate", "request hit %", "{:.2f}"),
    ("flops_saved", "FLOPs saved", "{:.3e}"),
    ("ttft_p50_s", "TTFT P50 s", "{:.4f}"),
    ("ttft_p95_s", "TTFT P95 s", "{:.4f}"),
    ("replay_seconds", "replay s", "{:.2f}"),
)


TEXT_KEYS = ("policy", "routing")

# the fleet table (`simulate --replicas`): the routing columns, then the single-cache columns minus the TTFTs
FLEET_COLUMNS = (
    TABLE_COLUMNS[:2]
    + (("replicas", "replicas", "{}"), ("routing", "routing", "{}"))
    + TABLE_COLUMNS[2:4]
    + (("load_imbalance", "imbalance", "{:.3f}"), ("single_cache_token_hit_rate", "1 cache x N hit %", "{:.2f}"))
    + TABLE_COLUMNS[-1:]
)


def result_row(result: SimResult, capacity_gb: float, ceiling: SimResult) -> dict[str, Any]:
    """The report row of one replay: every SimResult field, its capacity in GB and the infinite-cache ceiling."""
    return {
        **result.as_dict(),
        "capacity_gb": capacity_gb,
        "ceiling_token_hit_rate": ceiling.token_hit_rate,
        "ceiling_request_hit_rate": ceiling.request_hit_rate,
    }


def format_table(rows: list[dict[str, Any]], columns: tuple = TABLE_COLUMNS) -> str:
    """An aligned text table of `rows`, followed by the infinite-cache ceiling line."""
    cells = [[header for _, header, _ in columns]]
    cells += [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    # Text columns align left, numbers right, so digits line up.
    text = [key in TEXT_KEYS for key, _, _ in columns]
    lines = [
        "  ".join(
            cell.ljust(width) if text[i] else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        )
        for line in cells
    ]
    if rows:
        lines.append(
            f"infinite-cache ceiling: token hit {rows[0]['ceiling_token_hit_rate']:.2f} %, "
            f"request hit {rows[0]['ceiling_request_hit_rate']:.2f} %"
        )
    lines += [
        f"dp vs best other at {c['capacity_gb']:g} GB{_fleet_label(c)}: token hit {c['token_hit_pts']:+.2f} pts "
        f"(best other {c['best_token_policy']}), FLOPs saved {_flops_comparison(c['flops_saved_pct'])} "
        f"(best other {c['best_flops_policy']})"
        for c in dp_vs_best_other(rows)
    ]
    return "\n".join(lines)


def _flops_comparison(pct: float | None) -> str:
    return "some where every other saved none" if pct is None else f"{pct:+.2f} %"


def _fleet_label(comparison: dict[str, Any]) -> str:
    replicas = comparison.get("replicas")
    return "" if replicas is None else f" x {replicas} replicas, {comparison['routing']}"


def dp_vs_best_other(rows: list[dict[str, Any]], policy: str = "dp") -> list[dict[str, Any]]:
    """Per capacity (and, for fleet rows, replicas and routing) holding a `policy` row and another policy's:
    `policy`'s token hit rate minus the best other's (points) and its FLOPs saved relative to the best other's
    (percent; 0 when both saved nothing, None when only `policy` saved any: no ratio exists)."""
    out = []
    setups = dict.fromkeys((row["capacity_gb"], row.get("replicas"), row.get("routing")) for row in rows)
    for capacity_gb, replicas, routing in setups:
        same = [row for row in rows if (row["capacity_gb"], row.get("replicas"), row.get("routing")) == (
            capacity_gb, replicas, routing)]
        ours = next((row for row in same if row["policy"] == policy), None)
        others = [row for row in same if row["policy"] != policy]
        if ours is None or not others:
            continue
        by_hits = max(others, key=lambda row: row["token_hit_rate"])
        by_flops = max(others, key=lambda row: row["flops_saved"])
        best_flops = by_flops["flops_saved"]
        relative = 100.0 * (ours["flops_saved"] / best_flops - 1.0) if best_flops > 0 else (
            0.0 if ours["flops_saved"] <= 0 else None)
        out.append({
            "capacity_gb": capacity_gb, **({"replicas": replicas, "routing": routing} if replicas is not None else {}),
            "token_hit_pts": ours["token_hit_rate"] - by_hits["token_hit_rate"],
            "best_token_policy": by_hits["policy"], "flops_saved_pct": relative,
            "best_flops_policy": by_flops["policy"],
        })
    return out


def json_lines(rows: list[dict[str, Any]]) -> str:
    """One JSON object per row and line."""
    return "\n".join(json.dumps(row, sort_keys=True) for row in rows)


def check_plot_path(path: str | Path) -> Path:
    """`path` if a plot can be written there (a .png/.pdf/.svg name in an existing folder), else InvalidInputError."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise InvalidInputError(f"--plot {str(path)!r}: use a .png, .pdf or .svg file name")
    if not path.parent.is_dir():
        raise InvalidInputError(f"--plot {str(path)!r}: folder {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise InvalidInputError(f"--plot {str(path)!r} is a folder; pass the path of the image file to write")
    return path


def save_plot(figure, path: str | Path, **options) -> None:
    """`figure.savefig(path, **options)`; a path that cannot be written is InvalidInputError (every --plot)."""
    try:
        figure.savefig(path, **options)
    except OSError as err:
        raise InvalidInputError(f"--plot {str(path)!r}: cannot write it ({err.strerror}); pass a path you can write "
                                "to") from None


def plot_hit_rates(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Token hit rate vs capacity, one line per policy, the ceiling dashed; written with the Agg canvas."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and never touches a GUI backend

    path = check_plot_path(path)
    figure = Figure(figsize=(6, 4), layout="constrained")
    axes = figure.add_subplot()
    for policy in dict.fromkeys(row["policy"] for row in rows):
        points = sorted((row["capacity_gb"], row["token_hit_rate"]) for row in rows if row["policy"] == policy)
        axes.plot(*zip(*points, strict=True), marker="o", label=policy)
    if rows:
        axes.axhline(rows[0]["ceiling_token_hit_rate"], color="gray", linestyle="--", label="infinite cache")
    axes.set(xlabel="cache capacity (GB)", ylabel="token hit rate (%)", ylim=(0, 100))
    axes.legend()
    save_plot(figure, path)


ROUTING_COLORS = {"random": "tab:red", "round-robin": "tab:orange", "affinity": "tab:blue", "one cache": "tab:gray"}
SETUP_MARKERS = ("o", "s", "^", "D", "v", "P")


def plot_fleet(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Token hit rate vs replicas, one line per (policy, capacity, routing) and, when the rows have it, a dotted one
    per (policy, capacity) for one cache of the fleet's total capacity; a colour per routing, a marker per (policy,
    capacity), the legend beside the axes; written with the Agg canvas."""
    from matplotlib.figure import Figure

    path = check_plot_path(path)
    figure = Figure(figsize=(8.5, 4), layout="constrained")
    axes = figure.add_subplot()
    setups = list(dict.fromkeys((row["policy"], row["capacity_gb"]) for row in rows))
    for index, (policy, capacity_gb) in enumerate(setups):
        mine = [row for row in rows if (row["policy"], row["capacity_gb"]) == (policy, capacity_gb)]
        prefix = f"{policy} {capacity_gb:g} GB/replica, " if len(setups) > 1 else ""
        marker = SETUP_MARKERS[index % len(SETUP_MARKERS)]
        for routing in dict.fromkeys(row["routing"] for row in mine):
            points = sorted((row["replicas"], row["token_hit_rate"]) for row in mine if row["routing"] == routing)
            axes.plot(*zip(*points, strict=True), marker=marker, color=ROUTING_COLORS.get(routing),
                      label=prefix + routing)
        single = sorted({(row["replicas"], row["single_cache_token_hit_rate"]) for row in mine
                         if "single_cache_token_hit_rate" in row})
        if single:
            axes.plot(*zip(*single, strict=True), linestyle=":", marker=marker, color=ROUTING_COLORS["one cache"],
                      label=prefix + "one cache of N x capacity")
    if rows:
        axes.axhline(rows[0]["ceiling_token_hit_rate"], color="black", linestyle="--", linewidth=0.8,
                     label="infinite cache")
    title = f"{setups[0][0]}, {setups[0][1]:g} GB per replica" if len(setups) == 1 else ""
    axes.set(xlabel="replicas", ylabel="token hit rate (%)", ylim=(0, 100), xscale="log", title=title)
    replicas = sorted({row["replicas"] for row in rows})
    axes.set_xticks(replicas, [str(n) for n in replicas])
    axes.minorticks_off()
    figure.legend(loc="outside right upper", fontsize="small")
    save_plot(figure, path)

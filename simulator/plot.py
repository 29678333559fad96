"""Gantt chart of a replay with each rank's memory curve under its row (PNG, SVG or PDF).

matplotlib is imported here only, when a picture is asked for, and drawn without pyplot (no
display, no global state).
"""

from __future__ import annotations

import io
from pathlib import Path

from basics.errors import InputError
from basics.files import atomic_write_bytes
from basics.units import format_bytes
from simulator.result import SimulationResult

FORMATS = (".png", ".svg", ".pdf")
OP_COLOURS = {"F": "#3b75af", "B": "#ef8636", "I": "#c2413b", "W": "#519e3e"}
OP_LABELS = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
MEMORY_COLOUR = "#7f7f7f"
SHARDED_COLOUR = "#8c564b"  # data parallelism's share of the memory curve (FSDP's gathered parameters and gradients)
BAR_TOP, BAR_HEIGHT = 0.06, 0.5  # within a rank's row of height 1, measured downwards
CURVE_BASE, CURVE_HEIGHT = 0.94, 0.32
MAX_LABELS = 4000
RASTERIZE_ABOVE = 20000  # actions; above this, bars are embedded as an image even in SVG


def check_plot_path(path: str | Path, field: str = "plot") -> Path:
    """The path as a Path if its suffix names a format this module draws; InputError otherwise."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise InputError(field, f"expected a file ending in {', '.join(FORMATS)}, got {path.name!r}")
    return path


def draw_gantt(result: SimulationResult, path: str | Path, *, title: str | None = None) -> None:
    """Draw `result` to `path`; the suffix picks the format."""
    path = check_plot_path(path)
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise InputError("plot", "drawing needs matplotlib: pip install 'sapp-hook[plot]'") from None

    schedule = result.schedule
    ranks, chunks = schedule.ranks, schedule.chunks
    end_ms = result.iteration_time_ms or 1.0
    width_in = 14.0
    figure = Figure(figsize=(width_in, min(max(1.6 + 0.42 * ranks, 3.2), 32.0)), layout="constrained")
    axes = figure.add_subplot()
    bar_px_per_ms = (width_in * 0.82 * figure.dpi) / end_ms

    mean_ms = sum(result.rank_busy_ms) / max(schedule.num_actions, 1)
    edges = "white" if mean_ms * bar_px_per_ms >= 6 else "none"
    rasterized = schedule.num_actions > RASTERIZE_ABOVE
    ops_seen: set[str] = set()
    labels = []
    for rank in range(ranks):
        boxes: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for timed in result.rank_timeline(rank):
            duration = timed.end_ms - timed.start_ms
            boxes.setdefault((timed.action.op, timed.chunk), []).append((timed.start_ms, duration))
            if duration * bar_px_per_ms >= 14:
                labels.append((timed.start_ms + duration / 2, rank, timed.action.microbatch))
        for (op, chunk), spans in boxes.items():
            ops_seen.add(op)
            axes.broken_barh(
                spans,
                (rank + BAR_TOP, BAR_HEIGHT),
                facecolors=_shade(OP_COLOURS[op], chunk, chunks),
                edgecolors=edges,
                linewidth=0.4,
                rasterized=rasterized,
            )

    if len(labels) <= MAX_LABELS:
        for x, rank, microbatch in labels:
            axes.text(
                x, rank + BAR_TOP + BAR_HEIGHT / 2, str(microbatch), ha="center", va="center", fontsize=6, color="white"
            )

    peak_bytes = max(result.rank_peak_memory_bytes)
    curves = [result.memory_split(rank) for rank in range(ranks)] if peak_bytes > 0 else []
    # one scale for all rows, from the lowest level to the highest peak: activations show above large static memory
    floor_bytes = min(m for curve in curves for _, m, _ in curve) if curves else 0.0
    span_bytes = peak_bytes - floor_bytes
    sharded_seen = False
    for rank, curve in enumerate(curves):
        times = [t for t, _, _ in curve]

        def level(m: float, rank: int = rank) -> float:
            return rank + CURVE_BASE - CURVE_HEIGHT * ((m - floor_bytes) / span_bytes if span_bytes > 0 else 1.0)

        levels = [level(m) for _, m, _ in curve]
        axes.fill_between(
            times,
            rank + CURVE_BASE,
            levels,
            step="post",
            color=MEMORY_COLOUR,
            alpha=0.45,
            linewidth=0,
            rasterized=rasterized,
        )
        if any(sharded for _, _, sharded in curve):  # data parallelism's share, on top of the rest
            sharded_seen = True
            axes.fill_between(
                times,
                [level(max(m - sharded, floor_bytes)) for _, m, sharded in curve],
                levels,
                step="post",
                color=SHARDED_COLOUR,
                alpha=0.6,
                linewidth=0,
                rasterized=rasterized,
            )
        axes.text(
            end_ms * 1.004,
            rank + 0.5,
            f"peak {format_bytes(result.rank_peak_memory_bytes[rank])}",
            va="center",
            fontsize=7,
        )

    axes.axvline(end_ms, color="black", linewidth=0.8, linestyle="--")
    axes.set_xlim(0, end_ms * (1.09 if peak_bytes > 0 else 1.01))
    axes.set_ylim(ranks, 0)
    axes.set_yticks([rank + 0.5 for rank in range(ranks)])
    axes.set_yticklabels([f"rank {rank}" for rank in range(ranks)], fontsize=7 if ranks > 16 else 9)
    axes.set_xlabel("time (ms)")
    for spine in ("top", "right"):
        axes.spines[spine].set_visible(False)

    handles = [Patch(color=OP_COLOURS[k], label=OP_LABELS[k]) for k in OP_COLOURS if k in ops_seen]
    if chunks > 1:
        later = _shade(OP_COLOURS["F"], chunks - 1, chunks)
        handles.append(Patch(color=later, label=f"lighter = later chunk (of {chunks})"))
    if peak_bytes > 0:
        handles.append(
            Patch(
                color=MEMORY_COLOUR,
                alpha=0.45,
                label=f"memory ({format_bytes(floor_bytes)} to {format_bytes(peak_bytes)})",
            )
        )
    if sharded_seen:
        handles.append(Patch(color=SHARDED_COLOUR, alpha=0.6, label="of it, gathered parameters and whole gradients"))
    axes.legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=len(handles), fontsize=8, frameon=False
    )

    bubble = result.bubble
    figure.suptitle(
        title
        or (
            f"{schedule.describe()}; iteration {result.iteration_time_ms:,.4g} ms\n"
            f"bubble {bubble.real:.3f} = ideal {bubble.ideal:.3f} + imbalance {bubble.imbalance:.3f}"
            f" + recompute {bubble.recompute:.3f} + comm {bubble.comm:.3f}"
        ),
        fontsize=11,
    )
    buffer = io.BytesIO()
    figure.savefig(buffer, format=path.suffix.lower().lstrip("."), dpi=110)
    atomic_write_bytes(path, buffer.getvalue())


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Later chunks are lighter: mix the colour with white."""
    red, green, blue = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    mix = 0.55 * chunk / max(chunks - 1, 1) if chunks > 1 else 0.0
    return (red + (1 - red) * mix, green + (1 - green) * mix, blue + (1 - blue) * mix)

"""Point labels that do not overlap: :func:`place_labels` puts each label of a scatter plot where it covers no other
label, no point and stays inside the axes, with a thin line to its point when it had to move away from it.

Greedy, in display coordinates (Agg): for each point in turn, candidate offsets on rings of growing radius around it
(eight directions each, up-right first) are tried until one is free; when none is, the candidate that overlaps
least is taken. Call it after the figure's layout is final (``fig.tight_layout()`` first), and save without laying
the figure out again, or the points move under their labels.
"""

from __future__ import annotations

import math

__all__ = ["place_labels"]

#: ring radii (points) of the candidate offsets, and the eight directions of each ring (up-right first)
RADII = (5, 12, 20, 30, 42, 56, 72, 90, 110)
DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _outside(box, frame) -> float:
    """How much of ``box`` (area) lies outside ``frame``."""
    return box.width * box.height - _overlap(box, frame)


def place_labels(ax, xs, ys, labels, fontsize: float = 7, pad: float = 2.0) -> list:
    """Annotate point (xs[i], ys[i]) with labels[i] without overlaps (see the module docstring); returns the
    annotations. Points with the same label text are still labelled one by one."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    scale = fig.dpi / 72.0  # display pixels per point
    frame = ax.get_window_extent(renderer)
    points = [ax.transData.transform((x, y)) for x, y in zip(xs, ys)]
    marker = 4 * scale
    taken = [Bbox.from_extents(px - marker, py - marker, px + marker, py + marker) for px, py in points]
    out = []
    for (x, y), label in zip(zip(xs, ys), labels):
        ann = ax.annotate(label, (x, y), xytext=(0, 0), textcoords="offset points", fontsize=fontsize)
        best, best_cost = None, math.inf
        for radius in RADII:
            for dx, dy in DIRECTIONS:
                norm = math.hypot(dx, dy)
                offset = (radius * dx / norm, radius * dy / norm)
                ann.xyann = offset
                ann.set_ha("left" if dx > 0 else "right" if dx < 0 else "center")
                ann.set_va("bottom" if dy > 0 else "top" if dy < 0 else "center")
                box = ann.get_window_extent(renderer).padded(pad * scale)
                cost = sum(_overlap(box, t) for t in taken) + 10 * _outside(box, frame)
                if cost < best_cost:
                    best, best_cost = (offset, ann.get_ha(), ann.get_va(), box), cost
                if cost == 0:
                    break
            if best_cost == 0:
                break
        offset, ha, va, box = best
        ann.remove()
        far = math.hypot(*offset) > RADII[0] + 1
        ann = ax.annotate(label, (x, y), xytext=offset, textcoords="offset points", fontsize=fontsize, ha=ha, va=va,
                          arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5", shrinkA=1, shrinkB=3) if far else None)
        taken.append(box)
        out.append(ann)
    return out

"""The HTML form of `ptxc report`: one self-contained page (jinja2 template
ptxc/templates/report.html.j2) with an inline SVG roofline plot per GPU model.

The plots are computed here, in plain Python, as coordinates: no JavaScript, no external
stylesheets, fonts or images, so the page opens the same from a CI artifact, an e-mail or a
file:// URL. Axes are log-log: arithmetic intensity (FLOP/byte) against TFLOP/s. Each GPU gets
its bandwidth slope and two compute ceilings (tensor cores, f32 SIMT); each kernel x target is a
labelled point on its roof (the roofline-bound performance at the report's shape), and measured
points from `ptxc bench --json` (report --measured) are drawn as rings.
"""

from __future__ import annotations

import math

from .tables import LOOP_COLUMNS, fmt_bound, fmt_count, fmt_seconds
from .sass import MIX_CLASSES

WIDTH, HEIGHT = 560, 360
MARGIN = {"left": 70, "right": 24, "top": 28, "bottom": 52}
COLORS = {"tensor": "#c0392b", "simt": "#2471a3", "measured": "#1e8449"}


class _Axes:
    def __init__(self, xs: list[float], ys: list[float]):
        self.lx = (math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs))))
        self.ly = (math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys))))
        if self.lx[0] == self.lx[1]:
            self.lx = (self.lx[0], self.lx[0] + 1)
        if self.ly[0] == self.ly[1]:
            self.ly = (self.ly[0], self.ly[0] + 1)
        self.w = WIDTH - MARGIN["left"] - MARGIN["right"]
        self.h = HEIGHT - MARGIN["top"] - MARGIN["bottom"]

    def x(self, v: float) -> float:
        return round(MARGIN["left"] + (math.log10(v) - self.lx[0]) / (self.lx[1] - self.lx[0]) * self.w, 1)

    def y(self, v: float) -> float:
        return round(MARGIN["top"] + self.h - (math.log10(v) - self.ly[0]) / (self.ly[1] - self.ly[0]) * self.h, 1)

    def ticks(self, lo_hi: tuple[int, int], to_px) -> list[dict]:
        return [{"pos": to_px(10.0 ** e), "label": _decade(e)} for e in range(lo_hi[0], lo_hi[1] + 1)]


def _decade(e: int) -> str:
    v = 10.0 ** e
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


def roofline_plot(gpu: dict, points: list[dict], measured: list[dict]) -> dict:
    """Everything the template needs to draw one GPU's roofline as SVG."""
    bw = gpu["bandwidth_gbs"] * 1e9 / 1e12          # TFLOP/s per (FLOP/byte)
    peaks = {"tensor": gpu["tensor_tflops"], "simt": gpu["f32_tflops"]}
    ridges = {u: p / bw for u, p in peaks.items()}
    xs = [p["intensity"] for p in points + measured] + list(ridges.values())
    ys = [p["tflops"] for p in points + measured] + list(peaks.values())
    xs = [min(xs) / 4, max(xs) * 4]
    ys = [max(min(ys) / 4, 1e-6), max(ys) * 2]
    ax = _Axes(xs, ys)
    x_lo, x_hi = 10.0 ** ax.lx[0], 10.0 ** ax.lx[1]
    y_lo = 10.0 ** ax.ly[0]
    roofs = []
    for unit, peak in peaks.items():
        start = max(x_lo, y_lo / bw)     # where the bandwidth slope enters the plot
        pts = [(start, start * bw), (ridges[unit], peak), (x_hi, peak)]
        roofs.append({"unit": unit, "color": COLORS[unit], "peak": peak,
                      "label": f"{'tensor' if unit == 'tensor' else 'f32 SIMT'} {peak:g} TFLOP/s",
                      "label_y": ax.y(peak) + 13,   # under the line: point tags go above
                      "points": " ".join(f"{ax.x(a)},{ax.y(b)}" for a, b in pts)})
    # Points closer than a marker's width share one number; a lone point far from the others is
    # labelled with its name, crowded ones with their number only, and the legend under the
    # plot names every number (labels never pile up, however many kernels sit together).
    clusters: list[dict] = []
    for p in sorted(points, key=lambda p: (p["intensity"], p["label"])) + measured:
        px, py = ax.x(p["intensity"]), ax.y(p["tflops"])
        near = next((c for c in clusters if abs(c["px"] - px) < 11 and abs(c["py"] - py) < 11), None)
        if near is None:
            near = {"px": px, "py": py, "members": []}
            clusters.append(near)
        near["members"].append({**p, "px": px, "py": py})
    drawn, legend = [], []
    for n, c in enumerate(clusters, 1):
        lone = len(c["members"]) == 1 and not any(
            o is not c and abs(o["px"] - c["px"]) < 150 and abs(o["py"] - c["py"]) < 16 for o in clusters)
        right = c["px"] > WIDTH - MARGIN["right"] - 170
        tag = f"{n} {c['members'][0]['label']}" if lone else str(n)
        for m in c["members"]:
            drawn.append(m)
            legend.append({"n": n, "color": m["color"], "text": f"{m['label']}: {m['title']}"})
        drawn[-1] = {**drawn[-1], "tag": tag, "anchor": "end" if right else "start",
                     "label_x": c["px"] - 6 if right else c["px"] + 6, "label_y": c["py"] - 6}
    return {
        "gpu": gpu, "width": WIDTH, "height": HEIGHT, "margin": MARGIN, "roofs": roofs, "points": drawn,
        "legend": legend,
        "xticks": ax.ticks(ax.lx, ax.x), "yticks": ax.ticks(ax.ly, ax.y),
        "plot_bottom": HEIGHT - MARGIN["bottom"], "plot_right": WIDTH - MARGIN["right"],
        "bandwidth_label": f"{gpu['bandwidth_gbs']:g} GB/s",
        "slope_label_x": ax.x(max(x_lo, y_lo / bw) * 1.6), "slope_label_y": ax.y(max(x_lo, y_lo / bw) * 1.6 * bw) - 8,
    }


def plots_for(report: dict) -> list[dict]:
    plots = []
    for key, gpu in report["gpus"].items():
        points, measured = [], []
        for k in report["kernels"]:
            for t in k["targets"]:
                for r in t["roofline"]:
                    if r["gpu"] == key and t["cost"]["flops"] > 0:   # no FLOPs: no point on a log axis
                        points.append({"label": f"{k['name']} [{t['target']}]", "unit": t["cost"]["unit"],
                                       "color": COLORS[t["cost"]["unit"]], "measured": False,
                                       "intensity": t["cost"]["intensity"], "tflops": r["attainable_tflops"],
                                       "title": f"{r['bound']}-bound, {fmt_seconds(r['seconds'])} at "
                                                + ",".join(f"{n}={v}" for n, v in k["dims"].items())})
                for m in t["measured"]:
                    if m.get("gpu") == key and m.get("tflops"):
                        measured.append({"label": f"{k['name']} [{t['target']}] measured", "measured": True,
                                         "color": COLORS["measured"], "intensity": m["intensity"],
                                         "tflops": m["tflops"],
                                         "title": f"{m['median_ms']:.4g} ms, {m['tflops']:.3g} TFLOP/s"})
        if points or measured:
            plots.append(roofline_plot(gpu, points, measured))
    return plots


def render_html(report: dict) -> str:
    import jinja2  # deferred: keeps `ptxc --help` fast
    env = jinja2.Environment(loader=jinja2.PackageLoader("ptxc", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["seconds"] = fmt_seconds
    env.filters["count"] = fmt_count
    return env.get_template("report.html.j2").render(
        report=report, plots=plots_for(report), mix_classes=list(MIX_CLASSES),
        loop_columns=LOOP_COLUMNS, bound_text=lambda b: fmt_bound(report, b))


__all__ = ["plots_for", "render_html", "roofline_plot"]

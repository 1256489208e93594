// One chart of one or more metric series over uPlot: live appends, EMA
// smoothing, log scale, x by step / wall time / relative time, values on
// hover (uPlot's legend), and rewound points (those after a rollback) drawn
// as a separate faded dashed series so they never read as the live curve.
// Value-axis labels come from ticks.js (exact digits, 1e-7 for tiny values).

import uPlot from "../vendor/uplot/uPlot.esm.js";
import { ema } from "./smoothing.js";
import { formatTicks } from "./ticks.js";

const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#be185d", "#4b5563"];

function toSeconds(x) {
  return typeof x === "string" ? Date.parse(x) / 1000 : x;
}

function insertSorted(series, x, y) {
  const n = series.x.length;
  if (!n || series.x[n - 1] < x) {
    series.x.push(x);
    series.y.push(y);
    return;
  }
  const i = series.x.findIndex((v) => v >= x);
  if (series.x[i] === x) series.y[i] = y; // the same step again (a retried batch): the newer value wins
  else {
    series.x.splice(i, 0, x);
    series.y.splice(i, 0, y);
  }
}

// Room for the longest label ("-2.5e-7" needs more than "0.5"): about 7 px a character at uPlot's
// 12 px axis font, plus the tick (10 px) and its gap (5 px); uPlot passes null before the first labels.
function yAxisWidth(labels) {
  const longest = Math.max(0, ...(labels || []).map((s) => s.length));
  return Math.max(60, 22 + 7 * longest);
}

// The legend's value under the cursor, with the axis' notation (uPlot's default rounds 1e-7 to "0").
function hoverValue(u, v) {
  return v === null || v === undefined ? "--" : formatTicks([v])[0]; // "--": uPlot's own "no value"
}

export class MetricChart {
  // keys: metric names drawn together; opts: {xMode: "step"|"time"|"relative", smoothing, log, t0}
  constructor(container, title, keys, opts) {
    this.container = container;
    this.title = title;
    this.keys = keys;
    this.opts = { ...opts };
    // Per key, two sorted series: live points and rewound ones (kept apart: after a rollback the
    // run reports the same steps again, and both the old and the new values are drawn).
    this.data = Object.fromEntries(keys.map((k) => [k, { live: { x: [], y: [] }, rewound: { x: [], y: [] } }]));
    this.plot = null;
    this.pending = false;
  }

  // Replace a key's points (from GET /api/runs/<id>/metrics/).
  setSeries(key, series) {
    if (!this.data[key]) return;
    const d = { live: { x: [], y: [] }, rewound: { x: [], y: [] } };
    series.x.forEach((x, i) => {
      const target = series.rewound && series.rewound[i] ? d.rewound : d.live;
      insertSorted(target, toSeconds(x), series.y[i]);
    });
    this.data[key] = d;
  }

  // Add one live point; a point at an x already present replaces it.
  append(key, x, y) {
    const d = this.data[key];
    if (!d || y === null || y === undefined) return false;
    insertSorted(d.live, toSeconds(x), y);
    return true;
  }

  // Live points after ``afterStep`` become rewound (a rollback completed); only on the step axis
  // (on a time axis the page reloads the series from the server, which flags them).
  markRewound(afterStep) {
    if (this.opts.xMode !== "step") return;
    for (const d of Object.values(this.data)) {
      const keep = { x: [], y: [] };
      d.live.x.forEach((x, i) => {
        if (x > afterStep) insertSorted(d.rewound, x, d.live.y[i]);
        else {
          keep.x.push(x);
          keep.y.push(d.live.y[i]);
        }
      });
      d.live = keep;
    }
  }

  pointCount(which = "live") {
    return Object.values(this.data).reduce((n, d) => n + d[which].x.length, 0);
  }

  setOptions(opts) {
    const rebuild = opts.log !== undefined && opts.log !== this.opts.log;
    this.opts = { ...this.opts, ...opts };
    if (rebuild && this.plot) {
      this.plot.destroy();
      this.plot = null;
    }
    this.render();
  }

  // Coalesce bursts of live points into one redraw per animation frame.
  scheduleRender() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.render();
    });
  }

  // uPlot wants one shared x array: the union of every series' x, nulls where a series has no point.
  _aligned() {
    const xs = new Set();
    for (const d of Object.values(this.data)) {
      d.live.x.forEach((x) => xs.add(x));
      d.rewound.x.forEach((x) => xs.add(x));
    }
    const xAxis = Array.from(xs).sort((a, b) => a - b);
    const index = new Map(xAxis.map((x, i) => [x, i]));
    const columns = [];
    for (const key of this.keys) {
      const d = this.data[key];
      const live = new Array(xAxis.length).fill(null);
      const rewound = new Array(xAxis.length).fill(null);
      const smoothed = ema(d.live.y, this.opts.smoothing);
      d.live.x.forEach((x, i) => {
        live[index.get(x)] = this._logSafe(smoothed[i]);
      });
      d.rewound.x.forEach((x, i) => {
        rewound[index.get(x)] = this._logSafe(d.rewound.y[i]);
      });
      columns.push(live);
      if (this._withRewound) columns.push(rewound);
    }
    let x = xAxis;
    if (this.opts.xMode === "relative") {
      const t0 = this.opts.t0 ?? xAxis[0] ?? 0;
      x = xAxis.map((v) => v - t0);
    }
    return [x, ...columns];
  }

  // The value axis' labels; the last drawn ones are also kept on the element (data-y-ticks, space
  // separated, the blanks of ticks a log scale skips left out) since uPlot draws them on a canvas.
  _yTicks(splits) {
    const labels = formatTicks(splits);
    this.container.dataset.yTicks = labels.filter((label) => label !== "").join(" ");
    return labels;
  }

  _logSafe(v) {
    return this.opts.log && v !== null && v <= 0 ? null : v;
  }

  _build(width) {
    const series = [{ label: this.opts.xMode === "step" ? "step" : this.opts.xMode === "time" ? "time" : "seconds" }];
    this.keys.forEach((key, i) => {
      const color = COLORS[i % COLORS.length];
      const label = this.opts.smoothing > 0 ? `${key} (EMA)` : key;
      series.push({ label, stroke: color, width: 1.5, spanGaps: true, points: { show: false }, value: hoverValue });
      if (this._withRewound) {
        series.push({ label: `${key} rewound`, stroke: "#9ca3af", dash: [4, 4], width: 1, spanGaps: true, points: { show: false }, value: hoverValue });
      }
    });
    const opts = {
      title: this.title,
      width,
      height: 200,
      series,
      scales: { x: { time: this.opts.xMode === "time" }, y: this.opts.log ? { distr: 3 } : {} },
      axes: [{}, { values: (u, splits) => this._yTicks(splits), size: (u, labels) => yAxisWidth(labels) }],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
    };
    this.plot = new uPlot(opts, this._aligned(), this.container);
  }

  _width() {
    return Math.max(this.container.clientWidth || 400, 300); // 0 while in a folded section
  }

  // Fit the plot to its container again (a folded section was opened).
  resize() {
    if (this.plot) this.plot.setSize({ width: this._width(), height: 200 });
  }

  render() {
    const width = this._width();
    // The series list changes with the x mode, smoothing on/off and whether any point is rewound
    // (rewound series are added only then, to keep the legend short): rebuild the plot when it does.
    const shape = `${this.opts.xMode}|${this.opts.smoothing > 0}|${this.pointCount("rewound") > 0}`;
    if (this.plot && this._shape === shape) {
      this.plot.setData(this._aligned());
    } else {
      if (this.plot) this.plot.destroy();
      this._withRewound = this.pointCount("rewound") > 0;
      this._build(width);
      this._shape = shape;
    }
    // Counts on the element: what the browser tests (and a curious reader of the DOM) check.
    this.container.dataset.points = String(this.pointCount());
    this.container.dataset.rewound = String(this.pointCount("rewound"));
  }
}

// Overlay one metric of several runs: each run's downsampled series from
// GET /api/runs/<id>/metrics/, one line per run, on the step axis; live
// points of each run appended from its stream.

import { api, pageData } from "./api.js";
import { MetricChart } from "./chart.js";
import { Stream } from "./stream.js";

const live = pageData("compare-live");
const labels = live.runs.map((r) => `${r.id} · ${r.name}`);
const view = { xMode: "step", smoothing: 0, log: false };
const chart = new MetricChart(document.getElementById("compare-chart"), live.key, labels, view);

document.querySelector(".compare-form").addEventListener("submit", () => {
  const ids = Array.from(document.querySelectorAll(".compare-run:checked")).map((c) => c.value);
  document.getElementById("compare-runs").value = ids.join(",");
});
document.getElementById("smoothing").addEventListener("input", (e) => chart.setOptions({ smoothing: Number(e.target.value) }));
document.getElementById("log-scale").addEventListener("change", (e) => chart.setOptions({ log: e.target.checked }));

await Promise.all(
  live.runs.map(async (run, i) => {
    const query = `keys=${encodeURIComponent(live.key)}&x=step&max_points=1000`;
    try {
      const data = await api("GET", `/api/runs/${run.id}/metrics/?${query}`);
      const series = data.series[live.key];
      if (series) chart.setSeries(labels[i], series);
      // Resume each run's stream where the page was rendered; points racing the snapshot re-set the same x.
      new Stream(`/ws/runs/${run.id}/`, {
        after: run.seq,
        onEntry: (msg) => {
          if (msg.type !== "metrics") return;
          for (const point of msg.data.points || []) {
            const value = point.values?.[live.key];
            if (value !== undefined && chart.append(labels[i], point.step, value)) chart.scheduleRender();
          }
        },
      }).start();
    } catch {
      // A run the API refuses (deleted meanwhile) is left out of the overlay.
    }
  }),
);
chart.render();

// Pages listing runs (experiment, cluster): rows marked data-run-id get their
// state, queue position, reason and key metrics from the ws/runs/ stream; elements marked
// data-group-id / data-usage get a resource group's device counts.

import { el } from "./api.js";
import { Stream } from "./stream.js";

function onRun(run) {
  for (const row of document.querySelectorAll(`[data-run-id="${run.id}"]`)) {
    const badge = row.querySelector(".run-state");
    if (badge) {
      badge.textContent = run.state;
      badge.className = `state state-${run.state} run-state`;
    }
    const position = row.querySelector(".run-position");
    if (position) {
      const queued = run.state === "QUEUED";
      position.replaceChildren(
        queued ? `#${run.queue_position ?? "?"} · ` : "",
        el("span", { class: queued ? "reason" : "muted" }, run.reason || ""),
      );
    }
  }
}

function onMetrics(data) {
  // The run's newest key metrics (reward, accuracy, staleness), as the page rendered them.
  for (const cell of document.querySelectorAll(`[data-run-id="${data.id}"] .key-metrics`)) {
    cell.replaceChildren(
      ...Object.entries(data.metrics).map(([name, value]) =>
        el("div", {}, el("code", {}, name), ` ${Number(value).toFixed(3)}`),
      ),
    );
  }
}

function onCluster(group) {
  for (const box of document.querySelectorAll(`[data-group-id="${group.id}"]`)) {
    for (const cell of box.querySelectorAll("[data-usage]")) {
      const value = group[cell.dataset.usage];
      if (value !== undefined) cell.textContent = String(value);
    }
  }
}

const status = document.getElementById("stream-status");
new Stream("/ws/runs/", {
  resume: false,
  onEntry: (msg) => {
    if (msg.type === "run") onRun(msg.data);
    else if (msg.type === "metrics") onMetrics(msg.data);
    else if (msg.type === "cluster") onCluster(msg.data);
  },
  onStatus: (s) => {
    if (status) {
      status.textContent = s;
      status.dataset.status = s;
    }
  },
}).start();

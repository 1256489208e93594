// Pages listing runs (experiment, cluster): rows marked data-run-id get their
// state, queue position, reason and key metrics from the ws/runs/ stream; elements marked
// data-group-id / data-usage get a resource group's device counts. What else the page shows live it
// names in #stream-status's data-follow (sent as ?follow=): "alerts" (a runs page: the alert banner of
// the experiment's runs and each row's marker), "devices" (the Cluster page: each device's utilisation,
// memory, holder and read time, rows marked data-device="host:index").

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

// --- alerts: the banner (templates/jobs/_alert_banner.html) and the rows' markers ---------------------

const firing = new Map(); // run id -> {id, name, experiment, rules}, this page's runs only

function fmt3(value, trimIntegers) {
  const number = Number(value);
  return trimIntegers && Number.isInteger(number) ? String(number) : number.toFixed(3);
}

function bannerRow(run) {
  const rules = run.rules.map((r) =>
    el("span", { class: "alert-rule", "data-kind": r.kind }, el("code", {}, r.kind), r.metric ? ` ${r.metric}` : "",
      r.value !== null && r.value !== undefined ? ` = ${fmt3(r.value, false)}` : "", ` (threshold ${fmt3(r.threshold, true)})`),
  );
  const row = el("div", { class: "alert-run", "data-run-id": String(run.id) },
    el("strong", {}, run.rules.length > 1 ? "Alerts firing" : "Alert firing"), " on ",
    el("a", { href: `/runs/${run.id}/` }, `run ${run.id}`), ` (${run.name}): `);
  rules.forEach((item, i) => row.append(...(i ? [", ", item] : [item])));
  return row;
}

function onAlerts(data) {
  const banner = document.getElementById("alert-banner");
  const experiment = Number(banner?.dataset.experimentId);
  if (!banner || !experiment) return;
  if (data.snapshot) firing.clear();
  for (const run of data.runs) {
    if (run.experiment !== experiment) continue;
    if (run.rules.length) firing.set(run.id, run);
    else firing.delete(run.id);
  }
  const runs = [...firing.values()].sort((a, b) => a.id - b.id);
  banner.replaceChildren(...runs.map(bannerRow));
  banner.hidden = runs.length === 0;
  for (const row of document.querySelectorAll("tr[data-run-id]")) {
    const marker = row.querySelector(".alert-marker");
    if (marker) marker.hidden = !firing.has(Number(row.dataset.runId));
  }
}

// --- devices: the Cluster page's device rows -------------------------------------------------------------

function holderCell(device) {
  if (!device.holder) return [el("span", { class: "muted" }, "free")];
  const label = `run ${device.holder}`;
  return [device.holder_visible ? el("a", { href: `/runs/${device.holder}/` }, label) : label];
}

function onDevices(data) {
  for (const device of data.devices) {
    const row = document.querySelector(`[data-group-id="${data.group}"] tr[data-device="${CSS.escape(device.key)}"]`);
    if (!row) continue; // a device registered after the page loaded: shown on the next load
    const set = (selector, ...children) => row.querySelector(selector)?.replaceChildren(...children);
    set(".device-name", `${device.kind}${device.index}`,
      ...(device.healthy ? [] : [" ", el("span", { class: "reason" }, "unhealthy")]));
    set(".device-util", device.util_pct === null || device.util_pct === undefined ? "—" : `${Math.round(device.util_pct)}%`);
    set(".device-mem", device.mem_used_mb === null || device.mem_used_mb === undefined
      ? "—" : `${device.mem_used_mb}${device.memory_mb ? ` / ${device.memory_mb}` : ""} MB`);
    set(".device-holder", ...holderCell(device));
    set(".device-at", device.at || "—");
  }
}

const status = document.getElementById("stream-status");
const follow = status?.dataset.follow;
new Stream(follow ? `/ws/runs/?follow=${encodeURIComponent(follow)}` : "/ws/runs/", {
  resume: false,
  onEntry: (msg) => {
    if (msg.type === "run") onRun(msg.data);
    else if (msg.type === "metrics") onMetrics(msg.data);
    else if (msg.type === "cluster") onCluster(msg.data);
    else if (msg.type === "alerts") onAlerts(msg.data);
    else if (msg.type === "devices") onDevices(msg.data);
  },
  onStatus: (s) => {
    if (status) {
      status.textContent = s;
      status.dataset.status = s;
    }
  },
}).start();

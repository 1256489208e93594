// The run page: charts filled from GET /api/runs/<id>/metrics/ (server-side
// downsampled), then kept live from the run's stream; the roles, events,
// commands and config tables and the state badge updated from the same
// stream; the controls post commands (the server checks role and state again).

import { api, el, pageData } from "./api.js";
import { onAlertEvent, setupAlerts } from "./alerts.js";
import { MetricChart } from "./chart.js";
import { devicesGrid, newDeviceCharts } from "./device_charts.js";
import { fieldList } from "./fields.js";
import { rememberSections } from "./sections.js";
import { refreshEstimate } from "./start_estimate.js";
import { Stream } from "./stream.js";

const live = pageData("run-live");
const charts = [];
const chartsByKey = new Map();
let state = live.state;
let params = { ...live.params };
const view = { xMode: "step", smoothing: 0, log: false, t0: live.start, showRewound: true };

function addChart(node) {
  const keys = node.dataset.keys.split(",");
  const chart = new MetricChart(node, node.dataset.title, keys, view);
  charts.push(chart);
  for (const key of keys) {
    if (!chartsByKey.has(key)) chartsByKey.set(key, []);
    chartsByKey.get(key).push(chart);
  }
}

function setupCharts() {
  for (const node of document.querySelectorAll("#chart-groups .chart")) addChart(node);
}

// A device that first reports while the page is open gets its charts in the Devices group.
function addDeviceCharts(keys) {
  for (const spec of newDeviceCharts(keys, (key) => chartsByKey.has(key))) {
    const node = el("div", { class: "chart", "data-title": spec.title, "data-keys": spec.keys.join(",") });
    devicesGrid(document).append(node);
    addChart(node);
  }
}

const KEYS_PER_REQUEST = 64; // jobs.series.MAX_KEYS: the Devices group can take a run past it

async function loadMetrics() {
  const all = Array.from(chartsByKey.keys());
  const x = view.xMode === "step" ? "step" : "time";
  try {
    for (let i = 0; i < all.length; i += KEYS_PER_REQUEST) {
      const keys = all.slice(i, i + KEYS_PER_REQUEST).join(",");
      const query = `keys=${encodeURIComponent(keys)}&x=${x}&max_points=1000&include_rewound=${view.showRewound ? 1 : 0}`;
      const data = await api("GET", `/api/runs/${live.run}/metrics/?${query}`);
      for (const [key, series] of Object.entries(data.series || {})) {
        for (const chart of chartsByKey.get(key) || []) chart.setSeries(key, series);
      }
    }
  } catch (err) {
    document.getElementById("stream-status").title = `metrics: ${err.message}`;
  }
  charts.forEach((c) => c.setOptions(view));
}

function onMetrics(data) {
  for (const point of data.points || []) {
    addDeviceCharts(Object.keys(point.values || {}));
    const x = view.xMode === "step" ? point.step : point.time;
    for (const [key, value] of Object.entries(point.values || {})) {
      for (const chart of chartsByKey.get(key) || []) if (chart.append(key, x, value)) chart.scheduleRender();
    }
  }
}

// --- state and controls ---------------------------------------------------------------------------

function onState(data) {
  state = data.state;
  const badge = document.getElementById("run-state-badge");
  badge.textContent = state;
  badge.className = `state state-${state}`;
  document.getElementById("run-state").textContent = state;
  const reason = document.getElementById("run-reason");
  if (reason) {
    const position = data.queue_position ? `#${data.queue_position} · ` : "";
    reason.textContent = `${position}${data.reason || ""}`;
  }
  refreshEstimate(live.run, state);
  updateControls();
}

function updateControls() {
  for (const button of document.querySelectorAll("#controls [data-command]")) {
    const allowed = live.allowed[button.dataset.command] || [];
    button.disabled = !allowed.includes(state);
  }
}

function showError(message) {
  const box = document.getElementById("control-error");
  box.textContent = message;
  box.hidden = !message;
}

function commandArgs(kind) {
  if (kind === "rollback") {
    const checkpoint = Number(document.getElementById("rollback-checkpoint").value);
    const label = document.getElementById("rollback-checkpoint").selectedOptions[0]?.textContent;
    if (!checkpoint) throw new Error("there is no checkpoint to roll back to");
    if (!window.confirm(`Roll run ${live.run} back to ${label}? Later metric points become rewound.`)) return null;
    return { checkpoint };
  }
  if (kind === "fork") {
    const args = { spec: document.getElementById("fork-spec").value, name: document.getElementById("fork-name").value };
    const checkpoint = Number(document.getElementById("fork-checkpoint").value);
    if (checkpoint) args.checkpoint = checkpoint;
    return args;
  }
  if (kind === "set_params") {
    const changed = {};
    for (const input of document.querySelectorAll("[data-param]")) {
      if (input.value.trim() === "") continue;
      const value = Number(input.value);
      changed[input.dataset.param] = Number.isNaN(value) ? input.value : value;
    }
    return { params: changed };
  }
  if ((kind === "stop" || kind === "cancel") && !window.confirm(`${kind} run ${live.run}?`)) return null;
  return {};
}

async function sendCommand(kind) {
  showError("");
  let args;
  try {
    args = commandArgs(kind);
  } catch (err) {
    showError(err.message);
    return;
  }
  if (args === null) return;
  try {
    const command = await api("POST", `/api/runs/${live.run}/commands/`, { kind, args });
    onCommand(command);
    if (kind === "fork" && command.args && command.args.run) {
      const info = document.getElementById("control-info");
      info.replaceChildren("Forked: ", el("a", { href: `/runs/${command.args.run}/` }, `run ${command.args.run}`));
      info.hidden = false;
    }
  } catch (err) {
    showError(err.message);
  }
}

function onCommand(data) {
  const body = document.querySelector("#commands tbody");
  let row = body.querySelector(`tr[data-command-id="${data.id}"]`);
  const cells = [
    el("td", { class: "num" }, data.id),
    el("td", {}, data.kind),
    el("td", { class: `cmd-state cmd-${data.state}` }, data.state),
    el("td", {}, data.message || ""),
  ];
  if (!row) {
    row = el("tr", { "data-command-id": String(data.id) });
    body.prepend(row);
  }
  row.replaceChildren(...cells);
}

// --- tables ----------------------------------------------------------------------------------------

function dropEmpty(body) {
  body.querySelector("tr.empty")?.remove();
}

function fmtTime(value) {
  if (!value) return "—";
  const date = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  return Number.isNaN(date.getTime()) ? String(value) : date.toISOString().replace("T", " ").slice(0, 19);
}

function onRole(data) {
  const body = document.querySelector("#roles tbody");
  dropEmpty(body);
  let row = body.querySelector(`tr[data-role="${CSS.escape(data.role)}"]`);
  if (!row) {
    row = el("tr", { "data-role": data.role });
    row.append(
      el("td", {}, data.role),
      el("td", { class: "num role-attempt" }),
      el("td", { class: "role-status" }),
      el("td", { class: "role-host" }),
      el("td", { class: "role-devices" }),
      el("td", { class: "num role-restarts" }),
      el("td", { class: "role-seen" }),
      el("td", {}, el("pre", { class: "log-tail" }, data.log_tail || "")),
    );
    body.append(row);
  }
  // A live update carries only what changed: keep what the row already shows for the rest.
  const set = (cls, value) => {
    if (value !== undefined && value !== null) row.querySelector(cls).textContent = value;
  };
  set(".role-attempt", data.attempt);
  set(".role-status", data.exit_code != null ? `${data.status} (exit ${data.exit_code})` : data.status);
  set(".role-host", data.host || undefined);
  set(".role-devices", Array.isArray(data.devices) ? data.devices.join(",") || "—" : data.devices);
  set(".role-restarts", data.restarts);
  set(".role-seen", data.last_seen ? fmtTime(data.last_seen) : undefined);
  if (data.log_tail) row.querySelector(".log-tail").textContent = data.log_tail;
}

function onEvent(data) {
  onAlertEvent(data);
  const body = document.querySelector("#events tbody");
  dropEmpty(body);
  body.prepend(
    el(
      "tr",
      {},
      el("td", {}, fmtTime(data.time ?? Date.now() / 1000)),
      el("td", {}, data.kind),
      el("td", { class: "event-details" }, fieldList(data.payload ?? {})),
    ),
  );
}

function onConfig(data) {
  const body = document.querySelector("#configs tbody");
  dropEmpty(body);
  const changes = Object.entries(data.params || {})
    .filter(([key, value]) => params[key] !== value)
    .map(([key, value]) =>
      el("div", { class: "diff" }, el("code", {}, key), ": ", el("del", {}, String(params[key])), " → ", el("ins", {}, String(value))),
    );
  params = { ...params, ...data.params };
  body.prepend(el("tr", {}, el("td", { class: "num" }, `v${data.number}`), el("td", {}, ...changes), el("td", {}, fmtTime(Date.now() / 1000))));
}

function onCheckpoint(data) {
  for (const id of ["rollback-checkpoint", "fork-checkpoint"]) {
    const select = document.getElementById(id);
    if (!select || select.querySelector(`option[value="${data.id}"]`)) continue;
    select.querySelector('option[value=""]')?.remove();
    const version = data.weight_version !== null && data.weight_version !== undefined ? ` · v${data.weight_version}` : "";
    select.prepend(el("option", { value: String(data.id) }, `step ${data.step}${version}`));
    select.value = String(data.id);
  }
}

function onRewound(data) {
  if (view.xMode !== "step" || !view.showRewound) {
    loadMetrics(); // the server flags (or leaves out) the rewound points on any axis
    return;
  }
  charts.forEach((c) => {
    c.markRewound(data.after_step);
    c.scheduleRender();
  });
}

const HANDLERS = {
  metrics: onMetrics,
  state: onState,
  role: onRole,
  event: onEvent,
  command: onCommand,
  checkpoint: onCheckpoint,
  config: onConfig,
  rewound: onRewound,
};

function setupToolbar() {
  const xMode = document.getElementById("x-mode");
  xMode.addEventListener("change", () => {
    view.xMode = xMode.value;
    loadMetrics();
  });
  const smoothing = document.getElementById("smoothing");
  smoothing.addEventListener("input", () => {
    view.smoothing = Number(smoothing.value);
    document.getElementById("smoothing-value").textContent = smoothing.value;
    charts.forEach((c) => c.setOptions(view));
  });
  document.getElementById("log-scale").addEventListener("change", (e) => {
    view.log = e.target.checked;
    charts.forEach((c) => c.setOptions(view));
  });
  document.getElementById("show-rewound").addEventListener("change", (e) => {
    view.showRewound = e.target.checked;
    loadMetrics();
  });
  for (const button of document.querySelectorAll("#controls [data-command]")) {
    button.addEventListener("click", () => sendCommand(button.dataset.command));
  }
}

setupCharts();
window.tandemCharts = charts; // for the console and the browser tests (uPlot draws on a canvas)
setupToolbar();
updateControls();
// Opening a folded section: its charts were laid out while it had no width.
rememberSections(document, (section) => charts.filter((c) => section.contains(c.container)).forEach((c) => c.resize()));
setupAlerts(live);
// The events the page was rendered with (newest first), drawn as the stream's would be; newest on top.
[...live.events].reverse().forEach((e) => onEvent({ ...e, replayed: true }));
const status = document.getElementById("stream-status");
window.tandemStream = new Stream(`/ws/runs/${live.run}/`, {
  after: live.stream_seq,
  onEntry: (msg) => HANDLERS[msg.type]?.(msg.data),
  onStatus: (s) => {
    status.textContent = s;
    status.dataset.status = s;
  },
});
// Charts first (the REST snapshot), then the stream; entries racing the snapshot only re-set the same points.
loadMetrics().then(() => window.tandemStream.start());

// The run page's alerts: the banner of firing rules, the rules table and the rule / webhook form
// (REST under /api/runs/<id>/alerts/, jobs.api.alerts). The page is rendered with the rules
// (live.alerts); an alert event on the run's stream reads them again (transitions are rare).

import { api, el } from "./api.js";

let runId = null;
let rules = [];

function fmt(value) {
  if (value === null || value === undefined) return "—";
  return Number.isInteger(value) ? String(value) : Number(value).toPrecision(3);
}

function drawBanner() {
  const banner = document.getElementById("alert-banner");
  if (!banner) return;
  const firing = rules.filter((r) => r.firing && r.enabled);
  banner.hidden = firing.length === 0;
  if (!firing.length) return;
  const items = firing.map((r) =>
    el("span", { class: "alert-rule", "data-kind": r.kind }, el("code", {}, r.kind), r.metric ? ` ${r.metric}` : "",
      r.value !== null && r.value !== undefined ? ` = ${fmt(r.value)}` : "", ` (threshold ${fmt(r.threshold)})`),
  );
  const row = el("div", { class: "alert-run", "data-run-id": String(runId) },
    el("strong", {}, firing.length > 1 ? "Alerts firing" : "Alert firing"), ": ");
  items.forEach((item, i) => row.append(...(i ? [", ", item] : [item])));
  banner.replaceChildren(row);
}

function drawTable() {
  const body = document.querySelector("#alert-rules tbody");
  if (!body) return;
  body.replaceChildren(
    ...rules.map((r) =>
      el("tr", { "data-rule-id": String(r.id), title: r.meaning },
        el("td", {}, el("code", {}, r.kind)),
        el("td", {}, r.metric || "—"),
        el("td", { class: "num" }, fmt(r.threshold)),
        el("td", { class: r.firing ? "alert-firing" : "muted" }, r.firing ? `firing (${fmt(r.value)})` : "ok"),
        el("td", {}, el("input", { type: "checkbox", checked: r.enabled, "data-rule-toggle": String(r.id) })),
      ),
    ),
  );
  for (const box of body.querySelectorAll("[data-rule-toggle]")) {
    box.addEventListener("change", () => save(`${box.dataset.ruleToggle}/`, "PATCH", { enabled: box.checked }));
  }
}

function draw() {
  drawBanner();
  drawTable();
}

function showError(message) {
  const box = document.getElementById("alert-error");
  if (!box) return;
  box.textContent = message;
  box.hidden = !message;
}

async function reload() {
  try {
    rules = await api("GET", `/api/runs/${runId}/alerts/`);
    draw();
  } catch (err) {
    showError(`alerts: ${err.message}`);
  }
}

async function save(path, method, body) {
  showError("");
  try {
    await api(method, `/api/runs/${runId}/alerts/${path}`, body);
    await reload();
  } catch (err) {
    showError(err.message);
  }
}

function submitRule(event) {
  event.preventDefault();
  const kind = document.getElementById("alert-kind").value;
  const metric = document.getElementById("alert-metric").value.trim();
  const text = document.getElementById("alert-threshold").value.trim();
  const threshold = text === "" ? (kind === "non_finite" ? 0 : null) : Number(text);
  const body = { threshold: Number.isNaN(threshold) ? text : threshold };
  if (metric) body.metric = metric;
  const existing = rules.find((r) => r.kind === kind && (!metric || r.metric === metric));
  if (existing) save(`${existing.id}/`, "PATCH", body);
  else save("", "POST", { kind, ...body });
}

export function setupAlerts(live) {
  runId = live.run;
  rules = live.alerts || [];
  draw();
  document.getElementById("alert-form")?.addEventListener("submit", submitRule);
  const webhook = document.getElementById("alert-webhook");
  if (webhook) drawWebhook(live.alert_webhook);
  document.getElementById("alert-webhook-save")?.addEventListener("click", saveWebhook);
}

// The run's webhook setting (GET/PUT .../alerts/webhook/): its own URL ("" none: the experiment's default
// applies), or off (none at all); the input's placeholder shows the default, the note where alerts go.
function drawWebhook(hook) {
  const state = hook || { url: "", off: false, experiment_url: "", effective: "" };
  const input = document.getElementById("alert-webhook");
  const off = document.getElementById("alert-webhook-off");
  input.value = state.url;
  input.placeholder = state.experiment_url ? `experiment default: ${state.experiment_url}` : "https://...";
  if (off) off.checked = state.off;
  const note = document.getElementById("alert-webhook-effective");
  if (note) {
    const from = state.url ? "the run's own webhook" : "the experiment's default webhook";
    note.textContent = state.effective ? `alerts go to ${from}` : "alerts go to no webhook";
  }
}

async function saveWebhook() {
  showError("");
  const off = document.getElementById("alert-webhook-off")?.checked || false;
  const url = document.getElementById("alert-webhook").value.trim();
  try {
    drawWebhook(await api("PUT", `/api/runs/${runId}/alerts/webhook/`, off ? { off: true, url } : { url }));
  } catch (err) {
    showError(err.message);
  }
}

// A run event from the stream: an alert's transition redraws the banner and table.
export function onAlertEvent(data) {
  // Events the page was rendered with (replayed) are already in live.alerts' state.
  if (data && !data.replayed && (data.kind === "alert_firing" || data.kind === "alert_resolved")) {
    reload();
  }
}

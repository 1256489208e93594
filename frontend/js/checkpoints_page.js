// The checkpoint browser: rows from GET /api/runs/<id>/checkpoints/, files
// downloaded through /api/checkpoints/<id>/files/<path> (streamed by the
// server, which refuses paths outside the checkpoint root), pin / unpin /
// delete for editors. New checkpoints appear live from the run's stream.
// A row shows the headline metrics the view names (reward, held-out accuracy,
// loss: jobs.views.CHECKPOINT_HEADLINES_BY_WORKLOAD); the rest of the ~40 a
// checkpoint records fold into a <details> of their own, keeping rows short.

import { api, el, pageData } from "./api.js";
import { fieldList, fmtValue } from "./fields.js";
import { Stream } from "./stream.js";

const runId = pageData("run-id");
const canEdit = pageData("can-edit");
const headlines = pageData("headlines"); // [{label, keys: [the first one recorded is shown]}]
const body = document.querySelector("#checkpoints tbody");
const columns = document.querySelectorAll("#checkpoints thead th").length;

export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function fileLinks(c) {
  const files = c.files || [];
  if (!files.length) return el("span", { class: "muted" }, "—");
  return el(
    "ul",
    { class: "files" },
    ...files.map((f) => {
      const path = typeof f === "string" ? f : f.path;
      const size = typeof f === "string" ? "" : ` (${fmtBytes(f.size)})`;
      const href = `/api/checkpoints/${c.id}/files/${path.split("/").map(encodeURIComponent).join("/")}`;
      return el("li", {}, el("a", { href, download: path.split("/").pop() }, path), size);
    }),
  );
}

function headlineCells(metrics) {
  return headlines.map(({ keys }) => {
    const key = keys.find((k) => metrics[k] !== undefined && metrics[k] !== null);
    return key === undefined
      ? el("td", { class: "num headline muted", "data-key": keys[0] }, "—")
      : el("td", { class: "num headline", "data-key": key, title: key }, fmtValue(metrics[key]));
  });
}

// Every metric but the headline ones, folded (however few: the row stays one line tall).
function moreMetrics(metrics) {
  const shown = new Set(headlines.flatMap((h) => h.keys));
  const rest = Object.fromEntries(Object.entries(metrics).filter(([k]) => !shown.has(k)));
  const count = Object.keys(rest).length;
  if (!count) return el("span", { class: "muted" }, "—");
  return el("details", { class: "more-metrics" }, el("summary", {}, `${count} more`), fieldList(rest, { fold: false }));
}

function showError(message) {
  const box = document.getElementById("checkpoint-error");
  box.textContent = message;
  box.hidden = !message;
}

async function act(method, path, confirmText) {
  if (confirmText && !window.confirm(confirmText)) return;
  showError("");
  try {
    await api(method, path);
  } catch (err) {
    showError(err.message);
  }
  await load();
}

function row(c) {
  const tr = el(
    "tr",
    { "data-checkpoint-id": String(c.id) },
    el("td", { class: "num" }, c.step),
    el("td", { class: "num weights" }, c.weight_version ?? "—"),
    ...headlineCells(c.metrics || {}),
    el("td", { class: "num size" }, fmtBytes(c.size)),
    el("td", {}, moreMetrics(c.metrics || {})),
    el("td", {}, fileLinks(c)),
    el("td", { class: "pinned" }, c.pinned ? "pinned" : ""),
  );
  if (canEdit) {
    const pin = el("button", { type: "button", class: "pin" }, c.pinned ? "Unpin" : "Pin");
    pin.addEventListener("click", () => act("POST", `/api/checkpoints/${c.id}/${c.pinned ? "unpin" : "pin"}/`));
    const del = el("button", { type: "button", class: "delete", disabled: Boolean(c.pinned) }, "Delete");
    del.addEventListener("click", () => act("DELETE", `/api/checkpoints/${c.id}/`, `Delete the checkpoint at step ${c.step}?`));
    tr.append(el("td", {}, pin, " ", del));
  }
  return tr;
}

async function load() {
  try {
    const data = await api("GET", `/api/runs/${runId}/checkpoints/`);
    const rows = Array.isArray(data) ? data : data.results || [];
    rows.sort((a, b) => b.step - a.step);
    // A reload (a new checkpoint, a pin) keeps the rows a reader unfolded unfolded.
    const unfolded = new Set(Array.from(body.querySelectorAll("details[open]"), (d) => d.closest("tr").dataset.checkpointId));
    body.replaceChildren(...(rows.length ? rows.map(row) : [el("tr", { class: "empty" }, el("td", { colSpan: columns, class: "muted" }, "No checkpoints."))]));
    for (const id of unfolded) body.querySelector(`tr[data-checkpoint-id="${id}"] details`)?.setAttribute("open", "");
  } catch (err) {
    showError(err.message);
  }
}

await load();
// Only registrations after the page was rendered matter here.
let reloading = false;
new Stream(`/ws/runs/${runId}/`, {
  after: pageData("stream-seq"),
  onEntry: async (msg) => {
    if (msg.type !== "checkpoint" || reloading) return;
    reloading = true;
    await load();
    reloading = false;
  },
}).start();

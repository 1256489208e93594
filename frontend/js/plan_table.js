// The submit page's plan (POST /api/runs/plan/): the spec's predicted samples/s, step time and device-hours
// in each mode, the recommended mode and lag with its bottleneck, the calibration the figures come from,
// and the spec fields whose effect the model leaves out. Every figure is labelled an estimate.

import { el } from "./api.js";

function fixed(value, digits = 3) {
  return value === null || value === undefined ? "—" : Number(value).toPrecision(digits);
}

function modeName(row) {
  return row.max_policy_lag === null ? row.mode : `${row.mode} (lag ${row.max_policy_lag})`;
}

function splitText(split) {
  return Object.entries(split || {})
    .filter(([, seconds]) => seconds > 0)
    .map(([part, seconds]) => `${part} ${fixed(seconds, 2)} s`)
    .join(", ");
}

function modesTable(plan) {
  const recommended = plan.recommended || {};
  const head = el(
    "tr",
    {},
    ...["Mode", "Devices", "Samples/s", "Step time (s)", "Device-hours", "Bottleneck", "Step time split", ""].map((t) =>
      el("th", {}, t),
    ),
  );
  const rows = plan.modes.map((row) => {
    const chosen = row.mode === recommended.mode && row.max_policy_lag === recommended.max_policy_lag;
    const notes = [row.as_submitted ? "as submitted" : "", chosen ? "recommended" : "", row.problem].filter(Boolean);
    return el(
      "tr",
      { class: chosen ? "recommended" : "", "data-mode": modeName(row) },
      el("td", {}, modeName(row)),
      el("td", { class: "num" }, row.devices),
      el("td", { class: "num" }, fixed(row.samples_per_s)),
      el("td", { class: "num" }, fixed(row.step_time_s)),
      el("td", { class: "num" }, fixed(row.device_hours)),
      el("td", {}, row.bottleneck || "—"),
      el("td", {}, splitText(row.time_split)),
      el("td", { class: "muted" }, notes.join("; ")),
    );
  });
  return el("table", { id: "plan-modes" }, el("thead", {}, head), el("tbody", {}, ...rows));
}

export function renderPlan(container, plan) {
  container.replaceChildren();
  container.append(el("p", { class: "estimate-note", id: "plan-note" }, plan.note));
  if (plan.calibration) {
    const c = plan.calibration;
    container.append(
      el("p", { id: "plan-calibration" }, `Calibration: ${c.name} (${c.kind}) — ${c.source}`),
    );
  }
  if (!plan.modelled) {
    container.append(el("p", { class: "field-error", id: "plan-reason" }, `Not simulated: ${plan.reason}`));
  } else {
    const rec = plan.recommended;
    const text = rec
      ? `Recommended: ${modeName(rec)}, bottleneck ${rec.bottleneck}: ${rec.why}.`
      : "No mode fits this experiment's devices: nothing to recommend.";
    container.append(el("p", { id: "plan-recommended" }, text));
    container.append(modesTable(plan));
  }
  if (plan.not_modelled.length) {
    container.append(el("p", {}, "Not modelled (their effect on time is left out of the estimate):"));
    container.append(
      el(
        "ul",
        { id: "plan-not-modelled" },
        ...plan.not_modelled.map((n) =>
          el("li", { "data-field": n.field }, el("code", {}, n.field), `: ${n.reason}`),
        ),
      ),
    );
  }
}

export function renderPlanErrors(container, errors, message) {
  container.replaceChildren();
  const items = errors.length ? errors : [{ field: "", message }];
  container.append(
    el(
      "ul",
      { class: "errors", id: "plan-errors" },
      ...items.map((e) => el("li", { "data-field": e.field || "" }, e.field ? el("code", {}, e.field) : "", e.field ? `: ${e.message}` : e.message)),
    ),
  );
}

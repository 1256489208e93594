// A queued run's estimated start on the run page (GET /api/runs/<id>/start-estimate/): "~HH:MM" in the
// browser's time zone, always said to be an estimate and from which calibration; the reason when there is none.

import { api } from "./api.js";

export function estimateText(body) {
  const basis = body.estimate_basis || {};
  if (!body.estimated_start) return `no estimate: ${basis.reason || "unknown"}`;
  const at = new Date(body.estimated_start);
  const time = at.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  const names = (basis.calibrations || []).map((c) => c.name).join(", ") || "none";
  return `~${time}, an estimate from calibration ${names}`;
}

// Show the estimate of a run now in ``state`` (hidden unless QUEUED); the server renders the first one.
export async function refreshEstimate(runId, state) {
  const row = document.getElementById("estimated-start-row");
  const value = document.getElementById("estimated-start");
  if (!row || !value) return;
  row.hidden = state !== "QUEUED";
  value.hidden = row.hidden;
  if (row.hidden) return;
  try {
    const body = await api("GET", `/api/runs/${runId}/start-estimate/`);
    value.textContent = estimateText(body);
    value.title = (body.estimate_basis || {}).note || "";
  } catch (err) {
    value.textContent = `no estimate: ${err.message}`;
  }
}

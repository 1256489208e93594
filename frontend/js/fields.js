// A JSON value as labelled fields: an object becomes a <dl> of key / value,
// nested objects and arrays nest, and anything with more than FOLD_AT fields
// (a checkpoint's 40 metrics) is folded behind a <details> that names its size.
// The run page's event details and the checkpoints page's metrics use it.

import { el } from "./api.js";

export const FOLD_AT = 6;

// Numbers as JSON sent them, but without float noise (0.30000000000000004 -> 0.3).
export function fmtValue(value) {
  if (value === null || value === undefined) return "—";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : String(Number(value.toPrecision(6)));
  return String(value);
}

function isScalar(value) {
  return value === null || typeof value !== "object";
}

// One value: a scalar as text, a short list of scalars comma-separated, anything else as fields.
export function fieldValue(value) {
  if (isScalar(value)) return document.createTextNode(fmtValue(value));
  if (Array.isArray(value) && value.every(isScalar) && value.length <= FOLD_AT) {
    return document.createTextNode(value.map(fmtValue).join(", ") || "[]");
  }
  return fieldList(value);
}

// An object (or array, keyed by index) as a <dl class="fields">, folded when it has many fields
// (fold: false where the caller folds it already). An object's keys are sorted: PostgreSQL's jsonb
// keeps no order, so a payload read back from the database and the same one streamed live agree.
export function fieldList(value, { fold = true } = {}) {
  if (isScalar(value)) return document.createTextNode(fmtValue(value));
  const entries = Object.entries(value);
  if (!Array.isArray(value)) entries.sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  if (!entries.length) return el("span", { class: "muted" }, "—");
  const list = el("dl", { class: "fields" });
  for (const [key, item] of entries) list.append(el("dt", {}, key), el("dd", {}, fieldValue(item)));
  if (!fold || entries.length <= FOLD_AT) return list;
  return el("details", { class: "fields-fold" }, el("summary", {}, `${entries.length} fields`), list);
}

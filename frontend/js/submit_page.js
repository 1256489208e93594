// The submit form's YAML editor: seeded from examples/ (picked in a select),
// Tab indents instead of leaving the field, and after a rejected submit each
// spec error is marked at its line (the server sends dotted field paths such
// as "pipeline.mode"; the line is where that key sits in the YAML).

import { api, pageData } from "./api.js";
import { renderPlan, renderPlanErrors } from "./plan_table.js";

const examples = pageData("spec-examples") || {};
const editor = document.getElementById("id_spec");
const picker = document.getElementById("spec-example");

if (picker && editor) {
  picker.addEventListener("change", () => {
    if (!picker.value) return;
    // Typed by the user = neither the page's starting text nor an example: ask before replacing it.
    const dirty =
      editor.value.trim() && editor.value !== editor.defaultValue && !Object.values(examples).includes(editor.value);
    if (dirty && !window.confirm("Replace the spec you typed with this example?")) return;
    editor.value = examples[picker.value];
  });
}

if (editor) {
  editor.addEventListener("keydown", (event) => {
    if (event.key !== "Tab") return;
    event.preventDefault();
    const { selectionStart: start, selectionEnd: end, value } = editor;
    editor.value = `${value.slice(0, start)}  ${value.slice(end)}`;
    editor.selectionStart = editor.selectionEnd = start + 2;
  });
}

// The 1-based line of a dotted YAML key path, or null (a best effort: block mappings, two-space indents or more).
export function lineOf(text, dotted) {
  const parts = dotted.split(".");
  const lines = text.split("\n");
  let indent = -1;
  let from = 0;
  for (const part of parts) {
    let found = -1;
    for (let i = from; i < lines.length; i += 1) {
      const match = lines[i].match(/^(\s*)([^\s:#][^:]*):/);
      if (!match) continue;
      const depth = match[1].length;
      if (depth <= indent) break;
      if (match[2].trim() === part) {
        found = i;
        indent = depth;
        break;
      }
    }
    if (found < 0) return null;
    from = found + 1;
  }
  return from;
}

const errors = document.querySelectorAll("#spec-errors li[data-field]");
if (editor && errors.length) {
  editor.classList.add("has-errors");
  for (const item of errors) {
    const line = lineOf(editor.value, item.dataset.field);
    if (line) item.append(` (line ${line})`);
    item.addEventListener("click", () => {
      if (!line) return;
      const offset = editor.value.split("\n").slice(0, line - 1).join("\n").length + (line > 1 ? 1 : 0);
      editor.focus();
      editor.setSelectionRange(offset, offset + editor.value.split("\n")[line - 1].length);
    });
  }
}

// The Plan button: the same fields as the submit, to POST /api/runs/plan/ (nothing is stored).
const planButton = document.getElementById("plan-button");
const planBox = document.getElementById("plan-result");
if (planButton && planBox && editor) {
  planButton.addEventListener("click", async () => {
    const value = (id) => (document.getElementById(id) || {}).value || "";
    const body = { experiment: value("id_experiment"), spec: editor.value };
    if (value("id_submission_id")) body.submission_id = value("id_submission_id");
    if (value("id_priority")) body.priority = Number(value("id_priority"));
    planBox.hidden = false;
    planBox.setAttribute("aria-busy", "true");
    planButton.disabled = true;
    try {
      renderPlan(planBox, await api("POST", "/api/runs/plan/", body));
    } catch (err) {
      renderPlanErrors(planBox, err.errors || [], err.message);
    } finally {
      planButton.disabled = false;
      planBox.removeAttribute("aria-busy");
    }
  });
}

// The experiment page's default alert webhook form (editors only): PUT /api/experiments/<id>/alerts/webhook/
// (jobs.api.views.ExperimentViewSet.alert_webhook). Each run without a webhook setting of its own POSTs its
// alert transitions to it; "" removes the default.

import { api } from "./api.js";

const NONE = "none: only runs with a webhook of their own post their alerts";
const SET = "every run without a webhook of its own posts its alerts here";

function setup() {
  const form = document.getElementById("experiment-webhook");
  if (!form) return;
  const input = document.getElementById("experiment-webhook-url");
  const status = document.getElementById("experiment-webhook-status");
  const error = document.getElementById("experiment-webhook-error");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.hidden = true;
    try {
      const reply = await api("PUT", `/api/experiments/${form.dataset.experimentId}/alerts/webhook/`, {
        url: input.value.trim(),
      });
      input.value = reply.url;
      status.textContent = `saved: ${reply.url ? SET : NONE}`;
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
    }
  });
}

setup();

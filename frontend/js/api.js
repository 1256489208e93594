// fetch() helpers for the REST API under /api/ with the session cookie and
// Django's CSRF token (DRF's session auth checks it on writes).

function csrfToken() {
  const field = document.querySelector("input[name=csrfmiddlewaretoken]");
  if (field) return field.value;
  const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
  return match ? decodeURIComponent(match[1]) : "";
}

export class ApiError extends Error {
  constructor(status, body) {
    const errors = (body && body.errors) || [];
    const text = errors.length
      ? errors.map((e) => (e.field ? `${e.field}: ${e.message}` : e.message)).join("; ")
      : (body && (body.detail || body.message)) || `HTTP ${status}`;
    super(text);
    this.status = status;
    this.errors = errors;
  }
}

export async function api(method, path, body) {
  const init = { method, credentials: "same-origin", headers: { Accept: "application/json" } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  if (method !== "GET") init.headers["X-CSRFToken"] = csrfToken();
  const response = await fetch(path, init);
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = { detail: text.slice(0, 200) };
  }
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

// The JSON a template embedded with {{ value|json_script:"id" }}.
export function pageData(id) {
  const el = document.getElementById(id);
  return el ? JSON.parse(el.textContent) : null;
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

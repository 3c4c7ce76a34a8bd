// What both pages share: the API key (asked once, kept in this tab's sessionStorage), fetch with
// it, small DOM and number helpers. Every element is built through DOM APIs; no HTML strings.

const KEY_STORE = "llamadeploy.apiKey";
let pendingKey = null; // one key dialog at a time, shared by every call that got a 401

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

function withKey(headers = {}) {
  const key = apiKey();
  return key ? { ...headers, Authorization: `Bearer ${key}` } : { ...headers };
}

// Ask for the API key in a modal dialog; resolves once one is entered. `message` says why.
export function askKey(message) {
  if (pendingKey) return pendingKey;
  pendingKey = new Promise((resolve) => {
    const input = el("input", {
      type: "password",
      id: "api-key-input",
      autocomplete: "off",
      placeholder: "sk-…",
      "aria-label": "API key",
    });
    const note = el("p", { class: "dialog-note", id: "api-key-message", text: message });
    const form = el(
      "form",
      { class: "dialog-form" },
      el("h2", { text: "API key" }),
      note,
      input,
      el("p", {
        class: "dialog-hint",
        text: "Kept in this browser tab only (sessionStorage); it is sent to this server and nowhere else.",
      }),
      el("div", { class: "dialog-actions" }, el("button", { type: "submit", class: "primary", id: "api-key-save", text: "Use key" })),
    );
    const dialog = el("dialog", { class: "key-dialog", id: "api-key-dialog" }, form);
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORE, key);
      dialog.close();
      dialog.remove();
      pendingKey = null;
      resolve(key);
    });
    dialog.addEventListener("cancel", (event) => event.preventDefault()); // nothing works without one
    document.body.append(dialog);
    dialog.showModal();
    input.focus();
  });
  return pendingKey;
}

// fetch() with the API key; on a 401 for the key (the router sends WWW-Authenticate with it), ask
// for a key (saying when the one kept was refused) and send again.
export async function api(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: withKey(options.headers) });
    if (response.status !== 401 || !response.headers.get("WWW-Authenticate")) return response;
    const had = apiKey() !== "";
    sessionStorage.removeItem(KEY_STORE);
    await askKey(
      had
        ? "The server refused that key (401 Unauthorized). Enter another one."
        : "This server needs an API key (router.api_keys). Enter one of its keys.",
    );
  }
}

// The error message of an OpenAI-style error response, or its status line.
export async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch {
    // not JSON: the status line says enough
  }
  return `${response.status} ${response.statusText}`;
}

// Copy text to the clipboard; falls back to a selected textarea where the Clipboard API is not
// available (plain http on another host than localhost is not a secure context).
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // fall through to the old way
    }
  }
  const area = el("textarea", { class: "offscreen", readonly: true });
  area.value = text;
  document.body.append(area);
  area.select();
  let ok = false;
  try {
    ok = document.execCommand("copy");
  } catch {
    ok = false;
  }
  area.remove();
  return ok;
}

// A button that copies `getText()` and says so for a moment.
export function copyButton(getText, label = "Copy") {
  const button = el("button", { type: "button", class: "ghost small copy", text: label });
  button.addEventListener("click", async () => {
    const ok = await copyText(getText());
    button.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => (button.textContent = label), 1500);
  });
  return button;
}

export function formatBytes(bytes) {
  if (!bytes) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(value < 10 && unit ? 1 : 0)} ${units[unit]}`;
}

export function formatDuration(seconds) {
  if (!seconds) return "–";
  if (seconds < 60) return `${Math.floor(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.floor(seconds % 60)} s`;
  const h = Math.floor(seconds / 3600);
  if (h < 48) return `${h} h ${Math.floor((seconds % 3600) / 60)} min`;
  return `${Math.floor(h / 24)} d ${h % 24} h`;
}

export function formatMs(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`;
}

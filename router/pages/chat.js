// The chat page: streams /v1/chat/completions (Server-Sent Events read from fetch's body), renders
// answers as Markdown (markdown.js builds DOM nodes, never HTML strings), keeps the conversation in
// this tab's sessionStorage and nothing on the server.

import { api, copyButton, copyText, el, errorText, formatMs } from "./common.js";
import { renderMarkdown } from "./markdown.js";

const CHAT_STORE = "llamadeploy.chat";
const SETTINGS_STORE = "llamadeploy.chatSettings";
const KEYWORDS_FORMAT = {
  type: "json_schema",
  json_schema: {
    name: "keywords",
    strict: true,
    schema: {
      type: "object",
      properties: { keywords: { type: "array", items: { type: "string", maxLength: 60 }, minItems: 1, maxItems: 12 } },
      required: ["keywords"],
      additionalProperties: false,
    },
  },
};
const TASKS = {
  summarise: "Summarise the following document in a few sentences.",
  keywords: "List the keywords of the following document.",
};
const EXAMPLES = [
  "What is the capital of France?",
  "Write a Python function that reverses a string.",
  "Give me three tips for writing clear e-mails, as a list.",
];

const $ = (id) => document.getElementById(id);
let messages = load(CHAT_STORE, []);
let controller = null; // the running request's AbortController
let documentMode = false;

function load(name, fallback) {
  try {
    return JSON.parse(sessionStorage.getItem(name)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  sessionStorage.setItem(CHAT_STORE, JSON.stringify(messages));
}

function saveSettings() {
  const settings = {
    model: $("model").value,
    system: $("system").value,
    temperature: $("temperature").value,
    maxTokens: $("max-tokens").value,
  };
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(settings));
}

function restoreSettings() {
  let s = {};
  try {
    s = JSON.parse(localStorage.getItem(SETTINGS_STORE)) || {};
  } catch {
    s = {};
  }
  if (s.system !== undefined) $("system").value = s.system;
  if (s.temperature !== undefined) $("temperature").value = s.temperature;
  if (s.maxTokens !== undefined) $("max-tokens").value = s.maxTokens;
  $("temperature-value").textContent = Number($("temperature").value).toFixed(2);
  return s;
}

async function loadModels(preferred) {
  const select = $("model");
  const response = await api("/v1/models");
  if (!response.ok) {
    select.replaceChildren(el("option", { value: "", text: `models unavailable (${response.status})` }));
    return;
  }
  // An embedding model answers /v1/embeddings only: the picker offers the models that chat.
  const data = (await response.json()).data.filter((m) => m.task !== "embed");
  select.replaceChildren(...data.map((m) => el("option", { value: m.id, text: m.id })));
  if (preferred && data.some((m) => m.id === preferred)) select.value = preferred;
}

// ---- rendering ------------------------------------------------------------------------------

function stats(message) {
  const m = message.meta || {};
  const parts = [];
  if (m.ttft !== undefined) parts.push(`TTFT ${formatMs(m.ttft)}`);
  if (m.tokens) parts.push(`${m.estimated ? "≈" : ""}${m.tokens} tokens`);
  if (m.rate) parts.push(`${m.rate.toFixed(1)} tok/s`);
  if (m.finish && m.finish !== "stop") parts.push(m.finish === "length" ? "cut at max tokens" : m.finish);
  if (m.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function keywordsView(content) {
  let parsed;
  try {
    parsed = JSON.parse(content);
  } catch {
    return null;
  }
  if (!parsed || !Array.isArray(parsed.keywords)) return null;
  return el(
    "div",
    { class: "keywords" },
    el("span", { class: "keywords-label", text: "Keywords" }),
    parsed.keywords.map((k) => el("span", { class: "chip", text: String(k) })),
  );
}

function userBubble(message) {
  const body = el("div", { class: "bubble" });
  if (message.document) {
    body.append(el("p", { class: "plain", text: message.display }));
    body.append(
      el(
        "details",
        { class: "document-preview" },
        el("summary", { text: `Document · ${message.document.length.toLocaleString()} characters` }),
        el("div", { class: "plain document-text", text: message.document }),
      ),
    );
  } else {
    body.append(el("p", { class: "plain", text: message.content }));
  }
  return el("div", { class: "message user" }, body);
}

function assistantBubble(message, index) {
  const content = el("div", { class: "markdown" });
  renderMarkdown(message.content, content);
  const body = el("div", { class: "bubble" }, content);
  if (message.json) {
    const view = keywordsView(message.content);
    if (view) body.prepend(view);
  }
  if (message.error) body.append(el("p", { class: "error", text: message.error }));
  if (!message.content && !message.error && message.pending) body.append(el("span", { class: "typing", text: "…" }));
  const footer = el(
    "div",
    { class: "message-footer" },
    el("span", { class: "stats", text: stats(message) }),
    message.pending ? null : copyButton(() => messages[index].content),
  );
  return el("div", { class: "message assistant", "data-index": index }, body, footer);
}

function emptyState() {
  return el(
    "div",
    { class: "empty" },
    el("h1", { text: "Chat with the model" }),
    el("p", { text: "Answers stream in as they are generated, from this deployment only. Try one of these:" }),
    el(
      "div",
      { class: "examples" },
      EXAMPLES.map((text) =>
        el("button", {
          type: "button",
          class: "example",
          text,
          onclick: () => {
            $("prompt").value = text;
            $("prompt").focus();
          },
        }),
      ),
    ),
  );
}

function render() {
  const box = $("messages");
  const nearBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  box.replaceChildren(
    ...(messages.length ? messages.map((m, i) => (m.role === "user" ? userBubble(m) : assistantBubble(m, i))) : [emptyState()]),
  );
  if (nearBottom || controller) box.scrollTop = box.scrollHeight;
}

let frame = 0;
function renderSoon() {
  if (!frame) frame = requestAnimationFrame(() => ((frame = 0), render()));
}

// ---- sending --------------------------------------------------------------------------------

// The data fields of a Server-Sent Events body, one string per event.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

function requestBody(json) {
  const history = messages
    .filter((m) => !m.pending && !(m.role === "assistant" && !m.content))
    .map((m) => ({ role: m.role, content: m.content }));
  const system = $("system").value.trim();
  const body = {
    model: $("model").value,
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value) || 512,
  };
  if (json) body.response_format = KEYWORDS_FORMAT;
  return body;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
}

async function stream(answer, body) {
  const started = performance.now();
  let first = null;
  let chunks = 0;
  const response = await api("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal: controller.signal,
  });
  if (!response.ok) throw new Error(await errorText(response));
  for await (const data of sseData(response.body)) {
    if (data === "[DONE]") break;
    const event = JSON.parse(data);
    if (event.error) throw new Error(event.error.message || "the server ended the answer with an error");
    if (event.usage) answer.meta.usage = event.usage;
    for (const choice of event.choices || []) {
      const text = choice.delta && choice.delta.content;
      if (text) {
        if (first === null) {
          first = performance.now();
          answer.meta.ttft = (first - started) / 1000;
        }
        chunks += 1;
        answer.content += text;
      }
      if (choice.finish_reason) answer.meta.finish = choice.finish_reason;
    }
    renderSoon();
  }
  return { first, chunks };
}

async function send(display, content, extra = {}) {
  if (controller || !$("model").value) return;
  messages.push({ role: "user", content, display, ...extra.user });
  const answer = { role: "assistant", content: "", meta: {}, pending: true, json: Boolean(extra.json) };
  messages.push(answer);
  controller = new AbortController();
  setBusy(true);
  render();
  let timing = { first: null, chunks: 0 };
  const body = requestBody(extra.json);
  try {
    timing = await stream(answer, body);
  } catch (error) {
    if (error.name === "AbortError") answer.meta.stopped = true;
    else answer.error = error.message;
  } finally {
    const end = performance.now();
    const usage = answer.meta.usage;
    answer.meta.tokens = usage ? usage.completion_tokens : timing.chunks;
    answer.meta.estimated = !usage;
    if (timing.first !== null && answer.meta.tokens > 1 && end > timing.first) {
      answer.meta.rate = (answer.meta.tokens - 1) / ((end - timing.first) / 1000);
    }
    delete answer.meta.usage;
    delete answer.pending;
    controller = null;
    setBusy(false);
    save();
    render();
    $("prompt").focus();
  }
}

function submit() {
  if (documentMode) {
    const doc = $("document").value.trim();
    if (!doc) return $("document").focus();
    const task = $("task").value;
    const note = $("prompt").value.trim();
    const instruction = note || TASKS[task];
    $("prompt").value = "";
    send(instruction, `${instruction}\n\n${doc}`, { user: { document: doc }, json: $("json-schema").checked });
  } else {
    const text = $("prompt").value.trim();
    if (!text) return;
    $("prompt").value = "";
    send(text, text);
  }
}

function setMode(doc) {
  documentMode = doc;
  $("document-panel").hidden = !doc;
  $("mode-message").classList.toggle("active", !doc);
  $("mode-document").classList.toggle("active", doc);
  $("mode-message").setAttribute("aria-selected", String(!doc));
  $("mode-document").setAttribute("aria-selected", String(doc));
  $("prompt").placeholder = doc ? "Optional: your own instruction for the document" : "Ask something…";
  $("json-schema").disabled = $("task").value !== "keywords";
  if (doc) $("document").focus();
}

function wire() {
  $("composer-form").addEventListener("submit", (event) => {
    event.preventDefault();
    submit();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    messages = [];
    save();
    render();
  });
  $("temperature").addEventListener("input", () => {
    $("temperature-value").textContent = Number($("temperature").value).toFixed(2);
  });
  for (const id of ["model", "system", "temperature", "max-tokens"]) $(id).addEventListener("change", saveSettings);
  $("mode-message").addEventListener("click", () => setMode(false));
  $("mode-document").addEventListener("click", () => setMode(true));
  $("task").addEventListener("change", () => {
    $("json-schema").disabled = $("task").value !== "keywords";
    if ($("json-schema").disabled) $("json-schema").checked = false;
  });
  $("document").addEventListener("input", () => {
    const n = $("document").value.length;
    $("document-size").textContent = n ? `${n.toLocaleString()} characters` : "";
  });
  // The copy buttons of code blocks (markdown.js marks them).
  $("messages").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-copy='code']");
    if (!button) return;
    copyText(button.closest("figure").querySelector("code").textContent).then((ok) => {
      button.textContent = ok ? "Copied" : "Copy failed";
      setTimeout(() => (button.textContent = "Copy"), 1500);
    });
  });
}

async function main() {
  const settings = restoreSettings();
  wire();
  setMode(false);
  render();
  await loadModels(settings.model);
}

main();

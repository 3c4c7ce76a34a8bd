// The status page: polls GET /workers (the worker table) and GET /activity (recent throughput and
// TTFT, worker events, prefix-cache counters) every 1.5 s and redraws. Admin actions go through the
// router's /status/admin/ proxy with the admin token in X-Admin-Token (kept in sessionStorage).

import { lineChart } from "./charts.js";
import { api, el, errorText, formatBytes, formatDuration, formatMs } from "./common.js";

const POLL_MS = 1500;
const ADMIN_STORE = "llamadeploy.adminToken";
const $ = (id) => document.getElementById(id);
const confirming = new Map(); // worker id -> action awaiting its second click, until a time
let last = { table: null, activity: null };
let lastOk = 0;

function adminToken() {
  return sessionStorage.getItem(ADMIN_STORE) || "";
}

async function adminFetch(path, options = {}) {
  return api(path, { ...options, headers: { ...(options.headers || {}), "X-Admin-Token": adminToken() } });
}

// ---- admin token ------------------------------------------------------------------------------

function askAdminToken(message) {
  const input = el("input", { type: "password", id: "admin-token-input", autocomplete: "off", "aria-label": "Admin token" });
  const note = el("p", { class: "dialog-note", id: "admin-token-message", text: message });
  const cancel = el("button", { type: "button", class: "secondary", text: "Cancel" });
  const form = el(
    "form",
    { class: "dialog-form" },
    el("h2", { text: "Admin token" }),
    note,
    input,
    el("p", { class: "dialog-hint", text: "router.admin_token. Kept in this browser tab only; it unlocks drain and restart." }),
    el("div", { class: "dialog-actions" }, cancel, el("button", { type: "submit", class: "primary", id: "admin-token-save", text: "Unlock" })),
  );
  const dialog = el("dialog", { class: "key-dialog", id: "admin-token-dialog" }, form);
  cancel.addEventListener("click", () => dialog.close());
  dialog.addEventListener("close", () => dialog.remove());
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    sessionStorage.setItem(ADMIN_STORE, input.value.trim());
    if (await checkAdmin()) {
      dialog.close();
    } else {
      note.textContent = "The router refused that admin token (401). Try again.";
      note.classList.add("error");
    }
  });
  document.body.append(dialog);
  dialog.showModal();
  input.focus();
}

async function checkAdmin() {
  if (!adminToken()) return setAdmin(false);
  const response = await adminFetch("/status/admin");
  if (!response.ok) sessionStorage.removeItem(ADMIN_STORE);
  return setAdmin(response.ok);
}

function setAdmin(on) {
  document.body.classList.toggle("admin", on);
  for (const cell of document.querySelectorAll(".admin-col")) cell.hidden = !on;
  $("admin-button").textContent = on ? "Lock admin" : "Admin token…";
  if (last.table) renderTable(last.table, last.activity);
  return on;
}

async function act(worker, action) {
  const query = { drain: "?timeout=0", restart: "?drain=1&timeout=30" }[action] || "";
  $("admin-message").textContent = `worker ${worker.id}: ${action}…`;
  const response = await adminFetch(`/status/admin/workers/${worker.id}/${action}${query}`, { method: "POST" });
  if (response.status === 401) {
    sessionStorage.removeItem(ADMIN_STORE);
    setAdmin(false);
    $("admin-message").textContent = "The admin token was refused (401); enter it again.";
    return;
  }
  $("admin-message").textContent = response.ok
    ? `worker ${worker.id}: ${action} done`
    : `worker ${worker.id}: ${action} failed: ${await errorText(response)}`;
}

function actionButton(worker, action, label, className = "secondary") {
  const key = `${worker.id}:${action}`;
  const pending = confirming.get(key);
  const armed = pending && pending > Date.now();
  return el("button", {
    type: "button",
    class: `small ${armed ? "danger" : className}`,
    "data-action": action,
    "data-worker": worker.id,
    text: armed ? `Confirm ${label.toLowerCase()}` : label,
    onclick: () => {
      if (action === "restart" && !armed) {
        confirming.set(key, Date.now() + 4000);
        renderTable(last.table, last.activity);
        setTimeout(() => last.table && renderTable(last.table, last.activity), 4100);
        return;
      }
      confirming.delete(key);
      act(worker, action);
    },
  });
}

function actions(worker) {
  switch (worker.state) {
    case "ready":
      return [actionButton(worker, "drain", "Drain"), actionButton(worker, "restart", "Restart")];
    case "draining":
      return [actionButton(worker, "undrain", "Resume"), actionButton(worker, "restart", "Restart")];
    case "starting":
      return [el("span", { class: "hint", text: "loading…" })];
    default:
      return [actionButton(worker, "start", worker.start_requested ? "Starting…" : "Start", "primary")];
  }
}

// ---- rendering --------------------------------------------------------------------------------

function percent(part, whole) {
  return whole ? Math.round((100 * part) / whole) : null;
}

function bar(used, total, note) {
  const p = percent(used, total);
  if (p === null) return el("span", { class: "muted", text: "–" });
  const fill = el("span", { class: `bar-fill${p > 85 ? " hot" : ""}` });
  fill.style.width = `${Math.min(100, p)}%`;
  return el("div", { class: "bar-cell", title: note }, el("span", { class: "bar" }, fill), el("span", { class: "bar-text", text: `${p}%` }));
}

function where(w) {
  const parts = [w.device || "–"];
  if (w.node_ip) parts.push(w.node_ip);
  if (w.gpu_ids) parts.push(`GPU ${w.gpu_ids}`);
  return parts.join(" · ");
}

function stateCell(w) {
  const cell = el("td", {}, el("span", { class: `state state-${w.state}`, "data-state": w.state, text: w.state }));
  if (w.exit_reason && w.state !== "ready") cell.append(el("div", { class: "reason", text: w.exit_reason }));
  if (w.start_requested) cell.append(el("div", { class: "reason", text: "start requested" }));
  return cell;
}

function renderTable(table, activity) {
  const admin = document.body.classList.contains("admin");
  const prefix = (activity && activity.prefix_cache) || {};
  const rows = table.workers.map((w) => {
    const pc = prefix[String(w.id)] || {};
    const hits = percent(pc.hit_tokens || 0, pc.queried_tokens || 0);
    return el(
      "tr",
      { "data-worker": w.id, class: `row-${w.state}` },
      el("td", { class: "replica", text: `#${w.id}` }),
      el("td", { class: "model", "data-model": w.model || "", text: w.model || "–" }),
      stateCell(w),
      el("td", { text: where(w), title: (w.gpu_uuids || []).join(", ") }),
      el("td", { class: "mono", text: w.pid || "–" }),
      el("td", { class: "num", text: w.in_flight }),
      el("td", { class: "num", text: `${w.running} · ${w.waiting}` }),
      el("td", {}, bar(w.kv_used_tokens, w.kv_budget_tokens, `${w.kv_used_tokens} of ${w.kv_budget_tokens} tokens`)),
      el("td", { class: "num", title: `${pc.hit_tokens || 0} of ${pc.queried_tokens || 0} prompt tokens`, text: hits === null ? "–" : `${hits}%` }),
      el("td", { class: "num", text: w.restarts }),
      el("td", { class: "num", text: formatBytes(w.mem_bytes) }),
      el("td", { class: "num", text: formatDuration(w.uptime_s) }),
      el(
        "td",
        { class: "num", title: "requests finished; below: those that ended early (cancelled, failed or lost)" },
        String(w.served),
        w.failed_requests ? el("div", { class: "reason", text: `${w.failed_requests} ended early` }) : null,
      ),
      el("td", { class: "admin-col actions", hidden: !admin }, admin ? actions(w) : []),
    );
  });
  $("workers").tBodies[0].replaceChildren(...rows);
}

function renderCards(table, activity) {
  const ws = table.workers;
  const ready = ws.filter((w) => w.state === "ready").length;
  $("card-ready").textContent = `${ready} / ${ws.length}`;
  $("card-ready").className = `card-value${ready < ws.length ? " warn" : ""}`;
  $("card-ready-note").textContent = `${table.accepting ? "accepting" : "not accepting"} · policy ${table.policy}`;
  $("card-inflight").textContent = ws.reduce((n, w) => n + w.in_flight, 0);
  const running = ws.reduce((n, w) => n + w.running, 0);
  const waiting = ws.reduce((n, w) => n + w.waiting, 0);
  const heldBy = (activity && activity.held) || {};
  const held = Object.values(heldBy).reduce((n, c) => n + c, 0);
  const oldest = Math.max(0, ...Object.values((activity && activity.held_oldest_s) || {}));
  const heldNote = held ? ` · ${held} held for a replica (longest ${oldest.toFixed(1)} s)` : "";
  $("card-inflight-note").textContent = `${running} running · ${waiting} waiting in the workers${heldNote}`;
  if (table.router) {
    $("card-router").textContent = `pid ${table.router.pid}`;
    $("card-router-note").textContent = `up ${formatDuration(table.router.uptime_s)} · ${table.router.restarts} restarts`;
  }
  const buckets = (activity && activity.history && activity.history.buckets) || [];
  const recent = buckets.slice(-5);
  const rate = recent.reduce((s, b) => s + b.tokens_per_s, 0) / Math.max(1, recent.length);
  $("card-rate").textContent = rate.toFixed(1);
  let n = 0;
  let sum = 0;
  for (const b of buckets.slice(-30)) {
    if (b.ttft_mean_s !== null) {
      n += b.first_tokens;
      sum += b.ttft_mean_s * b.first_tokens;
    }
  }
  $("card-ttft").textContent = n ? formatMs(sum / n) : "–";
}

function renderCharts(activity) {
  const buckets = (activity && activity.history && activity.history.buckets) || [];
  const tps = buckets.map((b) => b.tokens_per_s);
  lineChart($("chart-rate"), [{ values: tps, className: "s1" }], { format: (v) => `${v} tok/s`, floor: 10 });
  lineChart(
    $("chart-ttft"),
    [
      { values: buckets.map((b) => (b.ttft_mean_s === null ? null : b.ttft_mean_s * 1000)), className: "s2", dots: true },
      { values: buckets.map((b) => (b.ttft_max_s === null ? null : b.ttft_max_s * 1000)), className: "s2 faint", dots: true },
    ],
    { format: (v) => `${v} ms`, floor: 100 },
  );
  lineChart($("chart-requests"), [{ values: buckets.map((b) => b.requests_per_s), className: "s3" }], {
    format: (v) => `${v}/s`,
    floor: 1,
  });
}

function clock(ts) {
  return new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
}

function renderEvents(activity) {
  const events = (activity && activity.events) || [];
  if (!events.length) {
    $("events").replaceChildren(el("li", { class: "muted", text: "No worker events yet." }));
    return;
  }
  $("events").replaceChildren(
    ...events.map((e) =>
      el(
        "li",
        { class: `event event-${e.kind}`, "data-kind": e.kind, "data-worker": e.worker_id },
        el("time", { text: clock(e.ts), datetime: new Date(e.ts * 1000).toISOString() }),
        el("span", { class: "event-worker", text: e.worker_id < 0 ? "router" : `#${e.worker_id}` }),
        el("span", { class: `event-kind kind-${e.kind}`, text: e.kind }),
        el("span", { class: "event-detail", text: e.detail }),
      ),
    ),
  );
}

function renderBatches(activity) {
  const batches = (activity && activity.batches) || [];
  if (!batches.length) {
    $("batches").replaceChildren(el("li", { class: "muted", text: "No batches." }));
    return;
  }
  $("batches").replaceChildren(
    ...batches.map((b) =>
      el(
        "li",
        { class: "event batch", "data-batch": b.id, "data-status": b.status },
        el("time", { text: clock(b.created_at), datetime: new Date(b.created_at * 1000).toISOString() }),
        el("span", { class: "event-worker", text: b.id }),
        el("span", { class: "event-kind", text: b.status }),
        el("span", {
          class: "event-detail",
          text: `${b.completed + b.failed} of ${b.total} done (${percent(b.completed + b.failed, b.total)}%, ${b.failed} failed) · ${b.endpoint}`,
        }),
      ),
    ),
  );
}

// ---- polling ----------------------------------------------------------------------------------

async function poll() {
  try {
    const [tr, ar] = await Promise.all([api("/workers"), api("/activity")]);
    if (!tr.ok) throw new Error(await errorText(tr));
    if (!ar.ok) throw new Error(await errorText(ar));
    const [table, activity] = await Promise.all([tr.json(), ar.json()]);
    last = { table, activity };
    lastOk = Date.now();
    // every served model (several models: all of them, not only the first)
    const states = activity.model_states || {};
    $("model-name").textContent = (activity.models || [activity.model])
      .map((m) => (states[m] && states[m] !== "ready" ? `${m} (${states[m]})` : m))
      .join(", ");
    $("admin-button").hidden = !activity.admin_controls;
    renderCards(table, activity);
    renderCharts(activity);
    renderTable(table, activity);
    renderEvents(activity);
    renderBatches(activity);
    $("live").textContent = "live";
    $("live").className = "live ok";
  } catch (error) {
    $("live").textContent = lastOk ? `no answer from the router: ${error.message}` : `cannot reach the router: ${error.message}`;
    $("live").className = "live down";
  }
  setTimeout(poll, POLL_MS);
}

$("admin-button").addEventListener("click", () => {
  if (document.body.classList.contains("admin")) {
    sessionStorage.removeItem(ADMIN_STORE);
    setAdmin(false);
  } else {
    askAdminToken("Enter the router's admin token to drain or restart replicas from this page.");
  }
});
checkAdmin();
poll();

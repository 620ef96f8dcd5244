// The llm-pipeline web UI: a chat playground and a status view, talking to this server's
// OpenAI API (/v1/models, /v1/chat/completions) and its /status document. Plain
// JavaScript, no framework, nothing loaded from elsewhere. With API keys the page asks
// for one and keeps it in sessionStorage: for this tab only.
"use strict";

const KEY_STORAGE = "llm-pipeline.api-key";
const STATUS_EVERY_MS = 2000;

const $ = (id) => document.getElementById(id);

const state = {
  history: [],          // the conversation sent with each request (system prompt aside)
  controller: null,     // the AbortController of the answer streaming now
  statusTimer: null,
  lastPoll: null,       // {tokens, time}: the previous status poll, for tokens/s
  keyNeeded: false,
};

class Unauthorized extends Error {}

// ------------------------------------------------------------------------ the API key

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function requestHeaders(json) {
  const headers = {};
  if (json) headers["content-type"] = "application/json";
  const key = apiKey();
  if (key) headers.authorization = "Bearer " + key;
  return headers;
}

function askForKey() {
  state.keyNeeded = true;
  $("key-button").hidden = false;
  const dialog = $("key-dialog");
  if (!dialog.open) {
    $("key-input").value = "";
    dialog.showModal();
    $("key-input").focus();
  }
}

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: requestHeaders(options.body !== undefined),
  });
  if (response.status === 401) {
    askForKey();
    throw new Unauthorized("this server needs an API key");
  }
  return response;
}

function setupKeyDialog() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORAGE, key);
    $("key-dialog").close();
    notice("API key kept for this tab.");
    loadModels();
    if (!$("status-view").hidden) refreshStatus();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    $("key-input").value = "";
    notice("API key forgotten.");
  });
  $("key-button").addEventListener("click", askForKey);
  if (apiKey()) $("key-button").hidden = false;
}

// ----------------------------------------------------------------------------- notices

function notice(text, kind = "info") {
  const element = $("notice");
  element.textContent = text;
  element.dataset.kind = kind;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) {
    // not JSON: the status says enough
  }
  return `HTTP ${response.status}`;
}

// ------------------------------------------------------------------------------ models

async function loadModels() {
  let response;
  try {
    response = await api("/v1/models");
  } catch (error) {
    if (!(error instanceof Unauthorized)) notice("Cannot list the models: " + error.message, "error");
    return;
  }
  if (!response.ok) {
    notice("Cannot list the models: " + (await errorText(response)), "error");
    return;
  }
  const models = (await response.json()).data || [];
  const select = $("model");
  const previous = select.value;
  select.replaceChildren(
    ...models.map((model) => {
      const option = document.createElement("option");
      option.value = model.id;
      option.textContent = model.id;
      return option;
    }),
  );
  if (models.some((model) => model.id === previous)) select.value = previous;
  if (state.keyNeeded) notice("");
}

// -------------------------------------------------------------------------------- chat

function addMessage(role, text = "") {
  const item = $("message-template").content.firstElementChild.cloneNode(true);
  item.classList.add(role);
  item.querySelector(".role").textContent = role === "user" ? "You" : "Assistant";
  item.querySelector(".content").textContent = text;
  const conversation = $("conversation");
  conversation.append(item);
  item.scrollIntoView({ block: "end" });
  return {
    item,
    content: item.querySelector(".content"),
    reasoning: item.querySelector(".reasoning"),
    reasoningText: item.querySelector(".reasoning-text"),
    toolCalls: item.querySelector(".tool-calls"),
    meta: item.querySelector(".meta"),
  };
}

function requestBody(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  const stops = $("stop-strings").value.split("\n").filter((line) => line !== "");
  if (stops.length) body.stop = stops;
  const tools = $("tools").value.trim();
  if (tools) {
    let parsed;
    try {
      parsed = JSON.parse(tools);
    } catch (error) {
      throw new Error("the tools are not valid JSON: " + error.message);
    }
    if (!Array.isArray(parsed)) throw new Error("the tools must be a JSON array");
    body.tools = parsed;
  }
  return body;
}

// Server-sent events: yields each `data:` payload (a string) of the response body.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data) yield data;
    }
  }
}

function showToolCalls(view, calls) {
  view.toolCalls.hidden = calls.length === 0;
  view.toolCalls.replaceChildren(
    ...calls.map((call) => {
      const item = document.createElement("li");
      const label = document.createElement("span");
      label.className = "tool-label";
      label.textContent = "Tool call";
      const name = document.createElement("strong");
      name.className = "tool-name";
      name.textContent = call.name || "?";
      const args = document.createElement("code");
      args.className = "tool-arguments";
      args.textContent = call.arguments;
      item.append(label, " ", name, " ", args);
      return item;
    }),
  );
}

function formatMeta(figures) {
  const parts = [];
  if (figures.ttftMs !== null) parts.push(`TTFT ${figures.ttftMs.toFixed(0)} ms`);
  if (figures.tokensPerSecond !== null) parts.push(`${figures.tokensPerSecond.toFixed(1)} tokens/s`);
  if (figures.tokens !== null) parts.push(`${figures.tokens} tokens`);
  if (figures.finish) parts.push(`finish: ${figures.finish}`);
  if (figures.note) parts.push(figures.note);
  return parts.join(" · ");
}

function updateMeta(view, figures) {
  view.meta.textContent = formatMeta(figures);
  if (figures.ttftMs !== null) view.meta.dataset.ttftMs = figures.ttftMs.toFixed(1);
  if (figures.tokensPerSecond !== null) {
    view.meta.dataset.tokensPerSecond = figures.tokensPerSecond.toFixed(1);
  }
}

async function send() {
  const input = $("message");
  const text = input.value.trim();
  if (!text || state.controller) return;
  let body;
  try {
    body = requestBody(text);
  } catch (error) {
    notice(error.message, "error");
    return;
  }
  notice("");
  input.value = "";
  addMessage("user", text);
  state.history.push({ role: "user", content: text });
  const view = addMessage("assistant");
  view.item.setAttribute("aria-busy", "true");
  const controller = new AbortController();
  state.controller = controller;
  $("stop").disabled = false;
  $("send").disabled = true;

  const started = performance.now();
  let first = null;
  let content = "";
  let reasoning = "";
  const calls = [];
  const figures = { ttftMs: null, tokensPerSecond: null, tokens: null, finish: null, note: "" };
  let chunks = 0;
  let failed = false;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the server failed the request");
      if (chunk.usage) figures.tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        let visible = false;
        if (delta.reasoning_content) {
          reasoning += delta.reasoning_content;
          view.reasoning.hidden = false;
          view.reasoning.open = true;
          view.reasoningText.textContent = reasoning;
          visible = true;
        }
        if (delta.content) {
          content += delta.content;
          view.content.textContent = content;
          visible = true;
        }
        for (const piece of delta.tool_calls || []) {
          const call = (calls[piece.index || 0] ||= { id: null, name: "", arguments: "" });
          if (piece.id) call.id = piece.id;
          if (piece.function && piece.function.name) call.name = piece.function.name;
          if (piece.function && piece.function.arguments) call.arguments += piece.function.arguments;
          showToolCalls(view, calls.filter(Boolean));
          visible = true;
        }
        if (visible) {
          chunks += 1;
          if (first === null) {
            first = performance.now();
            figures.ttftMs = first - started;
            updateMeta(view, figures);
          }
        }
        if (choice.finish_reason) figures.finish = choice.finish_reason;
      }
    }
  } catch (error) {
    if (error.name === "AbortError") {
      figures.note = "stopped";
    } else {
      failed = true;
      figures.note = "failed";
      if (!(error instanceof Unauthorized)) notice("The request failed: " + error.message, "error");
    }
  } finally {
    const ended = performance.now();
    if (figures.tokens === null && chunks) figures.tokens = chunks;
    if (first !== null && figures.tokens) {
      const seconds = (ended - (figures.tokens > 1 ? first : started)) / 1000;
      figures.tokensPerSecond = seconds > 0 ? figures.tokens / seconds : null;
    }
    updateMeta(view, figures);
    view.item.removeAttribute("aria-busy");
    state.controller = null;
    $("stop").disabled = true;
    $("send").disabled = false;
    const answer = { role: "assistant", content };
    const made = calls.filter(Boolean);
    if (made.length) {
      answer.tool_calls = made.map((call, index) => ({
        id: call.id || `call_${index}`,
        type: "function",
        function: { name: call.name, arguments: call.arguments },
      }));
    }
    if (!failed && (content || made.length)) state.history.push(answer);
    input.focus();
  }
}

function setupChat() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
  });
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    $("conversation").replaceChildren();
    notice("New chat.");
    $("message").focus();
  });
  // On a narrow window the settings start folded, so the conversation comes first.
  if (window.matchMedia("(max-width: 720px)").matches) $("settings").open = false;
}

// ------------------------------------------------------------------------------ status

function text(value, unit = "") {
  return value === null || value === undefined ? "–" : `${value}${unit}`;
}

function cell(row, value) {
  const td = document.createElement("td");
  td.textContent = value;
  row.append(td);
}

function renderWorkers(workers) {
  const body = $("workers").querySelector("tbody");
  body.replaceChildren(
    ...workers.map((worker) => {
      const row = document.createElement("tr");
      const name = document.createElement("th");
      name.scope = "row";
      name.textContent = worker.id;
      row.append(name);
      cell(row, worker.role);
      cell(row, String(worker.in_flight));
      const load = worker.load; // what the worker (an upstream server) last said of its load
      cell(
        row,
        load
          ? `${worker.where} (${load.decoding} decoding, ${load.waiting} starting, ` +
              `${load.prefill_tokens} prompt tokens queued)`
          : worker.where,
      );
      return row;
    }),
  );
}

function renderRequest(request) {
  const item = document.createElement("li");
  item.className = "request";
  const line = document.createElement("p");
  line.className = "request-line";
  const status = document.createElement("span");
  status.className = "http-status";
  status.dataset.ok = String(request.status !== null && request.status < 400);
  status.textContent = text(request.status);
  const when = new Date(request.started_at_ms).toLocaleTimeString();
  const parts = [
    when,
    request.name,
    request.model,
    request.completion_tokens === null ? null : `${request.completion_tokens} tokens`,
    request.ttft_ms === null ? null : `TTFT ${request.ttft_ms.toFixed(1)} ms`,
    `${request.duration_ms.toFixed(1)} ms`,
  ].filter((part) => part !== null && part !== undefined);
  const id = document.createElement("code");
  id.textContent = request.request_id || request.trace_id;
  id.title = `trace ${request.trace_id}`;
  line.append(status, " " + parts.join(" · ") + " · ", id);
  item.append(line);

  const stages = document.createElement("ol");
  stages.className = "waterfall";
  stages.setAttribute("aria-label", "Stage timings");
  const total = request.duration_ms || 1;
  for (const span of request.spans) {
    const row = document.createElement("li");
    row.className = "stage";
    if (span.error) row.dataset.error = "true";
    const name = document.createElement("span");
    name.className = "stage-name";
    name.textContent = span.name;
    name.style.paddingLeft = `${span.depth * 0.6}em`;
    const track = document.createElement("span");
    track.className = "track";
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.left = `${Math.min(100, (span.start_ms / total) * 100)}%`;
    bar.style.width = `${Math.max(0.5, (span.duration_ms / total) * 100)}%`;
    track.append(bar);
    for (const event of span.events) {
      const tick = document.createElement("span");
      tick.className = "tick";
      tick.title = `${event.name} at ${event.at_ms.toFixed(2)} ms`;
      tick.style.left = `${Math.min(100, (event.at_ms / total) * 100)}%`;
      track.append(tick);
    }
    const time = document.createElement("span");
    time.className = "stage-time";
    time.textContent = `${span.duration_ms.toFixed(2)} ms`;
    const detail = [
      `${span.name}: starts at ${span.start_ms.toFixed(2)} ms, takes ${span.duration_ms.toFixed(2)} ms`,
      span.operator ? `operator ${span.operator}` : null,
      span.worker ? `worker ${span.worker}` : null,
      span.error ? `error: ${span.error}` : null,
      ...span.events.map((event) => `${event.name} at ${event.at_ms.toFixed(2)} ms`),
    ].filter(Boolean);
    row.title = detail.join("\n");
    track.setAttribute("aria-label", detail[0]);
    row.append(name, track, time);
    stages.append(row);
  }
  item.append(stages);
  return item;
}

async function refreshStatus() {
  let response;
  try {
    response = await api("/status");
  } catch (error) {
    if (!(error instanceof Unauthorized)) notice("Cannot read the status: " + error.message, "error");
    return;
  }
  if (!response.ok) {
    notice("Cannot read the status: " + (await errorText(response)), "error");
    return;
  }
  const status = await response.json();
  const now = performance.now();
  let tokensPerSecond = null;
  if (state.lastPoll) {
    const seconds = (now - state.lastPoll.time) / 1000;
    if (seconds > 0) tokensPerSecond = (status.output_tokens_total - state.lastPoll.tokens) / seconds;
  }
  state.lastPoll = { tokens: status.output_tokens_total, time: now };
  $("stat-inflight").textContent = text(status.in_flight);
  $("stat-waiting").textContent = text(status.waiting);
  $("stat-tps").textContent = tokensPerSecond === null ? "–" : tokensPerSecond.toFixed(1);
  $("stat-kv").textContent =
    status.kv.hit_rate === null ? "–" : `${(status.kv.hit_rate * 100).toFixed(1)} %`;
  $("stat-requests").textContent = text(status.requests_total);
  $("stat-uptime").textContent = `${Math.round(status.uptime_s)} s`;
  renderWorkers(status.workers);
  const tracing = status.tracing;
  $("tracing").textContent =
    (tracing.recording ? "Stage timings from the spans recorded in this process." : "No spans are recorded.") +
    (tracing.exporting ? ` Traces are exported to ${tracing.exporting}.` : "");
  $("recent").replaceChildren(...status.recent.map(renderRequest));
}

function startStatus() {
  if (state.statusTimer !== null) return;
  refreshStatus();
  state.statusTimer = setInterval(() => {
    if (document.visibilityState === "visible") refreshStatus();
  }, STATUS_EVERY_MS);
}

function stopStatus() {
  if (state.statusTimer !== null) clearInterval(state.statusTimer);
  state.statusTimer = null;
  state.lastPoll = null;
}

// ----------------------------------------------------------------------------- routing

function show(view) {
  const status = view === "status";
  $("chat-view").hidden = status;
  $("status-view").hidden = !status;
  for (const [name, tab] of [["chat", $("tab-chat")], ["status", $("tab-status")]]) {
    if (name === view) tab.setAttribute("aria-current", "page");
    else tab.removeAttribute("aria-current");
  }
  document.title = status ? "Status · llm-pipeline" : "Chat · llm-pipeline";
  if (status) startStatus();
  else stopStatus();
}

function route() {
  show(location.hash === "#status" ? "status" : "chat");
}

document.addEventListener("DOMContentLoaded", () => {
  setupKeyDialog();
  setupChat();
  window.addEventListener("hashchange", route);
  route();
  loadModels();
});

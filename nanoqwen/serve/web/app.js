// The chat page of `nanoqwen serve`: streams answers from /v1/chat/completions and keeps
// conversations in localStorage. Model output is data, never code: markdown goes through
// marked with raw HTML escaped, then DOMPurify, and only then into the page.
"use strict";

const STORE = {
  conversations: "nanoqwen.conversations",
  current: "nanoqwen.current",
  settings: "nanoqwen.settings",
  key: "nanoqwen.apiKey",
};
const DEFAULT_SETTINGS = { system: "", temperature: 0.7, maxTokens: 1024 };

const $ = (id) => document.getElementById(id);
const state = {
  conversations: load(STORE.conversations, []),
  currentId: localStorage.getItem(STORE.current),
  settings: { ...DEFAULT_SETTINGS, ...load(STORE.settings, {}) },
  model: null,
  running: null, // {conversation, controller} while an answer streams
  views: new Map(), // message -> its element, for the conversation on screen
};

class ServerError extends Error {}

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
  localStorage.setItem(STORE.current, state.currentId ?? "");
  localStorage.setItem(STORE.settings, JSON.stringify(state.settings));
}

// ---- markdown --------------------------------------------------------------------------

const escapeHtml = (s) =>
  s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");

// Raw HTML in an answer is shown as the text it is (a model writing `<script>` means it).
marked.use({ gfm: true, renderer: { html: ({ text }) => escapeHtml(text) } });

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Fills element with text rendered as sanitized markdown; code blocks get a copy button. */
function renderMarkdown(element, text) {
  const html = marked.parse(text, { async: false });
  element.replaceChildren(DOMPurify.sanitize(html, { RETURN_DOM_FRAGMENT: true }));
  for (const pre of element.querySelectorAll("pre")) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.addEventListener("click", () => copyText(pre.querySelector("code") ?? pre, button));
    pre.prepend(button);
  }
}

async function copyText(code, button) {
  const text = code.textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // No clipboard API outside a secure context (http on another host than localhost).
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = "Copy"), 1200);
}

// ---- server ----------------------------------------------------------------------------

async function errorMessage(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message;
  } catch {
    return `${response.status} ${response.statusText}${text ? `: ${text}` : ""}`;
  }
}

/** fetch with the stored key; on a 401 asks for a key and tries again, until cancelled. */
async function api(path, init = {}) {
  for (;;) {
    const headers = new Headers(init.headers);
    const key = localStorage.getItem(STORE.key);
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    const message = await errorMessage(response);
    if (!(await askKey(message))) throw new ServerError(message);
  }
}

function askKey(reason) {
  const dialog = $("key-dialog");
  $("key-reason").textContent = reason ?? "";
  $("key-input").value = localStorage.getItem(STORE.key) ?? "";
  return new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        const key = $("key-input").value.trim();
        const saved = dialog.returnValue === "save" && key !== "";
        if (saved) localStorage.setItem(STORE.key, key);
        resolve(saved);
      },
      { once: true },
    );
    dialog.returnValue = "";
    dialog.showModal();
  });
}

/** The data of each server-sent event in body, as text. */
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const raw of lines) {
      const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
      if (line === "" && data.length) {
        yield data.join("\n");
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      }
    }
  }
}

async function loadModel() {
  try {
    const response = await api("v1/models");
    if (!response.ok) throw new ServerError(await errorMessage(response));
    state.model = (await response.json()).data[0].id;
    $("model-name").textContent = state.model;
  } catch (e) {
    $("model-name").textContent = `no model: ${e.message}`;
  }
}

// ---- conversations ---------------------------------------------------------------------

const current = () => state.conversations.find((c) => c.id === state.currentId);

// Not crypto.randomUUID: it exists only in secure contexts, and the page may be served over
// plain http to another host.
const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2);

function newConversation() {
  const open = current();
  if (open && !open.messages.length) {
    $("prompt").focus();
    return open;
  }
  const conversation = { id: newId(), title: "New chat", messages: [] };
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  save();
  render();
  $("prompt").focus();
  return conversation;
}

function deleteConversation(conversation) {
  if (state.running?.conversation === conversation) state.running.controller.abort();
  state.conversations = state.conversations.filter((c) => c !== conversation);
  if (state.currentId === conversation.id) state.currentId = state.conversations[0]?.id ?? null;
  save();
  render();
}

function requestBody(conversation) {
  const { system, temperature, maxTokens } = state.settings;
  const messages = conversation.messages
    .filter((m) => m.role === "user" || m.role === "assistant")
    .map(({ role, content }) => ({ role, content }));
  if (system.trim()) messages.unshift({ role: "system", content: system });
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (state.model) body.model = state.model;
  if (temperature !== "" && temperature != null) body.temperature = Number(temperature);
  if (maxTokens !== "" && maxTokens != null) body.max_tokens = Number(maxTokens);
  return body;
}

/** Streams the answer to the conversation's last user turn into a new assistant message. */
async function answer(conversation) {
  const controller = new AbortController();
  state.running = { conversation, controller };
  const message = { role: "assistant", content: "", streaming: true };
  conversation.messages.push(message);
  render();
  const started = performance.now();
  let first = null;
  let tokens = null;
  let chunks = 0;
  let failed = false;
  try {
    const response = await api("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(conversation)),
      signal: controller.signal,
    });
    if (!response.ok) throw new ServerError(await errorMessage(response));
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(chunk.error.message);
      const piece = chunk.choices?.[0]?.delta?.content;
      if (piece) {
        first ??= performance.now();
        chunks += 1;
        message.content += piece;
        update(message);
      }
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
    }
  } catch (e) {
    if (e.name === "AbortError") message.stopped = true;
    else {
      failed = true;
      fail(conversation, e);
    }
  } finally {
    const ended = performance.now();
    delete message.streaming;
    if (first !== null) {
      const count = tokens ?? chunks; // a stopped answer has no usage chunk
      // The decode rate: the tokens after the first over the time after it (TTFT is apart).
      const decoding = (ended - first) / 1000;
      message.stats = {
        ttft: (first - started) / 1000,
        tokens: count,
        tps: count > 1 && decoding > 0 ? (count - 1) / decoding : null,
      };
    }
    if (failed && !message.content) {
      conversation.messages.splice(conversation.messages.indexOf(message), 1);
    }
    state.running = null;
    save();
    render();
  }
}

function fail(conversation, error) {
  const text =
    error instanceof ServerError ? error.message : `cannot reach the server: ${error.message}`;
  conversation.messages.push({ role: "error", content: text });
}

function send(text) {
  if (state.running || !text.trim()) return;
  const conversation = current() ?? newConversation();
  if (!conversation.messages.length) conversation.title = text.trim().slice(0, 48);
  conversation.messages.push({ role: "user", content: text });
  save();
  $("prompt").value = "";
  answer(conversation);
}

function regenerate() {
  const conversation = current();
  if (state.running || !conversation) return;
  const last = conversation.messages.findLastIndex((m) => m.role === "user");
  if (last < 0) return;
  conversation.messages.splice(last + 1);
  answer(conversation);
}

// ---- view ------------------------------------------------------------------------------

function statsText(message) {
  const parts = [];
  const s = message.stats;
  if (s) {
    parts.push(`TTFT ${s.ttft.toFixed(2)} s`);
    if (s.tps !== null) parts.push(`${s.tps.toFixed(1)} tok/s`);
    parts.push(`${s.tokens} tokens`);
  }
  if (message.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function messageView(message) {
  const view = document.createElement("div");
  view.className = `message ${message.role}`;
  const body = document.createElement("div");
  body.className = "body";
  view.append(body);
  if (message.role === "assistant") {
    const stats = document.createElement("div");
    stats.className = "stats";
    view.append(stats);
  }
  state.views.set(message, view);
  fill(message, view);
  return view;
}

function fill(message, view) {
  const body = view.querySelector(".body");
  if (message.role === "assistant") renderMarkdown(body, message.content);
  else body.textContent = message.content;
  view.classList.toggle("streaming", Boolean(message.streaming));
  const stats = view.querySelector(".stats");
  if (stats) stats.textContent = statsText(message);
}

// A streamed answer is re-rendered at most once a frame, however many chunks arrive.
const pending = new Set();
function update(message) {
  if (!pending.size) requestAnimationFrame(flush);
  pending.add(message);
}
function flush() {
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  for (const message of pending) {
    const view = state.views.get(message);
    if (view?.isConnected) fill(message, view);
  }
  pending.clear();
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function render() {
  const list = $("conversations");
  list.replaceChildren(
    ...state.conversations.map((conversation) => {
      const item = document.createElement("li");
      item.classList.toggle("active", conversation.id === state.currentId);
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open";
      open.textContent = conversation.title;
      open.title = conversation.title;
      open.addEventListener("click", () => {
        state.currentId = conversation.id;
        save();
        render();
      });
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "delete";
      remove.textContent = "×";
      remove.title = "Delete this conversation";
      remove.addEventListener("click", () => deleteConversation(conversation));
      item.append(open, remove);
      return item;
    }),
  );

  state.views.clear();
  const box = $("messages");
  const conversation = current();
  box.replaceChildren(...(conversation?.messages ?? []).map(messageView));
  if (!conversation?.messages.length) {
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = "Send a message to start.";
    box.append(empty);
  }
  box.scrollTop = box.scrollHeight;

  const busy = state.running !== null;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy || !conversation?.messages.some((m) => m.role === "user");
}

function bindSettings() {
  const fields = { system: "system-prompt", temperature: "temperature", maxTokens: "max-tokens" };
  for (const [name, id] of Object.entries(fields)) {
    const input = $(id);
    input.value = state.settings[name] ?? "";
    input.addEventListener("input", () => {
      state.settings[name] = input.value;
      save();
    });
  }
}

function start() {
  // Answers cut short by a reload are kept as they are, no longer streaming.
  for (const c of state.conversations) for (const m of c.messages) delete m.streaming;
  if (!current()) state.currentId = state.conversations[0]?.id ?? null;
  bindSettings();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send($("prompt").value);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send($("prompt").value);
    }
  });
  $("stop").addEventListener("click", () => state.running?.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newConversation);
  $("set-key").addEventListener("click", () => askKey("").then(loadModel));
  render();
  loadModel();
}

start();

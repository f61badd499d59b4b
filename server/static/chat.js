// The chat: messages, streaming replies, sessions, stop, settings, and the API key prompt.
import { ApiError, apiKey, getJson, setApiKey, streamChat } from "./api.js";
import { Inspector } from "./inspector.js";
import { renderMarkdown } from "./markdown.js";

const CHAT_ITEM = "h2o-chat.conversation"; // {sessionId, messages}: a reload continues the session
const $ = (id) => document.getElementById(id);

const state = { sessionId: null, messages: [], controller: null };
const inspector = new Inspector(showError);

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function explain(error) {
  if (error instanceof ApiError && error.status === 401) {
    openSettings();
    $("api-key").focus();
  }
  showError(error.message || String(error));
}

function openSettings() {
  $("settings").hidden = false;
  $("toggle-settings").setAttribute("aria-expanded", "true");
}

function save() {
  localStorage.setItem(CHAT_ITEM, JSON.stringify({ sessionId: state.sessionId, messages: state.messages }));
  $("session").textContent = state.sessionId ? `Session ${state.sessionId.slice(0, 8)}…` : "";
}

function addMessage(role, content) {
  $("empty").hidden = true;
  const box = document.createElement("article");
  box.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "content";
  box.append(label, body);
  $("messages").append(box);
  setContent(body, role, content);
  return body;
}

function setContent(body, role, content) {
  if (role === "user") body.textContent = content; // what the user typed, shown as typed
  else body.innerHTML = renderMarkdown(content);
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
  if (!busy) $("prompt").focus();
}

function sampling() {
  const number = (id) => Number($(id).value);
  return { temperature: number("temperature"), top_p: number("top-p"), max_tokens: Math.round(number("max-tokens")) };
}

async function send(text) {
  showError("");
  const turn = { role: "user", content: text };
  const conversation = state.messages;
  conversation.push(turn);
  addMessage("user", text);
  const body = addMessage("assistant", "");
  const controller = (state.controller = new AbortController());
  let reply = "";
  let pending = false;
  const paint = () => { pending = false; setContent(body, "assistant", reply); };
  const onDelta = (piece) => {
    reply += piece;
    if (!pending) { pending = true; requestAnimationFrame(paint); } // at most one render per frame
  };
  const onSession = (id) => {
    if (state.messages !== conversation) return; // "New chat" was pressed meanwhile
    state.sessionId = id || state.sessionId;
    save();
    inspector.follow(state.sessionId, true);
  };
  setBusy(true);
  try {
    // With a session, only the new message; without one, the whole history (the server finds the
    // conversation it continues, or starts a new one).
    const messages = state.sessionId ? [turn] : state.messages;
    try {
      await streamChat({ messages, ...sampling() }, state.sessionId, controller.signal, { onSession, onDelta });
    } catch (error) {
      if (!(error instanceof ApiError && error.code === "session_not_found" && state.sessionId)) throw error;
      // The session expired on the server: re-send the whole history, which starts a new one.
      state.sessionId = null;
      await streamChat({ messages: state.messages, ...sampling() }, null, controller.signal,
        { onSession, onDelta });
    }
  } catch (error) {
    if (error.name !== "AbortError") explain(error);
    else body.parentElement.classList.add("stopped");
  } finally {
    paint();
    state.controller = null;
    const current = state.messages === conversation; // false once "New chat" was pressed meanwhile
    if (current && reply) {
      state.messages.push({ role: "assistant", content: reply });
    } else if (current) {
      // Nothing came back: the server kept no trace of this turn, so neither do we.
      state.messages.pop();
      body.parentElement.previousElementSibling.remove();
      body.parentElement.remove();
      $("empty").hidden = state.messages.length > 0;
      $("prompt").value = text;
    }
    save();
    setBusy(false);
    inspector.follow(state.sessionId, false);
  }
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.sessionId = null;
  state.messages = [];
  $("messages").querySelectorAll(".message").forEach((m) => m.remove());
  $("empty").hidden = false;
  showError("");
  save();
  inspector.reset();
  $("prompt").focus();
}

function restore() {
  try {
    const saved = JSON.parse(localStorage.getItem(CHAT_ITEM) || "null");
    if (saved && Array.isArray(saved.messages)) {
      state.sessionId = saved.sessionId || null;
      state.messages = saved.messages;
      for (const m of state.messages) addMessage(m.role, m.content);
    }
  } catch (_) {
    localStorage.removeItem(CHAT_ITEM);
  }
  save();
}

async function checkServer() {
  try {
    const models = await getJson("/v1/models");
    $("model").textContent = models.data && models.data[0] ? models.data[0].id : "";
    if (state.sessionId) inspector.follow(state.sessionId, false);
  } catch (error) {
    explain(error);
  }
}

function wire() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("toggle-settings").addEventListener("click", () => {
    const open = $("settings").hidden;
    $("settings").hidden = !open;
    $("toggle-settings").setAttribute("aria-expanded", String(open));
  });
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey($("api-key").value.trim());
    showError("");
    checkServer();
  });
}

window.addEventListener("error", (event) => showError(`The page hit an error: ${event.message}`));
window.addEventListener("unhandledrejection", (event) => showError(`The page hit an error: ${event.reason}`));
wire();
restore();
checkServer();
$("prompt").focus();

// The server's HTTP API as the page uses it: the API key (kept in this browser only), errors, SSE.

const KEY_ITEM = "h2o-chat.api-key";

export class ApiError extends Error {
  // status: HTTP status (0 when the server could not be reached); code: the error object's code
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_ITEM, key);
  else localStorage.removeItem(KEY_ITEM);
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// Every error the server sends has one shape: {"error": {"message", "type", "param", "code"}}.
async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch (_) {
    // not JSON (a proxy's page): the status line says enough
  }
  if (response.status === 401) {
    message = apiKey() ? `The API key was refused: ${message}` : `This server needs an API key: ${message}`;
  }
  return new ApiError(response.status, message, code);
}

async function send(path, options) {
  let response;
  try {
    response = await fetch(path, options);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(0, `The server could not be reached (${error.message}).`);
  }
  if (!response.ok) throw await failure(response);
  return response;
}

export async function getJson(path, signal) {
  const response = await send(path, { headers: headers(), signal });
  return response.json();
}

// POST a streamed chat completion. onSession(id) gets the session id as soon as the reply starts,
// onDelta(text) each piece of the reply as it arrives; resolves to {usage, finishReason}.
// Aborting `signal` closes the connection, which makes the server cancel the generation.
export async function streamChat(body, sessionId, signal, { onSession, onDelta }) {
  const extra = { "Content-Type": "application/json" };
  if (sessionId) extra["X-Session-ID"] = sessionId;
  const response = await send("/v1/chat/completions", {
    method: "POST",
    headers: headers(extra),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  onSession(response.headers.get("X-Session-ID"));
  const result = { usage: null, finishReason: null };
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    const frames = buffered.split("\n\n");
    buffered = frames.pop();
    for (const frame of frames) {
      const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(500, chunk.error.message, chunk.error.code);
      if (chunk.usage) result.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) onDelta(choice.delta.content);
        if (choice.finish_reason) result.finishReason = choice.finish_reason;
      }
    }
  }
  return result;
}

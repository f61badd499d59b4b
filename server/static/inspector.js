// The cache inspector: what the current session's KV cache holds, from GET /v1/sessions/{id}/cache.
// Refreshed after every turn, and during a reply every POLL_MS at most (one request at a time): the
// server reads the cache between two decode steps, so a reply streams at the same speed.
import { getJson } from "./api.js";

const POLL_MS = 1500;
const LAST_TOKENS = 2048; // tokens of the conversation spelled out in the token view
const COLORS = { sink: "#7c3aed", heavy: "#c2410c", recent: "#047857", recalled: "#be185d" };
const $ = (id) => document.getElementById(id);

// Each head's positions are ascending: the first kept_sinks are sinks, the last kept_recent the
// recent window, the rest heavy hitters or, when in the head's `recalled` set, recalled from the archive.
function kindOf(view, index, count, recalled, position) {
  if (index < view.kept_sinks) return "sink";
  if (index >= count - view.kept_recent) return "recent";
  return recalled.has(position) ? "recalled" : "heavy";
}

export class Inspector {
  constructor(onError) {
    this.onError = onError;
    this.sessionId = null;
    this.view = null;
    this.timer = null;
    this.loading = false;
    this.layer = 0;
    this.head = 0;
    $("heads").addEventListener("click", (event) => this.pick(event));
    $("layer").addEventListener("change", () => { this.layer = Number($("layer").value); this.draw(); });
    $("head").addEventListener("change", () => { this.head = Number($("head").value); this.draw(); });
  }

  // Show `sessionId`'s cache now; while `streaming`, keep refreshing until the next call.
  follow(sessionId, streaming) {
    clearInterval(this.timer);
    this.timer = null;
    this.sessionId = sessionId;
    if (!sessionId) return;
    if (streaming) this.timer = setInterval(() => this.refresh(), POLL_MS);
    else this.refresh(true);
  }

  reset() {
    this.follow(null, false);
    this.view = null;
    $("live").hidden = true;
    $("cache-summary").textContent = "No conversation yet.";
    $("turns-chart").replaceChildren();
    $("tokens").replaceChildren();
    $("head-summary").textContent = "";
    const canvas = $("heads");
    canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
  }

  async refresh(force = false) {
    if (!this.sessionId || (this.loading && !force)) return;
    const sessionId = this.sessionId;
    this.loading = true;
    try {
      const view = await getJson(`/v1/sessions/${encodeURIComponent(sessionId)}/cache?last=${LAST_TOKENS}`);
      if (sessionId !== this.sessionId) return; // a new chat started meanwhile
      this.view = view;
      this.draw();
    } catch (error) {
      this.onError(`Cache inspector: ${error.message}`);
    } finally {
      this.loading = false;
    }
  }

  draw() {
    const view = this.view;
    if (!view) return;
    $("live").hidden = !view.live;
    const layers = view.layers.length;
    const heads = layers ? view.layers[0].length : 0;
    this.layer = Math.min(this.layer, Math.max(layers - 1, 0));
    this.head = Math.min(this.head, Math.max(heads - 1, 0));
    const recalls = view.recalled_tokens > 0 || view.archived_tokens > 0;
    const heavy = view.resident_tokens - view.kept_sinks - view.kept_recent - view.recalled_tokens;
    $("cache-summary").textContent = layers
      ? `${view.conversation_tokens} tokens in the conversation; each of ${layers} layers x ${heads} KV heads ` +
        `holds ${view.resident_tokens} (${view.kept_sinks} sinks, ${view.kept_recent} recent, ${heavy} heavy hitters` +
        (recalls ? `, ${view.recalled_tokens} recalled); ${view.archived_tokens} evicted tokens archived for recall.`
          : ").")
      : "The session holds no cache (its last turn was stopped before a reply).";
    $("recalled-key").hidden = !recalls;
    fillSelect($("layer"), layers, this.layer);
    fillSelect($("head"), heads, this.head);
    this.drawTurns();
    this.drawHeads();
    this.drawTokens();
  }

  drawTurns() {
    const view = this.view;
    const points = view.turns.map((t) => [t.conversation_tokens, t.resident_tokens]);
    if (view.live || !points.length) points.push([view.conversation_tokens, view.resident_tokens]);
    const svg = $("turns-chart");
    const [w, h, left, bottom] = [320, 120, 34, 14];
    const top = Math.max(...points.map((p) => p[0]), 1);
    const x = (i) => left + (points.length > 1 ? (i * (w - left - 6)) / (points.length - 1) : (w - left) / 2);
    const y = (v) => h - bottom - (v * (h - bottom - 8)) / top;
    const line = (k, color) => {
      const path = points.map((p, i) => `${x(i).toFixed(1)},${y(p[k]).toFixed(1)}`).join(" ");
      const dots = points.map((p, i) => `<circle cx="${x(i)}" cy="${y(p[k])}" r="2.5" fill="${color}"/>`).join("");
      return `<polyline points="${path}" fill="none" stroke="${color}" stroke-width="2"/>${dots}`;
    };
    svg.innerHTML =
      `<line x1="${left}" y1="${h - bottom}" x2="${w}" y2="${h - bottom}" stroke="#c9cdd4"/>` +
      `<text x="2" y="12">${top}</text><text x="2" y="${h - bottom}">0</text>` +
      `<text x="${left}" y="${h - 2}">turn 1</text>` +
      `<text x="${w - 40}" y="${h - 2}">turn ${points.length}</text>` +
      line(0, "#1d4ed8") + line(1, "#c2410c");
  }

  drawHeads() {
    const view = this.view;
    const canvas = $("heads");
    const layers = view.layers.length;
    if (!layers) return;
    const heads = view.layers[0].length;
    const label = 26;
    const header = 12; // a row of KV head labels
    const rowH = layers > 24 ? 8 : 12;
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(canvas.clientWidth, 240);
    canvas.width = width * ratio;
    canvas.height = (header + layers * rowH + 4) * ratio;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    const cellW = (width - label) / heads;
    const span = Math.max(view.conversation_tokens, 1);
    ctx.font = "9px system-ui, sans-serif";
    ctx.fillStyle = "#50555f";
    for (let h = 0; h < heads; h++) ctx.fillText(`KV head ${h}`, label + h * cellW + 2, 9);
    ctx.translate(0, header);
    view.layers.forEach((row, layer) => {
      if (layer % 5 === 0) ctx.fillText(`L${layer}`, 2, layer * rowH + rowH);
      row.forEach((head, h) => {
        const x0 = label + h * cellW + 2;
        const w = cellW - 4;
        ctx.fillStyle = "#eceef1";
        ctx.fillRect(x0, layer * rowH + 1, w, rowH - 2);
        const recalled = new Set(head.recalled);
        head.positions.forEach((p, i) => {
          ctx.fillStyle = COLORS[kindOf(view, i, head.positions.length, recalled, p)];
          ctx.fillRect(x0 + (p / span) * w, layer * rowH + 1, Math.max(w / span, 1), rowH - 2);
        });
        if (layer === this.layer && h === this.head) {
          ctx.strokeStyle = "#1b1d21";
          ctx.lineWidth = 1.5;
          ctx.strokeRect(x0 - 1, layer * rowH, w + 2, rowH);
        }
        ctx.fillStyle = "#50555f";
      });
    });
    this.geometry = { label, header, rowH, cellW, layers, heads };
  }

  pick(event) {
    const g = this.geometry;
    if (!g) return;
    const box = $("heads").getBoundingClientRect();
    const scale = box.height / (g.header + g.layers * g.rowH + 4); // CSS may scale the canvas
    const layer = Math.floor((event.clientY - box.top) / scale / g.rowH - g.header / g.rowH);
    const head = Math.floor(((event.clientX - box.left) / scale - g.label) / g.cellW);
    if (layer < 0 || layer >= g.layers || head < 0 || head >= g.heads) return;
    [this.layer, this.head] = [layer, head];
    this.draw();
  }

  drawTokens() {
    const view = this.view;
    const box = $("tokens");
    const head = view.layers.length ? view.layers[this.layer][this.head] : { positions: [], scores: null, recalled: [] };
    const kept = new Map();
    const recalled = new Set(head.recalled);
    const top = head.scores ? Math.max(...head.scores, 1e-9) : 1;
    head.positions.forEach((p, i) => kept.set(p, { kind: kindOf(view, i, head.positions.length, recalled, p),
      score: head.scores ? head.scores[i] : null }));
    // The newest fed token is always kept (recent window), so later ones were sampled but not fed yet.
    const newest = head.positions.length ? head.positions[head.positions.length - 1] : -1;
    const nodes = [];
    if (view.first_position > 0) {
      const note = document.createElement("div");
      note.className = "muted";
      note.textContent = `… ${view.first_position} earlier tokens not shown`;
      nodes.push(note);
    }
    view.tokens.forEach((text, i) => {
      const position = view.first_position + i;
      const span = document.createElement("span");
      span.textContent = text;
      const held = kept.get(position);
      if (held) {
        span.className = `kept ${held.kind}`;
        if (held.score !== null) {
          // Shade by accumulated attention; sqrt spreads the many small scores apart.
          const alpha = 0.08 + 0.42 * Math.sqrt(Math.max(held.score, 0) / top);
          span.style.backgroundColor = `rgba(194, 65, 12, ${alpha.toFixed(3)})`;
        }
        span.title = `#${position} ${held.kind}` + (held.score !== null ? `, score ${held.score}` : "");
      } else if (position > newest) {
        span.title = `#${position} sampled, not fed to the cache yet`;
      } else {
        span.className = "evicted";
        span.title = `#${position} evicted`;
      }
      nodes.push(span);
    });
    box.replaceChildren(...nodes);
    const oldest = head.positions.length ? head.positions[0] : null;
    $("head-summary").textContent = view.layers.length
      ? `Layer ${this.layer}, KV head ${this.head}: holds ${head.positions.length} of ` +
        `${view.conversation_tokens} tokens (highlighted, darker = more attention` +
        (recalled.size ? `; ${recalled.size} recalled, outlined` : "") + `); ` +
        `${view.conversation_tokens - head.positions.length} evicted (grey).` +
        (oldest !== null ? ` Oldest kept: #${oldest}.` : "")
      : "";
  }
}

function fillSelect(select, count, chosen) {
  if (select.options.length !== count) {
    select.replaceChildren(...Array.from({ length: count }, (_, i) => new Option(String(i), String(i))));
  }
  select.value = String(chosen);
}

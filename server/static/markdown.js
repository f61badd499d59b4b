// A small markdown renderer for replies. Safe by construction: the text is HTML-escaped first, and
// every tag below is produced by this file; link targets are limited to http(s).
// Covers what chat replies use: fenced and inline code, headings, bold, italic, lists, links,
// paragraphs. An unclosed fence (a reply still streaming) renders as code to the end.

export function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

function inline(escaped) {
  const codes = [];
  // Inline code first, set aside so the other rules leave its contents alone.
  let html = escaped.replace(/`([^`\n]+)`/g, (_, code) => `\u0000${codes.push(code) - 1}\u0000`);
  html = html
    .replace(/\*\*(?=\S)([^*]+?)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*(?=\S)([^*\n]+?)\*(?!\w)/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
  return html.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
}

function list(lines, ordered) {
  const tag = ordered ? "ol" : "ul";
  const items = lines.map((l) => `<li>${inline(l.replace(/^\s*(?:[-*+]|\d+[.)])\s+/, ""))}</li>`);
  return `<${tag}>${items.join("")}</${tag}>`;
}

function blocks(escaped) {
  const out = [];
  let paragraph = [];
  let items = [];
  let ordered = false;
  const flush = () => {
    if (paragraph.length) out.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
    if (items.length) out.push(list(items, ordered));
    paragraph = [];
    items = [];
  };
  for (const line of escaped.split("\n")) {
    const heading = /^(#{1,4})\s+(.*)$/.exec(line);
    const bullet = /^\s*[-*+]\s+/.test(line);
    const numbered = /^\s*\d+[.)]\s+/.test(line);
    if (!line.trim()) {
      flush();
    } else if (heading) {
      flush();
      const level = heading[1].length + 2; // h3..h6: replies sit below the page's own headings
      out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
    } else if (bullet || numbered) {
      if (paragraph.length || (items.length && ordered !== numbered)) flush();
      ordered = numbered;
      items.push(line);
    } else if (items.length) {
      items[items.length - 1] += ` ${line.trim()}`; // a wrapped list item
    } else {
      paragraph.push(line);
    }
  }
  flush();
  return out.join("");
}

export function renderMarkdown(text) {
  const parts = escapeHtml(text).split(/^```/m);
  // Even parts are prose, odd parts code fences: "lang\ncode...".
  return parts.map((part, i) => {
    if (i % 2 === 0) return blocks(part);
    const newline = part.indexOf("\n");
    const lang = newline < 0 ? "" : part.slice(0, newline).trim();
    const code = newline < 0 ? "" : part.slice(newline + 1).replace(/\n$/, "");
    const label = /^[\w+#.-]+$/.test(lang) ? ` data-lang="${lang}"` : "";
    return `<pre${label}><code>${code}</code></pre>`;
  }).join("");
}

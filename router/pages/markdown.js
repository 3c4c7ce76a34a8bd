// A small Markdown renderer for model output that cannot inject HTML: it never parses HTML. Every
// node is made with document.createElement and every piece of text goes in as a text node, so
// "<script>" in an answer is shown as those characters. Links keep only http(s) and mailto
// targets; images are shown as links (a page of this router fetches nothing from elsewhere).
//
// Covers what chat models write: fenced code blocks (an unclosed fence while streaming is a code
// block too), headings, paragraphs with line breaks, bullet and numbered lists (nested by
// indentation), GitHub tables, block quotes, rules; inline code, bold, italic, strikethrough,
// links and bare URLs, backslash escapes.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST = /^( *)([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
const TABLE_RULE = /^ *\|? *:?-+:? *(?:\| *:?-+:? *)*\|? *$/;
const BLANK = /^\s*$/;
const SAFE_URL = /^(?:https?:\/\/|mailto:)/i;

function node(tag, className) {
  const n = document.createElement(tag);
  if (className) n.className = className;
  return n;
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

function isTableStart(lines, i) {
  return i + 1 < lines.length && lines[i].includes("|") && lines[i + 1].includes("-") && TABLE_RULE.test(lines[i + 1]);
}

function startsBlock(lines, i) {
  const line = lines[i];
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST.test(line) || isTableStart(lines, i);
}

// Render `source` into `root`, replacing what it held.
export function renderMarkdown(source, root) {
  root.replaceChildren(...renderBlocks(String(source)));
}

// The block nodes of `text`.
export function renderBlocks(text) {
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (BLANK.test(line)) {
      i += 1;
    } else if ((m = line.match(FENCE))) {
      const body = [];
      const close = new RegExp(`^ {0,3}${m[1][0] === "`" ? "`" : "~"}{${m[1].length},}\\s*$`);
      for (i += 1; i < lines.length && !close.test(lines[i]); i += 1) body.push(lines[i]);
      i += 1;
      out.push(codeBlock(body.join("\n"), m[2]));
    } else if ((m = line.match(HEADING))) {
      const h = node(`h${Math.min(6, m[1].length + 2)}`, "md-heading");
      h.append(...inline(m[2]));
      out.push(h);
      i += 1;
    } else if (RULE.test(line)) {
      out.push(node("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const inner = [];
      for (; i < lines.length && (m = lines[i].match(QUOTE)); i += 1) inner.push(m[1]);
      const quote = node("blockquote");
      quote.append(...renderBlocks(inner.join("\n")));
      out.push(quote);
    } else if (isTableStart(lines, i)) {
      i = table(lines, i, out);
    } else if (LIST.test(line) && line.match(LIST)[3] !== undefined) {
      i = list(lines, i, out);
    } else {
      const para = [];
      for (; i < lines.length && !BLANK.test(lines[i]) && (para.length === 0 || !startsBlock(lines, i)); i += 1) {
        para.push(lines[i].trim());
      }
      const p = node("p");
      p.append(...inline(para.join("\n")));
      out.push(p);
    }
  }
  return out;
}

function codeBlock(code, language) {
  const figure = node("figure", "md-code");
  const head = node("figcaption");
  const label = node("span", "md-lang");
  label.textContent = language || "code";
  const copy = node("button", "ghost small copy");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.dataset.copy = "code";
  head.append(label, copy);
  const pre = node("pre");
  const codeNode = node("code");
  if (language) codeNode.dataset.lang = language;
  codeNode.textContent = code;
  pre.append(codeNode);
  figure.append(head, pre);
  return figure;
}

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function table(lines, i, out) {
  const header = splitRow(lines[i]);
  const aligns = splitRow(lines[i + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "",
  );
  const wrap = node("div", "md-table");
  const t = node("table");
  const thead = node("thead");
  const tbody = node("tbody");
  const row = (cells, tag) => {
    const tr = node("tr");
    header.forEach((_, c) => {
      const cell = node(tag);
      if (aligns[c]) cell.style.textAlign = aligns[c];
      cell.append(...inline(cells[c] || ""));
      tr.append(cell);
    });
    return tr;
  };
  thead.append(row(header, "th"));
  for (i += 2; i < lines.length && !BLANK.test(lines[i]) && lines[i].includes("|"); i += 1) {
    tbody.append(row(splitRow(lines[i]), "td"));
  }
  t.append(thead, tbody);
  wrap.append(t);
  out.push(wrap);
  return i;
}

function list(lines, i, out) {
  const first = lines[i].match(LIST);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const listNode = node(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) listNode.start = parseInt(first[2], 10);
  while (i < lines.length) {
    const m = lines[i].match(LIST);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered || m[3] === undefined) break;
    const width = indent + m[2].length + 1;
    const body = [m[3]];
    for (i += 1; i < lines.length; i += 1) {
      const line = lines[i];
      if (BLANK.test(line)) {
        const next = lines.slice(i + 1).find((l) => !BLANK.test(l));
        if (next === undefined || indentOf(next) < width) break;
        body.push("");
        continue;
      }
      const sub = line.match(LIST);
      if (sub && sub[1].length <= indent) break;
      if (!sub && indentOf(line) < width && startsBlock(lines, i)) break;
      body.push(line.slice(Math.min(indentOf(line), width)));
    }
    const item = node("li");
    const blocks = renderBlocks(body.join("\n"));
    if (blocks.length && blocks[0].tagName === "P") item.append(...blocks.shift().childNodes); // tight item
    item.append(...blocks);
    listNode.append(item);
    // A blank line between items of one list does not end it.
    let j = i;
    while (j < lines.length && BLANK.test(lines[j])) j += 1;
    const again = j < lines.length && lines[j].match(LIST);
    if (j > i && again && again[1].length === indent && /\d/.test(again[2]) === ordered) i = j;
  }
  out.push(listNode);
  return i;
}

// Inline spans: code, escapes, images (as links), links, bare URLs, bold, strikethrough, italic, breaks.
const INLINE = new RegExp(
  [
    /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1, 2: code span
    /\\([\\`*_{}[\]()#+\-.!~|<>])/.source, // 3: escaped character
    /!\[([^\]\n]*)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)/.source, // 4, 5: image
    /\[([^\]\n]+)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)/.source, // 6, 7: link
    /(https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"*_])/.source, // 8: bare URL
    /\*\*(?=\S)([\s\S]*?\S)\*\*/.source, // 9: bold
    /__(?=\S)([\s\S]*?\S)__(?!\w)/.source, // 10: bold
    /~~(?=\S)([\s\S]*?\S)~~/.source, // 11: strikethrough
    /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source, // 12: italic
    /(?<![\w])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\w])/.source, // 13: italic
    /(\n)/.source, // 14: line break
  ].join("|"),
  "g",
);

function link(text, url, children) {
  if (!SAFE_URL.test(url)) {
    const span = node("span");
    span.append(...children, ` (${url})`);
    return span;
  }
  const a = node("a");
  a.href = url;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  a.title = url;
  a.append(...children);
  return a;
}

// The inline nodes of `text`.
export function inline(text) {
  const out = [];
  let last = 0;
  INLINE.lastIndex = 0;
  for (let m = INLINE.exec(text); m; m = INLINE.exec(text)) {
    if (m.index > last) out.push(document.createTextNode(text.slice(last, m.index)));
    last = INLINE.lastIndex;
    out.push(span(m));
    INLINE.lastIndex = last; // span() parses nested text with the same expression
  }
  if (last < text.length) out.push(document.createTextNode(text.slice(last)));
  return out;
}

function wrap(tag, text) {
  const n = node(tag);
  n.append(...inline(text));
  return n;
}

function span(m) {
  if (m[2] !== undefined) {
    const code = node("code");
    code.textContent = m[2].length > 2 && m[2].startsWith(" ") && m[2].endsWith(" ") ? m[2].slice(1, -1) : m[2];
    return code;
  }
  if (m[3] !== undefined) return document.createTextNode(m[3]);
  if (m[5] !== undefined) return link(m[4], m[5], [`image: ${m[4] || m[5]}`]);
  if (m[7] !== undefined) return link(m[6], m[7], inline(m[6]));
  if (m[8] !== undefined) return link(m[8], m[8], [m[8]]);
  if (m[9] !== undefined) return wrap("strong", m[9]);
  if (m[10] !== undefined) return wrap("strong", m[10]);
  if (m[11] !== undefined) return wrap("del", m[11]);
  if (m[12] !== undefined) return wrap("em", m[12]);
  if (m[13] !== undefined) return wrap("em", m[13]);
  return node("br");
}

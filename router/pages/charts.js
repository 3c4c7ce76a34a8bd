// Small line charts as inline SVG, drawn with DOM APIs: one or more series over the same time
// axis, an area under the first, a scale label. No library.

const SVG = "http://www.w3.org/2000/svg";
const W = 600;
const H = 120;

function svg(tag, attrs) {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
  return n;
}

// A "nice" upper bound for the y axis: 1, 2 or 5 times a power of ten, at least `floor`.
function niceMax(value, floor) {
  const v = Math.max(value, floor);
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

// Draw `series` ([{values: [number|null], className, dots}], all of one length) into `box`. A
// series with `dots` marks each point (sparse figures such as TTFT, where most buckets are empty).
// `format(v)` writes the y-axis top label; `floor` is the smallest y range shown.
export function lineChart(box, series, { format = String, floor = 1 } = {}) {
  const n = Math.max(...series.map((s) => s.values.length), 2);
  const top = niceMax(Math.max(0, ...series.flatMap((s) => s.values.filter((v) => v !== null))), floor);
  const x = (i) => (i / (n - 1)) * W;
  const y = (v) => H - (v / top) * (H - 6) - 1;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", class: "chart-svg", role: "img" });
  for (const f of [0.5, 1]) root.append(svg("line", { x1: 0, x2: W, y1: y(top * f), y2: y(top * f), class: "grid" }));
  series.forEach((s, k) => {
    // A run of known points is one path; a gap (null) breaks it.
    let d = "";
    let area = "";
    let runStart = null;
    s.values.forEach((v, i) => {
      if (v === null) {
        if (runStart !== null && k === 0) area += `L${x(i - 1)},${H}L${x(runStart)},${H}Z`;
        runStart = null;
        return;
      }
      const point = `${x(i).toFixed(1)},${y(v).toFixed(1)}`;
      d += `${runStart === null ? "M" : "L"}${point}`;
      if (k === 0) area += `${runStart === null ? "M" : "L"}${point}`;
      if (runStart === null) runStart = i;
    });
    if (runStart !== null && k === 0) area += `L${x(s.values.length - 1)},${H}L${x(runStart)},${H}Z`;
    if (k === 0 && area && !s.dots) root.append(svg("path", { d: area, class: `area ${s.className || ""}` }));
    if (d) root.append(svg("path", { d, class: `line ${s.className || ""}`, "vector-effect": "non-scaling-stroke" }));
    if (s.dots) {
      // Zero-length segments with round caps: round dots whatever the chart's aspect ratio.
      const dots = s.values.map((v, i) => (v === null ? "" : `M${x(i).toFixed(1)},${y(v).toFixed(1)}h0`)).join("");
      if (dots) root.append(svg("path", { d: dots, class: `dots ${s.className || ""}`, "vector-effect": "non-scaling-stroke" }));
    }
  });
  const label = document.createElement("span");
  label.className = "chart-max";
  label.textContent = format(top);
  box.replaceChildren(root, label);
}

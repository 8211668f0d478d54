// A small SVG line chart against training step: a few series (left or right axis, linear
// or log), vertical markers for failures/resizes, shaded recomputed spans, a hover readout.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(a >= 1e5 ? 0 : 1) + "k";
  if (a >= 100) return v.toFixed(0);
  if (a >= 0.01) return String(Number(v.toPrecision(3)));
  return v.toExponential(1).replace(".0e", "e").replace("e-", "e−");
}

function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
}

function linearTicks(lo, hi, count) {
  if (hi <= lo) return [lo];
  const step = niceStep(hi - lo, count);
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
  return out;
}

function logTicks(lo, hi) {
  // lo, hi are log10 values
  const out = [];
  for (let e = Math.floor(lo); e <= Math.ceil(hi); e++) {
    for (const m of hi - lo < 2 ? [1, 2, 5] : [1]) {
      const t = Math.log10(m) + e;
      if (t >= lo - 1e-9 && t <= hi + 1e-9) out.push(t);
    }
  }
  return out;
}

// A y axis: maps a value to [0, 1], and lists its ticks as [position, label].
function yAxis(values, { log = false, range = null } = {}) {
  let vals = values.filter((v) => Number.isFinite(v));
  const useLog = log && vals.length > 0 && vals.every((v) => v > 0);
  if (useLog) vals = vals.map(Math.log10);
  let lo = range ? range[0] : Math.min(...vals);
  let hi = range ? range[1] : Math.max(...vals);
  if (!vals.length) { lo = 0; hi = 1; }
  if (hi - lo < 1e-12) { const pad = useLog ? 0.5 : Math.abs(hi) * 0.1 || 1; lo -= pad; hi += pad; }
  else if (!range) { const pad = (hi - lo) * 0.05; lo -= pad; hi += pad; }
  if (!useLog && !range && lo < 0 && Math.min(...vals) >= 0) lo = 0;
  const toUnit = (v) => ((useLog ? Math.log10(v) : v) - lo) / (hi - lo);
  const ticks = useLog
    ? logTicks(lo, hi).map((t) => [(t - lo) / (hi - lo), fmt(Math.pow(10, t))])
    : linearTicks(lo, hi, 4).map((t) => [(t - lo) / (hi - lo), fmt(t)]);
  return { toUnit, ticks, log: useLog };
}

function nearest(points, x) {
  let lo = 0, hi = points.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (points[mid][0] < x) lo = mid; else hi = mid;
  }
  return Math.abs(points[lo][0] - x) <= Math.abs(points[hi][0] - x) ? points[lo] : points[hi];
}

class LineChart {
  // container: an element; options: {height, log (left axis), rightRange, empty (text when no data)}
  constructor(container, options = {}) {
    this.container = container;
    this.options = { height: 220, ...options };
    container.classList.add("chart");
    this.legend = document.createElement("div");
    this.legend.className = "legend";
    this.plot = document.createElement("div");
    this.plot.className = "plot";
    this.tip = document.createElement("div");
    this.tip.className = "tip";
    this.tip.hidden = true;
    container.append(this.legend, this.plot);
    this.plot.appendChild(this.tip);
    this.plot.addEventListener("mousemove", (e) => this.hover(e));
    this.plot.addEventListener("mouseleave", () => { this.tip.hidden = true; if (this.guide) this.guide.setAttribute("visibility", "hidden"); });
    this.data = { series: [], markers: [], xMax: 0 };
    container.dataset.points = "0";
  }

  // data: {xMax, points (for data-points; default: points of all series but derived ones), series: [{name, color, points: [[step, y]], right, derived, dots, faint}], markers: [{x, x0, kind, label}]}
  draw(data) {
    this.data = data;
    const series = data.series.filter((s) => s.points.length);
    const shown = data.points ?? data.series.filter((s) => !s.derived).reduce((n, s) => n + s.points.length, 0);
    this.container.dataset.points = String(shown);
    this.container.dataset.markers = String(data.markers.filter((m) => m.kind !== "recomputed").length);

    this.legend.replaceChildren(...data.series.map((s) => {
      const item = document.createElement("span");
      const last = s.points.length ? s.points[s.points.length - 1][1] : null;
      item.innerHTML = `<i style="background:${s.color};opacity:${s.faint ? 0.35 : 1}"></i>${esc(s.name)} <b>${fmt(last)}</b>`;
      return item;
    }));

    const width = Math.max(280, this.plot.clientWidth || 600);
    const height = this.options.height;
    const hasRight = series.some((s) => s.right);
    const m = { left: 50, right: hasRight ? 44 : 14, top: 14, bottom: 24 };
    const w = width - m.left - m.right, h = height - m.top - m.bottom;
    const svg = el("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "chart-svg" });
    this.geom = { m, w, h };

    const xMax = Math.max(data.xMax || 0, ...series.map((s) => s.points[s.points.length - 1][0]), 1);
    const X = (x) => m.left + (x / xMax) * w;
    this.X = X; this.xMax = xMax;
    const left = yAxis(series.filter((s) => !s.right).flatMap((s) => s.points.map((p) => p[1])), { log: this.options.log });
    const right = yAxis(series.filter((s) => s.right).flatMap((s) => s.points.map((p) => p[1])), { range: this.options.rightRange });
    const Y = (axis, v) => m.top + h - axis.toUnit(v) * h;

    const grid = el("g", { class: "grid" }, svg);
    for (const [u, label] of left.ticks) {
      const y = m.top + h - u * h;
      el("line", { x1: m.left, x2: m.left + w, y1: y, y2: y }, grid);
      el("text", { x: m.left - 6, y: y + 4, "text-anchor": "end" }, grid).textContent = label;
    }
    if (hasRight) {
      for (const [u, label] of right.ticks) {
        el("text", { x: m.left + w + 6, y: m.top + h - u * h + 4, class: "right" }, grid).textContent = label;
      }
    }
    for (const t of linearTicks(0, xMax, Math.max(2, Math.floor(w / 90)))) {
      el("text", { x: X(t), y: height - 6, "text-anchor": "middle" }, grid).textContent = fmt(t);
    }
    el("rect", { x: m.left, y: m.top, width: w, height: h, class: "frame" }, svg);

    const marks = el("g", { class: "markers" }, svg);
    for (const mk of data.markers) {
      if (mk.kind === "recomputed") {
        const x0 = X(Math.min(mk.x0, xMax)), x1 = X(Math.min(mk.x, xMax));
        el("rect", { x: x0, y: m.top, width: Math.max(1, x1 - x0), height: h, class: "marker marker-recomputed" }, marks)
          .appendChild(el("title")).textContent = mk.label;
        continue;
      }
      const x = X(Math.min(mk.x, xMax));
      const g = el("g", { class: `marker marker-${mk.kind}` }, marks);
      el("line", { x1: x, x2: x, y1: m.top, y2: m.top + h }, g);
      const text = el("text", { x: x + 3, y: m.top + 10 }, g);
      text.textContent = mk.short || "";
      if (x + 3 + 8 * (mk.short || "").length > m.left + w) { text.setAttribute("x", x - 3); text.setAttribute("text-anchor", "end"); }
      el("title", {}, g).textContent = mk.label;
    }

    const clipId = `clip-${this.container.id || Math.random().toString(36).slice(2)}`;
    el("rect", { x: m.left - 4, y: m.top - 4, width: w + 8, height: h + 8 }, el("clipPath", { id: clipId }, el("defs", {}, svg)));
    const lines = el("g", { "clip-path": `url(#${clipId})` }, svg);
    for (const s of series) {
      const axis = s.right ? right : left;
      const pts = s.points.filter((p) => Number.isFinite(p[1]) && (!axis.log || p[1] > 0));
      const d = pts.map((p) => `${X(p[0]).toFixed(1)},${Y(axis, p[1]).toFixed(1)}`).join(" ");
      el("polyline", { points: d, stroke: s.color, class: s.faint ? "line faint" : "line" }, lines);
      if (s.dots || pts.length === 1) {
        for (const p of pts) el("circle", { cx: X(p[0]), cy: Y(axis, p[1]), r: 3, fill: s.color }, lines);
      }
    }
    if (!series.length) {
      el("text", { x: m.left + w / 2, y: m.top + h / 2, "text-anchor": "middle", class: "empty" }, svg)
        .textContent = this.options.empty || "no data yet";
    }
    this.guide = el("line", { y1: m.top, y2: m.top + h, class: "guide", visibility: "hidden" }, svg);

    const old = this.plot.querySelector("svg");
    if (old) old.replaceWith(svg); else this.plot.insertBefore(svg, this.tip);
  }

  hover(event) {
    const series = this.data.series.filter((s) => s.points.length && !s.faint);
    if (!series.length || !this.geom) return;
    const box = this.plot.getBoundingClientRect();
    const px = event.clientX - box.left;
    const { m, w } = this.geom;
    if (px < m.left || px > m.left + w) { this.tip.hidden = true; return; }
    const step = ((px - m.left) / w) * this.xMax;
    const rows = series.map((s) => [s, nearest(s.points, step)]);
    const at = rows.reduce((best, [, p]) => (Math.abs(p[0] - step) < Math.abs(best - step) ? p[0] : best), rows[0][1][0]);
    this.tip.innerHTML = `<b>step ${at}</b>` + rows.map(([s, p]) =>
      `<div><i style="background:${s.color}"></i>${esc(s.name)} ${fmt(p[1])}${p[0] !== at ? ` <span class="muted">@${p[0]}</span>` : ""}</div>`).join("");
    this.tip.hidden = false;
    const x = this.X(at);
    this.guide.setAttribute("x1", x); this.guide.setAttribute("x2", x); this.guide.setAttribute("visibility", "visible");
    const tipW = this.tip.offsetWidth;
    this.tip.style.left = `${x + 12 + tipW > box.width ? x - 12 - tipW : x + 12}px`;
    this.tip.style.top = `${m.top + 4}px`;
  }
}

window.LineChart = LineChart;
window.fmt = fmt;
window.esc = esc;

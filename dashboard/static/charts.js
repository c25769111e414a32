// Line charts drawn as SVG by the page itself (nothing loaded from the internet).
"use strict";

const Charts = (() => {
  function niceStep(span, count) {
    const raw = span / Math.max(count, 1);
    const mag = Math.pow(10, Math.floor(Math.log10(raw || 1)));
    const norm = raw / mag;
    const step = norm >= 5 ? 10 : norm >= 2 ? 5 : norm >= 1 ? 2 : 1;
    return step * mag;
  }

  function ticks(lo, hi, count, minStep = 0) {
    if (!(hi > lo)) { hi = lo + 1; }
    const step = Math.max(niceStep(hi - lo, count), minStep);
    const start = Math.floor(lo / step) * step;
    const out = [];
    for (let v = start; v < hi + step; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }

  // series: [{name, color, points: [[x, y], ...], key, dash, dots}]
  //   key: the path's data-series attribute; dash: a dashed line; dots: a dot on every point
  //   (for sparse series, such as evaluations every N steps).
  // opts: {width, height, yFormat, xFormat, zeroBased, testid, attrs, empty}
  //   attrs: more attributes of the <svg> ({"data-metric": name}), escaped here.
  // The viewBox is the drawn size in pixels (opts.width), so text never stretches.
  function line(series, opts = {}) {
    const W = Math.max(240, Math.round(opts.width || 640)), H = opts.height || 200, L = 58, R = 16, T = 12, B = 26;
    const pts = series.flatMap((s) => s.points.filter((p) => Number.isFinite(p[1])));
    const yFmt = opts.yFormat || ((v) => fmtShort(v));
    const xFmt = opts.xFormat || ((v) => fmtShort(v));
    const tid = (opts.testid ? ` data-testid="${esc(opts.testid)}"` : "") +
      Object.entries(opts.attrs || {}).map(([k, v]) => ` ${k}="${esc(v)}"`).join("");
    if (pts.length === 0) {
      return `<svg class="chart" viewBox="0 0 ${W} ${H}"${tid} data-points="0">` +
        `<text class="empty" x="${W / 2}" y="${H / 2}" text-anchor="middle">${esc(opts.empty || "no data yet")}</text></svg>`;
    }
    let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
    let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
    if (opts.zeroBased !== false) y0 = Math.min(0, y0);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { y1 = y0 + (Math.abs(y0) || 1); }
    const yt = ticks(y0, y1, 4);
    y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    let svg = `<svg class="chart" viewBox="0 0 ${W} ${H}"${tid} data-points="${pts.length}">`;
    svg += `<g class="grid axis">`;
    for (const v of yt) {
      if (v < y0 || v > y1) continue;
      svg += `<line x1="${L}" x2="${W - R}" y1="${sy(v)}" y2="${sy(v)}"/>`;
      svg += `<text x="${L - 6}" y="${sy(v) + 4}" text-anchor="end">${esc(yFmt(v))}</text>`;
    }
    const xt = opts.xTicks ? opts.xTicks(x0, x1) : ticks(x0, x1, Math.max(2, Math.floor(W / 110)), opts.xMinStep || 0);
    for (const v of xt) {
      if (v < x0 || v > x1) continue;
      svg += `<text x="${sx(v)}" y="${H - 8}" text-anchor="middle">${esc(xFmt(v))}</text>`;
    }
    svg += `</g>`;
    for (const s of series) {
      const ok = s.points.filter((p) => Number.isFinite(p[1]));
      if (!ok.length) continue;
      const d = ok.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
      if (s.fill) {
        const area = `${d}L${sx(ok[ok.length - 1][0]).toFixed(1)},${sy(y0)}L${sx(ok[0][0]).toFixed(1)},${sy(y0)}Z`;
        svg += `<path d="${area}" fill="${s.color}" fill-opacity="0.09" stroke="none"/>`;
      }
      const key = s.key ? ` data-series="${esc(s.key)}"` : "";
      const dash = s.dash ? ` stroke-dasharray="6 4"` : "";
      svg += `<path class="series" d="${d}" fill="none" stroke="${s.color}" stroke-width="2"${dash} ` +
        `stroke-linejoin="round" data-points="${ok.length}"${key}/>`;
      if (s.dots && ok.length <= 400) {
        for (const p of ok) svg += `<circle cx="${sx(p[0]).toFixed(1)}" cy="${sy(p[1]).toFixed(1)}" r="2.2" fill="${s.color}"/>`;
      }
      const last = ok[ok.length - 1];
      svg += `<circle cx="${sx(last[0])}" cy="${sy(last[1])}" r="3" fill="${s.color}"/>`;
    }
    svg += `</svg>`;
    return svg;
  }

  function legend(series, fmt) {
    return `<div class="legend">` + series.map((s) => {
      const ok = s.points.filter((p) => Number.isFinite(p[1]));
      const last = ok.length ? (fmt || fmtShort)(ok[ok.length - 1][1]) : "–";
      return `<span><i style="background:${s.color}"></i>${esc(s.name)}: <b>${esc(last)}</b></span>`;
    }).join("") + `</div>`;
  }

  function fmtShort(v) {
    if (!Number.isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
    if (a >= 1) return String(+v.toFixed(a >= 10 ? 1 : 2));
    return v.toPrecision(2);
  }

  return { line, legend, fmtShort, esc };
})();

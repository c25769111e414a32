// The redgrain dashboard page: hash routes, one fetch loop, everything drawn here.
"use strict";

const esc = Charts.esc;
const $ = (sel) => document.querySelector(sel);
const state = {
  config: { cluster: "", admin: false, poll_ms: 1000 },
  route: { page: "overview", args: [] },
  methodSort: { key: "calls_per_s", desc: true },
  eventKind: "",
  reminderType: "",
  streamNamespace: "",
  logs: { level: "", silo: "", entries: [], lastId: null, open: new Set() },  // the Logs page's tail
  overviewRing: [],      // [time, calls/s, errors/s] kept by this page for the overview chart
  timer: null,
  busy: false,
};

// --- formatting ------------------------------------------------------------------
function num(v, digits = 0) {
  if (v === null || v === undefined || !Number.isFinite(+v)) return "–";
  return (+v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
function rate(v) { return v >= 100 ? num(v, 0) : v >= 10 ? num(v, 1) : num(v, 2); }
function ms(v) {
  if (!Number.isFinite(v)) return "–";
  if (v > 0 && v < 0.1) return num(v * 1000, 0) + " µs";
  if (v >= 1000) return num(v / 1000, 2) + " s";
  if (v >= 10) return num(v, 0) + " ms";
  if (v >= 1) return num(v, 1) + " ms";
  return num(v, 2) + " ms";
}
function bytes(v) {
  if (!Number.isFinite(v)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(v >= 100 ? 0 : 1) : v.toFixed(0)) + " " + units[i];
}
function duration(s) {
  if (!Number.isFinite(s)) return "–";
  s = Math.max(0, Math.floor(s));
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60, sec = s % 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  if (m) return `${m}m ${sec}s`;
  return `${sec}s`;
}
function clock(t) { return t ? new Date(t * 1000).toLocaleTimeString("en-GB") : "–"; }
function pill(text) { return `<span class="pill ${esc(text)}">${esc(text)}</span>`; }
function card(label, value, hint = "", testid = "") {
  const tid = testid ? ` data-testid="${testid}"` : "";
  return `<div class="card"><div class="label">${esc(label)}</div><div class="value"${tid}>${value}</div>` +
    (hint ? `<div class="hint">${hint}</div>` : "") + `</div>`;
}
function link(hash, text) { return `<a href="#${hash}">${esc(text)}</a>`; }
function enc(s) { return encodeURIComponent(s); }
// Charts are drawn at the pixel width they will get, so their text keeps its size.
function chartWidth(half) {
  const w = ($("#content").clientWidth || 900) - 34;
  return half && w >= 2 * 420 + 14 ? (w - 14) / 2 : w;
}
function brief(v) {
  if (Array.isArray(v)) return v.length > 4 ? `[${v.length} items]` : JSON.stringify(v);
  return typeof v === "object" && v !== null ? JSON.stringify(v) : String(v);
}

// --- data ---------------------------------------------------------------------------
class HttpError extends Error {
  constructor(status, detail) { super(detail); this.status = status; }
}
async function api(path, opts = {}) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), 4000);
  try {
    const r = await fetch(path, { ...opts, signal: ctl.signal, cache: "no-store" });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new HttpError(r.status, body.detail || r.statusText);
    return body;
  } finally {
    clearTimeout(timer);
  }
}
function setConn(ok, text) {
  const el = $("#conn");
  el.className = "conn " + (ok ? "ok" : "bad");
  $("#conn-text").textContent = text;
}
function setBanner(text) {
  const b = $("#banner");
  if (text) { b.textContent = text; b.classList.remove("hidden"); } else { b.classList.add("hidden"); }
}

// --- pages --------------------------------------------------------------------------
const pages = {};

pages.overview = async () => {
  const o = await api("/api/overview");
  state.lastOverview = o;
  const ring = state.overviewRing;
  if (o.redis.ok) {
    ring.push([o.at, o.calls_per_s, o.errors_per_s]);
    while (ring.length > 180) ring.shift();
  }
  const statuses = Object.entries(o.silos).filter(([, n]) => n).map(([s, n]) => `${n} ${s}`).join(", ");
  let html = `<h1>Overview</h1><div class="sub">Cluster <b>${esc(o.cluster)}</b> · updated ${clock(o.at)}</div>`;
  if (!o.redis.ok) return html + `<div class="notice" data-testid="redis-down">Nothing to show while Redis is unreachable.</div>`;
  if (o.message) html += `<div class="notice" data-testid="overview-message">${esc(o.message)}</div>`;
  for (const w of o.warnings || []) html += `<div class="notice warn" data-testid="overview-warning">${esc(w)}</div>`;
  html += `<div class="cards">` +
    card("Silos live", num(o.silos_live), esc(statuses || "none"), "silos-live") +
    card("Activations", num(o.activations), "", "activations") +
    card("Calls / s", rate(o.calls_per_s), `${num(o.calls_total)} total`, "calls-per-s") +
    card("Errors / s", rate(o.errors_per_s), `${num(o.errors_total)} total`, "errors-per-s") +
    card("Latency p50", ms(o.p50_ms), "cluster-wide", "p50") +
    card("Latency p99", ms(o.p99_ms), "cluster-wide", "p99") +
    card("Training jobs", num(o.jobs), `<a href="#/training">view</a>`, "jobs") +
    card("Redis", o.redis.ok ? "OK" : "down", o.redis.ok ? `${num(o.redis.latency_ms, 1)} ms read` : esc(o.redis.error || ""), "redis") +
    `</div>`;
  html += `<div style="display:none" data-testid="calls-total">${o.calls_total}</div>`;
  const calls = [{ name: "calls/s", color: "#3b6cf6", fill: true, points: ring.map((p) => [p[0], p[1]]) },
    { name: "errors/s", color: "#d64545", points: ring.map((p) => [p[0], p[2]]) }];
  html += `<h2>Throughput</h2><div class="panel">` +
    Charts.line(calls, { width: chartWidth(false), height: 190, xFormat: clock, xMinStep: 1, testid: "overview-chart", empty: "collecting…" }) +
    Charts.legend(calls, rate) + `</div>`;
  if (o.redis.ok && o.silos_live) {
    const [silos, events] = await Promise.all([api("/api/silos"), api("/api/events?count=8")]);
    html += `<h2>Silos</h2>${siloTable(silos.silos.filter((s) => s.status !== "Dead"), false)}` +
      `<h2>Recent events</h2>${eventTable(events.events)}`;
  }
  return html;
};

function siloTable(silos, full) {
  if (!silos.length) return `<div class="notice">No silos.</div>`;
  const admin = full && state.config.admin;
  let h = `<div class="table-wrap"><table data-testid="silo-table"><thead><tr><th>Silo</th><th>Status</th>` +
    (full ? `<th>Roles</th><th>Host / pid</th>` : "") +
    `<th class="num">Uptime</th><th class="num">CPU</th><th class="num">Memory</th><th class="num">Activations</th>` +
    `<th class="num">Calls/s</th>` + (full ? `<th class="num">Errors/s</th><th class="num">Heartbeat</th><th class="num">In / out</th>` : "") +
    (admin ? `<th></th>` : "") + `</tr></thead><tbody>`;
  for (const s of silos) {
    const live = s.status !== "Dead";
    h += `<tr data-silo="${esc(s.address)}"><td>${link("/silos/" + enc(s.address), s.address)}</td><td>${pill(s.status)}</td>` +
      (full ? `<td>${esc(s.roles.join(", ") || "–")}</td><td>${esc(s.hostname)} / ${s.pid}</td>` : "") +
      `<td class="num">${live ? duration(s.uptime_s) : "–"}</td>` +
      `<td class="num">${live ? num(s.cpu_percent, 1) + " %" : "–"}</td>` +
      `<td class="num">${live && s.rss_bytes ? bytes(s.rss_bytes) : "–"}</td>` +
      `<td class="num" data-testid="silo-activations">${live ? num(s.activations) : "–"}</td>` +
      `<td class="num">${live ? rate(s.calls_per_s) : "–"}</td>` +
      (full ? `<td class="num">${live ? rate(s.errors_per_s) : "–"}</td>` +
        `<td class="num">${s.heartbeat_age_s == null ? "–" : num(s.heartbeat_age_s, 1) + " s ago"}</td>` +
        `<td class="num">${bytes(s.bytes_in)} / ${bytes(s.bytes_out)}</td>` : "") +
      (admin ? `<td>${live ? `<button class="danger" data-action="drain" data-arg="${esc(s.address)}">Drain</button>` : ""}</td>` : "") +
      `</tr>`;
  }
  return h + `</tbody></table></div>`;
}

pages.silos = async () => {
  const r = await api("/api/silos");
  const live = r.silos.filter((s) => s.status !== "Dead").length;
  let html = `<h1>Silos</h1><div class="sub">${live} live, ${r.silos.length - live} dead · CPU and memory are per process</div>`;
  if (!r.silos.length) html += `<div class="notice" data-testid="no-silos">No silos have joined this cluster yet.</div>`;
  else html += siloTable(r.silos, true);
  return html;
};

pages.silo = async (address) => {
  const d = await api("/api/silos/" + enc(address));
  const s = d.silo;
  const h = d.history;
  const t = (k) => h.map((p) => [p.at, p[k]]);
  const cpu = [{ name: "CPU %", color: "#3b6cf6", fill: true, points: t("cpu_percent") }];
  const mem = [{ name: "RSS", color: "#7a3e9d", fill: true, points: t("rss_bytes") }];
  const act = [{ name: "activations", color: "#1f9d55", points: t("activations") }];
  const calls = [{ name: "calls/s", color: "#d98a00", points: t("calls_per_s") }];
  let html = `<div class="breadcrumb">${link("/silos", "Silos")} /</div><h1>${esc(s.address)} ${pill(s.status)}</h1>` +
    `<div class="sub">${esc(s.hostname)} · pid ${s.pid} · roles ${esc(s.roles.join(", ") || "none")} · started ${clock(s.started)}</div>`;
  if (!s.published && s.status !== "Dead") html += `<div class="notice">No fresh stats record from this silo.</div>`;
  html += `<div class="cards">` + card("Uptime", duration(s.uptime_s)) + card("CPU", num(s.cpu_percent, 1) + " %") +
    card("Memory (RSS)", bytes(s.rss_bytes), num(s.memory_percent, 1) + " % of host") +
    card("Activations", num(s.activations), "", "silo-activations") + card("Calls / s", rate(s.calls_per_s), num(s.calls_total) + " total") +
    card("Connections", num(s.connections), `${bytes(s.bytes_in)} in · ${bytes(s.bytes_out)} out`) + `</div>`;
  const xf = { xFormat: clock, xMinStep: 1, height: 170, width: chartWidth(true) };
  html += `<h2>History (last ${h.length} records)</h2><div class="grid2">` +
    `<div class="panel"><h3>CPU</h3>${Charts.line(cpu, { ...xf, testid: "cpu-chart", yFormat: (v) => v.toFixed(0) + "%" })}${Charts.legend(cpu, (v) => num(v, 1) + " %")}</div>` +
    `<div class="panel"><h3>Memory</h3>${Charts.line(mem, { ...xf, testid: "mem-chart", yFormat: (v) => bytes(v) })}${Charts.legend(mem, bytes)}</div>` +
    `<div class="panel"><h3>Activations</h3>${Charts.line(act, xf)}${Charts.legend(act, (v) => num(v))}</div>` +
    `<div class="panel"><h3>Calls per second</h3>${Charts.line(calls, xf)}${Charts.legend(calls, rate)}</div></div>`;
  const served = await api("/api/methods?silo=" + enc(address));
  html += `<h2>Methods served here</h2><div class="sub">Last ~10 s (since start when idle)</div>` +
    methodTable(served.rows, { testid: "silo-methods" });
  html += `<h2>Activations by type</h2>` + kvTable(d.by_type, "Type", "Activations");
  html += `<h2>Components</h2><div class="panel components">` + Object.entries(d.components).map(([name, fields]) =>
      `<section><h3>${esc(name)}</h3><dl class="kv">` + Object.entries(fields).filter(([, v]) => typeof v !== "object")
        .map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(typeof v === "number" ? num(v, Number.isInteger(v) ? 0 : 2) : v)}</dd>`).join("") +
      `</dl></section>`).join("") + `</div>`;
  return html;
};

function kvTable(obj, a, b) {
  const rows = Object.entries(obj || {}).sort((x, y) => y[1] - x[1]);
  if (!rows.length) return `<div class="notice">None.</div>`;
  return `<div class="table-wrap"><table><thead><tr><th>${a}</th><th class="num">${b}</th></tr></thead><tbody>` +
    rows.map(([k, v]) => `<tr><td>${esc(k)}</td><td class="num">${num(v)}</td></tr>`).join("") + `</tbody></table></div>`;
}

pages.grains = async () => {
  const g = await api("/api/grains");
  const silos = g.by_silo.map((s) => s.silo);
  const max = Math.max(1, ...g.by_type.map((r) => r.activations));
  let html = `<h1>Grains</h1><div class="sub">Live activations by type and by silo; persisted state by type and key</div>`;
  if (!g.by_type.length) return html + `<div class="notice">No activations and no persisted state yet.</div>`;
  html += `<h2>By type</h2><div class="table-wrap"><table data-testid="grains-by-type"><thead><tr><th>Type</th><th class="num">Activations</th><th></th>` +
    silos.map((s) => `<th class="num">${esc(s)}</th>`).join("") + `<th>State</th></tr></thead><tbody>`;
  for (const r of g.by_type) {
    html += `<tr><td>${link("/grains/" + enc(r.type), r.type)}</td><td class="num">${num(r.activations)}</td>` +
      `<td><div class="bar"><span style="width:${(100 * r.activations) / max}%"></span></div></td>` +
      silos.map((s) => `<td class="num">${num(r.by_silo[s] || 0)}</td>`).join("") +
      `<td>${r.persisted ? link("/grains/" + enc(r.type), "browse") : "<span class='muted'>–</span>"}</td></tr>`;
  }
  html += `</tbody></table></div><h2>By silo</h2><div class="table-wrap"><table><thead><tr><th>Silo</th><th>Status</th>` +
    `<th class="num">Activations</th><th>Types</th></tr></thead><tbody>` +
    g.by_silo.map((s) => `<tr><td>${link("/silos/" + enc(s.silo), s.silo)}</td><td>${pill(s.status)}</td><td class="num">${num(s.activations)}</td>` +
      `<td>${Object.entries(s.by_type).sort((a, b) => b[1] - a[1]).map(([t, n]) => `${esc(t)} <span class="muted">${n}</span>`).join(", ") || "–"}</td></tr>`).join("") +
    `</tbody></table></div>`;
  return html;
};

pages.grainType = async (type) => {
  const k = await api("/api/grains/" + enc(type));
  const keys = [...new Set([...k.persisted, ...k.active])].sort();
  let html = `<div class="breadcrumb">${link("/grains", "Grains")} /</div><h1>${esc(type)}</h1>` +
    `<div class="sub">${k.active.length} live (sampled) · ${k.persisted.length} with persisted state</div>` +
    `<div class="toolbar"><input id="grain-key" placeholder="key" data-type="${esc(type)}">` +
    `<button data-action="open-key" data-arg="${esc(type)}">Show state</button></div>`;
  html += `<h2>Methods</h2><div class="sub">Merged over live silos · last ~10 s (since start when idle)</div>` +
    `<div id="live-part">${await typeMethods(type)}</div><h2>Keys</h2>`;
  if (!keys.length) return html + `<div class="notice">No keys to show.</div>`;
  html += `<div class="table-wrap"><table><thead><tr><th>Key</th><th>Live</th><th>Persisted state</th></tr></thead><tbody>` +
    keys.map((key) => `<tr><td>${esc(key)}</td><td>${k.active.includes(key) ? pill("Active") : "–"}</td>` +
      `<td>${k.persisted.includes(key) ? link("/grains/" + enc(type) + "/" + enc(key), "view") : "–"}</td></tr>`).join("") +
    `</tbody></table></div>`;
  return html;
};
async function typeMethods(type) {
  const calls = await api("/api/methods?grain_type=" + enc(type));
  return methodTable(calls.rows, { withType: false, testid: "type-methods" });
}
function openKey(type) {
  const key = $("#grain-key").value.trim();
  if (key) location.hash = "#/grains/" + enc(type) + "/" + enc(key);
}

function jsonHtml(v, indent = "") {
  const pad = indent + "  ";
  if (v === null) return `<span class="j-lit">null</span>`;
  if (typeof v === "string") return `<span class="j-str">"${esc(v)}"</span>`;
  if (typeof v === "number") return `<span class="j-num">${v}</span>`;
  if (typeof v === "boolean") return `<span class="j-lit">${v}</span>`;
  if (Array.isArray(v)) {
    if (!v.length) return "[]";
    return "[\n" + v.map((x) => pad + jsonHtml(x, pad)).join(",\n") + "\n" + indent + "]";
  }
  if ((v.kind === "tensor" || v.kind === "ndarray") && v.summary) {
    const s = v.summary;
    const stats = s.mean !== undefined ? ` mean ${Charts.fmtShort(s.mean)} · std ${Charts.fmtShort(s.std)} · min ${Charts.fmtShort(s.min)} · max ${Charts.fmtShort(s.max)}` : "";
    return `<span class="tensor">${esc(v.kind)} ${esc(v.dtype)} [${v.shape.join("×")}]${stats}</span>`;
  }
  const entries = Object.entries(v);
  if (!entries.length) return "{}";
  const type = v.__type__ ? `<span class="j-type">${esc(v.__type__)}</span> ` : "";
  return type + "{\n" + entries.filter(([k]) => k !== "__type__")
    .map(([k, x]) => `${pad}<span class="j-key">${esc(k)}</span>: ${jsonHtml(x, pad)}`).join(",\n") + "\n" + indent + "}";
}

pages.grainState = async (type, key) => {
  const s = await api(`/api/grains/${enc(type)}/${key.split("/").map(enc).join("/")}/state`);
  let html = `<div class="breadcrumb">${link("/grains", "Grains")} / ${link("/grains/" + enc(type), type)} /</div>` +
    `<h1>${esc(type)}/${esc(key)}</h1>`;
  if (!s.found) return html + `<div class="notice">No persisted state for this grain.</div>`;
  html += `<div class="sub">etag <code>${esc(s.etag)}</code> · ${bytes(s.size)}</div>`;
  if (s.error) html += `<div class="notice">${esc(s.error)}</div>`;
  return html + `<pre class="json" data-testid="grain-state">${jsonHtml(s.state)}</pre>`;
};

const METHOD_COLS = [
  ["grain_type", "Grain type", false], ["method", "Method", false], ["calls", "Calls", true],
  ["calls_per_s", "Calls/s", true], ["errors", "Errors", true], ["error_percent", "Error %", true],
  ["mean_ms", "Mean", true], ["p50_ms", "p50", true], ["p99_ms", "p99", true],
];
// One table for the Methods page, a grain type's page (no type column) and a silo's page.
function methodTable(allRows, { withType = true, testid = "methods-table" } = {}) {
  const { key, desc } = state.methodSort;
  // Each column sorts by its own value (not by call count).
  const rows = allRows.slice().sort((a, b) => {
    const x = a[key], y = b[key];
    const c = typeof x === "string" ? x.localeCompare(y) : x - y;
    return (desc ? -c : c) || a.grain_type.localeCompare(b.grain_type) || a.method.localeCompare(b.method);
  });
  if (!rows.length) return `<div class="notice" data-testid="${testid}-empty">No calls recorded yet.</div>`;
  const cols = METHOD_COLS.filter(([k]) => withType || k !== "grain_type");
  let html = `<div class="table-wrap"><table data-testid="${testid}"><thead><tr>` + cols.map(([k, label, n]) =>
    `<th class="sortable${n ? " num" : ""}" data-sort="${k}" data-action="sort" data-arg="${k}">${label}` +
    (k === key ? `<span class="arrow">${desc ? "▼" : "▲"}</span>` : "") + `</th>`).join("") + `</tr></thead><tbody>`;
  for (const m of rows) {
    html += `<tr data-method="${esc(m.grain_type + "." + m.method)}">` + (withType ? `<td>${esc(m.grain_type)}</td>` : "") +
      `<td><code>${esc(m.method)}</code></td>` +
      `<td class="num" data-col="calls">${num(m.calls)}</td><td class="num" data-col="calls_per_s">${rate(m.calls_per_s)}</td>` +
      `<td class="num" data-col="errors">${num(m.errors)}</td><td class="num">${num(m.error_percent, 2)}</td>` +
      `<td class="num">${ms(m.mean_ms)}</td><td class="num" data-col="p50_ms">${ms(m.p50_ms)}</td>` +
      `<td class="num" data-col="p99_ms">${ms(m.p99_ms)}</td></tr>`;
  }
  return html + `</tbody></table></div>`;
}
pages.methods = async () => {
  const r = await api("/api/methods");
  return `<h1>Methods</h1><div class="sub">Merged over live silos · rates and latency over the last ~10 s (since start when idle) · click a column to sort</div>` +
    methodTable(r.rows);
};
function sortMethods(key) {
  const s = state.methodSort;
  s.desc = s.key === key ? !s.desc : !["grain_type", "method"].includes(key);
  s.key = key;
  refresh();
}

pages.training = async () => {
  const r = await api("/api/jobs");
  let html = `<h1>Training</h1><div class="sub">Jobs whose coordinator publishes progress</div>`;
  if (!r.jobs.length) return html + `<div class="notice">No training jobs yet.</div>`;
  html += `<div class="table-wrap"><table data-testid="jobs-table"><thead><tr><th>Job</th><th>Status</th><th>Mode</th><th>Progress</th>` +
    `<th class="num">Step</th><th class="num">Train loss</th><th>Evaluation (test split)</th><th class="num">Samples/s</th><th class="num">Updated</th></tr></thead><tbody>`;
  for (const j of r.jobs) {
    const frac = j.total_steps ? Math.min(1, j.step / j.total_steps) : 0;
    html += `<tr><td>${link("/training/" + enc(j.job), j.job)}</td><td>${pill(j.status)}</td><td>${esc(j.mode)}</td>` +
      `<td><div class="bar"><span style="width:${100 * frac}%"></span></div></td>` +
      `<td class="num">${num(j.step)}${j.total_steps ? " / " + num(j.total_steps) : ""}</td>` +
      `<td class="num">${j.loss == null ? "–" : sig4(j.loss)}</td>` +
      `<td>${Object.entries(j.eval_metrics || {}).map(([k, v]) => `${esc(k)} <b>${esc(metricFormat(k, [v])(v))}</b>`).join(" · ") ||
        (j.accuracy == null ? "–" : `accuracy <b>${num(100 * j.accuracy, 1)} %</b>`)}</td>` +
      `<td class="num">${rate(j.samples_per_s)}</td><td class="num">${clock(j.updated_at)}</td></tr>`;
  }
  return html + `</tbody></table></div>`;
};

// --- training metrics ------------------------------------------------------------------
// A metric is shown by name; a name with "acc" in it whose values lie in 0..1 is a
// percentage, any other value shows 4 significant digits.
const isAccuracy = (name) => /acc/i.test(name);
function sig4(v) { return v === null || v === undefined || !Number.isFinite(+v) ? "–" : String(+(+v).toPrecision(4)); }
function metricFormat(name, values) {
  const pct = isAccuracy(name) && values.every((v) => !Number.isFinite(v) || (v >= 0 && v <= 1));
  return pct ? (v) => (Number.isFinite(v) ? num(100 * v, 1) + " %" : "–") : sig4;
}
// A point's value of metric `name`, or NaN; training loss is the point's own field. Entries
// written before points had a split carry the evaluation accuracy as `accuracy`.
function pointValue(x, split, name) {
  const ptSplit = x.split || "train";
  let v;
  if (split === "eval" && ptSplit === "train" && name === "accuracy") v = x.accuracy;
  else if (ptSplit !== split) v = undefined;
  else if (split === "train" && name === "loss") v = x.loss;
  else v = (x.metrics || {})[name];
  return v === null || v === undefined ? NaN : +v;
}
const SPLIT_STYLE = { train: { color: "#d64545", label: "train" }, eval: { color: "#3b6cf6", label: "eval", dash: true, dots: true } };
function metricPanel(name, names, history, stepX) {
  const series = ["train", "eval"].filter((split) => (names[split] || []).includes(name)).map((split) => ({
    name: `${SPLIT_STYLE[split].label} ${name}`, key: split, color: SPLIT_STYLE[split].color,
    dash: SPLIT_STYLE[split].dash, dots: SPLIT_STYLE[split].dots, fill: split === "train",
    points: history.map((x) => [x.step, pointValue(x, split, name)]).filter((p) => Number.isFinite(p[1])),
  }));
  const fmt = metricFormat(name, series.flatMap((s) => s.points.map((p) => p[1])));
  const splits = series.map((s) => s.key).join(" + ");
  return `<div class="panel"><h3>${esc(name)} <span class="muted">${esc(splits)}</span></h3>` +
    Charts.line(series, { ...stepX, zeroBased: false, testid: "metric-curve", attrs: { "data-metric": name }, yFormat: fmt }) +
    Charts.legend(series, fmt) + `</div>`;
}
function metricCards(p) {
  const train = [["loss", p.loss], ...Object.entries(p.metrics || {})].filter(([, v]) => v !== null && v !== undefined);
  const evals = Object.entries(p.eval_metrics || {});
  const tag = (split, name) => `data-split="${split}" data-metric="${esc(name)}"`;
  const box = (split, name, v, hint) => `<div class="card" ${tag(split, name)}><div class="label">${esc(split === "eval" ? "Eval " + name : "Train " + name)}</div>` +
    `<div class="value" data-testid="job-metric">${esc(metricFormat(name, [v])(v))}</div>` + (hint ? `<div class="hint">${hint}</div>` : "") + `</div>`;
  const when = p.eval_step == null ? "test split" : `test split · step ${num(p.eval_step)}`;
  return train.map(([k, v]) => box("train", k, v, "latest, mean over trainers")).join("") +
    evals.map(([k, v]) => box("eval", k, v, when)).join("");
}

// Pipeline mode: each stage's place and costs, and the latest step's micro-batch timeline
// (one row per stage, a box per forward F / backward B, placed by its wall-clock time).
function stagesSection(stages) {
  let html = `<h2>Pipeline stages (${stages.length})</h2><div class="table-wrap"><table data-testid="stages"><thead><tr>` +
    `<th class="num">Trainer</th><th class="num">Stage</th><th>Key</th><th>Silo</th><th class="num">Forward / micro-batch</th>` +
    `<th class="num">Backward / micro-batch</th><th class="num">Parameters</th></tr></thead><tbody>` +
    stages.map((g) => `<tr><td class="num">${num(g.rank)}</td><td class="num">${num(g.index)}</td><td>${esc(g.key)}</td>` +
      `<td>${g.silo ? link("/silos/" + enc(g.silo), g.silo) : "–"}</td><td class="num">${num(g.forward_ms, 2)} ms</td>` +
      `<td class="num">${num(g.backward_ms, 2)} ms</td><td class="num">${bytes(g.param_bytes)}</td></tr>`).join("") +
    `</tbody></table></div>`;
  const spans = stages.flatMap((g) => g.timeline || []);
  if (!spans.length) return html + `<div class="notice">No step finished yet.</div>`;
  const t0 = Math.min(...spans.map((x) => x.start)), t1 = Math.max(...spans.map((x) => x.end));
  const W = chartWidth(true), row = 26, left = 90, width = Math.max(1, W - left - 10), scale = width / Math.max(1e-6, t1 - t0);
  let svg = `<svg class="timeline" data-testid="microbatch-timeline" width="${W}" height="${stages.length * row + 24}">`;
  stages.forEach((g, i) => {
    svg += `<text x="4" y="${i * row + 17}" class="axis">r${g.rank} stage ${g.index}</text>`;
    for (const x of g.timeline || []) {
      const fill = x.kind === "F" ? "#3b6cf6" : "#e08a2c";
      const xs = left + (x.start - t0) * scale, w = Math.max(1, (x.end - x.start) * scale);
      svg += `<rect data-kind="${esc(x.kind)}" data-mb="${x.mb}" x="${xs.toFixed(1)}" y="${i * row + 4}" width="${w.toFixed(1)}" height="${row - 8}" fill="${fill}">` +
        `<title>${esc(x.kind)}${x.mb}: ${num(1000 * (x.end - x.start), 2)} ms</title></rect>`;
      if (w > 14) svg += `<text x="${(xs + 3).toFixed(1)}" y="${i * row + 17}" class="span-label">${esc(x.kind)}${x.mb}</text>`;
    }
  });
  svg += `<text x="${left}" y="${stages.length * row + 18}" class="axis">latest step: ${num(1000 * (t1 - t0), 1)} ms · F forward, B backward</text></svg>`;
  return html + `<h2>Micro-batch timeline</h2><div class="panel">${svg}</div>`;
}

pages.job = async (job) => {
  const d = await api("/api/jobs/" + enc(job));
  const p = d.progress;
  const h = d.history;
  const names = d.metric_names || { train: [], eval: [] };
  const trainPts = h.filter((x) => (x.split || "train") === "train");
  const by = (k) => trainPts.map((x) => [x.step, x[k] == null ? NaN : +x[k]]);
  const sps = [{ name: "samples/s", color: "#3b6cf6", points: by("samples_per_s") }];
  const wire = [{ name: "bytes/step", color: "#7a3e9d", points: by("bytes") }];
  const stepX = { xFormat: (v) => num(v), height: 190, width: chartWidth(true) };
  const frac = p.total_steps ? Math.min(1, p.step / p.total_steps) : 0;
  const staleness = p.max_staleness ?? p.staleness;
  let html = `<div class="breadcrumb">${link("/training", "Training")} /</div>` +
    `<h1>${esc(p.job)} ${pill(p.status)}</h1><div class="sub">mode ${esc(p.mode)} · epoch <span data-testid="job-epoch">${num(p.epoch, 2)}</span> · updated ${clock(p.updated_at)}` +
    (d.cancel_requested ? ` · <b>cancel requested</b>` : "") + `</div>`;
  if (p.error) html += `<div class="notice">${esc(p.error)}</div>`;
  if (state.config.admin && ["running", "pending"].includes(p.status) && !d.cancel_requested)
    html += `<div class="toolbar"><button class="danger" data-action="cancel" data-arg="${esc(p.job)}">Cancel job</button></div>`;
  html += `<div class="cards">` +
    card("Step", num(p.step) + (p.total_steps ? `<span class="muted" style="font-size:15px"> / ${num(p.total_steps)}</span>` : ""),
      p.total_steps ? `<div class="bar" style="margin-top:6px"><span style="width:${100 * frac}%"></span></div>` : "", "job-step") +
    metricCards(p) +
    card("Samples / s", rate(p.samples_per_s), "", "job-sps") +
    card("Bytes on wire", bytes(p.bytes_per_step), "per step", "job-bytes") +
    (["async", "ssp"].includes(p.mode) ? card("Max staleness", num(staleness, 0), "steps (largest seen)", "job-staleness") : "") +
    (p.mode === "ssp" ? card("Max gap", num(p.max_gap, 0), "steps ahead of the slowest trainer", "job-gap") : "") + `</div>`;
  const metricsAll = [...new Set([...(names.train || []), ...(names.eval || [])])]
    .sort((a, b) => (a !== "loss") - (b !== "loss") || a.localeCompare(b));
  html += `<div class="grid2" data-testid="metric-panels">` + metricsAll.map((n) => metricPanel(n, names, h, stepX)).join("") +
    `<div class="panel"><h3>Samples per second</h3>${Charts.line(sps, { ...stepX, testid: "sps-curve" })}${Charts.legend(sps, rate)}</div>` +
    `<div class="panel"><h3>Bytes on the wire per step</h3>${Charts.line(wire, { ...stepX, yFormat: bytes })}${Charts.legend(wire, bytes)}</div></div>`;
  const placeTable = (title, rows, tid) => `<div><h2>${title} (${rows.length})</h2>` + (rows.length ?
    `<div class="table-wrap"><table data-testid="${tid}"><thead><tr><th>Key</th><th>Silo</th></tr></thead><tbody>` +
    rows.map((r) => `<tr><td>${esc(r.key)}</td><td>${r.silo ? link("/silos/" + enc(r.silo), r.silo) : "–"}</td></tr>`).join("") +
    `</tbody></table></div>` : `<div class="notice">None.</div>`) + `</div>`;
  if ((p.stages || []).length) html += stagesSection(p.stages);
  else html += `<div class="grid2">` + placeTable("Trainers", p.trainers, "trainers") + placeTable("Parameter shards", p.shards, "shards") + `</div>`;
  html += `<h2>Checkpoints (${p.checkpoints.length})</h2>` + (p.checkpoints.length ?
    `<div class="table-wrap"><table data-testid="checkpoints"><thead><tr><th>Snapshot</th><th class="num">Step</th><th class="num">Taken</th></tr></thead><tbody>` +
    p.checkpoints.slice().reverse().map((c) => `<tr><td><code>${esc(c.snapshot)}</code></td><td class="num">${num(c.step)}</td><td class="num">${clock(c.at)}</td></tr>`).join("") +
    `</tbody></table></div>` : `<div class="notice">No checkpoint yet.</div>`);
  const recoveries = p.recoveries || [];
  html += `<h2>Recoveries (${recoveries.length})</h2>` + (recoveries.length ?
    `<div class="table-wrap"><table data-testid="recoveries"><thead><tr><th>When</th><th class="num">From step</th><th class="num">Training again after</th><th>Trainers</th><th>Why</th></tr></thead><tbody>` +
    recoveries.slice().reverse().map((c) => `<tr><td class="num">${clock(c.at)}</td><td class="num">${num(c.start_step)}</td>` +
      `<td class="num">${c.back_after_s == null ? "–" : num(c.back_after_s, 2) + " s"}</td><td>${c.trainers ? num(c.trainers) : "all"}</td><td>${esc(c.reason)}</td></tr>`).join("") +
    `</tbody></table></div>` : `<div class="notice">None: no silo was lost and no trainer joined.</div>`);
  return html;
};

function eventTable(events) {
  if (!events.length) return `<div class="notice">No events yet.</div>`;
  return `<div class="table-wrap"><table data-testid="events-table"><thead><tr><th>Time</th><th>Kind</th><th>Silo</th><th>Details</th></tr></thead><tbody>` +
    events.map((e) => `<tr><td>${clock(e.at)}</td><td>${pill(e.kind)}</td><td>${esc(e.silo)}</td>` +
      `<td class="muted details">${esc(Object.entries(e.data).map(([k, v]) => `${k}=${brief(v)}`).join("  "))}</td></tr>`).join("") +
    `</tbody></table></div>`;
}

pages.events = async () => {
  const q = state.eventKind ? "&kind=" + enc(state.eventKind) : "";
  const r = await api("/api/events?count=300" + q);
  const kinds = ["", "join", "leave", "suspect", "dead", "rebalance", "failover", "drain", "cancel"];
  return `<h1>Events</h1><div class="sub">The cluster log, newest first</div>` +
    `<div class="toolbar">Kind <select onchange="state.eventKind=this.value;refresh()">` +
    kinds.map((k) => `<option value="${k}"${k === state.eventKind ? " selected" : ""}>${k || "all"}</option>`).join("") +
    `</select></div>` + eventTable(r.events);
};

// --- reminders and logs ---------------------------------------------------------------
function period(s) {
  if (!Number.isFinite(s)) return "–";
  return s < 1 ? ms(s * 1000) : s < 60 ? num(s, s % 1 ? 1 : 0) + " s" : duration(s);
}
function due(t) {
  if (!t) return "–";
  const d = t - Date.now() / 1000;
  return `${clock(t)} <span class="muted">(${d >= 0 ? "in " + duration(d) : duration(-d) + " ago"})</span>`;
}

pages.reminders = async () => {
  const q = state.reminderType ? "?type=" + enc(state.reminderType) : "";
  const r = await api("/api/reminders" + q);
  const types = r.types.includes(state.reminderType) || !state.reminderType ? r.types : [...r.types, state.reminderType];
  let html = `<h1>Reminders</h1><div class="sub">Durable reminders in Redis: when each is due next, and when and on which silo its last tick ran</div>` +
    `<div class="toolbar">Grain type <select data-testid="reminder-type" onchange="state.reminderType=this.value;refresh()">` +
    ["", ...types].map((t) => `<option value="${esc(t)}"${t === state.reminderType ? " selected" : ""}>${esc(t || "all")}</option>`).join("") +
    `</select><span class="muted">${num(r.reminders.length)} reminder${r.reminders.length === 1 ? "" : "s"}</span></div>`;
  if (!r.reminders.length) return html + `<div class="notice" data-testid="reminders-empty">No reminders${state.reminderType ? " of " + esc(state.reminderType) : ""}.</div>`;
  html += `<div class="table-wrap"><table data-testid="reminders-table"><thead><tr><th>Grain type</th><th>Key</th><th>Name</th>` +
    `<th class="num">Period</th><th>Next due</th><th>Last fired</th><th>On silo</th></tr></thead><tbody>`;
  for (const x of r.reminders) {
    html += `<tr data-reminder="${esc(x.type + "/" + x.key + "/" + x.name)}"><td data-col="type">${link("/grains/" + enc(x.type), x.type)}</td>` +
      `<td data-col="key">${link("/grains/" + enc(x.type) + "/" + enc(x.key), x.key)}</td><td data-col="name">${esc(x.name)}</td>` +
      `<td class="num" data-col="period">${period(x.period_s)}</td><td data-col="next-due">${due(x.next_due)}</td>` +
      `<td data-col="last-fired">${x.last_fired ? due(x.last_fired) : `<span class="muted">not yet</span>`}</td>` +
      `<td data-col="silo">${x.last_silo ? link("/silos/" + enc(x.last_silo), x.last_silo) : "–"}</td></tr>`;
  }
  return html + `</tbody></table></div>`;
};

// Streams: per stream, each subscribing grain type (consumer group) with its lag and consumers.
function tokenTime(t) { return t ? clock(+t.split("-")[0] / 1000) : "–"; }
pages.streams = async () => {
  const q = state.streamNamespace ? "?namespace=" + enc(state.streamNamespace) : "";
  const r = await api("/api/streams" + q);
  let html = `<h1>Streams</h1><div class="sub">Redis streams by namespace and key: items kept, and for each @subscribes grain type its lag, unacknowledged items, the silo delivering it and the group's consumers</div>` +
    `<div class="toolbar">Namespace <select data-testid="stream-namespace" onchange="state.streamNamespace=this.value;refresh()">` +
    ["", ...r.namespaces].map((n) => `<option value="${esc(n)}"${n === state.streamNamespace ? " selected" : ""}>${esc(n || "all")}</option>`).join("") +
    `</select><span class="muted">${num(r.streams.length)} stream${r.streams.length === 1 ? "" : "s"}${r.truncated ? " (more not listed)" : ""}</span></div>`;
  if (!r.streams.length) return html + `<div class="notice" data-testid="streams-empty">No streams${state.streamNamespace ? " in " + esc(state.streamNamespace) : ""}.</div>`;
  html += `<div class="table-wrap"><table data-testid="streams-table"><thead><tr><th>Namespace</th><th>Key</th><th class="num">Items</th><th>Newest</th>` +
    `<th>Subscriber</th><th class="num">Lag</th><th class="num">Pending</th><th>Delivered by</th><th>Consumers (pending)</th></tr></thead><tbody>`;
  for (const x of r.streams) {
    const groups = x.groups.length ? x.groups : [null];
    groups.forEach((g, i) => {
      const head = i ? `<td></td><td></td><td></td><td></td>` :
        `<td data-col="namespace">${esc(x.namespace)}</td><td data-col="key">${esc(x.key)}</td>` +
        `<td class="num" data-col="length">${num(x.length)}</td><td data-col="newest">${tokenTime(x.last_token)}</td>`;
      const tail = !g ? `<td class="muted">no implicit subscriber</td><td></td><td></td><td></td><td></td>` :
        `<td data-col="group">${link("/grains/" + enc(g.name), g.name)}</td>` +
        `<td class="num" data-col="lag">${g.lag === null ? "?" : num(g.lag)}</td><td class="num" data-col="pending">${num(g.pending)}</td>` +
        `<td data-col="holder">${g.holder ? link("/silos/" + enc(g.holder), g.holder) : "–"}</td>` +
        `<td data-col="consumers">${g.consumers.map((c) => `${esc(c.name)} (${num(c.pending)})`).join(", ") || "–"}</td>`;
      html += `<tr data-stream="${esc(x.namespace + "/" + x.key)}">${head}${tail}</tr>`;
    });
  }
  html += `</tbody></table></div>`;
  // Items no @subscribes turn took after streams.max_attempts: kept, never dropped unseen.
  for (const d of r.dead_letters) {
    html += `<h2 data-testid="dead-letters-${esc(d.namespace)}">Dead letters of ${esc(d.namespace)}: <span data-col="count">${num(d.count)}</span></h2>` +
      `<div class="table-wrap"><table><thead><tr><th>Key</th><th>Subscriber</th><th>Token</th><th class="num">Attempts</th><th>Error</th><th>Given up by</th></tr></thead><tbody>` +
      d.newest.map((x) => `<tr data-dead="${esc(d.namespace + "/" + x.key + "/" + x.token)}"><td>${esc(x.key)}</td><td>${link("/grains/" + enc(x.group), x.group)}</td>` +
        `<td>${esc(x.token)}</td><td class="num">${num(x.attempts)}</td><td data-col="error">${esc(x.error)}</td><td>${esc(x.silo)}</td></tr>`).join("") +
      `</tbody></table></div>`;
  }
  return html;
};

const LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"];
const LOG_KEEP = 1000;  // records this page holds; older ones scroll off
function logTime(t) {
  return t ? clock(t) + "." + String(Math.floor((t % 1) * 1000)).padStart(3, "0") : "–";
}
function resetLogs() { Object.assign(state.logs, { entries: [], lastId: null }); }
function setLogFilter(which, value) { state.logs[which] = value; resetLogs(); refresh(); }
function toggleExc(id) {
  const open = state.logs.open;
  if (open.has(id)) open.delete(id); else open.add(id);
  refresh();
}

pages.logs = async () => {
  const L = state.logs;
  const q = new URLSearchParams({ limit: "500" });
  if (L.lastId) q.set("since", L.lastId);
  if (L.level) q.set("level", L.level);
  if (L.silo) q.set("silo", L.silo);
  const filters = [L.level, L.silo];
  const [r, silos] = await Promise.all([api("/api/logs?" + q), api("/api/silos")]);
  if (filters[0] !== L.level || filters[1] !== L.silo) return pages.logs();  // changed meanwhile
  L.entries.push(...r.entries);
  if (L.entries.length > LOG_KEEP) L.entries.splice(0, L.entries.length - LOG_KEEP);
  if (r.last_id) L.lastId = r.last_id;
  const addresses = silos.silos.map((s) => s.address);
  if (L.silo && !addresses.includes(L.silo)) addresses.push(L.silo);
  let html = `<h1>Logs</h1><div class="sub">Silos' log records, live (newest first). Silos publish WARNING and above;` +
    ` <code>REDGRAIN_LOGS__LEVEL=INFO</code> adds INFO.</div>` +
    `<div class="toolbar">Level <select data-testid="log-level" onchange="setLogFilter('level', this.value)">` +
    ["", ...LOG_LEVELS].map((l) => `<option value="${l}"${l === L.level ? " selected" : ""}>${l ? l + " and above" : "all"}</option>`).join("") +
    `</select> Silo <select data-testid="log-silo" onchange="setLogFilter('silo', this.value)">` +
    ["", ...addresses].map((a) => `<option value="${esc(a)}"${a === L.silo ? " selected" : ""}>${esc(a || "all")}</option>`).join("") +
    `</select><span class="muted" data-testid="log-count">${num(L.entries.length)} record${L.entries.length === 1 ? "" : "s"}</span></div>`;
  if (!L.entries.length) return html + `<div class="notice" data-testid="logs-empty">No log records${L.level || L.silo ? " match" : " yet"}.</div>`;
  html += `<div class="table-wrap"><table data-testid="logs-table"><thead><tr><th>Time</th><th>Level</th><th>Silo</th><th>Logger</th><th>Message</th></tr></thead><tbody>`;
  for (const e of L.entries.slice().reverse()) {
    const open = L.open.has(e.id);
    const exc = e.exc ? ` <button class="exc-toggle" data-action="exc" data-arg="${esc(e.id)}">${open ? "hide" : "traceback"}</button>` +
      (open ? `<pre class="exc">${esc(e.exc)}</pre>` : "") : "";
    html += `<tr data-id="${esc(e.id)}" data-level="${esc(e.level)}" data-silo="${esc(e.silo)}"><td class="num">${logTime(e.time)}</td>` +
      `<td>${pill(e.level)}</td><td>${e.silo ? link("/silos/" + enc(e.silo), e.silo) : "–"}</td><td class="muted">${esc(e.logger)}</td>` +
      `<td class="details message">${esc(e.message)}${exc}</td></tr>`;
  }
  return html + `</tbody></table></div>`;
};

// --- admin --------------------------------------------------------------------------
function token() {
  let t = sessionStorage.getItem("redgrain-admin-token");
  if (!t) {
    t = prompt("Admin token");
    if (t) sessionStorage.setItem("redgrain-admin-token", t);
  }
  return t;
}
async function admin(path, what) {
  const t = token();
  if (!t || !confirm(what + "?")) return;
  try {
    const r = await api(path, { method: "POST", headers: { Authorization: "Bearer " + t } });
    alert(r.detail);
  } catch (e) {
    if (e.status === 403) sessionStorage.removeItem("redgrain-admin-token");
    alert("Refused: " + e.message);
  }
  refresh();
}
function drain(address) { admin(`/api/silos/${enc(address)}/drain`, `Drain silo ${address}`); }
function cancelJob(job) { admin(`/api/jobs/${enc(job)}/cancel`, `Cancel job ${job}`); }

// --- routing and the refresh loop ----------------------------------------------------
function parseRoute() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  const [head, ...rest] = parts;
  if (head === "silos" && rest.length) return { page: "silo", nav: "silos", args: [rest.join("/")] };
  if (head === "grains" && rest.length > 1) return { page: "grainState", nav: "grains", args: [rest[0], rest.slice(1).join("/")] };
  if (head === "grains" && rest.length === 1) return { page: "grainType", nav: "grains", args: [rest[0]] };
  if (head === "training" && rest.length) return { page: "job", nav: "training", args: [rest.join("/")] };
  if (pages[head]) return { page: head, nav: head, args: [] };
  return { page: "overview", nav: "overview", args: [] };
}

// A page with an input is not re-rendered while it is open (the input would lose its text);
// only its #live-part is, by the function named here.
const STATIC_PAGES = { grainType: typeMethods };

async function refreshPart(route) {
  try {
    const html = await STATIC_PAGES[route.page](...route.args);
    const part = $("#live-part");
    if (route === state.route && part) part.innerHTML = html;
  } catch (e) { /* the next full render reports what is wrong */ }
}

async function refresh(polled = false) {
  if (polled && STATIC_PAGES[state.route.page]) return refreshPart(state.route);
  if (state.busy) { state.again = true; return; }
  state.busy = true;
  const route = state.route;
  try {
    const html = await pages[route.page](...route.args);
    if (route === state.route) $("#content").innerHTML = html;
    const o = route.page === "overview" ? state.lastOverview : await api("/api/overview");
    redisStatus(o);
  } catch (e) {
    if (e instanceof HttpError && e.status === 503) {
      setConn(false, "Redis unreachable");
      setBanner("Redis unreachable — " + e.message + ". Showing nothing until it is back; retrying every second.");
      $("#content").innerHTML = `<div class="notice" data-testid="redis-down">Redis unreachable.</div>`;
    } else if (e instanceof HttpError) {
      $("#content").innerHTML = `<div class="notice">${esc(e.message)}</div>`;
      setBanner("");
    } else {
      setConn(false, "dashboard offline");
      setBanner("The dashboard server is unreachable — retrying every second.");
    }
  } finally {
    state.busy = false;
    if (state.again) { state.again = false; refresh(); }
  }
}

function redisStatus(o) {
  if (o.redis.ok) { setConn(true, "live · Redis OK"); setBanner(""); return; }
  const err = o.redis.error;
  setConn(false, "Redis unreachable");
  setBanner("Redis unreachable" + (err ? " — " + err : "") + ". Retrying every second.");
}

function route() {
  state.route = parseRoute();
  document.querySelectorAll("#nav a").forEach((a) => a.classList.toggle("active", a.dataset.page === state.route.nav));
  $("#content").innerHTML = `<p class="muted">Loading…</p>`;
  refresh();
}

// Buttons carry their argument in data-arg (escaped as HTML), never inside inline script.
document.addEventListener("click", (ev) => {
  const el = ev.target.closest("[data-action]");
  if (!el) return;
  const actions = { drain, cancel: cancelJob, "open-key": openKey, sort: sortMethods, exc: toggleExc };
  actions[el.dataset.action]?.(el.dataset.arg);
});
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && ev.target.id === "grain-key") openKey(ev.target.dataset.type);
});

async function start() {
  try { state.config = await api("/api/config"); } catch (e) { /* keep defaults; the loop retries */ }
  $("#cluster-name").textContent = "cluster " + (state.config.cluster || "?");
  document.title = `redgrain · ${state.config.cluster}`;
  window.addEventListener("hashchange", route);
  route();
  const tick = async () => {
    await refresh(true);
    state.timer = setTimeout(tick, state.config.poll_ms || 1000);
  };
  state.timer = setTimeout(tick, state.config.poll_ms || 1000);
}
start();

// The Models page: served models and their replicas, from /api/models (loaded after app.js).
"use strict";

function batchBars(counts, bounds) {
  const total = counts.reduce((a, b) => a + b, 0);
  if (!total) return "–";
  return counts.map((n, i) => n ? `${i < bounds.length ? "≤" + bounds[i] : ">" + bounds[bounds.length - 1]}: ${Math.round(100 * n / total)}%` : "")
    .filter(Boolean).join(" · ");
}

pages.models = async () => {
  const r = await api("/api/models");
  let html = `<h1>Models</h1><div class="sub">Served models (redgrain serve) · rates over the last second, latency (queue + compute) over the last ~10 s</div>`;
  if (!r.models.length) return html + `<div class="notice">No served models yet.</div>`;
  html += `<div class="table-wrap"><table data-testid="models-table"><thead><tr><th>Model</th><th>Replicas</th><th>Weights</th>` +
    `<th>Requests/s</th><th>p50</th><th>p99</th><th>Mean batch</th><th>Errors</th></tr></thead><tbody>`;
  for (const m of r.models) {
    html += `<tr><td>${esc(m.name)}</td><td>${num(m.ready_replicas)} ready of ${num(m.replicas.length)}</td>` +
      `<td>${esc(m.versions.join(", ") || "–")}</td><td>${rate(m.requests_per_s)}</td><td>${ms(m.p50_ms)}</td>` +
      `<td>${ms(m.p99_ms)}</td><td>${num(m.mean_batch_rows, 1)} rows</td><td>${num(m.errors)} of ${num(m.requests)}</td></tr>`;
  }
  html += `</tbody></table></div>`;
  for (const m of r.models) {
    html += `<h2>${esc(m.name)}</h2><div class="sub">Batch sizes: ${esc(batchBars(m.batch_rows, r.batch_buckets))}</div>` +
      `<div class="table-wrap"><table data-testid="replicas-${esc(m.name)}"><thead><tr><th>Silo</th><th>Replica</th><th>Status</th>` +
      `<th>Weights</th><th>Reloads</th><th>Requests/s</th><th>Requests</th><th>Errors</th><th>Batches</th><th>Up</th></tr></thead><tbody>`;
    for (const x of m.replicas) {
      const status = x.ready ? pill("ready") : pill("loading") + (x.error ? ` <span class="hint">${esc(x.error)}</span>` : "");
      html += `<tr><td>${link("/silos/" + enc(x.silo), x.silo)}</td><td>${esc(x.replica.slice(0, 8))}</td><td>${status}</td>` +
        `<td>${esc(x.version || "–")}</td><td>${num(x.reloads)}</td><td>${rate(x.requests_per_s)}</td><td>${num(x.requests)}</td>` +
        `<td>${num(x.errors)}</td><td>${num(x.batches)}</td><td>${duration(x.at - x.started)}</td></tr>`;
    }
    html += `</tbody></table></div>`;
  }
  return html;
};

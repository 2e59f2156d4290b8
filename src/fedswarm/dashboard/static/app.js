// fedswarm dashboard: subscribes to /events and redraws from the status JSON.
// Every string from the swarm goes in as text (textContent), never as HTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#3b82f6", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#06b6d4", "#ec4899", "#84cc16", "#f97316", "#64748b"];
const colorOf = (() => {
  const seen = new Map();
  return (key) => {
    if (!seen.has(key)) seen.set(key, COLORS[seen.size % COLORS.length]);
    return seen.get(key);
  };
})();

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "title") e.title = v;
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

const short = (id) => (id && id.length > 14 ? id.slice(0, 6) + "…" + id.slice(-6) : id || "");
const fmt = (x, d = 2) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
function fmtBytes(b) {
  if (!b) return "";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(b >= 10 ? 0 : 1)} ${u[i]}`;
}
function fmtJ(j) {
  if (j >= 3.6e6) return `${(j / 3.6e6).toFixed(2)} kWh`;
  if (j >= 1e3) return `${(j / 1e3).toFixed(1)} kJ`;
  return `${fmt(j, 1)} J`;
}

function replaceBody(table, rows) {
  const tb = document.querySelector(`#${table} tbody`);
  tb.replaceChildren(...rows);
}

// redraw a section only when what it shows changed (keeps hovers and
// selections alive between updates)
const drawn = new Map();
function changed(section, data) {
  const key = JSON.stringify(data);
  if (drawn.get(section) === key) return false;
  drawn.set(section, key);
  return true;
}

// ---------------------------------------------------------------- peers

function peerRow(p) {
  const dev = p.devices.map((d) => `${d.count}× ${d.kind} ${d.name}${d.mem_total ? " (" + fmtBytes(d.mem_total) + ")" : ""}`).join(", ");
  const thr = Object.entries(p.throughput).map(([k, v]) => (k === "*" ? fmt(v, 3) : `${k}: ${fmt(v, 3)}`)).join(", ");
  const capped = p.cap_w > 0;
  const frac = Math.min(1, p.power_w / Math.max(capped ? p.cap_w : p.max_w, 1e-9));
  const meter = el("span", { class: "meter", title: `${fmt(p.power_w, 1)} W now, max ${fmt(p.max_w, 0)} W${capped ? ", cap " + fmt(p.cap_w, 0) + " W" : ", no cap"}` },
    el("span", { class: "fill" + (frac > 0.9 ? " hot" : ""), style: `width:${(frac * 100).toFixed(0)}%` }));
  const watts = el("td", { class: "watts" }, meter, ` ${fmt(p.power_w, 0)} / ${capped ? fmt(p.cap_w, 0) : "–"} W`);
  const slots = p.slots_busy === null || p.slots_busy === undefined ? `${p.slots}` : `${p.slots_busy}/${p.slots}`;
  const blocks = p.spans.map((s) => `${s.start}:${s.end}`).join(" ");
  const name = el("td", { class: "peer", title: p.peer }, short(p.peer), p.self ? el("span", { class: "tag self-tag" }, "this peer") : null);
  return el("tr", { "data-peer": p.peer, class: p.self ? "self" : "" },
    name, el("td", { class: "small" }, dev), el("td", { class: "num" }, slots), el("td", { class: "num" }, thr),
    el("td", { class: "num" }, `${fmt(p.backlog_s, 1)} s`), watts, el("td", { class: "num" }, fmt(p.level, 2)),
    el("td", { class: "num" }, fmt(p.energy_price, 2)), el("td", { class: "num" }, fmt(p.carbon_g_kwh, 0)),
    el("td", {}, p.trust, p.trusted ? " ✓" : ""), el("td", {}, p.region), el("td", { class: "mono" }, blocks),
    el("td", { class: "num" }, `${fmt(p.age_s, 0)} s`));
}

// ---------------------------------------------------------------- models

function modelView(m) {
  const n = m.layers;
  const box = el("div", { class: "model", "data-model": m.model });
  const title = m.name ? `${m.name} (${short(m.model)})` : `model ${short(m.model)}`;
  const gaps = m.gaps.map(([a, b]) => `${a}:${b}`).join(", ");
  box.append(el("h3", {}, title, el("span", { class: "muted small" }, ` · ${n} blocks${m.layers_known ? "" : " or more (count unknown here)"}`)));
  const status = m.gaps.length
    ? el("div", { class: "gaps bad" }, `missing blocks ${gaps}: a generation cannot pass through yet`)
    : el("div", { class: "gaps ok" }, "every block is served");
  status.setAttribute("data-gaps", gaps);
  box.append(status);
  // the strip: one cell per block, coloured by how many peers hold it
  const strip = el("div", { class: "strip", style: `grid-template-columns: 9em repeat(${n}, 1fr)` });
  strip.append(el("div", { class: "lab small muted" }, "blocks"));
  for (let i = 0; i < n; i++) {
    const r = m.replicas[i];
    strip.append(el("div", { class: "cell " + (r === 0 ? "gap" : "held"), "data-block": i, "data-replicas": r,
      title: `block ${i}: ${r === 0 ? "MISSING" : r + " peer" + (r > 1 ? "s" : "")}` }, String(i)));
  }
  for (const h of m.holders) {
    strip.append(el("div", { class: "lab small" + (h.self ? " selfname" : ""), title: h.peer }, short(h.peer)));
    for (let i = 0; i < n; i++) {
      const on = i >= h.start && i < h.end;
      strip.append(el("div", { class: on ? "hold" : "empty", "data-holder": on ? h.peer : null,
        style: on ? `background:${colorOf(h.peer)}` : null, title: on ? `${short(h.peer)}: ${h.start}:${h.end}, ${fmt(h.throughput, 1)} tok/s` : null }));
    }
  }
  box.append(strip);
  return box;
}

// ---------------------------------------------------------------- sparklines

function sparkline(ts, ys, color, { min = 0, max = null, ref = null } = {}) {
  const w = 180, h = 32, pad = 2;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("class", "spark");
  const pts = ys.map((y, i) => [ts[i], y]).filter(([, y]) => y !== null && y !== undefined);
  if (pts.length === 0) return svg;
  if (pts.length === 1) pts.push([pts[0][0] + 1, pts[0][1]]); // one sample: a flat line
  const t0 = Math.min(...ts), t1 = Math.max(...ts, t0 + 1);
  const hi = max !== null ? max : Math.max(...pts.map(([, y]) => y), ref || 0, 1e-9);
  const X = (t) => pad + ((t - t0) / (t1 - t0)) * (w - 2 * pad);
  const Y = (y) => h - pad - ((Math.min(y, hi) - min) / (hi - min || 1)) * (h - 2 * pad);
  if (ref !== null && ref <= hi) {
    const l = document.createElementNS(SVG, "line");
    l.setAttribute("x1", pad); l.setAttribute("x2", w - pad);
    l.setAttribute("y1", Y(ref)); l.setAttribute("y2", Y(ref));
    l.setAttribute("class", "ref");
    svg.append(l);
  }
  const path = document.createElementNS(SVG, "polyline");
  path.setAttribute("points", pts.map(([t, y]) => `${X(t).toFixed(1)},${Y(y).toFixed(1)}`).join(" "));
  path.setAttribute("fill", "none");
  path.setAttribute("stroke", color);
  path.setAttribute("stroke-width", "1.5");
  svg.append(path);
  return svg;
}

function tenantRows(st) {
  const h = st.history || { t: [], shares: {}, rho: {} };
  const names = new Set([...Object.keys(st.tenant_shares), ...Object.keys(st.tenant_rho), ...Object.keys(st.energy_j_by_tenant),
    ...Object.keys(h.shares)]);
  const rows = [];
  for (const t of [...names].sort((a, b) => (st.tenant_shares[b] || 0) - (st.tenant_shares[a] || 0) || a.localeCompare(b))) {
    const c = colorOf("tenant:" + t);
    rows.push(el("tr", { "data-tenant": t },
      el("td", { title: t }, el("span", { class: "dot", style: `background:${c}` }), short(t)),
      el("td", { class: "num" }, fmt(st.tenant_shares[t] || 0, 3)),
      el("td", {}, sparkline(h.t, h.shares[t] || [], c, { max: 1 })),
      el("td", { class: "num" }, st.tenant_rho[t] === undefined ? "–" : fmt(st.tenant_rho[t], 2)),
      el("td", {}, sparkline(h.t, h.rho[t] || [], c, { ref: 1 })),
      el("td", { class: "num" }, fmtJ(st.energy_j_by_tenant[t] || 0))));
  }
  return rows;
}

// ---------------------------------------------------------------- render

function render(st) {
  document.getElementById("me").textContent = `peer ${short(st.peer)}${st.leaving ? " (leaving)" : ""} · v${st.version}` +
    (st.bootstrap && st.bootstrap.length ? ` · bootstrap: ${st.bootstrap.map((b) => b.state || b.status || "?").join(", ")}` : "");
  document.getElementById("me").title = st.peer;
  document.getElementById("footer-peer").textContent = short(st.peer);
  document.getElementById("peers-count").textContent = st.peers.length;
  if (changed("peers", st.peers)) replaceBody("peers", st.peers.map(peerRow));
  const models = document.getElementById("models");
  if (changed("models", st.models)) {
    if (st.models.length) models.replaceChildren(...st.models.map(modelView));
    else models.replaceChildren(el("p", { class: "muted" }, "no peer in view serves model blocks"));
  }
  document.getElementById("sessions-count").textContent = st.sessions.length;
  if (changed("sessions", [st.sessions, !!st.llm])) replaceBody("sessions", st.sessions.length ? st.sessions.map((s) => el("tr", {},
    el("td", { title: s.client }, short(s.client)), el("td", { class: "mono" }, `${s.span[0]}:${s.span[1]}`),
    el("td", { class: "num" }, `${s.length} / ${s.max_length}`), el("td", { class: "num" }, `${fmt(s.idle_s, 0)} s`)))
    : [el("tr", {}, el("td", { colspan: 4, class: "muted" }, st.llm ? "no open sessions" : "this peer serves no blocks"))]);
  document.getElementById("jobs-count").textContent = st.leases.length;
  if (changed("jobs", [st.leases, st.stats.shards_run])) replaceBody("jobs", st.leases.length ? st.leases.map((l) => el("tr", { class: l.state },
    el("td", { title: l.tenant }, short(l.tenant)), el("td", { class: "mono" }, l.job_id.slice(0, 12)),
    el("td", { class: "num" }, l.attempt ? `${l.shard} (try ${l.attempt + 1})` : l.shard), el("td", {}, l.state),
    el("td", { class: "num" }, `${fmt(l.run_s, 1)} s`), el("td", { class: "num" }, fmt(l.level, 2))))
    : [el("tr", {}, el("td", { colspan: 6, class: "muted" }, `no shards here · ${st.stats.shards_run || 0} run so far`))]);
  if (changed("tenants", [st.tenant_shares, st.tenant_rho, st.energy_j_by_tenant, st.history])) {
    const trows = tenantRows(st);
    replaceBody("tenants", trows.length ? trows : [el("tr", {}, el("td", { colspan: 6, class: "muted" }, "no tenant has used the swarm yet"))]);
  }
  document.getElementById("updated").textContent = new Date().toLocaleTimeString();
  document.body.dataset.peers = st.peers.length;
}

function setConn(up) {
  const c = document.getElementById("conn");
  c.textContent = up ? "live" : "reconnecting…";
  c.className = "conn " + (up ? "up" : "down");
}

function connect() {
  const es = new EventSource("/events");
  es.addEventListener("status", (ev) => {
    setConn(true);
    try { render(JSON.parse(ev.data)); } catch (e) { console.error(e); }
  });
  es.onerror = () => setConn(false); // EventSource reconnects by itself
}

connect();

// kthrottle's status page: draws what status.json answers, every few seconds.
// Every name shown comes from clients (principals, client-ids): it is set as
// text, never as markup.
"use strict";

const REFRESH_MS = 5000;
const SVG = "http://www.w3.org/2000/svg";
const CHART_W = 300, CHART_H = 60;

// The bearer token, when the endpoint needs one: from the URL fragment
// (/#token=...), which the browser never sends to the server itself.
function token() {
  return new URLSearchParams(location.hash.replace(/^#/, "")).get("token");
}

function el(name, text, cls) {
  const node = document.createElement(name);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function svg(name, attrs) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
  tbody.parentElement.classList.toggle("filled", rows.length > 0);
}

function row(cells, attrs) {
  const tr = el("tr");
  for (const cell of cells) {
    if (cell instanceof Node) {
      const td = el("td");
      td.append(cell);
      tr.append(td);
    } else if (cell && typeof cell === "object") {
      tr.append(el("td", cell.text, cell.cls));
    } else {
      tr.append(el("td", cell === null || cell === undefined ? "" : cell));
    }
  }
  for (const [k, v] of Object.entries(attrs || {})) tr.dataset[k] = v;
  return tr;
}

const BINARY = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

function human(bytes) {
  let i = 0;
  while (Math.abs(bytes) >= 1024 && i < BINARY.length - 1) { bytes /= 1024; i++; }
  return (i ? bytes.toFixed(bytes < 10 ? 2 : 1) : String(Math.round(bytes))) + " " + BINARY[i];
}

// exact figure as configured, then a readable one
function rate(value, unit) {
  if (value === null || value === undefined) return "\u2014";
  if (unit === "B/s") {
    const exact = String(Math.round(value));
    return exact + " B/s" + (Math.abs(value) >= 1024 ? " (" + human(value) + "/s)" : "");
  }
  return (Number.isInteger(value) ? String(value) : value.toFixed(2)) + " " + unit;
}

// a wait of a few ms reads as such, not as "0.00 s"
function seconds(ms) {
  return (ms / 1000).toFixed(ms < 10 ? 3 : ms < 10000 ? 2 : 1) + " s";
}

// The User and Client-id cells of a bucket. A quota entity that names no
// user (clients/app: `kthrottle quotas describe` says "client-id 'app'")
// counts every user's connections with that client-id in one bucket: that
// is said, not left blank; likewise an entity that names no client-id
// (users/alice).
function who(b) {
  return [
    b.all_users ? {text: "(all users)", cls: "all"} : b.user,
    b.all_client_ids ? {text: "(all client-ids)", cls: "all"} : b.client_id,
  ];
}

function chart(entity, now, span) {
  const points = entity.points;
  let top = 0;
  for (const p of points) top = Math.max(top, p[1] || 0, p[2] || 0, p[4] || 0);
  top = top > 0 ? top * 1.15 : 1;
  const x = t => ((t - (now - span)) / span * CHART_W).toFixed(1);
  const y = v => (CHART_H - (v || 0) / top * CHART_H).toFixed(1);
  const box = svg("svg", {
    class: "chart", width: CHART_W, height: CHART_H, viewBox: "0 0 " + CHART_W + " " + CHART_H,
    role: "img", "data-points": points.length,
  });
  box.append(svg("title"));
  box.firstChild.textContent = entity.kind + " rate of " + (entity.entity || "") +
    " over the last " + Math.round(span / 60) + " minutes";
  // the limit as steps: it holds until the next sample says otherwise
  const steps = [];
  points.forEach((p, i) => {
    if (i > 0) steps.push(x(p[0]) + "," + y(points[i - 1][2]));
    steps.push(x(p[0]) + "," + y(p[2]));
  });
  if (points.length) steps.push(CHART_W + "," + y(points[points.length - 1][2]));
  box.append(svg("polyline", {class: "limit", points: steps.join(" ")}));
  box.append(svg("polyline", {
    class: "rate", points: points.map(p => x(p[0]) + "," + y(p[1])).join(" "),
  }));
  box.append(svg("polyline", {
    class: "released", points: points.map(p => x(p[0]) + "," + y(p[4])).join(" "),
  }));
  for (const p of points) {
    if (!(p[3] > 0)) continue;
    const dot = svg("circle", {class: "throttled", cx: x(p[0]), cy: y(p[1]), r: 2.5});
    dot.append(svg("title"));
    dot.firstChild.textContent = "throttle time given: " + p[3] + " ms";
    box.append(dot);
  }
  const top_label = svg("text", {class: "axis", x: 2, y: 9});
  top_label.textContent = rate(Math.round(top), entity.unit);
  const left = svg("text", {class: "axis", x: 2, y: CHART_H - 2});
  left.textContent = "-" + Math.round(span / 60) + " min";
  const right = svg("text", {class: "axis", x: CHART_W - 2, y: CHART_H - 2, "text-anchor": "end"});
  right.textContent = "now";
  box.append(top_label, left, right);
  return box;
}

// A section of the page: its note (#noteId) and its table's rows (#tableId), as draw(data)
// gives them ([note, rows]), or what says the section is not configured and no rows.
function showSection(noteId, tableId, data, draw, unconfigured) {
  const [note, rows] = data.configured ? draw(data) : [unconfigured || "not configured", []];
  document.getElementById(noteId).textContent = note;
  fill(document.querySelector("#" + tableId + " tbody"), rows);
}

function quotaRows(q, now) {
  const entities = q.entities;
  let text = entities.length ? "one point every " + q.interval_s + " s" :
    "no quota bucket has counted anything yet";
  if (q.not_charted) text += "; " + q.not_charted + " more bucket(s) not charted";
  return [text, entities.map(e => row([
    {text: e.entity || "", cls: "entity"},
    // observe-only: its dots are the throttles it would have given
    e.observe_only ? e.kind + " (observe-only)" : e.kind, ...who(e),
    {text: rate(e.quota, e.unit), cls: "num quota"},
    {text: rate(e.limit, e.unit), cls: "num"},
    {text: rate(e.rate, e.unit), cls: "num"},
    chart(e, now, q.span_s),
  ], {entity: e.entity || "", kind: e.kind, quota: e.quota}))];
}

function showThrottled(t) {
  // nothing left to wait: not throttled (the proxy leaves those out itself)
  const clients = t.clients.filter(c => c.remaining_ms > 0);
  const total = t.total - (t.clients.length - clients.length);
  const note = document.getElementById("throttled-note");
  note.textContent = total ? (total > clients.length ?
    "the " + clients.length + " longest of " + total : "") : "no client is throttled now";
  fill(document.querySelector("#throttled-clients tbody"), clients.map(c => row([
    c.principal, c.client_id === null ? "\u2014" : c.client_id,
    {text: c.connections, cls: "num"},
    {text: seconds(c.remaining_ms) + (c.held_ms > c.muted_ms ? " (responses held)" : ""),
      cls: "num remaining"},
    c.over.join(", "),
  ], {principal: c.principal, clientId: c.client_id === null ? "" : c.client_id,
    remainingMs: c.remaining_ms})));
}

function stateCell(state, factor) {
  const text = state + (state === "THROTTLE" && factor !== null ? " (factor " + factor + ")" : "");
  return {text: text, cls: "state-" + state};
}

function storageRows(s) {
  const parts = ["producers meet " + s.state +
    (s.state === "THROTTLE" ? " (factor " + s.factor + ")" : ""), "scope " + s.scope,
    "fail-safe " + s.fail_safe];
  parts.push(s.snapshot_age_s === null ? "no cluster state read yet" :
    "cluster state " + s.snapshot_age_s + " s old (max " + s.max_age_s + " s)");
  if (s.fail_safe_reason) parts.push("fail-safe applies: " + s.fail_safe_reason);
  if (s.source) parts.push("ZooKeeper " + (s.source.connected ? "connected" : "not connected"));
  if (s.brokers_total > s.brokers.length) {
    parts.push("the " + s.brokers.length + " of " + s.brokers_total + " brokers not OPEN first");
  }
  const rows = [];
  for (const b of s.brokers) {
    const broker = stateCell(b.state, b.factor);
    if (!b.volumes.length) {
      rows.push(row([b.broker, broker, b.reason || "", "", "", "", "", ""], {broker: b.broker}));
      continue;
    }
    for (const v of b.volumes) {
      rows.push(row([
        b.broker, broker, v.name, v.log_dir,
        {text: v.used === null ? "" : (v.used * 100).toFixed(1) + " %", cls: "num"},
        {text: human(v.consumed || 0) + " / " + human(v.capacity || 0), cls: "num"},
        stateCell(v.state, v.factor), {text: v.factor, cls: "num"},
      ], {broker: b.broker, volume: v.name}));
    }
    if (b.volumes_total > b.volumes.length) {
      rows.push(row([b.broker, "", "and " + (b.volumes_total - b.volumes.length) +
        " more volume(s)", "", "", "", "", ""]));
    }
  }
  return [parts.join("; "), rows];
}

function fleetRows(f) {
  const parts = ["proxy " + f.proxy_id];
  parts.push(f.cycle === null ? "no quota shares read yet" : "shares of cycle " + f.cycle +
    " for " + f.fleet_size + " proxies, " + f.shares_age_s + " s old (max " + f.max_age_s + " s)");
  parts.push(f.fail_safe_active ? "fail-safe " + f.fail_safe + " applies: " + f.reason :
    "no fail-safe");
  parts.push(f.reports + " usage reports sent, " + f.report_errors + " failed");
  return [parts.join("; "), f.buckets.map(b => row([
    b.kind, ...who(b), {text: rate(b.quota, b.unit), cls: "num"},
    {text: rate(b.share, b.unit), cls: "num"},
    {text: b.fraction === null ? "" : (b.fraction * 100).toFixed(1) + " %", cls: "num"},
  ], {kind: b.kind, user: b.user, clientId: b.client_id}))];
}

let lastGood = null;
// The history held here: after the first answer only the points taken since
// the previous one are asked for ({started, generatedAt, entities: Map}).
let held = null;

function entityId(e) {
  return JSON.stringify([e.key, e.user, e.client_id]);
}

// The answer's entities (the server's list is authoritative), each with the
// points held here followed by the new ones, within the span.
function merge(q, generatedAt) {
  const fresh = q.points_since === null || q.points_since === undefined;
  if (!fresh && (!held || held.started !== q.history_started_at)) return false;
  const entities = new Map();
  const oldest = generatedAt - q.span_s;
  for (const e of q.entities) {
    const id = entityId(e);
    const before = fresh ? null : held.entities.get(id);
    if (before && before.points.length) {
      const last = before.points[before.points.length - 1][0];
      e.points = before.points.concat(e.points.filter(p => p[0] > last));
    }
    e.points = e.points.filter(p => p[0] >= oldest);
    entities.set(id, e);
  }
  held = {started: q.history_started_at, generatedAt: generatedAt, entities: entities};
  q.entities = [...entities.values()];
  return true;
}

function problem(text) {
  const p = document.getElementById("problem");
  p.textContent = text || "";
  p.hidden = !text;
  const updated = document.getElementById("updated");
  updated.classList.toggle("stale", Boolean(text));
}

async function refresh() {
  const headers = {};
  const bearer = token();
  if (bearer) headers.Authorization = "Bearer " + bearer;
  let answer;
  try {
    const since = held ? "?since=" + held.generatedAt : "";
    answer = await fetch("status.json" + since, {headers: headers, cache: "no-store"});
  } catch (error) {
    problem("Cannot reach the proxy's admin endpoint (" + error.message + ")" +
      (lastGood ? "; the figures shown are from " + lastGood : ""));
    return;
  }
  if (answer.status === 401) {
    held = null;
    problem((bearer ? "The token given was refused. " : "") + "The status data needs the " +
      "admin endpoint's bearer token: open this page as /#token=<token> (the part after # " +
      "stays in the browser). The endpoint said: " + (await answer.text()).trim());
    return;
  }
  if (!answer.ok) {
    problem("The admin endpoint answered " + answer.status + ": " + (await answer.text()).trim());
    return;
  }
  const data = await answer.json();
  if (data.quotas.configured && !merge(data.quotas, data.generated_at)) {
    held = null;  // the proxy restarted: its history starts over
    return refresh();
  }
  problem(null);
  showSection("quotas-note", "entities", data.quotas, q => quotaRows(q, data.generated_at),
    "not configured (no quota source)");
  showThrottled(data.throttled);
  showSection("storage-summary", "storage-volumes", data.storage, storageRows);
  showSection("fleet-summary", "fleet-shares", data.fleet, fleetRows);
  lastGood = new Date(data.generated_at * 1000).toLocaleTimeString();
  document.getElementById("updated").textContent = "updated " + lastGood +
    ", every " + REFRESH_MS / 1000 + " s";
  document.body.dataset.generatedAt = data.generated_at;
}

async function loop() {
  try {
    await refresh();
  } catch (error) {
    problem("Cannot show the status: " + error.message);
  }
  setTimeout(loop, REFRESH_MS);
}

window.addEventListener("hashchange", refresh);
loop();

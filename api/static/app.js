// The elastic-train page: sign in, a jobs list, and a live page per job. Plain JS, no build.
"use strict";

const TOKEN_KEY = "etrain.token";
const POLL_MS = 2000;
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
// KIND and FAILURE_KINDS come from /kinds.js, made from the run record's own definitions
// (workers/events.py): the page names no event kind of its own.
const RECOVERY_KINDS = new Set([KIND.RESUMED, KIND.LIVE_RECOVERED]);
const QUIET = new Set([KIND.WORKER_STARTED, KIND.WORKER_FINISHED, KIND.TRAINING_STARTED]);
const $ = (sel, root = document) => root.querySelector(sel);

class SignedOut extends Error {}

// ------------------------------------------------------------------ API

async function api(method, path, body) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) throw new SignedOut();
  const init = { method, headers: { Authorization: `Bearer ${token}` } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  if (r.status === 401) {
    signOut("The API refused the token (401 Unauthorized). Sign in again with the right one.");
    throw new SignedOut();
  }
  return r;
}

async function detail(r) {
  try {
    const b = await r.json();
    return b.message || (typeof b.detail === "string" ? b.detail : JSON.stringify(b.detail));
  } catch {
    return `${r.status} ${r.statusText}`;
  }
}

async function getJSON(path) {
  const r = await api("GET", path);
  if (!r.ok) throw new Error(await detail(r));
  return r.json();
}

// ------------------------------------------------------------------ small helpers

function html(text) {
  const t = document.createElement("template");
  t.innerHTML = text.trim();
  return t.content.firstElementChild;
}

function duration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  s = Math.max(0, s);
  if (s < 60) return `${s < 10 ? s.toFixed(1) : Math.round(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.round((s % 86400) / 3600)} h`;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

const now = () => Date.now() / 1000;

function stateBadge(state) {
  return `<span class="state state-${esc(state)}">${esc(state)}</span>`;
}

function progressBar(step, total) {
  const pct = total ? Math.min(100, (100 * step) / total) : 0;
  return `<div class="progress"><div style="width:${pct.toFixed(1)}%"></div></div>`;
}

// Exponential moving average with the start-up bias removed (as TensorBoard's smoothing).
function smooth(points, weight = 0.8) {
  let avg = 0, n = 0;
  return points.map(([x, y]) => {
    avg = weight * avg + (1 - weight) * y;
    n += 1;
    return [x, avg / (1 - Math.pow(weight, n))];
  });
}

// ------------------------------------------------------------------ sign-in and routing

let view = null;
let timer = null;
let ticks = 0;

function showSignIn(message) {
  clearTimeout(timer);
  view = null;
  $("#signin-view").hidden = false;
  $("#main").hidden = true;
  $("#signout").hidden = true;
  $("#cluster").textContent = "";
  $("#signin-error").textContent = message || "";
  $("#token").focus();
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  showSignIn(message);
}

$("#signin-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("#signin-error").textContent = "";
  sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
  try {
    await getJSON("/v1/jobs?limit=1");
  } catch (err) {
    if (!(err instanceof SignedOut)) $("#signin-error").textContent = `The API did not answer: ${err.message}`;
    return;
  }
  $("#token").value = "";
  route();
});

$("#signout").addEventListener("click", () => signOut("Signed out."));
window.addEventListener("hashchange", route);

function route() {
  if (!sessionStorage.getItem(TOKEN_KEY)) return showSignIn();
  $("#signin-view").hidden = true;
  $("#main").hidden = false;
  $("#signout").hidden = false;
  const m = location.hash.match(/^#\/jobs\/(.+)$/);
  view = m ? new JobView(decodeURIComponent(m[1])) : new JobsView();
  $("#main").replaceChildren(view.root);
  ticks = 0;
  poll();
}

async function poll() {
  clearTimeout(timer);
  const current = view;
  if (!current) return;
  if (ticks++ % 5 === 0) refreshCluster();
  try {
    await current.refresh();
    current.root.classList.remove("stale");
    $(".load-error", current.root).textContent = "";
  } catch (err) {
    if (err instanceof SignedOut) return;
    current.root.classList.add("stale");
    $(".load-error", current.root).textContent = `Could not refresh: ${err.message}`;
  }
  if (view === current) timer = setTimeout(poll, POLL_MS);
}

async function refreshCluster() {
  const box = $("#cluster");
  try {
    const c = await getJSON("/v1/cluster");
    box.innerHTML = `Ray ${esc(c.ray_version)} · ${c.nodes} node${c.nodes === 1 ? "" : "s"} · ` +
      `CPUs ${fmt(c.cpus.free)}/${fmt(c.cpus.total)} free` +
      (c.gpus.total ? ` · GPUs ${fmt(c.gpus.free)}/${fmt(c.gpus.total)} free` : "") +
      ` · <a id="ray-dashboard" href="${esc(c.dashboard_url)}" target="_blank" rel="noopener">Ray dashboard ↗</a>`;
  } catch (err) {
    if (!(err instanceof SignedOut)) box.textContent = `Ray: ${err.message}`;
  }
}

// ------------------------------------------------------------------ jobs list

class JobsView {
  constructor() {
    this.root = html(`
      <section class="card">
        <div class="row"><h2>Jobs</h2><span class="spacer"></span><span class="load-error error"></span></div>
        <table id="jobs-table" class="table">
          <thead><tr><th>Job</th><th>State</th><th class="wide">Progress</th><th class="num">Loss</th>
            <th class="num">Restarts</th><th class="num">Age</th></tr></thead>
          <tbody></tbody>
        </table>
        <p id="no-jobs" class="muted" hidden>No jobs yet. Submit one with <code>etrain submit spec.yaml</code>
          or <code>POST /v1/jobs</code> (see <a href="/docs">API docs</a>).</p>
      </section>`);
  }

  async refresh() {
    const { data, count } = await getJSON("/v1/jobs?limit=200");
    $("#no-jobs", this.root).hidden = count > 0;
    $("tbody", this.root).replaceChildren(...data.map((job) => {
      const p = job.progress;
      const spec = job.spec || {};
      const loss = job.latest_metrics ? job.latest_metrics.loss : null;
      const row = html(`<table><tr data-job="${esc(job.id)}" data-state="${esc(job.state)}">
        <td><a href="#/jobs/${encodeURIComponent(job.id)}">${esc(job.id)}</a>
          <div class="muted small">${esc(modelName(spec))} · ${esc(workerCount(spec))} workers</div></td>
        <td>${stateBadge(job.state)} <span class="muted small">${TERMINAL.has(job.state) ? "" : esc(p.phase)}</span></td>
        <td>${progressBar(p.step, totalSteps(job))}<div class="small num-text">${p.step} / ${totalSteps(job) ?? "?"}</div></td>
        <td class="num">${fmt(loss)}</td>
        <td class="num">${job.restarts}</td>
        <td class="num">${duration(now() - job.created_at)}</td>
      </tr></table>`).querySelector("tr");
      row.addEventListener("click", (e) => { if (e.target.tagName !== "A") location.hash = `#/jobs/${encodeURIComponent(job.id)}`; });
      return row;
    }));
  }
}

// The spec's max_steps until the workers say how many steps the job runs.
function totalSteps(job) {
  return job.progress.total_steps ?? (job.spec && job.spec.training && job.spec.training.max_steps) ?? null;
}

function modelName(spec) {
  return typeof spec.model === "string" ? spec.model : (spec.model && spec.model.name) || "?";
}

function workerCount(spec) {
  const w = spec.workers;
  return w && typeof w === "object" ? `${w.min}–${w.max}` : String(w ?? "?");
}

// ------------------------------------------------------------------ one job

class JobView {
  constructor(id) {
    this.id = id;
    this.path = `/v1/jobs/${encodeURIComponent(id)}`;
    this.rows = [];
    this.maxStep = 0;
    this.events = [];
    this.eventsOffset = 0;
    this.job = null;
    this.tick = 0;
    this.root = html(`
      <section class="job">
        <div class="card head">
          <div class="row"><a href="#/">← All jobs</a><span class="spacer"></span><span class="load-error error"></span></div>
          <div class="row">
            <h2 id="job-title">${esc(id)}</h2><span id="job-state"></span><span id="job-phase" class="muted"></span>
            <span class="spacer"></span><a id="ray-job-link" target="_blank" rel="noopener" hidden>This job in Ray ↗</a>
          </div>
          <div id="job-progress"></div>
          <div id="job-facts" class="facts"></div>
          <div class="actions">
            <button id="kill-button" type="button" title="Kill one worker process now, to watch the job recover">Kill a worker</button>
            <select id="kill-rank" aria-label="rank to kill"><option value="">random rank</option></select>
            <button id="cancel-button" type="button" class="danger">Cancel job</button>
            <span id="action-message" role="status"></span>
          </div>
          <div id="job-error" class="error"></div>
        </div>
        <div id="stats" class="stats"></div>
        <div class="charts">
          <div class="card"><h3>Training loss <span class="muted">(log scale; faint: raw, bold: smoothed)</span></h3><div id="chart-loss"></div></div>
          <div class="card"><h3>Validation <span class="muted">(loss, left · accuracy, right)</span></h3><div id="chart-val"></div></div>
          <div class="card"><h3>Throughput <span class="muted">(samples/s)</span></h3><div id="chart-throughput"></div></div>
          <div class="card"><h3>Learning rate</h3><div id="chart-lr"></div></div>
        </div>
        <div class="cols">
          <div class="card">
            <h3>Recoveries</h3>
            <table id="recoveries" class="table"><thead><tr><th>Time</th><th>Failed</th><th>Cause</th>
              <th class="num">Resumed from</th><th class="num">Steps recomputed</th><th class="num">Recovery</th></tr></thead>
              <tbody></tbody></table>
            <p id="no-recoveries" class="muted small">None yet. <b>Kill a worker</b> to see one.</p>
            <div class="row"><h3>Timeline</h3><span class="spacer"></span>
              <label class="small muted"><input id="timeline-checkpoints" type="checkbox"> checkpoints</label></div>
            <ol id="timeline"></ol>
          </div>
          <div class="card">
            <h3>Checkpoints</h3>
            <table id="checkpoints" class="table"><thead><tr><th class="num">Step</th><th class="num">Epoch</th>
              <th class="num">Loss</th><th class="num">Size</th><th class="num">Committed</th></tr></thead><tbody></tbody></table>
            <p id="no-checkpoints" class="muted small">None yet.</p>
          </div>
        </div>
        <div class="card"><h3>Log <span class="muted">(last 50 lines)</span></h3><pre id="logs" class="muted">…</pre></div>
      </section>`);
    this.charts = {
      loss: new LineChart($("#chart-loss", this.root), { log: true, empty: "waiting for the first step…" }),
      val: new LineChart($("#chart-val", this.root), { log: true, rightRange: [0, 1] }),
      throughput: new LineChart($("#chart-throughput", this.root), { empty: "waiting for the first step…" }),
      lr: new LineChart($("#chart-lr", this.root), { empty: "waiting for the first step…" }),
    };
    $("#kill-button", this.root).addEventListener("click", () => this.kill());
    $("#cancel-button", this.root).addEventListener("click", () => this.cancel());
    $("#timeline-checkpoints", this.root).addEventListener("change", () => this.drawTimeline());
  }

  async refresh() {
    const since = this.maxStep, offset = this.eventsOffset;
    const [job, metrics, events] = await Promise.all([
      getJSON(this.path), getJSON(`${this.path}/metrics?since_step=${since}`), getJSON(`${this.path}/events?offset=${offset}`)]);
    if (this.job && job.created_at !== this.job.created_at) {
      // Deleted and made again under this id: another run record, read from its start.
      Object.assign(this, { rows: [], maxStep: 0, events: [], eventsOffset: 0, job: null });
      return this.refresh();
    }
    const ended = this.job && !TERMINAL.has(this.job.state) && TERMINAL.has(job.state);
    this.job = job;
    // The events file only grows: ask for what was written since the last answer (unless
    // another refresh, overlapping this one, already took them).
    if (offset === this.eventsOffset) {
      this.events.push(...events.data);
      this.eventsOffset = events.next_offset;
    }
    // Steps recomputed after a failure come again with numbers already seen; training is
    // deterministic, so the first rows stand for them.
    for (const row of metrics.data) {
      if (row.step > this.maxStep) {
        this.rows.push(row);
        this.maxStep = row.step;
      }
    }
    if (this.tick++ % 3 === 0 || ended) await this.refreshSlow();
    this.draw();
  }

  async refreshSlow() {
    const [checkpoints, logs] = await Promise.all([
      getJSON(`${this.path}/checkpoints`), api("GET", `${this.path}/logs?tail=50`).then((r) => (r.ok ? r.text() : ""))]);
    $("#no-checkpoints", this.root).hidden = checkpoints.data.length > 0;
    $("#checkpoints tbody", this.root).replaceChildren(...checkpoints.data.slice().reverse().map((c) => html(
      `<table><tr><td class="num">${c.step}</td><td class="num">${c.epoch ?? "–"}</td><td class="num">${fmt(c.loss)}</td>
       <td class="num">${bytes(c.bytes)}</td><td class="num">${c.committed_at ? clock(c.committed_at) : "–"}</td></tr></table>`)
      .querySelector("tr")));
    const pre = $("#logs", this.root);
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 8;
    const lines = logs.replace(/\s+$/, "").split("\n");
    pre.textContent = logs.trim() ? lines.slice(-50).join("\n") : "(no output yet)";
    pre.classList.toggle("muted", !logs.trim());
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }

  draw() {
    const job = this.job;
    const p = job.progress;
    const terminal = TERMINAL.has(job.state);
    $("#job-state", this.root).innerHTML = stateBadge(job.state);
    $("#job-phase", this.root).textContent = terminal ? "" : p.phase;
    $("#job-progress", this.root).innerHTML = progressBar(p.step, totalSteps(job));
    const link = $("#ray-job-link", this.root);
    link.hidden = !job.dashboard_url;
    if (job.dashboard_url) link.href = job.dashboard_url;
    $("#job-facts", this.root).innerHTML = this.facts().map(([k, v]) => `<span>${k} <b>${v}</b></span>`).join("");
    $("#job-error", this.root).textContent = job.error ? job.error.message : "";
    $("#kill-button", this.root).disabled = terminal;
    $("#cancel-button", this.root).disabled = terminal;
    this.fillRanks();
    this.drawStats();
    this.drawCharts();
    this.drawRecoveries();
    this.drawTimeline();
  }

  facts() {
    const job = this.job, p = job.progress;
    const end = TERMINAL.has(job.state) ? job.updated_at : now();
    const out = [["step", `${p.step} / ${totalSteps(job) ?? "?"}`]];
    if (p.epoch !== null && p.epoch !== undefined) out.push(["epoch", p.epoch]);
    out.push(["elapsed", duration(end - job.created_at)]);
    const eta = this.eta();
    if (eta !== null && !TERMINAL.has(job.state)) out.push(["ETA", duration(eta)]);
    out.push(["workers", esc(this.worldSize() ?? workerCount(job.spec))], ["model", esc(modelName(job.spec))],
      ["restarts", job.restarts], ["steps recomputed", job.steps_recomputed]);
    return out;
  }

  eta() {
    const total = totalSteps(this.job);
    // This attempt's rows only: the pause of a recovery is not the training pace.
    const last = this.rows[this.rows.length - 1];
    if (!last) return null;
    const rows = this.rows.filter((r) => r.attempt === last.attempt).slice(-30);
    if (!total || rows.length < 5) return null;
    const a = rows[0], b = rows[rows.length - 1];
    if (b.step <= a.step || b.time <= a.time) return null;
    return ((b.time - a.time) / (b.step - a.step)) * (total - this.job.progress.step);
  }

  worldSize() {
    const started = this.events.filter((e) => e.event === KIND.ATTEMPT_STARTED);
    return started.length ? started[started.length - 1].world_size : null;
  }

  fillRanks() {
    const n = this.worldSize() ?? (typeof this.job.spec.workers === "number" ? this.job.spec.workers : 0);
    const select = $("#kill-rank", this.root);
    if (select.options.length === n + 1) return;
    const chosen = select.value;
    select.replaceChildren(html(`<option value="">random rank</option>`),
      ...Array.from({ length: n }, (_, r) => html(`<option value="${r}">rank ${r}</option>`)));
    if (chosen && Number(chosen) < n) select.value = chosen;
  }

  validation() {
    const rows = this.rows.filter((r) => r.val_loss !== undefined && r.val_loss !== null);
    if (!rows.length && this.job.result && this.job.result.val_loss !== undefined) {
      const r = this.job.result;
      return [{ step: r.final_step ?? this.maxStep, val_loss: r.val_loss, val_accuracy: r.val_accuracy, val_metrics: r.val_metrics }];
    }
    return rows;
  }

  drawStats() {
    const last = this.rows[this.rows.length - 1] || this.job.latest_metrics || {};
    const losses = smooth(this.rows.map((r) => [r.step, r.loss]));
    const speeds = smooth(this.rows.map((r) => [r.step, r.samples_per_s]));
    const val = this.validation();
    const v = val[val.length - 1] || {};
    const ckpt = this.job.latest_checkpoint;
    const recov = this.events.filter((e) => RECOVERY_KINDS.has(e.event));
    const secs = recov.map((e) => e.recovery_s ?? e.rejoin_s ?? e.stall_s).filter((s) => s !== undefined && s !== null);
    const cards = [
      ["Training loss", fmt(last.loss), losses.length ? `smoothed ${fmt(losses[losses.length - 1][1])}` : ""],
      ["Validation loss", fmt(v.val_loss), v.step !== undefined ? (this.job.result && val.length === 1 && !this.rows.some((r) => r.val_loss != null) ? "final" : `at step ${v.step}`) : "not scored yet"],
      ["Validation accuracy", v.val_accuracy !== undefined && v.val_accuracy !== null ? `${(100 * v.val_accuracy).toFixed(1)}%` : "–", ""],
      ["Samples/s", speeds.length ? fmt(speeds[speeds.length - 1][1]) : "–", last.step_s ? `${(1000 * last.step_s).toFixed(0)} ms/step` : ""],
      ["Learning rate", fmt(last.lr), ""],
      ["Checkpoint", ckpt ? `step ${ckpt.step}` : "–", ckpt && ckpt.committed_at ? `${duration(now() - ckpt.committed_at)} ago` : ""],
      ["Recoveries", String(recov.length), secs.length ? `mean ${seconds(secs.reduce((a, b) => a + b, 0) / secs.length)} to recover` : ""],
    ];
    $("#stats", this.root).innerHTML = cards.map(([k, value, sub]) =>
      `<div class="stat"><div class="k">${k}</div><div class="v">${value}</div><div class="sub muted">${sub}</div></div>`).join("");
  }

  drawCharts() {
    const xMax = totalSteps(this.job) || this.maxStep;
    const markers = chartMarkers(this.events, this.maxStep);
    const pts = (key) => this.rows.filter((r) => Number.isFinite(r[key])).map((r) => [r.step, r[key]]);
    const loss = pts("loss");
    this.charts.loss.draw({ xMax, markers, series: [
      { name: "loss", color: "#2563eb", points: loss, faint: true },
      { name: "smoothed", color: "#1d4ed8", points: smooth(loss), derived: true },
    ] });

    const val = this.validation();
    const valSeries = [
      { name: "val loss", color: "#ea580c", points: val.map((r) => [r.step, r.val_loss]), dots: true },
      { name: "val accuracy", color: "#16a34a", right: true, dots: true,
        points: val.filter((r) => Number.isFinite(r.val_accuracy)).map((r) => [r.step, r.val_accuracy]) },
    ];
    const palette = ["#9333ea", "#0891b2", "#be185d", "#854d0e"];
    const names = [...new Set(val.flatMap((r) => Object.keys(r.val_metrics || {})))].filter((n) => n !== "accuracy");
    names.forEach((name, i) => {
      const points = val.filter((r) => r.val_metrics && Number.isFinite(r.val_metrics[name])).map((r) => [r.step, r.val_metrics[name]]);
      // Only scores that fit the 0–1 axis share it with accuracy.
      if (points.every((q) => q[1] >= 0 && q[1] <= 1)) valSeries.push({ name, color: palette[i % palette.length], right: true, dots: true, points });
    });
    const every = this.job.spec.evaluation && this.job.spec.evaluation.every_steps;
    this.charts.val.options.empty = every ? `validation runs every ${every} steps` : "validation runs once, at the end (set evaluation.every_steps for more)";
    this.charts.val.draw({ xMax, markers, series: valSeries, points: val.length });

    const speed = pts("samples_per_s");
    this.charts.throughput.draw({ xMax, markers, series: [
      { name: "samples/s", color: "#0d9488", points: speed, faint: true },
      { name: "smoothed", color: "#0f766e", points: smooth(speed), derived: true },
    ] });
    this.charts.lr.draw({ xMax, markers, series: [{ name: "lr", color: "#7c3aed", points: pts("lr") }] });
  }

  drawRecoveries() {
    const resumed = this.events.filter((e) => RECOVERY_KINDS.has(e.event));
    $("#no-recoveries", this.root).hidden = resumed.length > 0;
    // A live recovery (failure.mode live): the survivors kept training, nothing was recomputed.
    $("#recoveries tbody", this.root).replaceChildren(...resumed.map((e) => html(`<table><tr class="recovery">
      <td>${clock(e.time)}</td><td>${esc(who(e))}</td><td>${esc(e.event === KIND.LIVE_RECOVERED ? "live: survivors kept training" : e.cause ?? "–")}</td>
      <td class="num">${e.from_step ?? e.failed_after_step}</td><td class="num">${e.lost_steps ?? 0}</td>
      <td class="num">${recoveryTime(e)}</td></tr></table>`).querySelector("tr")));
  }

  drawTimeline() {
    const withCheckpoints = $("#timeline-checkpoints", this.root).checked;
    const first = this.events.length ? this.events[0].time : 0;
    const shown = this.events.filter((e) => !QUIET.has(e.event) && (withCheckpoints || e.event !== KIND.CHECKPOINT_COMMITTED));
    $("#timeline", this.root).replaceChildren(...shown.reverse().map((e) => {
      const text = describe(e);
      const li = html(`<li class="ev ev-${esc(e.event)}"><span class="when" title="${esc(clock(e.time))}">+${esc(offset(e.time - first))}</span>
        <span class="what"></span></li>`);
      $(".what", li).textContent = text;
      $(".what", li).title = text;
      return li;
    }));
  }

  async kill() {
    const rank = $("#kill-rank", this.root).value;
    await this.act(`${this.path}/faults`, rank === "" ? {} : { rank: Number(rank) },
      (f) => `Killed rank ${f.rank} (pid ${f.pid}). Watch the timeline for the recovery.`);
  }

  async cancel() {
    if (!confirm(`Cancel job ${this.id}?`)) return;
    await this.act(`${this.path}/cancel`, undefined, () => "Cancel requested.");
  }

  async act(path, body, said) {
    const box = $("#action-message", this.root);
    box.className = "";
    box.textContent = "…";
    let r;
    try {
      r = await api("POST", path, body);
    } catch (err) {
      if (err instanceof SignedOut) return;
      box.className = "error";
      box.textContent = err.message;
      return;
    }
    if (r.ok) {
      box.className = "ok";
      box.textContent = said(await r.json());
    } else {
      box.className = "error";
      box.textContent = `${r.status === 409 ? "Not now" : `Error ${r.status}`}: ${await detail(r)}`;
    }
  }
}

function offset(s) {
  const m = Math.floor(s / 60);
  return `${m}:${String(Math.floor(s % 60)).padStart(2, "0")}`;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  return n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${(n / 1024).toFixed(0)} KiB`;
}

function who(e) {
  if (e.failed_rank !== null && e.failed_rank !== undefined) return `rank ${e.failed_rank}`;
  if (e.failed_ranks) return e.failed_ranks.length ? `rank ${e.failed_ranks.join(", ")}` : "a worker";
  return e.cause === "resize" ? "(resize)" : "driver";
}

function seconds(s) {
  return s < 60 ? `${s.toFixed(1)} s` : duration(s);
}

function recoveryTime(e) {
  if (e.recovery_s !== undefined && e.recovery_s !== null) return seconds(e.recovery_s);
  if (e.rejoin_s !== undefined && e.rejoin_s !== null) return `${seconds(e.rejoin_s)} (stall ${seconds(e.stall_s)})`;
  if (e.stall_s !== undefined && e.stall_s !== null) return `${seconds(e.stall_s)} stall`;
  return "–";
}

function short(text, n = 160) {
  text = String(text ?? "");
  return text.length > n ? `${text.slice(0, n)}…` : text;
}

function describe(e) {
  switch (e.event) {
    case KIND.JOB_STARTED: return "Job started (driver up)";
    case KIND.ATTEMPT_STARTED: return `Attempt ${e.attempt}: ${e.world_size} worker(s), ` +
      (e.from_step ? `from checkpoint of step ${e.from_step}` : "from scratch");
    case KIND.FAULT_INJECTED: return `Fault injected: rank ${e.rank} killed (${e.kind ?? "crash"})` + (e.step !== undefined ? ` at step ${e.step}` : "");
    case KIND.WORKER_FAILED: return `Rank ${e.rank ?? "?"} failed` + (e.step !== undefined ? ` at step ${e.step}` : "") +
      (e.hung ? " (hung)" : e.process_died ? " (process died)" : "") + `: ${short(e.error || e.signature || e.kind || e.classification)}`;
    case KIND.DRIVER_LOST: return `Driver lost: ${short(e.error)}`;
    case KIND.BACKOFF: return `Waiting ${e.delay_s} s before attempt ${e.attempt}: ${e.reason}`;
    case KIND.CHECKPOINT_SKIPPED: return `Checkpoint of step ${e.step} unusable, trying an older one`;
    case KIND.CHECKPOINT_COMMITTED: return `Checkpoint committed at step ${e.step}`;
    case KIND.RESIZED: return `Resized: ${e.old_size} → ${e.new_size} workers at step ${e.from_step}`;
    case KIND.RESUMED: return `Recovered from ${who(e)} failure (${e.cause ?? "?"}): resumed from step ${e.from_step}, ` +
      `${e.lost_steps ?? "?"} steps recomputed, ${recoveryTime(e)}`;
    case KIND.LIVE_RECOVERED: return `Live recovery from ${who(e)} failure: the others kept training ` +
      `(${e.survivor_steps} steps, stalled ${seconds(e.stall_s)})` +
      (e.rejoin_s !== null && e.rejoin_s !== undefined ? `, rejoined in ${seconds(e.rejoin_s)}` : ", not rejoined before the end") +
      `; ${e.samples_skipped} samples of the missing group skipped`;
    case KIND.LIVE_JOINED: return `Rank ${e.rank} replaced: took the state of step ${e.step} from a live peer in ${seconds(e.fetch_s)}`;
    case KIND.FINISHED: return `Finished at step ${e.final_step}: loss ${fmt(e.loss)}` +
      (e.val_loss !== undefined && e.val_loss !== null ? `, val loss ${fmt(e.val_loss)}` : "") +
      (e.val_accuracy !== undefined && e.val_accuracy !== null ? `, val accuracy ${(100 * e.val_accuracy).toFixed(1)}%` : "");
    case KIND.FAILED: return `Failed: ${short(e.error, 400)}`;
    default: return e.event.replace(/_/g, " ");
  }
}

// Vertical markers for the charts: each recovery marks the step it failed at and shades the
// steps it had to recompute; a failure not yet recovered marks where training stands.
function chartMarkers(events, lastStep) {
  const out = [];
  let pending = [];
  for (const e of events) {
    if (FAILURE_KINDS.has(e.event)) {
      pending.push(e);
    } else if (e.event === KIND.RESUMED) {
      const label = describe(e);
      if (e.lost_steps) out.push({ kind: "recomputed", x0: e.from_step, x: e.reached_step ?? e.from_step + e.lost_steps, label });
      out.push({ kind: "failure", x: e.reached_step ?? e.from_step, short: `✕ ${who(e)}`, label });
      pending = [];
    } else if (e.event === KIND.LIVE_RECOVERED) {
      out.push({ kind: "failure", x: e.failed_after_step, short: `✕ ${who(e)} (live)`, label: describe(e) });
      pending = [];
    } else if (e.event === KIND.RESIZED) {
      out.push({ kind: "resize", x: e.from_step, short: `${e.old_size}→${e.new_size}`, label: describe(e) });
    } else if (e.event === KIND.FAILED) {
      out.push({ kind: "failure", x: lastStep, short: "✕ failed", label: describe(e) });
      pending = [];
    }
  }
  if (pending.length) {
    const first = pending.find((e) => e.event === KIND.FAULT_INJECTED) || pending[0];
    out.push({ kind: "failure", x: first.step ?? lastStep, short: `✕ rank ${first.rank ?? "?"}`, label: `${describe(first)} (recovering…)` });
  }
  return out;
}

route();

// The dashboard: an overview, the jobs (submit, filter, cancel), the worker groups and the
// batches, each a view of this one page (#overview, #jobs, #workers, #batches). Everything
// comes from the JSON API with the key kept in this browser, and stays current from
// /v1/events (polling when the stream cannot be had).
"use strict";
(() => {
  const { $, api, esc, bytes, span, ago, when } = kiln;
  const STATES = ["queued", "running", "succeeded", "failed", "cancelled", "dead", "expired"];
  const VIEWS = ["overview", "jobs", "workers", "batches"];
  const JOBS = 50;  // rows of the jobs table
  const BATCHES = 25;
  const TICK_MS = 10000;  // ages, heartbeats and ETAs are read again this often regardless
  const thumbs = new Map();  // job id -> Promise of an object URL (fetched once, with the key)
  let summary = null, models = [], stopLive = null, timer = null;
  const due = new Set();  // what a burst of events asks to reload, reloaded once
  let dueTimer = null;

  const view = () => (VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1)
    : "overview");
  const showError = (m) => { $("error").textContent = m || ""; };
  const chip = (state) => `<span class="chip ${esc(state)}">${esc(state)}</span>`;
  const bar = (fraction, cls = "") =>
    `<div class="bar ${esc(cls)}"><div style="width:${(100 * (fraction || 0)).toFixed(0)}%">` +
    "</div></div>";

  // ---- overview ----------------------------------------------------------------------------

  function renderOverview(s) {
    const card = (n, label, cls = "", sub = "") => `<div class="card"><div class="n ${cls}">` +
      `${n}</div><div class="l">${label}</div>${sub ? `<div class="s">${sub}</div>` : ""}</div>`;
    $("cards").innerHTML = STATES.map((st) => card(s.jobs_by_state[st] || 0, st, st)).join("");
    const rate = (r) => (r == null ? "—" : r.toFixed(r < 10 ? 1 : 0));
    const eta = s.queue_eta_seconds == null ? "—" : s.queue_depth ? span(s.queue_eta_seconds)
      : "empty";
    $("rates").innerHTML = [
      card(s.videos_last_hour, "videos, last hour", "", `${rate(s.videos_per_hour)} / hour`),
      card(s.videos_since_start, "videos since start", "",
           `${rate(s.videos_per_hour_since_start)} / hour since ${esc(when(s.api_started_at))}`),
      card(s.queue_depth, "queue depth", "queued"),
      card(eta, "queue ETA", "", s.videos_per_hour ? "at the last hour's rate"
        : "known once a video finishes"),
      card(s.failures_last_hour, "failures, last hour", s.failures_last_hour ? "failed" : ""),
    ].join("");
    const classes = Object.keys(s.jobs_by_class).sort();
    $("classes").className = classes.length ? "" : "empty";
    $("classes").innerHTML = classes.length ? `<table><tr><th>class</th>${STATES.map((st) =>
      `<th>${st}</th>`).join("")}</tr>${classes.map((c) => `<tr><td>${esc(c)}</td>${STATES.map(
      (st) => `<td class="${st}">${s.jobs_by_class[c][st] || ""}</td>`).join("")}</tr>`)
      .join("")}</table>` : "no jobs yet";
    $("failures-count").textContent = s.failures_last_hour > s.recent_failures.length
      ? `the newest ${s.recent_failures.length} of ${s.failures_last_hour}` : "";
    $("failures").className = s.recent_failures.length ? "" : "empty";
    $("failures").innerHTML = s.recent_failures.length ? `<table><tr><th>job</th><th>state</th>
      <th>model</th><th>reason</th><th>when</th></tr>${s.recent_failures.map((f) => `<tr>
      <td class="mono"><a href="/dashboard/jobs/${encodeURIComponent(f.id)}">${esc(f.id)}</a></td>
      <td>${chip(f.status)}</td><td class="mono">${esc(f.model)}</td>
      <td class="text">${esc(f.error || "—")}${f.error_code ?
        ` <span class="mono dim">(${esc(f.error_code)})</span>` : ""}</td>
      <td class="dim nowrap">${ago(f.finished_at)}</td></tr>`).join("")}</table>`
      : "none in the last hour";
  }

  // ---- jobs: submit, filter, cancel ---------------------------------------------------------

  function fillModels() {
    const options = models.map((m) => `<option value="${esc(m.id)}">${esc(m.id)}</option>`);
    $("models").innerHTML = options.join("");
    $("filter-models").innerHTML = '<option value="">any model</option>' + options.join("");
    if (models.length) useDefaults(models[0]);
  }

  function useDefaults(m) {  // the model's own values and rules in the form
    const form = $("submit");
    for (const name of ["width", "height", "num_frames", "num_inference_steps"]) {
      form.elements[name].value = m.defaults[name];
    }
    for (const name of ["width", "height"]) {
      Object.assign(form.elements[name], { step: m.size_multiple, min: m.min_size,
                                           max: name === "width" ? m.max_width : m.max_height });
    }
    // frame_base + k x frame_stride frames; a family's fewest keeps its rule (1, or 124 = 5 + 7 x 17).
    Object.assign(form.elements.num_frames, { step: m.frame_stride, min: m.min_num_frames,
                                              max: m.max_num_frames });
    form.elements.num_inference_steps.max = m.max_num_inference_steps;
    form.elements.prompt.maxLength = m.max_prompt_chars;
    // A model that renders from an image or a video offers a file, previewed before it goes.
    const kinds = m.inputs || [];
    $("input-label").hidden = $("fit-label").hidden = !kinds.length;
    $("input-file").accept = kinds.map((k) => k === "image"
      ? "image/png,image/jpeg,image/webp" : "video/mp4,video/webm").join(",");
    if (!kinds.length) clearInput();
    loadAdapters(m.id);
  }

  async function loadAdapters(model) {  // the caller's and the shared adapters for the model
    let found = [];
    try {
      found = (await (await api(`/v1/adapters?model=${encodeURIComponent(model)}`)).json()).data;
    } catch (err) {
      found = [];  // an API without adapters: the form offers none
    }
    $("adapters").innerHTML = '<option value="">none</option>' + found.map((a) =>
      `<option value="${esc(a.id)}">${esc(a.name)}${a.shared ? " (shared)" : ""}</option>`)
      .join("");
    $("adapter-label").hidden = $("adapter-scale-label").hidden = !found.length;
  }

  let previewUrl = null;
  function clearInput() {
    $("input-file").value = "";
    showInput(null);
  }

  function showInput(file) {  // the chosen file as the render will start from it
    if (previewUrl) URL.revokeObjectURL(previewUrl);
    previewUrl = file ? URL.createObjectURL(file) : null;
    const box = $("input-preview");
    box.hidden = !file;
    box.replaceChildren();
    if (!file) return;
    const el = document.createElement(file.type.startsWith("video/") ? "video" : "img");
    Object.assign(el, { src: previewUrl, alt: file.name, muted: true, loop: true,
                        autoplay: true, playsInline: true });
    box.append(el);
  }

  function fieldErrors(errors) {  // each message beside its field; the rest under the button
    const form = $("submit");
    for (const el of form.querySelectorAll(".field-error")) el.textContent = "";
    for (const e of errors) {
      const field = String(e.field || "").split(".")[0];
      const el = form.querySelector(`.field-error[data-for="${CSS.escape(field)}"]`) ||
        form.querySelector('.field-error[data-for=""]');
      el.textContent = (el.textContent ? el.textContent + "; " : "") + e.message;
    }
  }

  async function onSubmit(e) {
    e.preventDefault();
    const form = e.currentTarget, body = {};
    const file = form.elements.input.files[0] || null;
    for (const el of form.elements) {
      if (!el.name || el.type === "file" || el.value.trim() === "") continue;
      if (el.name === "fit" && !file) continue;
      if (el.name === "adapter" || el.name === "adapter_scale") continue;  // as adapters, below
      body[el.name] = el.type === "number" ? Number(el.value) : el.value.trim();
    }
    if (form.elements.adapter.value) {
      const scale = form.elements.adapter_scale.value.trim();
      body.adapters = [{ id: form.elements.adapter.value, scale: scale === "" ? 1 : Number(scale) }];
    }
    const local = [];  // the rest is checked by the API, whose messages name the nearest values
    if (!body.prompt) local.push({ field: "prompt", message: "write what the video shows" });
    fieldErrors(local);
    if (local.length) return;
    $("submit-button").disabled = true;
    try {
      if (file) {  // uploaded first (decoded and checked there), then named by the job
        const upload = new FormData();
        upload.append("file", file, file.name);
        try {
          body.input_file_id = (await (await api("/v1/files", {
            method: "POST", body: upload })).json()).id;
        } catch (err) {
          err.body = { errors: [{ field: "input_file_id", message: err.message }] };
          throw err;
        }
      }
      const job = await (await api("/v1/jobs", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body) })).json();
      $("submitted").innerHTML = `submitted <a class="mono" href="/dashboard/jobs/` +
        `${encodeURIComponent(job.id)}">${esc(job.id)}</a>` + (job.queue_position != null
        ? ` <span class="dim">#${job.queue_position} in the queue</span>` : "");
      form.elements.prompt.value = "";
      form.elements.seed.value = "";
      clearInput();
      refresh(["summary", "jobs"]);
    } catch (err) {
      $("submitted").textContent = "";
      fieldErrors(err.body && err.body.errors ? err.body.errors
        : [{ field: "", message: err.message }]);
    } finally {
      $("submit-button").disabled = false;
    }
  }

  function jobQuery() {
    const params = new URLSearchParams({ limit: String(JOBS) });
    for (const el of $("filters").elements) if (el.value.trim()) params.set(el.name, el.value.trim());
    return params;
  }

  function thumbnail(job) {
    if (job.status !== "succeeded" || !job.thumbnail_url) return Promise.resolve("");
    if (!thumbs.has(job.id)) {
      thumbs.set(job.id, api(`/v1/jobs/${encodeURIComponent(job.id)}/thumbnail`)
        .then((r) => r.blob()).then((b) => URL.createObjectURL(b)).catch(() => ""));
    }
    return thumbs.get(job.id).then((src) => (src ? `<img class="thumb" src="${src}" alt="">`
      : ""));
  }

  async function renderJobs(list) {
    const el = $("jobs"), admin = summary && summary.is_admin;
    $("jobs-count").textContent = list.has_more ? `the newest ${list.data.length}` : "";
    if (!list.data.length) { el.className = "empty"; el.textContent = "no jobs match"; return; }
    const rows = await Promise.all(list.data.map(async (j) => {
      const open = j.status === "queued" || j.status === "running";
      const info = j.queue_position != null ? `#${j.queue_position} in queue`
        : j.error ? esc(j.error.message || j.error) : "";
      return `<tr data-job="${esc(j.id)}">
        <td>${await thumbnail(j)}</td>
        <td class="mono"><a href="/dashboard/jobs/${encodeURIComponent(j.id)}">${esc(j.id)}</a>
          </td>
        <td>${chip(j.status)}</td>
        <td class="nowrap">${bar(j.progress, j.status)}
          <span class="dim steps">${j.step}/${j.total_steps}</span></td>
        <td class="prompt" title="${esc(j.prompt)}">${esc(j.prompt)}</td>
        <td class="nowrap">${j.width}×${j.height} · ${j.num_frames} f · ${esc(j.class)}</td>
        ${admin ? `<td>${esc(j.owner)}</td>` : ""}
        <td class="dim reason">${info}</td>
        <td class="dim nowrap">${ago(j.created_at)}</td>
        <td>${open && !j.cancel_requested ? `<button type="button" class="danger small"
          data-cancel="${esc(j.id)}">Cancel</button>` : j.cancel_requested && open
          ? '<span class="dim">cancelling</span>' : ""}</td></tr>`;
    }));
    el.className = "";
    el.innerHTML = `<table><tr><th></th><th>job</th><th>status</th><th>progress</th>
      <th>prompt</th><th>size · frames · class</th>${admin ? "<th>user</th>" : ""}<th></th>
      <th>submitted</th><th></th></tr>${rows.join("")}</table>`;
  }

  async function onCancel(e) {
    const button = e.target.closest("button[data-cancel]");
    if (!button || !confirm("Cancel this job?")) return;
    button.disabled = true;
    try {
      await api(`/v1/jobs/${encodeURIComponent(button.dataset.cancel)}/cancel`,
                { method: "POST" });
    } catch (err) {
      showError(err.message);
      button.disabled = false;
    }
    refresh(["summary", "jobs"]);
  }

  function onProgress(d) {  // a running job's step, in place
    for (const row of document.querySelectorAll(`[data-job="${CSS.escape(d.job_id)}"]`)) {
      const fill = row.querySelector(".bar > div"), steps = row.querySelector(".steps");
      if (fill) fill.style.width = `${(100 * Number(d.progress)).toFixed(0)}%`;
      if (steps) steps.textContent = `${Number(d.step)}/${Number(d.total_steps)}`;
    }
  }

  // ---- workers -----------------------------------------------------------------------------

  function layoutOf(g) {
    const r = g.ranks.find((x) => x.num_blocks != null) || {};
    const blocks = r.num_blocks != null ? ` · ${r.resident_blocks || 0} of ${r.num_blocks} ` +
      "blocks resident" : "";
    return `dp ${g.dp_size} × sp ${g.sp_size} · ${esc(g.mode.replace("_", "-"))}${blocks}`;
  }

  function renderWorkers(groups) {
    const el = $("workers");
    if (!groups.length) {
      el.innerHTML = '<section><h2>Worker groups</h2><p class="empty">no worker group ' +
        "running</p></section>";
      return;
    }
    el.innerHTML = groups.map((g) => {
      const state = g.stale ? "stale" : g.state;
      const why = g.stale ? `no heartbeat for ${ago(g.heartbeat_at).replace(" ago", "")}`
        : (g.reason || "");
      const cgroup = (g.ranks[0] || {}).cgroup_mem_bytes;
      const ranks = g.ranks.map((r) => {
        const weights = r.device_weight_buffer_bytes != null
          ? `${bytes(r.device_weight_buffer_bytes)} <span class="dim">of ${bytes(r.model_bytes)}` +
            ` (${(100 * r.device_weight_buffer_bytes / r.model_bytes).toFixed(0)} %)</span>`
          : '<span class="dim">all resident</span>';
        const stored = r.stored_block_bytes != null
          ? `${bytes(r.stored_block_bytes)} <span class="dim">in ${esc(r.weights_dtype ?? "?")}` +
            "</span>"
          : '<span class="dim">—</span>';
        // What its last step cost: the block gathers it took part in, and the blocks it
        // computed where a step cache counts them (fewer than the model has when it skipped).
        const cost = r.step_gathers != null
          ? ` <span class="dim step-cost">· last step ${r.step_gathers} gathers` +
            (r.step_blocks_computed != null ? `, ${r.step_blocks_computed} blocks computed` : "") +
            "</span>"
          : "";
        const job = r.job_id ? `<span data-job="${esc(r.job_id)}"><a class="mono" ` +
          `href="/dashboard/jobs/${encodeURIComponent(r.job_id)}">${esc(r.job_id)}</a> ` +
          `<span class="dim steps">${r.step ?? "?"}/${r.total_steps ?? "?"}</span>${cost}</span>`
          : '<span class="dim">idle</span>';
        return `<tr><td>rank ${r.rank}</td><td>${r.replica ?? "—"}</td>
          <td class="mono">${esc(r.device)}</td><td>${job}</td><td>${weights}</td><td>${stored}</td>
          <td>${String(r.device).startsWith("cpu") ? '<span class="dim" title="on the CPU ' +
            'the device is host memory: see the PSS">—</span>' : bytes(r.device_mem_used_bytes)}
          </td><td>${bytes(r.host_mem_bytes)}</td>
          <td class="mono dim">${r.pid ?? ""}</td></tr>`;
      }).join("");
      return `<section><h2>${esc(g.name)} ${chip(state)}
        <span class="aside">${esc(g.host)} · started ${ago(g.started_at)}</span></h2>
        <table class="params">
          <tr><th>model · layout</th><td><span class="mono">${esc(g.model)}</span> · ${layoutOf(g)}
            · ${esc(g.platform)}${g.goal ? ` · goal ${esc(g.goal)}` : ""}</td></tr>
          <tr><th>state</th><td>${chip(state)}${why ? ` <span class="text">${esc(why)}</span>`
            : ""}</td></tr>
          <tr><th>heartbeat</th><td>${ago(g.heartbeat_at)}</td></tr>
          <tr><th>host memory</th><td>${bytes(g.host_mem_bytes)} <span class="dim">summed PSS of
            ${g.ranks.length} rank(s)${cgroup != null ? `; cgroup charged ${bytes(cgroup)}` : ""}
            </span></td></tr>
          <tr><th>running</th><td>${g.num_running} of ${g.dp_size} replica(s)</td></tr>
        </table>
        <div class="ranks"><table><tr><th>rank</th><th>replica</th><th>device</th><th>current job · step</th>
          <th>device weight buffers · of the model</th><th>blocks as kept · dtype</th>
          <th>device memory used</th>
          <th>host memory (PSS)</th><th>pid</th></tr>${ranks}</table></div></section>`;
    }).join("");
  }

  // ---- batches -----------------------------------------------------------------------------

  const at = (t) => `<span class="nowrap">${esc(when(t))}</span>`;

  function windowOf(b) {
    if (!b.not_before && !b.deadline) return '<span class="dim">any time</span>';
    if (!b.not_before) return `until ${at(b.deadline)}`;
    return b.deadline ? `${at(b.not_before)} → ${at(b.deadline)}` : `from ${at(b.not_before)}`;
  }

  function etaOf(b) {
    if (b.status === "finished") return `<span class="dim">ended ${ago(b.finished_at)}</span>`;
    const wait = b.not_before ? (new Date(b.not_before).getTime() - Date.now()) / 1000 : 0;
    if (b.status === "queued" && wait > 0) return `<span class="dim">starts in ${span(wait)}</span>`;
    if (b.eta_seconds == null) {
      return '<span class="dim" title="known once a job of the batch has ended">—</span>';
    }
    return `in ${span(Number(b.eta_seconds))} <span class="dim">(${esc(when(b.eta))})</span>`;
  }

  function renderBatches(batches) {
    const el = $("batches");
    if (!batches.length) { el.className = "empty"; el.textContent = "no batches yet"; return; }
    el.className = "";
    const rows = batches.map((b) => {
      const p = b.progress, pct = (100 * Number(p.step_fraction)).toFixed(0);
      const counts = STATES.filter((s) => b.counts[s]).map((s) =>
        `<span class="chip ${s}">${Number(b.counts[s])} ${s}</span>`).join("");
      const page = `/dashboard/batches/${encodeURIComponent(b.id)}`;
      return `<tr>
        <td><div class="name" title="${esc(b.name)}"><a href="${page}">${b.name ? esc(b.name)
          : "unnamed"}</a></div>
          <div class="mono dim">${esc(b.id)}${b.owner ? " · " + esc(b.owner) : ""}</div></td>
        <td>${chip(b.status)}</td>
        <td class="nowrap"><span title="${pct}% of all steps">${bar(p.step_fraction, b.status)}
          </span> <span class="dim">${Number(p.finished)}/${Number(p.total)} done</span></td>
        <td><div class="counts">${counts}</div></td>
        <td>${windowOf(b)}</td>
        <td class="nowrap">${etaOf(b)}</td>
        <td class="dim nowrap">${ago(b.created_at)}</td>
        <td><a href="${page}">report</a></td>
      </tr>`;
    });
    el.innerHTML = `<table><tr><th>batch</th><th>status</th><th>progress</th><th>jobs</th>
      <th>window</th><th>ETA</th><th>submitted</th><th></th></tr>${rows.join("")}</table>`;
  }

  // ---- loading and live updates ------------------------------------------------------------

  const LOADERS = {
    summary: async () => {
      summary = await (await api("/v1/summary")).json();
      renderOverview(summary);
      $("filter-owner").hidden = !summary.is_admin;
    },
    jobs: async () => renderJobs(await (await api(`/v1/jobs?${jobQuery()}`)).json()),
    workers: async () => renderWorkers((await (await api("/v1/workers")).json()).data),
    batches: async () =>
      renderBatches((await (await api(`/v1/batches?limit=${BATCHES}`)).json()).data),
  };
  const NEEDS = { overview: ["summary"], jobs: ["summary", "jobs"], workers: ["workers"],
                  batches: ["batches"] };

  // Reloads what ``parts`` name that the current view shows (all of it by default).
  async function refresh(parts) {
    if (!kiln.key) return;
    const wanted = NEEDS[view()].filter((p) => !parts || parts.includes(p));
    try {
      await Promise.all(wanted.map((p) => LOADERS[p]()));
      showError("");
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (err) {
      showError(err.message);
    }
  }

  function soon(parts) {  // a burst of events reloads each part once, half a second later
    for (const p of parts) due.add(p);
    if (dueTimer) return;
    dueTimer = setTimeout(() => {
      const parts = [...due];
      due.clear();
      dueTimer = null;
      refresh(parts);
    }, 500);
  }

  function onEvent(d) {
    if (d.type === "progress") onProgress(d);
    else if (d.type === "job") soon(["summary", "jobs", "workers"].concat(d.batch_id
      ? ["batches"] : []));
    else if (d.type === "worker_group") soon(["workers"]);
    else if (d.type === "batch") soon(["batches"]);
  }

  function showView() {
    const v = view();
    for (const el of document.querySelectorAll("[data-view]")) el.hidden = el.dataset.view !== v;
    for (const a of document.querySelectorAll("#nav a")) {
      a.classList.toggle("here", a.getAttribute("href") === "#" + v);
    }
    refresh();
  }

  async function connect() {
    if (stopLive) stopLive();
    clearInterval(timer);
    if (!kiln.key) return;
    try {
      models = (await (await api("/v1/models")).json()).data;
      fillModels();
    } catch (err) {
      showError(err.message);
    }
    showView();
    stopLive = kiln.live({ onMessage: onEvent, onPoll: () => refresh(),
                           status: (t) => { $("live").textContent = t; } });
    timer = setInterval(() => refresh(), TICK_MS);
  }

  $("filters").elements.status.innerHTML += STATES.map((s) => `<option>${s}</option>`).join("");
  $("filters").addEventListener("change", () => refresh(["jobs"]));
  $("filters").addEventListener("submit", (e) => { e.preventDefault(); refresh(["jobs"]); });
  $("submit").addEventListener("submit", onSubmit);
  $("input-file").addEventListener("change", (e) => showInput(e.target.files[0] || null));
  $("models").addEventListener("change", (e) => {
    const m = models.find((x) => x.id === e.target.value);
    if (m) useDefaults(m);
  });
  $("jobs").addEventListener("click", onCancel);
  window.addEventListener("hashchange", showView);
  kiln.keyForm(connect);
  for (const el of document.querySelectorAll("[data-view]")) el.hidden = el.dataset.view !== view();
  connect();
})();

// The job page: loads the server-rendered job with the stored key, fetches its video and
// thumbnail with the key, and keeps itself current from /v1/events (polling when the stream
// cannot be had).
"use strict";
(() => {
  const POLL_MS = 2000;  // the fallback's pace
  const STREAM_RETRY_MS = 30000;  // while polling, how soon the stream is tried again
  const jobId = decodeURIComponent(location.pathname.split("/").pop());
  const media = new Map();  // output path -> Promise of an object URL (fetched once, with the key)
  const $ = (id) => document.getElementById(id);
  const main = () => document.querySelector("main");
  let key = localStorage.getItem("kiln-key") || "";
  if (location.hash.startsWith("#key=")) {  // a link that carries the key (kept out of the URL after)
    key = decodeURIComponent(location.hash.slice(5));
    localStorage.setItem("kiln-key", key);
    history.replaceState(null, "", location.pathname);
  }
  let source = null, pollTimer = null, busy = false, again = false;

  const showError = (message) => { $("error").textContent = message || ""; };
  const setLive = (text) => { const el = $("live"); if (el) el.textContent = text; };

  async function api(path, init = {}) {
    const r = await fetch(path, { ...init, headers: { Authorization: "Bearer " + key } });
    if (!r.ok) {
      let reason = r.statusText;
      try { reason = (await r.json()).detail || reason; } catch (_) {}
      const err = new Error(`${r.status} ${typeof reason === "string" ? reason : ""}`);
      err.status = r.status;
      throw err;
    }
    return r;
  }

  async function load() {
    const html = await (await api(location.pathname)).text();
    const fresh = new DOMParser().parseFromString(html, "text/html").querySelector("main");
    if (!fresh) throw new Error("the page came back without a job");
    main().replaceWith(document.adoptNode(fresh));
    hydrate();
  }

  async function refresh() {  // one load at a time; a call during a load loads again after it
    if (!key) return;
    if (busy) { again = true; return; }
    busy = true;
    try {
      do { again = false; await load(); } while (again);
      showError("");
    } catch (err) {
      showError(err.message);
      if (err.status === 401 || err.status === 404) stopLive();
    } finally {
      busy = false;
    }
  }

  function objectUrl(path) {
    if (!media.has(path)) {
      const url = api(path).then((r) => r.blob()).then((b) => URL.createObjectURL(b));
      url.catch(() => media.delete(path));  // tried again at the next load
      media.set(path, url);
    }
    return media.get(path);
  }

  function hydrate() {
    const m = main();
    if (m.dataset.shell) return;
    for (const el of m.querySelectorAll("[data-src]")) {
      objectUrl(el.dataset.src).then((u) => { el.src = u; }, (e) => showError(e.message));
    }
    for (const el of m.querySelectorAll("video[data-poster]")) {
      objectUrl(el.dataset.poster).then((u) => { el.poster = u; }, () => {});
    }
    for (const a of m.querySelectorAll("a[data-download]")) {
      a.addEventListener("click", async (e) => {
        e.preventDefault();
        try {
          const url = await objectUrl(a.getAttribute("href"));
          Object.assign(document.createElement("a"), { href: url, download: a.dataset.download })
            .click();
        } catch (err) { showError(err.message); }
      });
    }
    for (const t of m.querySelectorAll("time[datetime]")) {
      t.title = t.textContent;
      t.textContent = new Date(t.dateTime).toLocaleString();
    }
    const cancel = $("cancel");
    if (cancel) cancel.addEventListener("click", onCancel);
    if (m.dataset.terminal === "true") stopLive(); else startLive();
  }

  async function onCancel(e) {
    const button = e.currentTarget;
    if (!confirm("Cancel this job?")) return;
    button.disabled = true;
    try {
      await api(`/v1/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST" });
    } catch (err) {
      showError(err.message);
      button.disabled = false;
    }
    await refresh();
  }

  function onProgress(d) {
    const bar = $("bar"), steps = $("steps");
    if (bar) bar.style.width = `${(100 * Number(d.progress)).toFixed(0)}%`;
    if (steps) steps.textContent = `${Number(d.step)}/${Number(d.total_steps)} steps`;
  }

  function startLive() {
    if (source || pollTimer) return;
    if (!window.EventSource) { startPolling(); return; }
    // EventSource cannot send headers: the key goes in the query (this route only). A reconnect
    // sends Last-Event-ID by itself; the first connection starts after the events rendered.
    const after = main().dataset.lastEvent || "";
    source = new EventSource(`/v1/events?key=${encodeURIComponent(key)}` +
                             `&after=${encodeURIComponent(after)}`);
    source.onopen = () => setLive("live");
    source.onmessage = (e) => {
      let d;
      try { d = JSON.parse(e.data); } catch (_) { return; }
      if (d.job_id !== jobId) return;
      if (d.type === "progress") onProgress(d);
      else if (d.type === "job") refresh();
    };
    source.onerror = () => {
      if (source && source.readyState === EventSource.CLOSED) {  // refused (401, 503): poll
        source = null;
        startPolling();
      } else {
        setLive("reconnecting…");
      }
    };
  }

  function startPolling() {
    if (pollTimer) return;
    setLive("polling");
    pollTimer = setInterval(refresh, POLL_MS);
    setTimeout(() => {
      if (pollTimer && main().dataset.terminal !== "true") {
        clearInterval(pollTimer);
        pollTimer = null;
        startLive();
      }
    }, STREAM_RETRY_MS);
  }

  function stopLive() {
    if (source) { source.close(); source = null; }
    if (pollTimer) { clearInterval(pollTimer); pollTimer = null; }
    setLive("");
  }

  $("keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    key = $("key").value.trim();
    localStorage.setItem("kiln-key", key);
    stopLive();
    refresh();
  });
  $("key").value = key;
  if (main().dataset.shell) refresh(); else hydrate();
})();

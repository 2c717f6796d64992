// What kiln's server-rendered pages (a job, a batch) add to kiln.js: the shell that loads the page
// with the stored key (a link followed sends no header), reloading it one load at a time, local
// times, and staying live from /v1/events until the page says it is over. A page's own script
// calls kilnPage({ hydrate(main, page), onMessage(data, page) }) once.
"use strict";
window.kilnPage = (spec) => {
  const main = () => document.querySelector("main");
  let stop = null, busy = false, again = false, soonTimer = null;

  const showError = (message) => { kiln.$("error").textContent = message || ""; };
  const setLive = (text) => { const el = kiln.$("live"); if (el) el.textContent = text; };

  async function load() {
    const html = await (await kiln.api(location.pathname)).text();
    const fresh = new DOMParser().parseFromString(html, "text/html").querySelector("main");
    if (!fresh) throw new Error("the page came back empty");
    main().replaceWith(document.adoptNode(fresh));
    hydrate();
  }

  async function refresh() {  // one load at a time; a call during a load loads again after it
    if (!kiln.key) return;
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

  function refreshSoon(ms) {  // at most one load per ``ms``, for frequent messages (progress)
    if (soonTimer) return;
    soonTimer = setTimeout(() => { soonTimer = null; refresh(); }, ms);
  }

  const page = { api: kiln.api, refresh, refreshSoon, showError, main };

  function hydrate() {
    const m = main();
    if (m.dataset.shell) return;
    for (const t of m.querySelectorAll("time[datetime]")) {
      t.title = t.textContent;
      t.textContent = new Date(t.dateTime).toLocaleString();
    }
    if (spec.hydrate) spec.hydrate(m, page);
    if (m.dataset.terminal === "true") stopLive(); else startLive();
  }

  function startLive() {
    if (stop) return;
    // The first connection starts after the events the page was rendered with.
    stop = kiln.live({ onMessage: (d) => spec.onMessage(d, page), onPoll: refresh,
                       after: main().dataset.lastEvent || "", status: setLive });
  }

  function stopLive() {
    if (stop) { stop(); stop = null; }
  }

  kiln.keyForm(() => { stopLive(); refresh(); });
  if (main().dataset.shell) refresh(); else hydrate();
  return page;
};

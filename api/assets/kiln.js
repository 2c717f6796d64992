// What every kiln page shares: the API key kept in this browser, calls to the API with it,
// escaping and formatting, and a live feed from /v1/events with polling as the fallback.
"use strict";
const kiln = (() => {
  const KEY = "kiln-key";
  const STREAM_RETRY_MS = 30000;  // while polling, how soon the stream is tried again
  let key = localStorage.getItem(KEY) || "";
  if (location.hash.startsWith("#key=")) {  // a link that carries the key (kept out of the URL after)
    key = decodeURIComponent(location.hash.slice(5));
    localStorage.setItem(KEY, key);
    history.replaceState(null, "", location.pathname + location.search);
  }

  const $ = (id) => document.getElementById(id);

  // The header's key form: fills it in, and calls ``changed`` with each key entered.
  function keyForm(changed) {
    const input = $("key");
    input.value = key;
    $("keyform").addEventListener("submit", (e) => {
      e.preventDefault();
      key = input.value.trim();
      localStorage.setItem(KEY, key);
      changed(key);
    });
  }

  // A call to the API with the key; an Error with the reason (and .status) unless 2xx.
  async function api(path, init = {}) {
    const headers = { Authorization: "Bearer " + key, ...(init.headers || {}) };
    const r = await fetch(path, { ...init, headers });
    if (!r.ok) {
      let reason = r.statusText, body = null;
      try { body = await r.json(); reason = body.detail || reason; } catch (_) {}
      const err = new Error(`${r.status} ${typeof reason === "string" ? reason : ""}`.trim());
      err.status = r.status;
      err.body = body;
      throw err;
    }
    return r;
  }

  const esc = (s) => String(s ?? "").replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const bytes = (b) => b == null ? "—" : b >= 1e9 ? (b / 1e9).toFixed(2) + " GB"
    : (b / 1e6).toFixed(1) + " MB";
  const span = (s) => s < 60 ? `${s.toFixed(0)} s` : s < 3600 ? `${(s / 60).toFixed(0)} min`
    : `${(s / 3600).toFixed(1)} h`;
  const ago = (t) => t ? `${span(Math.max(0, (Date.now() - new Date(t).getTime()) / 1000))} ago`
    : "—";
  const when = (t) => {  // a time of today as the clock, any other with its date
    const d = new Date(t), clock = { hour: "2-digit", minute: "2-digit" };
    return d.toDateString() === new Date().toDateString() ? d.toLocaleTimeString([], clock)
      : d.toLocaleString([], { month: "short", day: "numeric", ...clock });
  };

  // Live updates: ``onMessage(data)`` for each event of /v1/events (EventSource sends no
  // headers, so the key goes in the query, on that route only); when the stream cannot be had,
  // ``onPoll()`` every ``pollMs`` instead, trying the stream again every 30 s. ``status(text)``
  // says which. Returns ``stop()``.
  function live({ onMessage, onPoll, pollMs = 2000, after = "", status = () => {} }) {
    let source = null, pollTimer = null, retryTimer = null, stopped = false;
    const poll = () => {
      if (pollTimer || stopped) return;
      status("polling");
      pollTimer = setInterval(onPoll, pollMs);
      retryTimer = setTimeout(() => { clearInterval(pollTimer); pollTimer = null; stream(); },
                              STREAM_RETRY_MS);
    };
    const stream = () => {
      if (stopped) return;
      if (!window.EventSource) { poll(); return; }
      source = new EventSource(`/v1/events?key=${encodeURIComponent(key)}` +
                               (after ? `&after=${encodeURIComponent(after)}` : ""));
      source.onopen = () => status("live");
      source.onmessage = (e) => {
        let d;
        try { d = JSON.parse(e.data); } catch (_) { return; }
        onMessage(d);
      };
      source.onerror = () => {
        if (source && source.readyState === EventSource.CLOSED) {  // refused (401, 503): poll
          source = null;
          poll();
        } else {
          status("reconnecting…");
        }
      };
    };
    stream();
    return () => {
      stopped = true;
      if (source) source.close();
      clearInterval(pollTimer);
      clearTimeout(retryTimer);
      status("");
    };
  }

  return { get key() { return key; }, $, keyForm, api, esc, bytes, span, ago, when, live };
})();

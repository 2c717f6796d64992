// What every kiln page shares: the API key kept in this browser, calls to the API with it,
// escaping and formatting, and a live feed from /v1/events with polling as the fallback.
//
// The key comes from the header's form only, and goes out only in the Authorization header:
// never in a URL (one ends up in access logs and history), never from a link (a link with
// someone else's key would put this browser's work into their account).
"use strict";
const kiln = (() => {
  const KEY = "kiln-key";
  const STREAM_RETRY_MS = 30000;  // while polling, how soon the stream is tried again
  let key = localStorage.getItem(KEY) || "";
  const dropKeyLink = () => {  // a #key= link is not read; it is dropped from the address
    if (location.hash.startsWith("#key=")) {
      history.replaceState(null, "", location.pathname + location.search);
    }
  };
  dropKeyLink();
  window.addEventListener("hashchange", dropKeyLink);  // before any page's own listener

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

  // The server-sent events of ``body`` (a fetch response's stream), as the EventSource
  // parser reads them: ``onEvent(data)`` per message, ``onId(id)`` and ``onRetry(ms)`` for
  // those fields; comments are skipped. Resolves when the stream ends.
  async function readEvents(body, { onEvent, onId, onRetry }) {
    const reader = body.getReader(), decoder = new TextDecoder();
    let buffer = "", data = [];
    const line = (text) => {
      if (text === "") {  // a blank line ends a message
        if (data.length) onEvent(data.join("\n"));
        data = [];
        return;
      }
      if (text.startsWith(":")) return;
      const colon = text.indexOf(":");
      const field = colon < 0 ? text : text.slice(0, colon);
      let value = colon < 0 ? "" : text.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") data.push(value);
      else if (field === "id" && !value.includes("\0")) onId(value);
      else if (field === "retry" && /^\d+$/.test(value)) onRetry(Number(value));
    };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop();
      lines.forEach(line);
    }
  }

  // Live updates: ``onMessage(data)`` for each event of /v1/events, read with fetch (the key
  // in its header, as everywhere) and resumed after a drop from the last event id
  // (Last-Event-ID); ``after``: the id the first connection starts after. When the stream is
  // refused (401, 503), ``onPoll()`` every ``pollMs`` instead, trying the stream again every
  // 30 s. ``status(text)`` says which. Returns ``stop()``.
  function live({ onMessage, onPoll, pollMs = 2000, after = "", status = () => {} }) {
    let controller = null, pollTimer = null, retryTimer = null, stopped = false;
    let lastId = after, retryMs = 2000;
    const poll = () => {
      if (pollTimer || stopped) return;
      status("polling");
      pollTimer = setInterval(onPoll, pollMs);
      retryTimer = setTimeout(() => { clearInterval(pollTimer); pollTimer = null; stream(); },
                              STREAM_RETRY_MS);
    };
    const reconnect = () => {
      if (stopped) return;
      status("reconnecting…");
      retryTimer = setTimeout(stream, retryMs);
    };
    const stream = async () => {
      if (stopped) return;
      controller = new AbortController();
      const headers = { Authorization: "Bearer " + key, Accept: "text/event-stream" };
      if (lastId) headers["Last-Event-ID"] = lastId;
      let r;
      try {
        r = await fetch("/v1/events", { headers, cache: "no-store", signal: controller.signal });
      } catch (_) {  // no answer (the API restarting): as EventSource does, try again
        reconnect();
        return;
      }
      if (!r.ok || !r.body) { poll(); return; }
      status("live");
      try {
        await readEvents(r.body, {
          onEvent: (text) => {
            let d;
            try { d = JSON.parse(text); } catch (_) { return; }
            onMessage(d);
          },
          onId: (id) => { lastId = id; },
          onRetry: (ms) => { retryMs = ms; },
        });
      } catch (_) {}  // dropped mid-stream, or stopped
      reconnect();
    };
    stream();
    return () => {
      stopped = true;
      if (controller) controller.abort();
      clearInterval(pollTimer);
      clearTimeout(retryTimer);
      status("");
    };
  }

  return { get key() { return key; }, $, keyForm, api, esc, bytes, span, ago, when, live };
})();

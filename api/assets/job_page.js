// The job page (after page.js): fetches the video and thumbnail with the key, wires the cancel
// button, and follows the job's own events: its progress in place, a state change by a reload.
"use strict";
(() => {
  const jobId = decodeURIComponent(location.pathname.split("/").pop());
  const media = new Map();  // output path -> Promise of an object URL (fetched once, with the key)

  function objectUrl(page, path) {
    if (!media.has(path)) {
      const url = page.api(path).then((r) => r.blob()).then((b) => URL.createObjectURL(b));
      url.catch(() => media.delete(path));  // tried again at the next load
      media.set(path, url);
    }
    return media.get(path);
  }

  function hydrate(m, page) {
    for (const el of m.querySelectorAll("[data-src]:not(.preview)")) {
      objectUrl(page, el.dataset.src).then((u) => { el.src = u; }, (e) => page.showError(e.message));
    }
    for (const el of m.querySelectorAll("video[data-poster]")) {
      objectUrl(page, el.dataset.poster).then((u) => { el.poster = u; }, () => {});
    }
    for (const a of m.querySelectorAll("a[data-download]")) {
      a.addEventListener("click", async (e) => {
        e.preventDefault();
        try {
          const url = await objectUrl(page, a.getAttribute("href"));
          Object.assign(document.createElement("a"), { href: url, download: a.dataset.download })
            .click();
        } catch (err) { page.showError(err.message); }
      });
    }
    const cancel = document.getElementById("cancel");
    if (cancel) cancel.addEventListener("click", (e) => onCancel(e, page));
    loadPreview(page);
  }

  // A running job's newest preview, fetched anew (none yet: a 404, asked again on progress).
  async function loadPreview(page) {
    const img = page.main().querySelector("img.preview");
    if (!img) return;
    try {
      const r = await page.api(img.dataset.src);
      const [step, total] = (r.headers.get("Kiln-Preview-Step") || "").split("/");
      const old = img.src;
      img.src = URL.createObjectURL(await r.blob());
      if (old.startsWith("blob:")) URL.revokeObjectURL(old);
      if (total) img.nextElementSibling.textContent = `current estimate, step ${step} of ${total}`;
      img.closest("section").hidden = false;
    } catch (_) {}
  }

  async function onCancel(e, page) {
    const button = e.currentTarget;
    if (!confirm("Cancel this job?")) return;
    button.disabled = true;
    try {
      await page.api(`/v1/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST" });
    } catch (err) {
      page.showError(err.message);
      button.disabled = false;
    }
    await page.refresh();
  }

  function onProgress(d) {
    const bar = document.getElementById("bar"), steps = document.getElementById("steps");
    if (bar) bar.style.width = `${(100 * Number(d.progress)).toFixed(0)}%`;
    if (steps) steps.textContent = `${Number(d.step)}/${Number(d.total_steps)} steps`;
  }

  window.kilnPage({
    hydrate,
    onMessage(d, page) {
      if (d.job_id !== jobId) return;
      if (d.type === "progress") { onProgress(d); loadPreview(page); }
      else if (d.type === "job") page.refresh();
    },
  });
})();

// The batch page (after page.js): reloads when one of its jobs changes state (the stream sends a
// "batch" message then), and at most every few seconds while its running jobs make progress.
"use strict";
(() => {
  const PROGRESS_RELOAD_MS = 5000;  // a big batch's steps would otherwise reload it constantly
  const batchId = decodeURIComponent(location.pathname.split("/").pop());
  window.kilnPage({
    onMessage(d, page) {
      if (d.type === "batch" && d.id === batchId) page.refresh();
      else if (d.type === "progress" && d.batch_id === batchId) {
        page.refreshSoon(PROGRESS_RELOAD_MS);
      }
    },
  });
})();

// idemq console: the little script the pages use. No inline script anywhere
// (the Content-Security-Policy forbids it); everything works without it,
// except the live progress of a running replay and "select all".
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  const all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", () => {
      for (const box of document.querySelectorAll('article.envelope input[name="id"]:not(:disabled)')) {
        box.checked = all.checked;
      }
    });
  }

  const confirmForm = document.getElementById("confirm");
  if (confirmForm) {
    confirmForm.addEventListener("submit", (ev) => {
      const action = confirmForm.querySelector('input[name="action"]:checked');
      const what = action ? action.value : "replay";
      if (!window.confirm("Run the " + what + " now? The dry run above is what it will do.")) {
        ev.preventDefault();
      }
    });
  }

  const job = document.getElementById("job");
  if (job && job.dataset.done !== "true") {
    const id = job.dataset.job;
    const tick = async () => {
      let j;
      try {
        const resp = await fetch("/jobs/" + encodeURIComponent(id) + "?format=json", { credentials: "same-origin" });
        j = await resp.json();
      } catch (e) {
        setTimeout(tick, 1000);
        return;
      }
      for (const dd of job.querySelectorAll("dd[data-k]")) {
        const v = j.result[dd.dataset.k];
        if (v !== undefined) dd.textContent = String(v);
      }
      const r = j.result;
      const settled = r.republished + r.skipped_already_applied + r.mismatched_left + r.beyond_horizon + r.unverified + r.missing_id_left;
      document.getElementById("job-progress").value = settled;
      document.getElementById("job-outcome").textContent = j.outcome;
      if (j.error) {
        const e = document.getElementById("job-error");
        e.textContent = j.error;
        e.hidden = false;
      }
      if (j.done) {
        job.dataset.done = "true";
      } else {
        setTimeout(tick, 500);
      }
    };
    setTimeout(tick, 300);
  }
});

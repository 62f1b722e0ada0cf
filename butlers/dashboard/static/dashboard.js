// Auto-refresh, the dashboard's only script (pages work without it): every data-refresh
// seconds the page's own URL is fetched again and its <main> replaced, unless the reader is
// typing in a form or has a session's details open.
(function () {
  "use strict";
  var seconds = parseInt(document.body.dataset.refresh || "0", 10);
  if (!seconds) return;
  function busy() {
    var active = document.activeElement;
    if (active && /^(INPUT|TEXTAREA|SELECT)$/.test(active.tagName)) return true;
    return document.querySelector("main details[open]") !== null;
  }
  function refresh() {
    if (document.hidden || busy()) return;
    fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (!html) return;
        var fresh = new DOMParser().parseFromString(html, "text/html").querySelector("main");
        var current = document.querySelector("main");
        if (fresh && current && !busy()) {
          current.replaceWith(fresh);
          document.body.dataset.refreshed = String(Date.now());
        }
      })
      .catch(function () { /* the next round tries again */ });
  }
  window.setInterval(refresh, seconds * 1000);
})();

// Ledger console: live countdowns for approvals' expiry. Dependency-free,
// loaded from this origin only (the CSP allows no inline script). The page
// works the same without it; this only keeps "expires in" current.
(function () {
  "use strict";
  function fmt(ms) {
    var s = Math.floor(ms / 1000);
    if (s < 60) return s + "s";
    var m = Math.floor(s / 60);
    if (m < 60) return m + "m " + (s % 60) + "s";
    var h = Math.floor(m / 60);
    if (h < 48) return h + "h " + (m % 60) + "m";
    return Math.floor(h / 24) + "d " + (h % 24) + "h";
  }
  function tick() {
    var els = document.querySelectorAll("time[data-countdown]");
    for (var i = 0; i < els.length; i++) {
      var t = Date.parse(els[i].getAttribute("datetime"));
      if (isNaN(t)) continue;
      var left = t - Date.now();
      var prefix = els[i].getAttribute("data-countdown") || "";
      els[i].textContent = left > 0 ? prefix + fmt(left) : "overdue";
    }
  }
  document.addEventListener("DOMContentLoaded", function () {
    if (document.querySelector("time[data-countdown]")) {
      tick();
      setInterval(tick, 1000);
    }
  });
})();

// llmgw dashboard: swap in the sections the server rendered (and escaped) whenever one changes.
// No framework, no build step; the page reads right without this script, only not live.
(function () {
  "use strict";
  var conn = document.getElementById("conn");
  var source = null;

  function apply(event) {
    var message = JSON.parse(event.data);
    Object.keys(message.sections).forEach(function (id) {
      var target = document.getElementById(id);
      if (target) {
        target.innerHTML = message.sections[id]; // HTML the server built with every value escaped
      }
    });
    document.body.setAttribute("data-version", String(message.v));
  }

  function lost() {
    // EventSource retries on its own (the server says how soon); until then, say so.
    conn.innerHTML = "";
    var note = document.createElement("span");
    note.className = "conn reconnecting";
    note.textContent = "reconnecting to the dashboard…";
    conn.appendChild(note);
    if (source && source.readyState === EventSource.CLOSED) {
      // Refused: a session that ended (the dashboard restarted, expired) shows the key form; else try again.
      fetch("api/status", {method: "HEAD", credentials: "same-origin", cache: "no-store"}).then(function (r) {
        if (r.status === 401) {
          window.location.reload();
        } else {
          setTimeout(open, 2000);
        }
      }, function () { setTimeout(open, 2000); });
    }
  }

  function open() {
    source = new EventSource("events");
    source.addEventListener("update", apply);
    source.addEventListener("logout", function () {
      source.close();
      window.location.reload(); // the server ended this session: it shows the key form
    });
    source.onerror = lost;
  }

  open();
})();

// The onceflow console's page. Everything it shows comes from the console's JSON API (api/...,
// relative to the page) and goes into the page as text: this script makes elements and sets
// their text and attributes, and never has data parsed as markup, so an id, a reason or a
// payload holding <script> shows as those characters. docs/console.md documents the API.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const nf = new Intl.NumberFormat("en");
  const state = {
    info: null,
    view: "handlers",
    filter: {},
    offset: 0,
    limit: 50,
    page: null,
    letter: null,
    format: null,
    unfolded: false,
    poll: null,
    keepReport: false,
  };

  // el makes an element: attributes from attrs, children appended as nodes or as text.
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) {
      if (c === undefined || c === null) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  function clear(e) {
    while (e.firstChild) e.removeChild(e.firstChild);
    return e;
  }

  function show(e, text) {
    e.textContent = text || "";
    e.hidden = !text;
  }

  async function api(path, body) {
    const init = { headers: { Accept: "application/json" }, credentials: "same-origin" };
    if (body !== undefined) {
      init.method = "POST";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const res = await fetch(path, init);
    let doc = null;
    try {
      doc = await res.json();
    } catch (e) {
      throw new Error(res.status + " " + res.statusText);
    }
    if (!res.ok && !(doc && (doc.done || doc.failed))) {
      throw new Error((doc && doc.error) || res.status + " " + res.statusText);
    }
    return doc;
  }

  // Times and numbers.

  function ago(iso) {
    if (!iso) return "";
    const s = (Date.now() - Date.parse(iso)) / 1000;
    if (s < 0) return "just now";
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return (s / 3600).toFixed(1) + " h ago";
    return (s / 86400).toFixed(1) + " d ago";
  }

  function when(iso) {
    if (!iso) return el("span", { class: "muted", text: "unknown" });
    return el("span", { title: iso, text: iso.replace("T", " ").replace(/\.\d+Z$/, "Z") + " (" + ago(iso) + ")" });
  }

  function num(v) {
    return v === null || v === undefined ? "–" : nf.format(v);
  }

  function rate(v) {
    if (v === null || v === undefined) return "–";
    return (v >= 100 ? Math.round(v) : v.toFixed(v >= 10 ? 1 : 2)) + "/s";
  }

  function plural(n, noun) {
    return nf.format(n) + " " + noun + (n === 1 ? "" : "s");
  }

  function bytes(n) {
    if (n < 1024) return n + " B";
    if (n < 1048576) return (n / 1024).toFixed(1) + " KiB";
    return (n / 1048576).toFixed(1) + " MiB";
  }

  // Views.

  function route() {
    const h = location.hash.slice(1);
    clearInterval(state.poll);
    state.poll = null;
    $("confirm").hidden = true;
    if (!state.keepReport) $("report").hidden = true;
    state.keepReport = false;
    let view = "handlers";
    if (h.startsWith("dead-letter=")) view = "dead-letter";
    else if (h === "dead-letters" || h === "storage") view = h;
    state.view = view;
    for (const s of document.querySelectorAll("main > section")) s.hidden = s.id !== "view-" + view;
    for (const a of document.querySelectorAll("nav a")) {
      const v = a.getAttribute("data-view");
      a.classList.toggle("active", v === view || (v === "dead-letters" && view === "dead-letter"));
    }
    if (view === "handlers") {
      loadHandlers();
      state.poll = setInterval(loadHandlers, 2000);
    } else if (view === "dead-letters") {
      loadDeadLetters();
    } else if (view === "dead-letter") {
      loadLetter(decodeURIComponent(h.slice("dead-letter=".length)));
    } else if (view === "storage") {
      loadStorage();
      state.poll = setInterval(loadStorage, 10000);
    }
  }

  async function loadInfo() {
    try {
      state.info = await api("api/info");
    } catch (e) {
      state.info = { read_only: true, read_only_reason: "the console did not answer: " + e.message, scan_limit: 1000 };
    }
    const i = state.info;
    const parts = [];
    if (i.broker) parts.push("dead letters in " + i.dead_letter_topic + " for consumer group " + i.consumer_group + " on " + i.broker);
    if (i.database) parts.push("database " + i.database);
    if (i.source === "database") parts.push("handlers read from the database");
    $("where").textContent = parts.join(" · ");
    show($("read-only"), i.read_only ? "Read-only: " + i.read_only_reason.replace(/^the console is read-only: /, "") : "");
    for (const b of document.querySelectorAll("button.change")) {
      if (i.read_only) {
        b.disabled = true;
        b.title = "read-only";
      }
    }
  }

  // Handlers.

  const routerColumns = [
    ["Handler", (h) => el("strong", { text: h.name })],
    ["Topic", (h) => h.topic],
    ["QoS", (h) => h.qos || "custom chain"],
    ["State", (h) => stateCell(h.state)],
    ["Rate", (h) => rate(h.rate), "num rate"],
    ["In flight", (h) => num(h.in_flight), "num inflight"],
    ["Processed", (h) => num(h.processed), "num"],
    ["Duplicates", (h) => num(h.duplicates), "num"],
    ["Failed", (h) => num(h.failed + h.panicked), "num", "nacked for a redelivery; panics among them: see title"],
    ["Dead-lettered", (h) => deadCell(h), "num"],
  ];
  const databaseColumns = [
    ["Handler", (h) => el("strong", { text: h.name })],
    ["Topic", (h) => h.topic || "–"],
    ["Applied/s", (h) => rate(h.rate), "num rate"],
    ["Last applied", (h) => (h.last_applied ? when(h.last_applied) : "–")],
    ["Ids recorded", (h) => num(h.applied), "num"],
    ["Redelivered", (h) => num(h.redelivered), "num"],
    ["Dead-lettered", (h) => deadCell(h), "num", "messages dead-lettered; at limit: dead letters waiting that reached the delivery limit"],
  ];

  function stateCell(s) {
    if (!s) return "–";
    const e = el("span", { class: "state-" + s.kind, text: s.kind });
    const tip = (s.reason ? s.reason + ", " : "") + "since " + s.since;
    return el("span", { title: tip }, e, el("span", { class: "muted small", text: " " + ago(s.since) }));
  }

  function deadCell(h) {
    const e = el("span", { text: num(h.dead_lettered) });
    if (h.delivery_limit) e.append(el("span", { class: "badge", title: "given up at the delivery limit", text: num(h.delivery_limit) + " at limit" }));
    return e;
  }

  async function loadHandlers() {
    let doc;
    try {
      doc = await api("api/handlers");
    } catch (e) {
      show($("handlers-error"), e.message);
      return;
    }
    show($("handlers-error"), "");
    $("handlers-note").textContent = doc.note;
    const cols = doc.source === "database" ? databaseColumns : routerColumns;
    const head = clear($("handlers-table").tHead.rows[0]);
    for (const [name, , cls, tip] of cols) head.append(el("th", { class: cls ? cls.split(" ")[0] : null, title: tip, text: name }));
    const body = clear($("handlers-table").tBodies[0]);
    if (doc.handlers.length === 0) body.append(el("tr", {}, el("td", { colspan: cols.length, class: "muted", text: "no handlers" })));
    for (const h of doc.handlers) {
      const tr = el("tr", { "data-handler": h.name });
      for (const [, cell, cls] of cols) tr.append(el("td", { class: cls }, cell(h)));
      body.append(tr);
    }
  }

  // Dead letters.

  function readFilter() {
    const f = {};
    const form = $("dl-filter");
    for (const name of ["handler", "topic", "reason"]) {
      const v = form.elements[name].value;
      if (v) f[name] = v;
    }
    for (const name of ["since", "until"]) {
      const v = form.elements[name].value;
      if (v) f[name] = new Date(v).toISOString();
    }
    return f;
  }

  function query(f, offset, limit) {
    const p = new URLSearchParams(f);
    p.set("offset", offset);
    p.set("limit", limit);
    return "api/dead-letters?" + p.toString();
  }

  async function loadDeadLetters() {
    let doc;
    try {
      doc = await api(query(state.filter, state.offset, state.limit));
    } catch (e) {
      show($("dl-error"), e.message);
      clear($("dl-table").tBodies[0]);
      $("dl-summary").textContent = "";
      return;
    }
    show($("dl-error"), "");
    state.page = doc;
    const body = clear($("dl-table").tBodies[0]);
    for (const d of doc.dead_letters) {
      const link = el("a", { href: "#dead-letter=" + encodeURIComponent(d.id), class: "letter-link", text: d.id });
      const reason = el("div", { title: d.reason, text: d.reason });
      const size = d.payload_dropped ? el("span", { class: "badge", title: d.payload_dropped, text: "dropped" }) : bytes(d.payload_size);
      const tr = el("tr", { "data-id": d.id },
        el("td", { class: "check" }, el("input", { type: "checkbox", class: "pick", "aria-label": "select" })),
        el("td", { class: "when" }, when(d.time)),
        el("td", { class: "id" }, link),
        el("td", { text: d.handler }),
        el("td", { text: d.topic }),
        el("td", { class: "reason" }, reason, d.delivery_limit ? el("span", { class: "badge", text: "delivery limit" }) : null),
        el("td", { class: "num", text: d.attempt }),
        el("td", { class: "num" }, size));
      tr.querySelector("input").addEventListener("change", updateSelection);
      body.append(tr);
    }
    const first = doc.dead_letters.length ? doc.offset + 1 : 0;
    const last = doc.offset + doc.dead_letters.length;
    let summary = doc.matched === 0 ? "No dead letters match." : first + "–" + last + " of " + nf.format(doc.matched) + (doc.truncated ? "+" : "") + " matching";
    summary += " (" + plural(doc.read, "waiting dead letter") + " read" + (doc.truncated ? ", the first " + nf.format(doc.scan_limit) + "; more may wait" : "") + ")";
    $("dl-summary").textContent = summary;
    $("dl-prev").disabled = doc.offset === 0;
    $("dl-next").disabled = !doc.more;
    $("dl-check-all").checked = false;
    updateSelection();
  }

  function selectedRows() {
    return [...document.querySelectorAll("#dl-table tbody tr")].filter((tr) => tr.querySelector("input.pick").checked);
  }

  function updateSelection() {
    const n = selectedRows().length;
    const ro = state.info && state.info.read_only;
    $("replay-selected").disabled = ro || n === 0;
    $("delete-selected").disabled = ro || n === 0;
    $("replay-selected").textContent = "Replay selected" + (n ? " (" + n + ")" : "");
    $("delete-selected").textContent = "Delete selected" + (n ? " (" + n + ")" : "");
    const matching = state.page ? state.page.matched : 0;
    $("replay-matching").disabled = ro || matching === 0;
    $("delete-matching").disabled = ro || matching === 0;
  }

  function lettersOfRows(rows) {
    const byID = new Map();
    for (const d of state.page.dead_letters) if (!byID.has(d.id)) byID.set(d.id, d);
    return rows.map((tr) => byID.get(tr.getAttribute("data-id")));
  }

  // act asks the operator to confirm verb ("replay" or "delete") of letters, then sends their
  // ids, each choosing one dead letter: one that arrived since the list was read is left alone.
  function act(verb, letters, filter, after) {
    const panel = $("confirm");
    const n = letters.length;
    $("confirm-text").textContent = (verb === "replay"
      ? "Replay " + plural(n, "dead letter") + " to the topic each came from? Duplicate detection keeps a message that was applied already from being applied again."
      : "Delete " + plural(n, "dead letter") + " for good? Their messages are gone unless their producers still have them.");
    const list = clear($("confirm-list"));
    for (const d of letters.slice(0, 20)) list.append(el("li", {}, el("code", { text: d.id }), " — " + d.handler + ": " + d.reason.slice(0, 160)));
    if (n > 20) list.append(el("li", { class: "muted", text: "and " + (n - 20) + " more" }));
    $("confirm-yes").textContent = verb === "replay" ? "Replay " + n : "Delete " + n;
    $("confirm-yes").className = verb === "delete" ? "danger" : "";
    panel.hidden = false;
    $("report").hidden = true;
    panel.scrollIntoView({ block: "nearest" });
    $("confirm-no").onclick = () => { panel.hidden = true; };
    $("confirm-yes").onclick = async () => {
      panel.hidden = true;
      const body = { ids: letters.map((d) => d.id), exact: true, filter: filter || {} };
      let rep;
      try {
        rep = await api("api/dead-letters/" + verb, body);
      } catch (e) {
        report(verb, null, e.message);
        return;
      }
      report(verb, rep, rep.error);
      if (after) after();
    };
  }

  function report(verb, rep, error) {
    const r = clear($("report"));
    const past = verb === "replay" ? "Replayed" : "Deleted";
    r.className = "panel report " + (error ? "bad" : "ok");
    if (rep) {
      r.append(el("p", { id: "report-summary" }, el("strong", { text: past + " " + plural(rep.done.length, "dead letter") + "." }),
        rep.failed.length ? " " + rep.failed.length + " failed:" : ""));
      if (rep.failed.length) {
        const ul = el("ul", { id: "report-failed" });
        for (const f of rep.failed) ul.append(el("li", {}, el("code", { text: f.id }), " — " + f.error));
        r.append(ul);
      }
      if (rep.not_found.length) r.append(el("p", { class: "muted", text: "Gone since the list was read: " + rep.not_found.join(", ") }));
      if (rep.done.length && verb === "replay") {
        const ul = el("ul", { class: "small" });
        for (const d of rep.done.slice(0, 20)) ul.append(el("li", {}, el("code", { text: d.id }), " → " + d.to));
        r.append(ul);
      }
    }
    if (error && (!rep || !rep.failed.length)) r.append(el("p", { class: "error", text: error }));
    r.append(el("p", {}, el("button", { onclick: () => { r.hidden = true; }, text: "Dismiss" })));
    r.hidden = false;
    r.scrollIntoView({ block: "nearest" });
  }

  async function matchingLetters() {
    const doc = await api(query(state.filter, 0, state.info.scan_limit));
    return doc.dead_letters;
  }

  // One dead letter.

  async function loadLetter(id) {
    show($("letter-error"), "");
    $("letter-id").textContent = id;
    for (const t of ["letter-fields", "letter-headers"]) clear($(t).tBodies[0]);
    $("letter-payload").textContent = "";
    let d;
    try {
      d = await api("api/dead-letter?id=" + encodeURIComponent(id));
    } catch (e) {
      show($("letter-error"), e.message);
      state.letter = null;
      return;
    }
    state.letter = d;
    state.unfolded = false;
    const fields = $("letter-fields").tBodies[0];
    const row = (name, value) => fields.append(el("tr", {}, el("th", { text: name }), el("td", {}, value)));
    row("Id", el("code", { text: d.id }));
    if (d.original_id) row("Original id", el("code", { text: d.original_id }));
    row("Handler", d.handler);
    row("From topic", d.topic);
    row("Reason", el("span", { id: "letter-reason", text: d.reason }));
    row("Dead-lettered", when(d.time));
    row("Attempt", String(d.attempt));
    row("Deliveries", d.deliveries ? String(d.deliveries) : "unknown");
    row("Replays before", String(d.replays));
    if (d.delivery_limit) row("Delivery limit", "reached");
    if (d.key) row("Key", el("code", { text: d.key }));
    if (d.payload_dropped) row("Payload dropped", d.payload_dropped);
    const headers = $("letter-headers").tBodies[0];
    const names = Object.keys(d.headers).sort();
    if (!names.length) headers.append(el("tr", {}, el("td", { class: "muted", text: "none" })));
    for (const k of names) headers.append(el("tr", {}, el("th", {}, el("code", { text: k })), el("td", {}, el("code", { text: d.headers[k] }))));
    $("letter-size").textContent = bytes(d.payload_size) + ", " + d.payload_format;
    showPayload(d.payload_format === "binary" ? "hex" : d.payload_format);
  }

  const foldLines = 60;
  const foldChars = 6000;

  function showPayload(format) {
    const d = state.letter;
    if (!d) return;
    state.format = format;
    for (const b of document.querySelectorAll(".formats button")) b.classList.toggle("active", b.getAttribute("data-format") === format);
    let text;
    if (format === "json") {
      try {
        text = JSON.stringify(JSON.parse(d.payload_text), null, 2);
      } catch (e) {
        text = "(not JSON: " + e.message + ")";
      }
    } else if (format === "text") {
      text = d.payload_text === undefined || d.payload_text === null ? "(not UTF-8 text: see Hex)" : d.payload_text;
    } else {
      text = hexdump(d.payload_base64);
    }
    const lines = text.split("\n");
    const folded = !state.unfolded && (lines.length > foldLines || text.length > foldChars);
    let shown = text;
    if (folded) shown = lines.slice(0, foldLines).join("\n").slice(0, foldChars) + "\n…";
    $("letter-payload").textContent = shown;
    const more = $("letter-unfold");
    more.hidden = !folded;
    more.textContent = "Show all (" + nf.format(lines.length) + " lines, " + nf.format(text.length) + " characters)";
  }

  function hexdump(b64) {
    const raw = atob(b64);
    const out = [];
    for (let i = 0; i < raw.length; i += 16) {
      const chunk = raw.slice(i, i + 16);
      let hex = "";
      let asc = "";
      for (let j = 0; j < 16; j++) {
        if (j < chunk.length) {
          const c = chunk.charCodeAt(j);
          hex += c.toString(16).padStart(2, "0") + " ";
          asc += c >= 32 && c < 127 ? chunk[j] : ".";
        } else {
          hex += "   ";
        }
        if (j === 7) hex += " ";
      }
      out.push(i.toString(16).padStart(8, "0") + "  " + hex + " |" + asc + "|");
    }
    return out.join("\n");
  }

  // Storage.

  async function loadStorage() {
    let doc;
    try {
      doc = await api("api/storage");
    } catch (e) {
      show($("storage-error"), e.message);
      return;
    }
    show($("storage-error"), doc.errors.join("\n"));
    const cards = clear($("storage-cards"));
    const card = (title, rows) => {
      const t = el("table", { class: "fields" });
      const tb = el("tbody");
      for (const [k, v] of rows) tb.append(el("tr", {}, el("th", { text: k }), el("td", {}, v)));
      t.append(tb);
      return el("div", { class: "card" }, el("h3", { text: title }), t);
    };
    const dd = doc.dedup;
    cards.append(dd
      ? card("Duplicate detection: " + dd.table, [["Rows", num(dd.rows)], ["Expired, waiting for a purge", num(dd.expired)], ["Oldest row", when(dd.oldest)]])
      : card("Duplicate detection", [["Table", "none in this database"]]));
    const p = dd && dd.last_purge;
    cards.append(card("Last purge", p
      ? [["When", when(p.at)], ["Keys deleted", num(p.deleted)], ["Batches", num(p.batches)], ["Took", p.took_ms.toFixed(1) + " ms"]]
      : [["When", dd ? "never, or before purges were recorded" : "–"]]));
    const o = doc.outbox;
    cards.append(o
      ? card("Outbox: " + o.table, [["Relay group", o.group], ["Waiting to be sent", num(o.waiting)], ["Oldest waiting", o.oldest ? when(o.oldest) : "–"], ["Lag", o.lag_seconds.toFixed(1) + " s"]])
      : card("Outbox", [["Table", "none in this database"]]));
  }

  // Wiring.

  function wire() {
    window.addEventListener("hashchange", route);
    $("dl-filter").addEventListener("submit", (e) => {
      e.preventDefault();
      state.filter = readFilter();
      state.offset = 0;
      loadDeadLetters();
    });
    $("dl-filter").addEventListener("reset", () => {
      state.filter = {};
      state.offset = 0;
      setTimeout(loadDeadLetters, 0);
    });
    $("dl-prev").addEventListener("click", () => {
      state.offset = Math.max(0, state.offset - state.limit);
      loadDeadLetters();
    });
    $("dl-next").addEventListener("click", () => {
      state.offset += state.limit;
      loadDeadLetters();
    });
    $("dl-check-all").addEventListener("change", (e) => {
      for (const c of document.querySelectorAll("#dl-table input.pick")) c.checked = e.target.checked;
      updateSelection();
    });
    for (const verb of ["replay", "delete"]) {
      $(verb + "-selected").addEventListener("click", () => act(verb, lettersOfRows(selectedRows()), state.filter, loadDeadLetters));
      $(verb + "-matching").addEventListener("click", async () => {
        try {
          act(verb, await matchingLetters(), state.filter, loadDeadLetters);
        } catch (e) {
          report(verb, null, e.message);
        }
      });
      $("letter-" + verb).addEventListener("click", () => {
        const d = state.letter;
        if (d) act(verb, [d], {}, () => {
          state.keepReport = true; // the report goes with the operator to the list
          location.hash = "dead-letters";
        });
      });
    }
    for (const b of document.querySelectorAll(".formats button")) b.addEventListener("click", () => showPayload(b.getAttribute("data-format")));
    $("letter-unfold").addEventListener("click", () => {
      state.unfolded = true;
      showPayload(state.format);
    });
  }

  document.addEventListener("DOMContentLoaded", async () => {
    wire();
    await loadInfo();
    route();
  });
})();

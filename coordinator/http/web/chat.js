// The web chat of `deltafin-coordinator serve`: streams /v1/chat/completions (SSE over fetch), keeps the
// conversation, and polls /v1/status into the cluster panel. No framework, no build step. Model output is
// only ever set as textContent.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const STORE = "deltafin.chat.";
  const STATUS_EVERY_MS = 5000;
  const SETTINGS = { "api-key": "", effort: "low", temperature: "1", "max-tokens": "" };

  const state = { history: [], controller: null, model: null, statusTimer: null };

  // ---- small helpers ------------------------------------------------------------------------------------

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function headers() {
    const key = $("api-key").value.trim();
    const h = { "Content-Type": "application/json" };
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  function bytes(n) {
    if (n >= 1e9) return (n / 1e9).toFixed(2) + " GB";
    if (n >= 1e6) return (n / 1e6).toFixed(1) + " MB";
    if (n >= 1e3) return (n / 1e3).toFixed(1) + " kB";
    return n + " B";
  }

  function duration(s) {
    if (s < 90) return s.toFixed(0) + " s";
    if (s < 5400) return (s / 60).toFixed(0) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  // The message of an API error body ({"error": {"message": ...}}), or the raw text.
  async function errorText(response) {
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
    } catch (e) { /* not JSON: show it as it came */ }
    return `${response.status} ${response.statusText}${text ? ": " + text.slice(0, 500) : ""}`;
  }

  function nearBottom() {
    const log = $("log");
    return log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  }

  function follow(wasNear) {
    if (wasNear) $("log").scrollTop = $("log").scrollHeight;
  }

  // ---- settings (kept in localStorage) ------------------------------------------------------------------

  function loadSettings() {
    for (const [id, fallback] of Object.entries(SETTINGS)) {
      const kept = localStorage.getItem(STORE + id);
      $(id).value = kept !== null ? kept : fallback;
      if ($(id).value === "" && fallback !== "") $(id).value = fallback; // a kept choice the page no longer has
      $(id).addEventListener("change", () => {
        localStorage.setItem(STORE + id, $(id).value);
        if (id === "api-key") pollStatus();
      });
    }
  }

  // The request's options from the settings; a field left empty or invalid is left to the server.
  function options() {
    const out = { reasoning_effort: $("effort").value };
    const t = parseFloat($("temperature").value);
    if (Number.isFinite(t) && t >= 0) out.temperature = t;
    const n = parseInt($("max-tokens").value, 10);
    if (Number.isInteger(n) && n > 0) out.max_tokens = n;
    return out;
  }

  // ---- SSE over fetch -----------------------------------------------------------------------------------

  // Calls onData(text) for each event's data and onComment(text) for each `: ...` line, until the stream
  // ends or onData returns false ([DONE]).
  async function readSse(body, onData, onComment) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
      const lines = buffer.split("\n");
      buffer = done ? "" : lines.pop();
      for (const raw of lines) {
        const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
        if (line === "") {
          if (data.length && onData(data.join("\n")) === false) { reader.cancel(); return; }
          data = [];
        } else if (line.startsWith(":")) {
          onComment(line.slice(1).trim());
        } else if (line.startsWith("data:")) {
          data.push(line.slice(5).replace(/^ /, ""));
        }
      }
      if (done) {
        if (data.length) onData(data.join("\n"));
        return;
      }
    }
  }

  // ---- the conversation ---------------------------------------------------------------------------------

  function addUser(text) {
    $("empty").hidden = true;
    const li = el("li", "msg user");
    li.append(el("h3", "who", "You"), el("div", "text", text));
    $("log").append(li);
    follow(true);
  }

  // An assistant reply's elements: reasoning (folded), progress of the prefill, content, stats, error.
  function addReply() {
    const li = el("li", "msg assistant");
    li.dataset.state = "waiting";
    const reasoning = el("details", "reasoning");
    reasoning.hidden = true;
    const summary = el("summary", "", "Reasoning");
    const reasoningText = el("div", "text");
    reasoning.append(summary, reasoningText);
    const progress = el("div", "progress");
    const bar = el("progress");
    const said = el("span", "muted", "sending…");
    progress.append(bar, said);
    const content = el("div", "text content");
    const stats = el("p", "stats muted");
    const error = el("p", "error");
    error.setAttribute("role", "alert");
    error.hidden = true;
    li.append(el("h3", "who", "Model"), reasoning, progress, content, stats, error);
    $("log").append(li);
    follow(true);
    return { li, reasoning, summary, reasoningText, progress, bar, said, content, stats, error };
  }

  // A heartbeat comment: "prefill 512/4096 tokens, 1.2 GB of 30.0 GB read, about 40 s left" or "waiting ...".
  function showProgress(view, comment) {
    const m = /prefill (\d+)\/(\d+) tokens/.exec(comment);
    if (m) {
      view.bar.max = Number(m[2]);
      view.bar.value = Number(m[1]);
    } else {
      view.bar.removeAttribute("value");
    }
    view.said.textContent = comment;
  }

  function showStats(view, t) {
    const parts = [];
    if (t.first !== null) parts.push(`first token ${((t.first - t.sent) / 1000).toFixed(2)} s`);
    const tokens = t.usage ? t.usage.completion_tokens : t.chunks;
    const span = (t.end - (t.first !== null ? t.first : t.sent)) / 1000;
    if (tokens > 1 && span > 0) parts.push(`${((tokens - 1) / span).toFixed(1)} tok/s`);
    parts.push(`${tokens} token${tokens === 1 ? "" : "s"}${t.usage ? "" : " (counted)"}`);
    if (t.usage) parts.push(`prompt ${t.usage.prompt_tokens}`);
    if (t.finish === "length") parts.push("cut at max tokens");
    if (t.stopped) parts.push("stopped");
    view.stats.textContent = parts.join(" · ");
  }

  function fail(view, message) {
    view.progress.hidden = true;
    view.error.hidden = false;
    view.error.textContent = message;
    view.li.dataset.state = "error";
  }

  // One chunk of the stream: reasoning and content deltas, usage, or an error event.
  function onChunk(view, t, chunk) {
    if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
    if (chunk.usage) t.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const d = choice.delta || {};
      if (choice.finish_reason) t.finish = choice.finish_reason;
      if (!d.reasoning_content && !d.content) continue;
      const near = nearBottom();
      if (t.first === null) {
        t.first = performance.now();
        view.li.dataset.ttftMs = (t.first - t.sent).toFixed(1);
        view.li.dataset.state = "streaming";
        view.progress.hidden = true;
      }
      t.chunks += 1;
      if (d.reasoning_content) {
        t.reasoning += d.reasoning_content;
        view.reasoning.hidden = false;
        view.reasoningText.textContent = t.reasoning;
      }
      if (d.content) {
        t.content += d.content;
        view.content.textContent = t.content;
      }
      follow(near);
    }
  }

  async function stream(view, t, body) {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    view.said.textContent = "waiting for the first token…";
    await readSse(response.body, (data) => {
      if (data === "[DONE]") return false;
      onChunk(view, t, JSON.parse(data));
      return true;
    }, (comment) => showProgress(view, comment));
    if (t.finish === null) throw new Error("the stream ended before the reply did (did the server stop?)");
  }

  async function send(text) {
    const model = state.model || (await fetchModel());
    const history = state.history; // this conversation's, even if "New chat" replaces it meanwhile
    history.push({ role: "user", content: text });
    addUser(text);
    const view = addReply();
    const t = { sent: performance.now(), first: null, end: 0, chunks: 0, usage: null, finish: null,
                stopped: false, reasoning: "", content: "" };
    const body = { model, messages: history, stream: true, stream_options: { include_usage: true },
                   ...options() };
    busy(true);
    try {
      await stream(view, t, body);
      view.li.dataset.state = "done";
    } catch (e) {
      if (e.name !== "AbortError") {
        history.pop(); // the turn failed: it is not part of the conversation
        fail(view, "The request failed: " + e.message);
        return;
      }
      t.stopped = true;
      view.li.dataset.state = "stopped";
    } finally {
      t.end = performance.now();
      view.progress.hidden = true;
      busy(false);
    }
    const reply = { role: "assistant", content: t.content };
    if (t.reasoning) reply.reasoning_content = t.reasoning;
    history.push(reply);
    showStats(view, t);
    pollStatus();
  }

  async function fetchModel() {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorText(response));
    const models = await response.json();
    state.model = models.data[0].id;
    return state.model;
  }

  function busy(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
    if (!on) state.controller = null;
  }

  // ---- the cluster panel --------------------------------------------------------------------------------

  function row(cells) {
    const tr = el("tr");
    cells.forEach((text, i) => tr.append(el(i === 0 ? "th" : "td", "", text)));
    if (tr.firstChild) tr.firstChild.setAttribute("scope", "row");
    return tr;
  }

  function layers(range) {
    if (!range || range.length !== 2) return "?";
    return range[1] > range[0] ? `${range[0]}–${range[1] - 1}` : "—";
  }

  function renderSummary(s) {
    const c = s.counters;
    const items = [["model", s.model], ["context", s.context_length ? `${s.context_length} tokens` : "?"],
                   ["up", duration(s.uptime_s)], ["requests", String(c.requests)],
                   ["tokens", `${c.generated_tokens} out, ${c.prompt_tokens} in`],
                   ["last tok/s", c.last_tokens_per_second.toFixed(2)],
                   ["running", `${s.queue.running}, ${s.queue.waiting} waiting`]];
    const dl = $("cluster-summary");
    dl.replaceChildren();
    for (const [k, v] of items) {
      const div = el("div");
      div.append(el("dt", "", k), el("dd", "", v));
      dl.append(div);
    }
  }

  function renderPrefills(list) {
    const box = $("prefills");
    box.replaceChildren();
    for (const p of list) {
      const div = el("div", "prefill");
      const bar = el("progress");
      bar.max = 1;
      bar.value = p.fraction;
      const left = p.seconds_left !== null ? `, about ${duration(p.seconds_left)} left` : "";
      div.append(el("span", "", `prefill ${p.tokens_done}/${p.tokens_total} tokens${left}`), bar);
      box.append(div);
    }
  }

  function renderStatus(s) {
    state.model = state.model || s.model;
    $("model-name").textContent = s.model;
    renderSummary(s);
    renderPrefills(s.prefilling);
    const body = $("workers").tBodies[0];
    body.replaceChildren(...s.workers.map((w) => row([
      w.name, layers(w.layers), w.experts || "own layers",
      w.hit_rate === null ? "resident" : (w.hit_rate * 100).toFixed(1) + "%",
      bytes(w.expert_bytes_read + w.spine_bytes_streamed),
    ])));
    const err = $("cluster-error");
    err.hidden = !s.workers_error;
    err.textContent = s.workers_error ? "Workers did not answer: " + s.workers_error : "";
    $("cluster-updated").textContent = "updated " + new Date().toLocaleTimeString();
  }

  async function pollStatus() {
    clearTimeout(state.statusTimer);
    state.statusTimer = setTimeout(pollStatus, STATUS_EVERY_MS);
    if (document.hidden) return;
    try {
      const response = await fetch("/v1/status", { headers: headers() });
      if (!response.ok) throw new Error(await errorText(response));
      renderStatus(await response.json());
    } catch (e) {
      const err = $("cluster-error");
      err.hidden = false;
      err.textContent = "Status unavailable: " + e.message;
    }
  }

  // ---- wiring -------------------------------------------------------------------------------------------

  function submit(event) {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    for (const old of $("log").querySelectorAll(".notice")) old.remove(); // said; this is another try
    state.controller = new AbortController();
    send(text).catch((e) => { // before the request (finding the model's name): show it, keep the text
      busy(false);
      $("prompt").value = text;
      const li = el("li", "msg notice");
      const p = el("p", "error", "Could not send: " + e.message);
      p.setAttribute("role", "alert");
      li.append(p);
      $("log").append(li);
    });
  }

  function newChat() {
    if (state.controller) state.controller.abort();
    state.history = [];
    $("log").replaceChildren();
    $("empty").hidden = false;
    $("prompt").focus();
  }

  function start() {
    loadSettings();
    $("composer").addEventListener("submit", submit);
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => state.controller && state.controller.abort());
    $("new-chat").addEventListener("click", newChat);
    document.addEventListener("visibilitychange", () => { if (!document.hidden) pollStatus(); });
    pollStatus();
    $("prompt").focus();
  }

  start();
})();

// What the chat and the dashboard share: the API key, fetch with auth, an SSE reader,
// the model list and the two tabs. Plain scripts (no modules, no build step): each file
// adds to the global `mlx` object. Paths are relative to the page ("v1/models"), so it also
// works behind a proxy that serves the server under a path prefix.
"use strict";

const mlx = {};

(() => {
  const KEY = "mlxserve.apiKey";
  const $ = (id) => document.getElementById(id);
  mlx.$ = $;

  // ---- API key ----
  // The server checks a Bearer key on /v1/* when it runs with --api-key. The page keeps
  // the key in localStorage so a reload does not ask again; "Forget key" removes it.
  mlx.key = () => localStorage.getItem(KEY) || "";
  let asking = null; // one dialog for every request that got a 401 at the same time

  mlx.askKey = (message) => {
    if (asking) return asking;
    const dialog = $("key-dialog");
    $("key-error").textContent = message || "";
    $("key-input").value = mlx.key();
    asking = new Promise((resolve) => {
      const done = (ok) => {
        dialog.close();
        asking = null;
        resolve(ok);
      };
      $("key-ok").onclick = (e) => {
        e.preventDefault();
        localStorage.setItem(KEY, $("key-input").value.trim());
        window.dispatchEvent(new Event("mlx-key")); // streams that gave up on a 401 start again
        done(true);
      };
      $("key-cancel").onclick = () => done(false);
      $("key-clear").onclick = () => {
        localStorage.removeItem(KEY);
        done(true);
      };
      dialog.oncancel = () => done(false); // Escape
    });
    dialog.showModal();
    $("key-input").focus();
    return asking;
  };

  // fetch() with the key; on a 401 asks for a key and tries again until it works or the
  // user cancels (then the 401 response is returned to the caller).
  mlx.api = async (path, init = {}) => {
    for (;;) {
      const headers = new Headers(init.headers || {});
      if (mlx.key()) headers.set("Authorization", "Bearer " + mlx.key());
      const res = await fetch(path, { ...init, headers });
      if (res.status !== 401) return res;
      const message = mlx.key() ? "The server refused this key." : "";
      if (!(await mlx.askKey(message))) return res;
    }
  };

  // The message of an error response in the OpenAI shape, else its status line.
  mlx.errorText = async (res) => {
    try {
      const body = await res.json();
      if (body.error && body.error.message) return `${res.status}: ${body.error.message}`;
    } catch (e) { /* not JSON */ }
    return `${res.status} ${res.statusText}`;
  };

  // ---- server-sent events over fetch ----
  // EventSource cannot send an Authorization header, so streams are read with fetch and
  // a ReadableStream. Yields {event, data} per event; data lines are joined with "\n".
  mlx.sse = async function* (res) {
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, end);
        buf = buf.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          else if (line.startsWith("event:")) event = line.slice(6).trim();
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  };

  // ---- models ----
  // /v1/models lists what the server serves; a server with several models may add a
  // `state` to each (loaded, loading…), shown beside the picker and on the dashboard.
  mlx.models = [];
  const listeners = [];
  mlx.onModels = (fn) => listeners.push(fn);
  mlx.selectedModel = () => $("model").value || undefined;

  mlx.loadModels = async () => {
    let res;
    try {
      res = await mlx.api("v1/models");
    } catch (e) {
      return; // the server is down; the next poll tries again
    }
    if (!res.ok) return;
    mlx.models = (await res.json()).data || [];
    const select = $("model");
    const chosen = select.value;
    select.replaceChildren(...mlx.models.map((m) => new Option(m.id, m.id)));
    if (mlx.models.some((m) => m.id === chosen)) select.value = chosen;
    showState();
    listeners.forEach((fn) => fn(mlx.models));
  };

  function showState() {
    const m = mlx.models.find((x) => x.id === $("model").value);
    $("model-state").textContent = m && m.state ? m.state : "";
    $("model-state").dataset.state = (m && m.state) || "";
  }

  // ---- tabs ----
  const views = ["chat", "dashboard"];
  const tabListeners = [];
  mlx.onTab = (fn) => tabListeners.push(fn);

  function route() {
    const name = views.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat";
    for (const v of views) {
      $(v).hidden = v !== name;
      $("tab-" + v).classList.toggle("active", v === name);
    }
    tabListeners.forEach((fn) => fn(name));
  }

  // ---- formatting ----
  mlx.bytes = (n) => {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  };
  mlx.pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
  mlx.num = (x, digits = 0) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));

  document.addEventListener("DOMContentLoaded", () => {
    $("model").addEventListener("change", showState);
    $("key-button").addEventListener("click", async () => {
      if (await mlx.askKey("")) mlx.loadModels();
    });
    window.addEventListener("hashchange", route);
    route();
    mlx.loadModels();
    setInterval(mlx.loadModels, 10000); // states change while a model loads
  });
})();

// The chat: streamed answers from /v1/chat/completions, images by drop, paste or file
// picker (sent as data-URL image_url parts), reasoning in a collapsible block.
"use strict";

(() => {
  const $ = mlx.$;
  const history = []; // the conversation as the API takes it
  let attachments = []; // {name, url} of images waiting for the next message
  let controller = null; // aborts the answer being streamed

  // ---- images ----
  function addFiles(fileList) {
    const images = [...fileList].filter((f) => f.type.startsWith("image/"));
    for (const file of images) {
      const reader = new FileReader();
      reader.onload = () => {
        attachments.push({ name: file.name, url: reader.result });
        renderThumbs();
      };
      reader.readAsDataURL(file);
    }
    return images.length;
  }

  function renderThumbs() {
    $("thumbs").replaceChildren(...attachments.map((a, i) => {
      const box = document.createElement("span");
      box.className = "thumb";
      const img = new Image();
      img.src = a.url;
      img.alt = img.title = a.name;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.textContent = "×";
      remove.title = "Remove";
      remove.onclick = () => { attachments.splice(i, 1); renderThumbs(); };
      box.append(img, remove);
      return box;
    }));
  }

  // ---- messages ----
  function bubble(role) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    $("messages").append(div);
    return div;
  }

  function scroll() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function showUser(text, images) {
    const div = bubble("user");
    for (const a of images) {
      const img = new Image();
      img.src = a.url;
      img.alt = a.name;
      img.className = "sent-image";
      div.append(img);
    }
    const p = document.createElement("div");
    p.className = "content";
    p.textContent = text;
    div.append(p);
  }

  // An answer's parts: a collapsed "Reasoning" block (shown once reasoning arrives), the
  // text, and a line of usage. Text goes in as text nodes: the model's output is never HTML.
  function answerBubble() {
    const div = bubble("assistant");
    div.innerHTML = '<details class="reasoning" hidden><summary>Reasoning</summary>' +
      '<div class="reasoning-text"></div></details><div class="content"></div><div class="meta"></div>';
    return {
      div,
      reasoning: div.querySelector(".reasoning"),
      reasoningText: div.querySelector(".reasoning-text"),
      content: div.querySelector(".content"),
      meta: div.querySelector(".meta"),
    };
  }

  function showError(target, text) {
    const p = document.createElement("div");
    p.className = "error";
    p.textContent = text;
    target.append(p);
  }

  function busy(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
  }

  // ---- sending ----
  async function send() {
    const text = $("prompt").value.trim();
    if (controller || (!text && !attachments.length)) return;
    const images = attachments;
    const content = images.length
      ? [...images.map((a) => ({ type: "image_url", image_url: { url: a.url } })),
         ...(text ? [{ type: "text", text }] : [])]
      : text;
    showUser(text, images);
    history.push({ role: "user", content });
    attachments = [];
    renderThumbs();
    $("prompt").value = "";

    const out = answerBubble();
    const body = { messages: history, stream: true, stream_options: { include_usage: true } };
    const model = mlx.selectedModel();
    if (model) body.model = model;
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const temperature = parseFloat($("temperature").value);
    if (!Number.isNaN(temperature)) body.temperature = temperature;

    controller = new AbortController();
    busy(true);
    out.div.classList.add("streaming");
    let answer = "", reasoning = "", finish = null, usage = null, first = null, tokens = 0;
    const started = performance.now();
    try {
      const res = await mlx.api("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!res.ok) {
        showError(out.div, await mlx.errorText(res));
        history.pop(); // the server did not take it: the next message must not carry it
        return;
      }
      for await (const ev of mlx.sse(res)) {
        if (ev.data === "[DONE]") break;
        const chunk = JSON.parse(ev.data);
        if (chunk.error) { showError(out.div, chunk.error.message); continue; }
        if (chunk.usage) usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        const think = delta.reasoning_content || "";
        if (think) {
          reasoning += think;
          out.reasoning.hidden = false;
          if (!answer) out.reasoning.open = true; // open while the model thinks...
          out.reasoningText.append(think);
        }
        if (delta.content) {
          if (!answer) out.reasoning.open = false; // ...and folded once it answers
          answer += delta.content;
          out.content.append(delta.content);
        }
        if (think || delta.content) {
          tokens++;
          if (first === null) first = performance.now();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
        scroll();
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else showError(out.div, String(e));
    } finally {
      controller = null;
      busy(false);
      out.div.classList.remove("streaming");
      if (answer || reasoning) history.push({ role: "assistant", content: answer });
      showMeta(out, usage, finish, first, started, tokens);
      scroll();
    }
  }

  // The usage line; its numbers are also data attributes, for scripts and tests.
  function showMeta(out, usage, finish, first, started, chunks) {
    const parts = [];
    if (usage) {
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push(`${usage.prompt_tokens} prompt tokens (${cached} cached)`,
                 `${usage.completion_tokens} generated`);
      out.div.dataset.promptTokens = usage.prompt_tokens;
      out.div.dataset.cachedTokens = cached;
      out.div.dataset.completionTokens = usage.completion_tokens;
    }
    if (first !== null) {
      const now = performance.now();
      parts.push(`first token ${((first - started) / 1000).toFixed(2)} s`);
      const n = usage ? usage.completion_tokens : chunks;
      if (now > first && n > 1) parts.push(`${((n - 1) / ((now - first) / 1000)).toFixed(1)} tok/s`);
    }
    if (finish) parts.push(finish);
    out.div.dataset.finish = finish || "";
    out.meta.textContent = parts.join(" · ");
  }

  document.addEventListener("DOMContentLoaded", () => {
    const prompt = $("prompt");
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    });
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      if (controller) controller.abort();
      history.length = 0;
      $("messages").replaceChildren();
    });
    $("file").addEventListener("change", (e) => { addFiles(e.target.files); e.target.value = ""; });
    prompt.addEventListener("paste", (e) => {
      if (e.clipboardData && addFiles(e.clipboardData.files)) e.preventDefault();
    });
    // Drop anywhere on the chat; the composer lights up while something is dragged over.
    const zone = $("chat");
    zone.addEventListener("dragover", (e) => {
      e.preventDefault();
      $("composer").classList.add("dragging");
    });
    zone.addEventListener("dragleave", () => $("composer").classList.remove("dragging"));
    zone.addEventListener("drop", (e) => {
      e.preventDefault();
      $("composer").classList.remove("dragging");
      if (e.dataTransfer) addFiles(e.dataTransfer.files);
    });
  });
})();

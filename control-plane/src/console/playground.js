// Tessera console: the playground. Each turn posts the conversation (with the page's
// anti-forgery token) to the console, which runs it through the API with the chosen
// key and streams the API's own server-sent events back. Reasoning and answer are shown
// apart; when the stream ends, the turn's usage and billed cost are read from its usage
// record.
"use strict";

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text) el.textContent = text;
  return el;
}

function setup(form) {
  const conversation = document.getElementById("pg-conversation");
  const input = document.getElementById("pg-message");
  const send = document.getElementById("pg-send");
  const status = document.getElementById("pg-status");
  let messages = [];

  document.getElementById("pg-clear").addEventListener("click", () => {
    messages = [];
    conversation.textContent = "";
    status.textContent = "";
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (!text) return;
    messages.push({ role: "user", content: text });
    conversation.append(element("div", "turn user", text));
    input.value = "";
    const turn = element("div", "turn assistant");
    const thinking = element("details", "reasoning");
    thinking.append(element("summary", "", "Reasoning"));
    const reasoning = element("div", "reasoning-text");
    thinking.append(reasoning);
    const answer = element("div", "answer");
    const usage = element("span", "usage");
    turn.append(answer, usage);
    conversation.append(turn);
    send.disabled = true;
    status.textContent = "Streaming…";

    const body = new URLSearchParams(new FormData(form));
    body.set("messages", JSON.stringify(messages));
    let requestId = null;
    let finish = null;
    let answered = false;
    try {
      const response = await fetch(form.dataset.chat, { method: "POST", body, credentials: "same-origin" });
      requestId = response.headers.get("x-request-id");
      const kind = response.headers.get("content-type") || "";
      if (!response.ok || !response.body || !kind.startsWith("text/event-stream")) {
        const error = kind.startsWith("application/json") ? await response.json().catch(() => null) : null;
        throw new Error(
          (error && error.error && error.error.message) ||
            (response.status === 413
              ? "The conversation is too long for the playground: start a new one."
              : response.ok
                ? "Your session has ended: reload the page and sign in again."
                : "The request failed (" + response.status + ").")
        );
      }
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message);
            for (const choice of chunk.choices || []) {
              const delta = choice.delta || {};
              if (delta.reasoning) {
                if (!thinking.isConnected) turn.prepend(thinking);
                reasoning.textContent += delta.reasoning;
              }
              if (delta.content) answer.textContent += delta.content;
              if (choice.finish_reason) finish = choice.finish_reason;
            }
          }
        }
      }
      messages.push({ role: "assistant", content: answer.textContent });
      answered = true;
      turn.dataset.finish = finish || "";
      const cost = await fetch(form.dataset.requests + encodeURIComponent(requestId), { credentials: "same-origin" });
      if (cost.ok) {
        const u = await cost.json();
        usage.textContent =
          u.prompt_tokens + " input (" + u.cached_tokens + " cached) · " + u.completion_tokens + " output (" +
          u.reasoning_tokens + " reasoning) · " + u.cost + " from " + (u.funding === "subscription" ? "your plan" : "credits") +
          " · " + (finish || "") + " · " + requestId;
        turn.dataset.cost = u.cost;
      }
      status.textContent = "";
    } catch (e) {
      turn.classList.add("failed");
      if (answered) {
        usage.textContent = e.message;
      } else {
        answer.textContent = e.message;
        messages.pop();
      }
      status.textContent = "";
    } finally {
      send.disabled = false;
      turn.dataset.done = "1";
    }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("playground");
  if (form) setup(form);
});

// The chat page: streams an answer with each token marked by who proposed it (the request's
// "show_speculation" field), and summarises the server's /metrics beside it.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // {role, content} of the finished turns
let running = null;  // the AbortController of the answer being streamed

function headers() {
  const key = $("api-key").value.trim();
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error.message;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  $("chat").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function addSpans(div, spans) {
  for (const span of spans) {
    const el = document.createElement("span");
    el.className = span.drafter ? "tok drafted" : "tok";
    if (span.drafter) {
      el.dataset.drafter = span.drafter;
      el.title = `drafted by ${span.drafter}, accepted`;
    }
    el.textContent = span.text;
    div.append(el);
  }
  div.scrollIntoView({ block: "end" });
}

class Figures {
  constructor() {
    this.start = performance.now();
    this.tokens = 0;
    this.accepted = 0;
    this.steps = 0;
  }
  add(speculation) {
    this.tokens += speculation.drafted.length;
    this.accepted += speculation.accepted;
    this.steps += speculation.drafted.length > 0;
    const seconds = (performance.now() - this.start) / 1000;
    $("tokens-per-second").textContent = (this.tokens / seconds).toFixed(1);
    $("accepted-per-step").textContent = (this.accepted / Math.max(this.steps, 1)).toFixed(2);
    $("accepted-share").textContent = `${this.accepted} of ${this.tokens}`;
  }
}

function* events(text) {
  for (const line of text.split("\n")) {
    if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
  }
}

async function stream(response, div) {
  const figures = new Figures();
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  let answer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += value;
    const end = buffered.lastIndexOf("\n\n");
    if (end < 0) continue;
    for (const chunk of events(buffered.slice(0, end))) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (!chunk.choices.length) continue;
      answer += chunk.choices[0].delta.content || "";
      if (chunk.speculation) {
        addSpans(div, chunk.speculation.spans);
        figures.add(chunk.speculation);
      }
    }
    buffered = buffered.slice(end + 2);
  }
  return answer;
}

async function send() {
  const text = $("message").value;
  if (!text.trim() || running) return;
  showError("");
  $("message").value = "";
  addMessage("user", text);
  const turn = [...conversation, { role: "user", content: text }];
  const body = {
    messages: turn,
    stream: true,
    show_speculation: true,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  if (!$("speculate").checked) body.speculative_method = "none";
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const div = addMessage("assistant", "");
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: running.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    const answer = await stream(response, div);
    conversation.push(turn.at(-1), { role: "assistant", content: answer });
  } catch (error) {
    if (error.name !== "AbortError") showError(error.message);
    if (!div.textContent) div.remove();
  } finally {
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function metric(text, name) {
  const line = text.split("\n").find((l) => l.startsWith(name + " ") || l.startsWith(name + "{"));
  return line ? Number(line.split(" ").at(-1)) : NaN;
}

async function pollMetrics() {
  if (document.body.dataset.keyRequired === "true" && !$("api-key").value.trim()) return;
  try {
    const response = await fetch("/metrics", { headers: headers() });
    if (!response.ok) return;
    const text = await response.text();
    $("running").textContent = metric(text, "tandem_requests_running");
    $("waiting").textContent = metric(text, "tandem_requests_waiting");
    const used = metric(text, "tandem_kv_pages_used");
    $("pages").textContent = `${used} of ${metric(text, "tandem_kv_pages_total")}`;
  } catch {
    // the server is away: the figures keep their last values
  }
}

$("compose").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => running && running.abort());
$("api-key").addEventListener("change", pollMetrics);
pollMetrics();
setInterval(pollMetrics, 1000);

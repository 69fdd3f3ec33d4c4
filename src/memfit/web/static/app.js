// memfit serve: the page. It draws the form from /api/form (the settings schema), keeps its state in the
// URL's fragment (a link restores the page), asks /api/estimate on every change and draws the answer.
// Every number comes from the server (the library's estimate); this file only formats and draws.
"use strict";

const GiB = 2 ** 30, GB = 1e9;
const CATEGORIES = ["weights", "gradients", "optimizer", "activations", "logits", "temporary", "other"];
const $ = (id) => document.getElementById(id);
const state = { kind: "preset", preset: "tiny", hub: "", file: null, format: "", typed: {}, baseline: {},
                budget: "24GiB", batch: "", emit: "" };
let controls = [], planControls = [], inflight = null, redraws = 0;
window.memfitTimings = [];  // ms from a settings change to the redrawn page (read by the browser tests)

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}
const gib = (b) => (b / GiB).toFixed(2) + " GiB";
const plain = (v) => Array.isArray(v) ? v.join(",") : (v === null || v === undefined ? "" : String(v));

// ---- the form, from the schema -------------------------------------------------------------------------
function controlNode(c, prefix) {
  let input;
  if (c.kind === "bool") {
    input = el("input", { type: "checkbox", id: prefix + c.key, name: c.key });
  } else if (c.kind === "choice") {
    input = el("select", { id: prefix + c.key, name: c.key });
    for (const choice of c.choices) input.append(el("option", { value: choice, text: choice }));
  } else {
    const attrs = { id: prefix + c.key, name: c.key, type: c.kind === "text" ? "text" : "number" };
    if (c.kind === "float") attrs.step = "any";
    if (c.min !== null && c.min !== undefined) attrs.min = c.min;
    input = el("input", attrs);
  }
  const box = el("div", { class: "control", "data-key": c.key },
                 el("label", { for: prefix + c.key }, c.flag, input));
  if (c.help) box.append(el("span", { class: "help", text: c.help }));
  box.append(el("div", { class: "err", id: "err-" + c.key, role: "alert" }));
  return box;
}

function buildForm(data) {
  controls = data.controls; planControls = data.plan;
  const titles = { shape: "Shape of a step", precision: "Precision, memory", method: "Method, LoRA, QLoRA",
                   more: "Techniques" };
  for (const section of Object.keys(titles)) {
    const box = el("fieldset", {}, el("legend", { text: titles[section] }));
    for (const c of controls.filter((c) => c.section === section)) box.append(controlNode(c, "s-"));
    $("controls").append(box);
  }
  for (const c of planControls) $("plan-controls").append(controlNode(c, "p-"));
  for (const name of data.presets) $("preset").append(el("option", { value: name, text: name }));
  for (const tool of data.tools) {
    $("tool-format").append(el("option", { value: tool, text: tool }));
    $("emit").append(el("option", { value: tool, text: tool }));
  }
  $("version").textContent = "memfit " + data.version;
}

function baselineOf(c) { return c.key in state.baseline ? state.baseline[c.key] : c.default; }

function fillForm() {
  document.querySelector(`input[name=kind][value=${state.kind}]`).checked = true;
  for (const div of document.querySelectorAll("[data-kind]")) div.hidden = div.dataset.kind !== state.kind;
  $("preset").value = state.preset; $("hub").value = state.hub; $("tool-format").value = state.format;
  if (state.kind === "tool" && state.file) $("tool-text").value = state.file.text;
  for (const c of controls) {
    const input = $("s-" + c.key), value = c.key in state.typed ? state.typed[c.key] : baselineOf(c);
    if (c.kind === "bool") input.checked = value === true || value === "true"; else input.value = plain(value);
    input.closest(".control").classList.toggle("changed", c.key in state.typed);
  }
  for (const c of planControls) $("p-" + c.key).value = c.key === "budget" ? state.budget : (state.batch || plain(c.default));
  $("emit").value = state.emit;
}

function readForm(changed) {
  // a setting is typed when it differs from the baseline (the schema's default, or the file's value)
  const c = controls.find((c) => c.key === changed);
  if (!c) return;
  const input = $("s-" + c.key);
  const value = c.kind === "bool" ? input.checked : input.value;
  const base = baselineOf(c);
  const same = c.kind === "bool" ? value === (base === true) : value === plain(base);
  if (same) delete state.typed[c.key]; else state.typed[c.key] = value;
  input.closest(".control").classList.toggle("changed", !same);
}

// ---- the URL holds the page's state ------------------------------------------------------------------
function b64(text) { return btoa(String.fromCharCode(...new TextEncoder().encode(text))); }
function unb64(text) { return new TextDecoder().decode(Uint8Array.from(atob(text), (ch) => ch.charCodeAt(0))); }

function writeUrl() {
  const p = new URLSearchParams();
  p.set("kind", state.kind);
  if (state.kind === "preset") p.set("preset", state.preset);
  if (state.kind === "hub") p.set("hub", state.hub);
  if ((state.kind === "config" || state.kind === "tool") && state.file) {
    p.set("file", b64(state.file.text)); p.set("name", state.file.name);
  }
  if (state.kind === "tool" && state.format) p.set("format", state.format);
  for (const [k, v] of Object.entries(state.typed)) p.set("s." + k, String(v));
  p.set("budget", state.budget);
  if (state.batch) p.set("batch", state.batch);
  if (state.emit) p.set("emit", state.emit);
  history.replaceState(null, "", "#" + p.toString());
}

function readUrl() {
  const p = new URLSearchParams(location.hash.slice(1));
  if (!p.has("kind")) return;
  state.kind = p.get("kind");
  state.preset = p.get("preset") || state.preset; state.hub = p.get("hub") || "";
  if (p.has("file")) state.file = { text: unb64(p.get("file")), name: p.get("name") || "config.yaml" };
  state.format = p.get("format") || ""; state.budget = p.get("budget") || state.budget;
  state.batch = p.get("batch") || ""; state.emit = p.get("emit") || "";
  for (const [k, v] of p) if (k.startsWith("s.")) state.typed[k.slice(2)] = v === "true" ? true : v === "false" ? false : v;
}

// ---- asking the server -------------------------------------------------------------------------------
function modelRequest() {
  const value = { preset: state.preset, hub: state.hub }[state.kind] ?? (state.file ? state.file.text : "");
  return { kind: state.kind, value, filename: state.file ? state.file.name : "", format: state.format || null };
}

async function post(path, body, signal) {
  const response = await fetch(path, { method: "POST", body: JSON.stringify(body), signal,
                                       headers: { "content-type": "application/json" } });
  return { ok: response.ok, data: await response.json() };
}

function showError(sentence, field, fallback) {
  const slot = $("err-" + field) || $("err-" + fallback);
  slot.textContent = sentence;
  const input = $("s-" + field) || $("p-" + field);
  if (input) input.classList.add("invalid");
}
function clearErrors(ids) {
  for (const id of ids) $("err-" + id).textContent = "";
  for (const node of document.querySelectorAll(".invalid")) node.classList.remove("invalid");
}

async function refresh(started = performance.now()) {
  writeUrl();
  if (inflight) inflight.abort();
  inflight = new AbortController();
  let answer;
  try {
    answer = await post("/api/estimate", { model: modelRequest(), settings: state.typed }, inflight.signal);
  } catch (err) {
    if (err.name === "AbortError") return;  // a newer change asked again
    throw err;
  }
  clearErrors(["model", ...controls.map((c) => c.key)]);
  if (!answer.ok) {
    showError(answer.data.error, answer.data.field, "model");
    document.body.dataset.state = "error";
  } else {
    drawEstimate(answer.data);
    document.body.dataset.state = "ok";
  }
  document.body.dataset.redraws = String(++redraws);
  window.memfitTimings.push(performance.now() - started);
}

// ---- drawing the answer ------------------------------------------------------------------------------
function stacked(breakdown, scale) {
  const bar = el("div", { class: "bar" });
  for (const c of CATEGORIES) {
    if (!breakdown[c]) continue;
    bar.append(el("span", { style: `width:${(100 * breakdown[c] / scale).toFixed(3)}%;background:var(--${c})`,
                            title: `${c}: ${gib(breakdown[c])}` }));
  }
  return bar;
}

function drawBars(d) {
  // one stacked bar per phase: the step's peak phase by category; the others as what the phase's tensors peak at
  // (phase_peaks) over what every phase holds besides them (other: CUDA context, workspace, reserve)
  const box = $("bars"); box.replaceChildren();
  const phases = Object.keys(d.phase_peaks || {}).length ? Object.entries(d.phase_peaks) : [[d.phase, d.peak_bytes]];
  const beside = d.peak_bytes - (d.phase_peaks?.[d.phase] ?? d.peak_bytes);
  for (const [phase, bytes] of phases) {
    const total = phase === d.phase ? d.peak_bytes : bytes + beside;
    const bar = phase === d.phase ? stacked(d.breakdown, d.peak_bytes) : el("div", { class: "bar" },
      el("span", { style: `width:${(100 * beside / d.peak_bytes).toFixed(3)}%;background:var(--other)`, title: "other" }),
      el("span", { class: "total", style: `width:${(100 * bytes / d.peak_bytes).toFixed(3)}%`,
                   title: `tensors at the ${phase} peak: ${gib(bytes)}` }));
    box.append(el("div", { class: "bar-row", "data-phase": phase },
                  el("span", { text: phase === d.phase ? `${phase} (peak)` : phase }), bar, el("span", { text: gib(total) })));
  }
  const legend = el("div", { class: "legend" });
  for (const c of CATEGORIES) legend.append(el("span", {}, el("i", { style: `background:var(--${c})` }), c));
  legend.append(el("span", {}, el("i", { style: "background:#9aa7b8" }), "tensors (composition known at the peak only)"));
  box.append(legend);
}

function breakdownTable(table, d) {
  table.replaceChildren(el("tr", {}, ...["category", "bytes", "GiB (2^30 B)", "GB (10^9 B)", "share"]
    .map((h) => el("th", { text: h }))));
  const row = (name, bytes, cls) => el("tr", { class: cls || "" }, el("td", { text: name }),
    el("td", { "data-bytes": String(bytes), "data-category": name, text: bytes.toLocaleString("en-US") }),
    el("td", { text: (bytes / GiB).toFixed(2) }), el("td", { text: (bytes / GB).toFixed(2) }),
    el("td", { text: d.peak_bytes ? Math.round(100 * bytes / d.peak_bytes) + "%" : "" }));
  for (const c of CATEGORIES) table.append(row(c, d.breakdown[c]));
  table.append(row(`peak (${d.phase})`, d.peak_bytes, "peak"));
}

function drawEstimate(d) {
  const params = d.params.toLocaleString("en-US"), trainable = d.trainable_params.toLocaleString("en-US");
  $("summary").replaceChildren(el("span", { class: "peak", id: "peak", "data-bytes": String(d.peak_bytes),
                                            text: gib(d.peak_bytes) }),
    ` per GPU at the ${d.phase} peak (${(d.peak_bytes / GB).toFixed(2)} GB) · ${d.model}: ${params} params, ` +
    `${trainable} trainable · ${d.method}`);
  drawBars(d);
  breakdownTable($("table"), d);
  $("notes").replaceChildren(...d.notes.map((n) => el("li", { text: n })));
  $("gpus").replaceChildren(...d.page.gpus.map((g) => el("span", { class: g.fits ? "fits" : "nofit",
    "data-gpu": g.name, title: g.fits ? "fits, with the planner's 5% margin" : "does not fit",
    text: `${g.name} ${(g.memory_bytes / GiB).toFixed(0)} GiB` })));
  $("cli-estimate").textContent = d.page.cli;
  drawReading(d.page.reading);
  if (d.page.baseline && JSON.stringify(d.page.baseline) !== JSON.stringify(state.baseline)) {
    state.baseline = d.page.baseline;  // a trainer's file: its values are the form's starting point
    fillForm();
  }
}

function drawReading(reading) {
  const box = $("reading"); box.replaceChildren();
  if (!reading) return;
  box.append(el("div", { text: `Read ${reading.file} (${reading.format}; model: ${reading.model}).` }));
  for (const [title, lines] of [["Priced as the tool runs it:", reading.priced], ["Not mapped:", reading.unmapped]]) {
    if (lines.length) box.append(el("div", { text: title }), el("ul", {}, ...lines.map((l) => el("li", { text: l }))));
  }
}

// ---- exact trace and plan -------------------------------------------------------------------------------
async function runExact() {
  clearErrors(["exact"]);
  $("exact-result").replaceChildren();
  const start = await post("/api/exact", { model: modelRequest(), settings: state.typed });
  if (!start.ok) return showError(start.data.error, start.data.field, "exact");
  $("exact-progress").hidden = false; $("exact-run").disabled = true;
  for (;;) {
    await new Promise((resolve) => setTimeout(resolve, 400));
    const status = await (await fetch("/api/exact/" + start.data.job)).json();
    if (status.state === "queued" || status.state === "running") {
      $("exact-elapsed").textContent = `${status.state}, ${status.elapsed_s.toFixed(1)} s`;
      continue;
    }
    $("exact-progress").hidden = true; $("exact-run").disabled = false;
    if (status.state === "error") return showError(status.error, status.field, "exact");
    const d = status.result, table = el("table", { id: "exact-table" });
    breakdownTable(table, d);
    $("exact-result").replaceChildren(el("div", { text: `exact: ${gib(d.peak_bytes)} at the ${d.phase} peak` }), table,
      el("img", { alt: "memory timeline of one traced step", src: "data:image/png;base64," + d.page.timeline_png }),
      el("code", { text: d.page.cli }));
    return;
  }
}

async function runPlan() {
  clearErrors(["plan", "budget", "batch"]);
  $("plan-result").replaceChildren(el("span", { text: "planning..." }));
  const answer = await post("/api/plan", { model: modelRequest(), settings: state.typed, budget: state.budget,
                                           batch: state.batch || null, emit: state.emit || null });
  $("plan-result").replaceChildren();
  if (!answer.ok) return showError(answer.data.error, answer.data.field, "plan");
  const d = answer.data, best = d.plans[d.chosen];
  const lines = [el("div", { id: "plan-summary", text: `${d.fitting} of ${d.candidates} candidates fit ` +
    `${gib(d.budget_bytes)}; chosen: peak ${gib(best.peak_bytes)} (${best.phase}), ~` +
    `${Math.round(best.tokens_per_s).toLocaleString("en-US")} tokens/s on ${d.gpu}.` })];
  if (d.launch) {
    lines.push(el("div", { class: "cli" }, el("code", { id: "launch", text: d.launch }),
                  el("button", { type: "button", class: "copy", "data-copy": "launch" }, "Copy")));
  }
  if (d.emit) {
    const blob = URL.createObjectURL(new Blob([d.emit.text], { type: "text/yaml" }));
    lines.push(el("div", { class: "row" }, `${d.emit.tool} config:`,
      el("button", { type: "button", class: "copy", "data-copy": "emitted" }, "Copy"),
      el("a", { href: blob, download: d.emit.filename, id: "download" }, "Download " + d.emit.filename)),
      el("pre", { id: "emitted", text: d.emit.text }));
  }
  lines.push(el("code", { id: "cli-plan", text: d.page.cli }));
  $("plan-result").replaceChildren(...lines);
}

async function copy(button) {
  const text = $(button.dataset.copy).textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch {  // no clipboard permission (http on another host): select the text for Ctrl-C
    getSelection().selectAllChildren($(button.dataset.copy));
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// ---- events ------------------------------------------------------------------------------------------
function readFile(input, kind) {
  const file = input.files[0];
  if (!file) return;
  file.text().then((text) => {
    state.file = { text, name: file.name }; state.baseline = {}; state.kind = kind;
    if (kind === "tool") $("tool-text").value = text;
    refresh();
  });
}

function wire() {
  $("controls").addEventListener("input", (event) => {
    const started = performance.now();
    readForm(event.target.name);
    refresh(started);
  });
  $("kinds").addEventListener("change", (event) => {
    state.kind = event.target.value; state.baseline = {}; state.file = null;
    fillForm(); refresh();
  });
  $("preset").addEventListener("change", () => { state.preset = $("preset").value; refresh(); });
  $("hub").addEventListener("change", () => { state.hub = $("hub").value.trim(); refresh(); });
  $("config-file").addEventListener("change", () => readFile($("config-file"), "config"));
  $("tool-file").addEventListener("change", () => readFile($("tool-file"), "tool"));
  $("tool-text").addEventListener("change", () => {
    state.file = { text: $("tool-text").value, name: state.file ? state.file.name : "config.yaml" };
    state.baseline = {}; refresh();
  });
  $("tool-format").addEventListener("change", () => { state.format = $("tool-format").value; refresh(); });
  $("plan-controls").addEventListener("input", (event) => {
    if (event.target.name === "budget") state.budget = event.target.value; else state.batch = event.target.value;
    writeUrl();
  });
  $("emit").addEventListener("change", () => { state.emit = $("emit").value; writeUrl(); });
  $("plan-run").addEventListener("click", runPlan);
  $("exact-run").addEventListener("click", runExact);
  document.addEventListener("click", (event) => { if (event.target.matches("button.copy")) copy(event.target); });
}

(async function start() {
  buildForm(await (await fetch("/api/form")).json());
  readUrl();
  fillForm();
  wire();
  await refresh();
})();

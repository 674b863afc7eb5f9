// Building the page: elements from data with textContent only (never innerHTML), so a job
// name or a drain reason is always text, never markup.

/** h("td", {class: "num"}, "42", child...) */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = v;
    else if (v === true) el.setAttribute(k, "");
    else el.setAttribute(k, String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === undefined || c === null || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function stateBadge(state, prefix = "s") {
  return h("span", { class: `state ${prefix}-${state}`, "data-state": state }, state);
}

export function jobLink(ref, text) {
  return h("a", { href: `#/job/${encodeURIComponent(ref)}` }, text ?? ref);
}

export function nodeLink(name) {
  return h("a", { href: `#/node/${encodeURIComponent(name)}` }, name);
}

export function time(t) {
  if (!t) return "";
  const d = new Date(t * 1000);
  const today = new Date();
  const sameDay = d.toDateString() === today.toDateString();
  const hms = d.toLocaleTimeString([], { hour12: false });
  return sameDay ? hms : `${d.toISOString().slice(0, 10)} ${hms}`;
}

export function ago(t) {
  if (!t) return "never";
  const s = Math.round(Date.now() / 1000 - t);
  if (s < 0) return `in ${duration(-s)}`;
  return `${duration(s)} ago`;
}

export function duration(s) {
  if (s === null || s === undefined) return "";
  s = Math.round(s);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

export function facts(pairs) {
  const dl = h("dl", { class: "facts" });
  for (const [k, v] of pairs) {
    if (v === undefined || v === null || v === "") continue;
    dl.append(h("dt", {}, k), h("dd", {}, v));
  }
  return dl;
}

export function table(headers, rows, attrs = {}) {
  return h(
    "table",
    attrs,
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows),
  );
}

/** Words for a pending job's reason code (squeue's REASON column). */
const REASONS = {
  Resources: "waiting for resources: the nodes it needs are busy",
  Priority: "waiting behind jobs of higher priority",
  Dependency: "waiting for a job it depends on",
  DependencyNeverSatisfied: "a job it depends on ended in a way that can never satisfy it",
  BeginTime: "not allowed to start yet (--begin)",
  JobHeldUser: "held by its owner (release it to let it run)",
  JobHeldAdmin: "held by an operator",
  JobArrayTaskLimit: "its array already runs as many tasks as it may at once",
  Reserved: "kept for a restart on its own nodes after a node failure",
  PartitionTimeLimit: "its time limit is above its partition's",
  ReqNodeNotAvail: "a node it asked for is not available",
  launch_failed: "its launches kept failing",
};

export function reasonWords(reason, state) {
  if (!reason || reason === "None") {
    if (state === "HELD") return "held: it waits until released";
    return "";
  }
  const code = reason.split(/[\s(:]/, 1)[0];
  const words = REASONS[code];
  return words ? `${words} (${reason})` : reason;
}

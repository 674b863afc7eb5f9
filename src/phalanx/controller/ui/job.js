// One job: its state and why it waits, attempts, steps, checkpoints, an events timeline
// (requeues, node failures, health drains) and, for its owner, the tail of its output.
import { api, ApiError } from "./api.js";
import { ago, duration, facts, h, jobLink, nodeLink, reasonWords, replace, stateBadge, table, time } from "./dom.js";

const TERMINAL = new Set(["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"]);
let explainRoute = true; // false once this controller answered that it has no explain route
let nodeCache = new Map(); // node name -> its recent events, for the job page shown

export function title(ref) {
  return `Job ${ref}`;
}

/** A timeline class for an event kind: requeues, node failures, health drains stand out. */
export function eventClass(e) {
  const kind = (e.kind || "").toLowerCase();
  const msg = (e.message || "").toLowerCase();
  if (kind.includes("requeue") || kind.includes("restart")) return "k-requeue";
  if (kind.includes("retry")) return "k-retry";
  if (kind.includes("health") || kind.includes("drain") || /\bhealth\b|\bxid\b/.test(msg)) return "k-health";
  if (/node_fail|node\.down|lost|spare_lost/.test(kind) || /node .*(down|failed|lost)/.test(msg)) return "k-node";
  if (/failed|timeout|out_of_memory/.test(kind)) return "k-fail";
  if (/completed|cancelled/.test(kind)) return "k-end";
  if (/running|starting/.test(kind)) return "k-start";
  return "";
}

export function mount(main, ref, _params, ctx) {
  const head = h("h1", {}, `Job ${ref}`);
  const summary = h("div", { class: "card", id: "job-summary" }, h("p", { class: "muted" }, "Waiting for data…"));
  const buttons = {
    cancel: h("button", { type: "button", class: "danger", id: "act-cancel", disabled: true }, "Cancel"),
    hold: h("button", { type: "button", class: "secondary", id: "act-hold", disabled: true }, "Hold"),
    release: h("button", { type: "button", class: "secondary", id: "act-release", disabled: true }, "Release"),
  };
  const verb = { cancel: "Cancel", hold: "Hold", release: "Release" };
  for (const [name, b] of Object.entries(buttons)) {
    b.addEventListener("click", () => {
      if (name === "cancel" && !confirm(`Cancel job ${ref}?`)) return;
      ctx.act(`${verb[name]} job ${ref}`, () => api(`/v1/jobs/${name}`, { method: "POST", body: { jobs: [ref] } }));
    });
  }
  const actions = h("div", { class: "actions", id: "job-actions" }, Object.values(buttons));
  const why = h("div", { id: "job-why" });
  const attempts = h("div", { id: "job-attempts" });
  const steps = h("div", { id: "job-steps" });
  const ckpt = h("div", { id: "job-checkpoints" });
  const events = h("div", { id: "job-events" });
  const output = h("div", { id: "job-output" });
  replace(
    main,
    head,
    summary,
    actions,
    h("h2", {}, "Why"),
    why,
    h("h2", {}, "Attempts"),
    attempts,
    h("h2", {}, "Steps"),
    steps,
    h("h2", {}, "Checkpoints"),
    ckpt,
    h("h2", {}, "Events"),
    events,
    h("h2", {}, "Output"),
    output,
  );
  const enc = encodeURIComponent(ref);
  let outputDone = false;
  nodeCache = new Map();

  return async () => {
    const shown = await api(`/v1/jobs/${enc}`);
    const jobs = shown.jobs || [];
    if (jobs.length > 1) {
      replace(summary, h("p", {}, `${ref} is an array of ${jobs.length} tasks:`), tasksTable(jobs));
      for (const b of Object.values(buttons)) b.disabled = false;
      return;
    }
    const j = jobs[0];
    replace(head, `Job ${j.job_id} `, stateBadge(j.state));
    head.dataset.state = j.state;
    renderSummary(summary, j);
    buttons.cancel.disabled = TERMINAL.has(j.state);
    buttons.hold.disabled = j.state !== "PENDING";
    buttons.release.disabled = j.state !== "HELD";

    const [ev, ex, out] = await Promise.all([
      api(`/v1/jobs/${enc}/events`).catch((e) => e),
      explainRoute ? api(`/v1/jobs/${enc}/explain`).catch((e) => e) : Promise.resolve(null),
      outputDone ? Promise.resolve(null) : api(`/v1/jobs/${enc}/output`).catch((e) => e),
    ]);
    for (const r of [ev, ex, out]) if (r instanceof ApiError && r.outage) throw r;
    renderWhy(why, j, ex);
    replace(attempts, attemptsTable(j.attempts || []));
    replace(steps, (j.steps || []).length ? stepsTable(j.steps) : h("p", { class: "muted" }, j.private ? "Private to its owner." : "No steps."));
    renderCheckpoints(ckpt, j);
    if (ev instanceof ApiError) replace(events, h("p", { class: "muted" }, ev.message));
    else replace(events, timeline(mergeEvents(ev.events || [], await nodeEventsOf(j.attempts || []))));
    if (out !== null) {
      renderOutput(output, out);
      // a finished job's output does not change: read it once more after the end, then stop
      outputDone = TERMINAL.has(j.state) && !(out instanceof ApiError && out.outage);
    }
  };
}

const NODE_KINDS = /^node\.(drain|down)|health/;
const MAX_NODES = 16;

/** The drains and failures of the nodes an ended attempt ran on, while it ran: the health
 * drain or node failure behind a requeue is the node's event, not the job's. Read once per
 * node (an ended attempt does not change), only for jobs with more than one attempt or one
 * that did not end well, and for 16 nodes at most. */
async function nodeEventsOf(atts) {
  const ended = atts.filter(
    (a) => a.end_time && (atts.length > 1 || !["COMPLETED", "CANCELLED"].includes(a.result)),
  );
  const names = [...new Set(ended.flatMap((a) => a.nodes || []))].slice(0, MAX_NODES);
  await Promise.all(
    names
      .filter((n) => !nodeCache.has(n))
      .map((n) =>
        api(`/v1/nodes/${encodeURIComponent(n)}`)
          .then((v) => nodeCache.set(n, v.events || []))
          .catch(() => null),
      ),
  );
  const out = [];
  for (const a of ended) {
    const from = (a.start_time || a.created_at || 0) - 60;
    for (const n of a.nodes || []) {
      for (const e of nodeCache.get(n) || []) {
        if (NODE_KINDS.test(e.kind) && e.ts >= from && e.ts <= a.end_time + 60) out.push(e);
      }
    }
  }
  return out;
}

function mergeEvents(own, fromNodes) {
  const byId = new Map();
  for (const e of [...own, ...fromNodes]) byId.set(e.id, e);
  return [...byId.values()].sort((a, b) => a.ts - b.ts || a.id - b.id);
}

function tasksTable(jobs) {
  return table(
    ["Task", "State", "Reason", "Nodes", "Started", "Ended"],
    jobs.map((t) =>
      h(
        "tr",
        { "data-job": t.job_id },
        h("td", {}, jobLink(t.job_id)),
        h("td", {}, stateBadge(t.state)),
        h("td", {}, t.reason || ""),
        h("td", {}, t.nodelist || ""),
        h("td", {}, time(t.start_time)),
        h("td", {}, time(t.end_time)),
      ),
    ),
  );
}

function renderSummary(el, j) {
  const exit = j.exit_code !== null && j.exit_code !== undefined ? `${j.exit_code}${j.exit_signal ? ` (signal ${j.exit_signal})` : ""}` : null;
  replace(
    el,
    facts([
      ["State", h("span", { id: "job-state", "data-state": j.state }, stateBadge(j.state))],
      ["Reason", h("span", { id: "job-reason" }, reasonWords(j.reason, j.state) || "—")],
      ["Name", j.name],
      ["User", j.user],
      ["Partition", j.partition],
      ["Nodes", `${j.nodes}${j.nodes_max ? `-${j.nodes_max}` : ""}${j.spares ? ` + ${j.spares} spare` : ""}`],
      ["Node list", j.nodelist ? j.nodelist : null],
      ["Resources per node", `${j.cpus_per_node} CPUs, ${j.mem_per_node_mb} MB${j.gpus_per_node ? `, ${j.gpus_per_node} GPUs${j.gpu_type ? ` (${j.gpu_type})` : ""}` : ""}`],
      ["Submitted", time(j.submit_time)],
      ["Started", time(j.start_time)],
      ["Ended", time(j.end_time)],
      ["Time limit", j.time_limit],
      ["Exit code", exit],
      ["Restarts", j.restart_count ? String(j.restart_count) : null],
      ["Failure retries", j.retries ? String(j.retries) : null],
      ["Avoids nodes", j.avoid_nodes && j.avoid_nodes.length ? j.avoid_nodes.join(", ") : null],
      ["Dependency", j.dependency && j.dependency.length ? JSON.stringify(j.dependency) : null],
      ["Command", j.command],
      ["Working dir", j.workdir],
      ["Output", j.stdout],
      ["Private", j.private ? "the job's details are private to its owner" : null],
    ]),
  );
}

function renderWhy(el, j, ex) {
  if (ex instanceof ApiError && ex.status === 404 && ex.code === "http_404") explainRoute = false;
  if (ex && !(ex instanceof ApiError)) {
    replace(
      el,
      h(
        "div",
        { class: "card explain", id: "explain" },
        h("p", {}, h("strong", {}, ex.summary || "")),
        (ex.lines || []).length ? h("ul", {}, ex.lines.map((l) => h("li", {}, l))) : null,
      ),
    );
    return;
  }
  // no explanation route here: the pending reason in words, or how the job ended
  let text;
  if (j.state === "PENDING" || j.state === "HELD") text = reasonWords(j.reason, j.state) || "pending: about to be considered by the scheduler";
  else if (TERMINAL.has(j.state)) text = `${j.state.toLowerCase()}${j.reason && j.reason !== "None" ? `: ${j.reason}` : ""}`;
  else text = `${j.state.toLowerCase()} on ${j.nodelist || "its nodes"}`;
  replace(el, h("div", { class: "card explain", id: "explain" }, text));
}

function attemptsTable(atts) {
  if (!atts.length) return h("p", { class: "muted" }, "No attempt yet.");
  return table(
    ["#", "State", "Result", "Nodes", "Started", "Ended", "Exit", "Stop reason"],
    atts.map((a) =>
      h(
        "tr",
        { "data-attempt": a.seq },
        h("td", { class: "num" }, a.seq),
        h("td", {}, a.state),
        h("td", {}, a.result ? stateBadge(a.result) : ""),
        h("td", {}, (a.nodes || []).map((n, i) => [i ? ", " : "", nodeLink(n)])),
        h("td", {}, time(a.start_time)),
        h("td", {}, time(a.end_time)),
        h("td", {}, a.exit_code ?? ""),
        h("td", {}, a.stop_reason || ""),
      ),
    ),
  );
}

function stepsTable(steps) {
  return table(
    ["Step", "Attempt", "Name", "State", "Tasks", "Nodes", "Started", "Ended", "Exit"],
    steps.map((s) =>
      h(
        "tr",
        {},
        h("td", { class: "num" }, s.step_id),
        h("td", { class: "num" }, s.attempt_seq ?? ""),
        h("td", {}, s.name),
        h("td", {}, s.state),
        h("td", { class: "num" }, s.ntasks),
        h("td", {}, (s.nodes || []).join(", ")),
        h("td", {}, time(s.start_time)),
        h("td", {}, time(s.end_time)),
        h("td", {}, s.exit_code ?? ""),
      ),
    ),
  );
}

function renderCheckpoints(el, j) {
  if (j.private) {
    replace(el, h("p", { class: "muted" }, "Private to its owner."));
    return;
  }
  const spec = j.checkpoint_spec;
  const last = j.checkpoint;
  const interval = j.checkpoint_interval;
  if (!spec && !last) {
    replace(el, h("p", { class: "muted" }, "The job does not checkpoint (no --checkpoint)."));
    return;
  }
  replace(
    el,
    facts([
      ["Asked for", spec ? JSON.stringify(spec) : null],
      ["Interval in force", interval ? (interval.interval_s ? duration(interval.interval_s) : JSON.stringify(interval)) : null],
      ["Latest", last ? `${last.path || last.step || JSON.stringify(last)}${last.time ? ` (${ago(last.time)})` : ""}` : "none recorded yet"],
      ["Progress", j.progress ? JSON.stringify(j.progress) : null],
    ]),
  );
}

function timeline(evs) {
  if (!evs.length) return h("p", { class: "muted" }, "No events.");
  return h(
    "ol",
    { class: "timeline", id: "timeline" },
    evs.map((e) =>
      h(
        "li",
        { class: eventClass(e), "data-kind": e.kind },
        h("time", {}, time(e.time ?? e.ts ?? e.created_at)),
        h("span", { class: "kind" }, e.kind),
        e.message || "",
        e.node ? [" · ", nodeLink(e.node)] : null,
        e.actor ? h("span", { class: "muted" }, ` · ${e.actor}`) : null,
      ),
    ),
  );
}

function renderOutput(el, out) {
  if (out instanceof ApiError) {
    replace(el, h("p", { class: "muted", id: "output-refused" }, out.message));
    return;
  }
  if (!out.available) {
    replace(el, h("p", { class: "muted", id: "output-where" }, out.why));
    return;
  }
  replace(
    el,
    h("p", { class: "muted" }, `${out.path} on ${out.node}${out.truncated ? ` — the last part of ${out.size} bytes` : ""}`),
    h("pre", { class: "output", id: "output-text" }, out.text || "(empty)"),
  );
}

// One node: state, resources, drain and health, its jobs, maintenance windows and events;
// drain and resume for operators (the API refuses anyone else, with its own message).
import { api } from "./api.js";
import { ago, facts, h, jobLink, replace, stateBadge, table, time } from "./dom.js";

export function title(name) {
  return `Node ${name}`;
}

export function mount(main, name, _params, ctx) {
  const enc = encodeURIComponent(name);
  const head = h("h1", {}, `Node ${name}`);
  const summary = h("div", { class: "card", id: "node-summary" }, h("p", { class: "muted" }, "Waiting for data…"));
  const reason = h("input", { id: "drain-reason", name: "reason", placeholder: "why (shown to users)", size: 30, required: true });
  const now = h("input", { type: "checkbox", id: "drain-now", name: "now" });
  const drain = h("button", { type: "submit", id: "act-drain" }, "Drain");
  const resume = h("button", { type: "button", class: "secondary", id: "act-resume" }, "Resume");
  const form = h(
    "form",
    { class: "inline", id: "drain-form" },
    h("label", {}, "Drain reason", reason),
    h("label", {}, h("span", {}, now, " now: checkpoint and requeue its jobs")),
    drain,
    resume,
    ctx.isOperator ? null : h("span", { class: "muted" }, "(operators only)"),
  );
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    ctx.act(`Drain ${name}`, () => api(`/v1/nodes/${enc}/drain`, { method: "POST", body: { reason: reason.value, now: now.checked } }));
  });
  resume.addEventListener("click", () => ctx.act(`Resume ${name}`, () => api(`/v1/nodes/${enc}/resume`, { method: "POST" })));
  const health = h("div", { id: "node-health" });
  const jobs = h("div", { id: "node-jobs" });
  const windows = h("div", { id: "node-maintenance" });
  const events = h("div", { id: "node-events" });
  replace(main, head, summary, form, h("h2", {}, "Health"), health, h("h2", {}, "Jobs"), jobs, h("h2", {}, "Maintenance windows"), windows, h("h2", {}, "Recent events"), events);

  return async () => {
    const n = await api(`/v1/nodes/${enc}`);
    replace(head, `Node ${n.name} `, stateBadge(n.state.split("+")[0]));
    head.dataset.state = n.state;
    replace(
      summary,
      facts([
        ["State", h("span", { id: "node-state" }, n.state)],
        ["Drain reason", n.drain ? `${n.drain_reason || ""} (by ${n.drain_by || "?"}, ${ago(n.drain_time)})` : null],
        ["Down reason", n.down ? n.down_reason : null],
        ["CPUs", `${n.cpus_alloc} of ${n.cpus} allocated`],
        ["Memory", `${n.mem_alloc_mb} of ${n.mem_mb} MB allocated`],
        ["GPUs", (n.gpus || []).length ? `${n.gpus_alloc} of ${n.gpus.length} allocated (${n.gpus.map((g) => g[1]).join(", ")})` : null],
        ["Features", (n.features || []).join(", ")],
        ["Address", n.addr],
        ["Last heartbeat", ago(n.last_heartbeat)],
        ["Registered", time(n.registered_at)],
        ["Launch failures in a row", n.launch_failures ? String(n.launch_failures) : null],
        ["Hot spare for", (n.spare_for || []).length ? n.spare_for.join(", ") : null],
      ]),
    );
    const hl = n.health;
    if (!hl) replace(health, h("p", { class: "muted" }, "No health report yet."));
    else
      replace(
        health,
        h("p", {}, `Overall: ${hl.status}${hl.reason ? ` — ${hl.check}: ${hl.reason}` : ""}`),
        table(
          ["Check", "Status", "Reason", "Since"],
          Object.entries(hl.checks || {}).map(([k, c]) => h("tr", {}, h("td", {}, k), h("td", {}, c.status), h("td", {}, c.reason || ""), h("td", {}, time(c.since)))),
        ),
      );
    replace(jobs, (n.jobs || []).length ? h("p", {}, n.jobs.map((j, i) => [i ? ", " : "", jobLink(String(j))])) : h("p", { class: "muted" }, "No jobs."));
    replace(
      windows,
      (n.maintenance || []).length
        ? table(["Window", "State", "Start", "End", "Reason"], n.maintenance.map((w) => h("tr", {}, h("td", {}, w.id), h("td", {}, w.state), h("td", {}, time(w.start)), h("td", {}, time(w.end)), h("td", {}, w.reason || ""))))
        : h("p", { class: "muted" }, "None."),
    );
    replace(
      events,
      table(
        ["Time", "Kind", "Message", "Actor"],
        [...(n.events || [])].reverse().map((e) => h("tr", {}, h("td", {}, time(e.ts)), h("td", {}, e.kind), h("td", {}, e.message), h("td", {}, e.actor))),
      ),
    );
  };
}

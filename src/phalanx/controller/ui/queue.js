// The queue: filtered by user, state and partition (kept in the URL, so a link or the back
// button gives the same view), array tasks folded into one row, paged by the controller.
import { api, query } from "./api.js";
import { duration, h, jobLink, reasonWords, replace, stateBadge, table, time } from "./dom.js";

export const PAGE_SIZE = 100;
const STATES = ["active", "all", "PENDING", "HELD", "RUNNING", "COMPLETING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"];

export function title() {
  return "Queue";
}

function go(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v) q.set(k, v);
  const s = q.toString();
  location.hash = `#/queue${s ? `?${s}` : ""}`;
}

export function mount(main, _arg, params, ctx) {
  const f = {
    user: params.get("user") || "",
    state: params.get("state") || "active",
    partition: params.get("partition") || "",
    offset: Math.max(0, parseInt(params.get("offset") || "0", 10) || 0),
  };
  const user = h("input", { id: "f-user", name: "user", value: f.user, placeholder: "any user", list: "users", size: 14 });
  const mine = h("button", { type: "button", class: "secondary", id: "f-mine" }, "My jobs");
  mine.addEventListener("click", () => go({ ...f, user: ctx.me.user, offset: "" }));
  const state = h("select", { id: "f-state", name: "state" }, STATES.map((s) => h("option", { value: s, selected: s === f.state }, s)));
  const part = h("select", { id: "f-partition", name: "partition" }, h("option", { value: "" }, "any partition"));
  if (f.partition) part.append(h("option", { value: f.partition, selected: true }, f.partition));
  const form = h(
    "form",
    { class: "filters", id: "filters" },
    h("label", {}, "User", user),
    h("label", {}, "State", state),
    h("label", {}, "Partition", part),
    h("button", { type: "submit" }, "Filter"),
    mine,
  );
  const apply = () => go({ user: user.value.trim(), state: state.value, partition: part.value });
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    apply();
  });
  state.addEventListener("change", apply);
  part.addEventListener("change", apply);
  const summary = h("p", { id: "queue-summary", class: "muted" }, "Waiting for data…");
  const pager = h("div", { class: "pager", id: "pager" });
  const body = h("div", { id: "queue" });
  const users = h("datalist", { id: "users" });
  replace(main, h("h1", {}, "Queue"), form, users, summary, pager, body);

  const loadPartitions = () =>
    api("/v1/cluster")
      .then((c) => {
        for (const p of c.partitions || []) {
          if (p.name !== f.partition) part.append(h("option", { value: p.name }, p.name));
        }
      })
      .catch(() => {});
  let first = true;
  const opened = new Set(); // folds the user opened stay open across refreshes
  return async () => {
    const t0 = performance.now();
    const q = await api(
      `/v1/queue${query({ user: f.user, state: f.state, partition: f.partition, offset: f.offset, limit: PAGE_SIZE })}`,
    );
    const seen = new Set(q.rows.map((r) => r.user));
    replace(users, [...seen].sort().map((u) => h("option", { value: u })));
    const counts = Object.entries(q.by_state).sort().map(([s, n]) => `${n} ${s.toLowerCase()}`).join(", ");
    replace(
      summary,
      `${q.total_jobs} jobs in ${q.total_rows} rows${counts ? ` (${counts})` : ""}`,
    );
    const pages = Math.max(1, Math.ceil(q.total_rows / PAGE_SIZE));
    const pageNo = Math.floor(f.offset / PAGE_SIZE) + 1;
    const prev = h("button", { type: "button", class: "secondary", id: "prev", disabled: f.offset <= 0 }, "← Previous");
    const next = h("button", { type: "button", class: "secondary", id: "next", disabled: f.offset + PAGE_SIZE >= q.total_rows }, "Next →");
    prev.addEventListener("click", () => go({ ...f, offset: String(Math.max(0, f.offset - PAGE_SIZE)) }));
    next.addEventListener("click", () => go({ ...f, offset: String(f.offset + PAGE_SIZE) }));
    replace(pager, prev, h("span", { id: "page-no" }, `page ${pageNo} of ${pages}`), next);
    replace(
      body,
      table(
        ["Job", "Name", "User", "Partition", "State", "Reason", "Nodes", "Node list", "Submitted", "Started", "Time limit", "Priority"],
        q.rows.map((r) => row(r, opened)),
        { id: "queue-table" },
      ),
    );
    if (first) {
      first = false;
      // what the page's own work cost: request, reply, table (tests read these marks)
      performance.mark("queue-rendered");
      performance.measure("queue-fetch-render", { start: t0, end: performance.now() });
      loadPartitions(); // after the first table: it does not compete with it
    }
  };
}

function row(r, opened) {
  const folded = r.array && r.count > 1;
  const job = folded
    ? h(
        "details",
        { open: opened.has(r.job_id), ontoggle: (ev) => (ev.target.open ? opened.add(r.job_id) : opened.delete(r.job_id)) },
        h("summary", {}, `${r.job_id} `, h("span", { class: "muted" }, `(${r.count} tasks)`)),
        h("div", {}, r.task_ids.map((t, i) => [i ? ", " : "", jobLink(`${r.array_job_id}_${t}`, String(t))])),
      )
    : jobLink(r.ref, r.job_id);
  return h(
    "tr",
    { "data-job": r.job_id, "data-state": r.state },
    h("td", {}, job),
    h("td", {}, r.name),
    h("td", {}, r.user),
    h("td", {}, r.partition),
    h("td", {}, stateBadge(r.state)),
    h("td", { title: reasonWords(r.reason, r.state) }, r.state === "PENDING" || r.state === "HELD" ? r.reason || "" : ""),
    h("td", { class: "num" }, r.nodes),
    h("td", {}, r.nodelist || ""),
    h("td", {}, time(r.submit_time)),
    h("td", {}, time(r.start_time)),
    h("td", {}, r.time_limit || duration(r.time_limit_s)),
    h("td", { class: "num" }, r.priority),
  );
}

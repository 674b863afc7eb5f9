// Maintenance windows: the live ones (or all, with past and removed), adding and removing
// them for operators.
import { api } from "./api.js";
import { duration, h, replace, table, time } from "./dom.js";

export function title() {
  return "Maintenance";
}

export function mount(main, _arg, params, ctx) {
  const all = params.get("all") === "true";
  const toggle = h("a", { href: all ? "#/maintenance" : "#/maintenance?all=true", id: "toggle-all" }, all ? "Show live windows only" : "Show past and removed windows too");
  const list = h("div", { id: "windows" }, h("p", { class: "muted" }, "Waiting for data…"));
  const nodes = h("input", { name: "nodes", id: "mw-nodes", placeholder: "node[01-04]", required: true });
  const start = h("input", { name: "start", id: "mw-start", value: "now+1h", required: true });
  const dur = h("input", { name: "duration", id: "mw-duration", value: "2h", required: true, size: 8 });
  const reason = h("input", { name: "reason", id: "mw-reason", placeholder: "reason", size: 24 });
  const form = h(
    "form",
    { class: "inline", id: "maint-form" },
    h("label", {}, "Nodes", nodes),
    h("label", {}, "Start", start),
    h("label", {}, "Duration", dur),
    h("label", {}, "Reason", reason),
    h("button", { type: "submit" }, "Add window"),
  );
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    ctx.act("Add maintenance window", () =>
      api("/v1/maintenance", { method: "POST", body: { nodes: nodes.value, start: start.value, duration: dur.value, reason: reason.value || null } }),
    );
  });
  replace(main, h("h1", {}, "Maintenance windows"), toggle, list, ctx.isOperator ? [h("h2", {}, "Add a window"), form] : null);

  return async () => {
    const r = await api(`/v1/maintenance${all ? "?all=true" : ""}`);
    const ws = r.windows || [];
    replace(
      list,
      ws.length
        ? table(
            ["Window", "Nodes", "State", "Start", "End", "Length", "Reason", "By", ""],
            ws.map((w) =>
              h(
                "tr",
                { "data-window": w.id },
                h("td", {}, w.id),
                h("td", {}, w.nodes),
                h("td", {}, w.state),
                h("td", {}, time(w.start)),
                h("td", {}, time(w.end)),
                h("td", {}, duration(w.duration_s)),
                h("td", {}, w.reason || ""),
                h("td", {}, w.created_by),
                h(
                  "td",
                  {},
                  ctx.isOperator && (w.state === "scheduled" || w.state === "active")
                    ? h("button", { type: "button", class: "secondary", onclick: () => ctx.act(`Remove window ${w.id}`, () => api(`/v1/maintenance/${w.id}`, { method: "DELETE" })) }, "Remove")
                    : null,
                ),
              ),
            ),
          )
        : h("p", { class: "muted" }, "No maintenance windows."),
    );
  };
}

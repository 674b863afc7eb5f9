// The cluster: counts, controllers with their leases and terms, and every node as a grid
// grouped by rack (when nodes carry a `rack=NAME` feature) or else by partition.
import { api } from "./api.js";
import { ago, h, nodeLink, replace, stateBadge, table, time } from "./dom.js";

export function title() {
  return "Cluster";
}

const NODE_STATES = [
  ["IDLE", "--idle"],
  ["MIXED", "--mixed"],
  ["ALLOCATED", "--alloc"],
  ["DRAINING / DRAINED", "--drain"],
  ["DOWN", "--down"],
  ["UNKNOWN", "--unknown"],
];

/** fnmatch-style globs of a partition's `nodes` ("*", "gpu[0-9]*", comma lists). */
export function globMatch(globs, name) {
  return String(globs)
    .split(",")
    .map((g) => g.trim())
    .filter(Boolean)
    .some((g) => {
      let re = "";
      for (let i = 0; i < g.length; i++) {
        const c = g[i];
        if (c === "*") re += ".*";
        else if (c === "?") re += ".";
        else if (c === "[") {
          const end = g.indexOf("]", i + 1);
          if (end < 0) re += "\\[";
          else {
            let body = g.slice(i + 1, end).replace(/\\/g, "\\\\");
            if (body.startsWith("!")) body = `^${body.slice(1)}`;
            re += `[${body}]`;
            i = end;
          }
        } else re += c.replace(/[.+^${}()|\\]/g, "\\$&");
      }
      return new RegExp(`^${re}$`).test(name);
    });
}

function rackOf(n) {
  for (const f of n.features || []) {
    const m = /^rack[=:](.+)$/.exec(f);
    if (m) return m[1];
  }
  return null;
}

export function groups(nodes, partitions) {
  if (nodes.some((n) => rackOf(n) !== null)) {
    const by = new Map();
    for (const n of nodes) {
      const r = rackOf(n) ?? "(no rack)";
      if (!by.has(r)) by.set(r, []);
      by.get(r).push(n);
    }
    return { kind: "rack", groups: [...by.entries()].sort(([a], [b]) => a.localeCompare(b)) };
  }
  const out = partitions.map((p) => [p.name, nodes.filter((n) => globMatch(p.nodes, n.name))]);
  const inNone = nodes.filter((n) => !partitions.some((p) => globMatch(p.nodes, n.name)));
  if (inNone.length) out.push(["(in no partition)", inNone]);
  return { kind: "partition", groups: out };
}

function nodeCell(n) {
  const health = n.health && n.health.status && n.health.status !== "ok" ? n.health : null;
  const why = n.drain ? n.drain_reason : n.down ? n.down_reason : null;
  const gpus = (n.gpus || []).length;
  return h(
    "a",
    {
      class: `node n-${n.state.split("+")[0]}${health ? " unhealthy" : ""}`,
      href: `#/node/${encodeURIComponent(n.name)}`,
      title: [n.state, why, health ? `health ${health.status}: ${health.reason}` : null]
        .filter(Boolean)
        .join(" · "),
      "data-node": n.name,
      "data-state": n.state,
    },
    h("span", { class: "name" }, n.name),
    h("small", {}, n.state),
    h("small", {}, `CPU ${n.cpus_alloc}/${n.cpus}${gpus ? ` · GPU ${n.gpus_alloc}/${gpus}` : ""}`),
    why ? h("small", { class: "why" }, why) : null,
    health ? h("small", { class: "health" }, `health ${health.status}: ${health.reason || health.check}`) : null,
  );
}

export function mount(main) {
  const counts = h("div", { class: "card", id: "counts" }, h("p", { class: "muted" }, "Waiting for data…"));
  const ctls = h("div", { id: "controllers" });
  const grid = h("div", { id: "nodes" });
  const legend = h(
    "div",
    { class: "legend" },
    NODE_STATES.map(([name, v]) => {
      const s = h("span", {}, name);
      s.style.setProperty("--c", `var(${v})`);
      return s;
    }),
  );
  replace(main, h("h1", {}, "Cluster"), counts, h("h2", {}, "Nodes"), legend, grid, h("h2", {}, "Controllers and leases"), ctls);

  return async () => {
    const [c, ns] = await Promise.all([api("/v1/cluster"), api("/v1/nodes")]);
    const nodes = ns.nodes;
    const jobs = c.jobs || {};
    replace(
      counts,
      h(
        "div",
        { class: "chips" },
        h("span", { class: "chip", id: "count-nodes" }, `${c.nodes.total} nodes`),
        h("span", { class: "chip" }, `${c.nodes.down} down`),
        h("span", { class: "chip" }, `${c.nodes.drain} drained`),
        Object.entries(jobs)
          .sort()
          .map(([s, n]) => h("span", { class: "chip", "data-count": s }, stateBadge(s), ` ${n}`)),
      ),
    );
    const g = groups(nodes, c.partitions || []);
    replace(
      grid,
      g.groups.map(([name, members]) =>
        h(
          "section",
          { class: "group", "data-group": name },
          h("h3", {}, `${g.kind === "rack" ? "Rack" : "Partition"} ${name} `, h("span", { class: "muted" }, `(${members.length})`)),
          h("div", { class: "grid" }, members.map(nodeCell)),
        ),
      ),
    );
    const holders = new Map();
    for (const l of c.leases || []) {
      if (!holders.has(l.holder)) holders.set(l.holder, []);
      holders.get(l.holder).push(l);
    }
    replace(
      ctls,
      h(
        "div",
        { class: "cols" },
        table(
          ["Controller", "URL", "Started", "Last seen", "Leases held"],
          (c.controllers || []).map((x) =>
            h(
              "tr",
              { "data-controller": x.id },
              h("td", {}, x.id, x.id === (c.this_controller || {}).controller ? " (this one)" : ""),
              h("td", {}, x.url || ""),
              h("td", {}, time(x.started_at)),
              h("td", {}, ago(x.last_seen)),
              h("td", {}, (holders.get(x.id) || []).filter((l) => l.valid).map((l) => `${l.name} (term ${l.term})`).join(", ")),
            ),
          ),
        ),
        table(
          ["Lease", "Holder", "Term", "Expires", "Valid"],
          (c.leases || []).map((l) =>
            h(
              "tr",
              { "data-lease": l.name },
              h("td", {}, l.name),
              h("td", {}, l.holder || "—"),
              h("td", { class: "num" }, l.term),
              h("td", {}, ago(l.expires_at)),
              h("td", {}, l.valid ? "yes" : "no"),
            ),
          ),
        ),
      ),
    );
  };
}

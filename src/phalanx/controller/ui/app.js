// The dashboard's shell: login, routing (#/page/arg?filters), polling and the outage banner.
// Pages are modules with `title` and `mount(main, arg, params, ctx)`; `mount` returns a
// `refresh()` that the poller calls (never two at once, paused while the tab is hidden).
import { api, ApiError, setToken, token } from "./api.js";
import { h, replace } from "./dom.js";
import * as cluster from "./cluster.js";
import * as queue from "./queue.js";
import * as job from "./job.js";
import * as node from "./node.js";
import * as maint from "./maint.js";

const PAGES = { cluster, queue, job, node, maintenance: maint };
const main = document.getElementById("main");
const banner = document.getElementById("banner");
const notice = document.getElementById("notice");
const whoEl = document.getElementById("who");

let me = null; // {user, role} from /v1/whoami
let current = null; // {timer, refresh, gen}
let generation = 0;
let lastOk = null;

export function whoami() {
  return me;
}

export function isOperator() {
  return me !== null && (me.role === "operator" || me.role === "admin");
}

/** Say something after an action: its result, or the API's refusal word for word. */
export function say(text, isError = false) {
  notice.hidden = false;
  notice.className = isError ? "error" : "";
  notice.textContent = text;
}

function outage(err) {
  banner.hidden = false;
  const since = lastOk ? ` Showing data from ${lastOk.toLocaleTimeString([], { hour12: false })}.` : "";
  const what = err.code === "unreachable" ? "The controller cannot be reached" : "The cluster's store is unavailable";
  banner.textContent = `${what}: ${err.message}.${since} Retrying…`;
}

function healthy() {
  banner.hidden = true;
  lastOk = new Date();
}

/** Run an action (cancel, drain...) and show its outcome; then refresh the page at once. */
export async function act(what, fn) {
  try {
    const result = await fn();
    say(`${what}: ${describe(result)}`);
  } catch (e) {
    if (e instanceof ApiError) say(`${what} refused: ${e.message}`, true);
    else say(`${what} failed: ${e}`, true);
  }
  if (current) current.kick();
}

function describe(result) {
  if (result && result.results) {
    return Object.entries(result.results).map(([k, v]) => `${k} ${v}`).join(", ");
  }
  return "done";
}

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, qs] = raw.split("?", 2);
  const [page, ...rest] = path.split("/");
  return {
    page: page || "cluster",
    arg: rest.length ? decodeURIComponent(rest.join("/")) : null,
    params: new URLSearchParams(qs || ""),
  };
}

const POLL_MS = { cluster: 3000, queue: 5000, job: 2000, node: 3000, maintenance: 10000 };

function stop() {
  if (current) {
    clearTimeout(current.timer);
    current = null;
  }
}

async function route() {
  stop();
  // A new page starts without the last page's notice: hidden *and* emptied, so nothing (a
  // reader, a test waiting on its words) can take the old outcome for the next action's.
  notice.hidden = true;
  notice.textContent = "";
  const { page, arg, params } = parseHash();
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.classList.toggle("current", a.dataset.nav === page);
  }
  if (!token() || page === "login") {
    showLogin(null);
    return;
  }
  if (me === null) {
    try {
      me = await api("/v1/whoami");
    } catch (e) {
      if (e instanceof ApiError && (e.status === 401 || e.status === 403)) {
        setToken(null);
        showLogin(e.message);
        return;
      }
      if (e instanceof ApiError && e.outage) outage(e);
      replace(main, h("p", { class: "error" }, e.message));
      current = { timer: setTimeout(route, 3000), kick: route };
      return;
    }
    showWho();
  }
  const mod = PAGES[page];
  if (!mod) {
    replace(main, h("h1", {}, "Not found"), h("p", {}, `There is no page ${page}.`));
    return;
  }
  document.title = `${mod.title(arg)} · Phalanx`;
  const gen = ++generation;
  replace(main);
  const refresh = mod.mount(main, arg, params, { me, isOperator: isOperator(), act, say });
  const every = POLL_MS[page] || 5000;
  const state = { timer: null, kick: null };
  current = state;
  let running = false;
  const tick = async () => {
    if (gen !== generation || running) return;
    clearTimeout(state.timer);
    if (document.hidden) {
      state.timer = setTimeout(tick, 1000);
      return;
    }
    running = true;
    try {
      await refresh();
      healthy();
    } catch (e) {
      if (gen !== generation) return;
      if (e instanceof ApiError && e.status === 401) {
        setToken(null);
        me = null;
        showLogin(e.message);
        return;
      }
      if (e instanceof ApiError && e.outage) outage(e);
      else say(e.message || String(e), true);
    } finally {
      running = false;
    }
    if (gen === generation) state.timer = setTimeout(tick, every);
  };
  state.kick = tick;
  tick();
}

function showWho() {
  replace(
    whoEl,
    h("span", { id: "whoami", "data-user": me.user, "data-role": me.role }, `${me.user} (${me.role})`),
    h("button", { class: "secondary", type: "button", onclick: logout }, "Log out"),
  );
}

function logout() {
  setToken(null);
  me = null;
  replace(whoEl);
  location.hash = "#/login";
}

function showLogin(message) {
  stop();
  replace(whoEl);
  const area = h("textarea", {
    id: "token",
    name: "token",
    required: true,
    autocomplete: "off",
    spellcheck: "false",
    placeholder: "eyJhbGciOi…",
  });
  const err = h("p", { class: "error", id: "login-error", role: "alert" }, message || "");
  const form = h(
    "form",
    { class: "login card", id: "login-form" },
    h("h1", {}, "Log in"),
    h(
      "p",
      {},
      "Paste a Phalanx token: ",
      h("code", {}, "phalanx token create USER"),
      " (an admin) or ",
      h("code", {}, "scontrol token"),
      " gives one. It is kept in this tab only (sessionStorage) and sent to this controller's API.",
    ),
    h("label", {}, "Token", area),
    h("p", {}, h("button", { type: "submit" }, "Log in")),
    err,
  );
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    setToken(area.value.trim());
    try {
      me = await api("/v1/whoami");
    } catch (e) {
      setToken(null);
      me = null;
      err.textContent = e.message;
      return;
    }
    showWho();
    if (parseHash().page === "login") location.hash = "#/cluster";
    else route();
  });
  replace(main, form);
}

window.addEventListener("hashchange", route);
document.addEventListener("visibilitychange", () => {
  if (!document.hidden && current && current.kick) current.kick();
});
route();

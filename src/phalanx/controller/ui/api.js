// Calls to the controller's REST API with the user's bearer token (kept in sessionStorage:
// gone when the tab closes). Every call has a timeout, so a stalled request never piles up.
const TOKEN_KEY = "phalanx.token";
export const TIMEOUT_MS = 10000;

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

/** An API refusal or failure, with the API's own message (`{"error": {code, message}}`). */
export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details || {};
  }
  /** The store or the controller is out: show a banner and keep the last data. */
  get outage() {
    return this.status === 0 || this.status === 502 || this.status === 503 || this.status === 504;
  }
}

export async function api(path, { method = "GET", body, timeout = TIMEOUT_MS } = {}) {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), timeout);
  const headers = { Accept: "application/json" };
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  try {
    let resp;
    try {
      resp = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: abort.signal,
        cache: "no-store",
      });
    } catch (e) {
      const why = abort.signal.aborted
        ? `the controller did not answer within ${timeout / 1000} s`
        : "the controller cannot be reached";
      throw new ApiError(0, "unreachable", why);
    }
    let data = null;
    try {
      data = await resp.json();
    } catch (e) {
      data = null;
    }
    if (!resp.ok) {
      const err = data && data.error;
      if (err && err.message) throw new ApiError(resp.status, err.code, err.message, err.details);
      const detail = data && typeof data.detail === "string" ? data.detail : resp.statusText;
      throw new ApiError(resp.status, `http_${resp.status}`, `${resp.status} ${detail}`);
    }
    return data;
  } finally {
    clearTimeout(timer);
  }
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v === undefined || v === null || v === "") continue;
    for (const x of Array.isArray(v) ? v : [v]) q.append(k, String(x));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

// A WebSocket client for the per-run stream (ws/runs/<id>/) and the runs list
// (ws/runs/). It reconnects with backoff and, for a run stream, resumes from
// the last sequence number it saw: the server replays what was missed, so the
// page never shows a gap or the same entry twice. Duplicates that still arrive
// (a replay racing a live message) are dropped here by seq.

const DENIED_CODES = new Set([4401, 4403, 4404]);

export function wsUrl(path) {
  const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${window.location.host}${path}`;
}

export class Stream {
  // path: "/ws/runs/12/"; onEntry(msg) gets every entry in seq order;
  // onStatus(status) gets "connecting" | "backlog" | "live" | "reconnecting" | "denied".
  // after: the last seq the page already shows (0 = replay the whole stream).
  constructor(path, { onEntry, onStatus = () => {}, resume = true, after = 0, maxDelayMs = 8000 } = {}) {
    this.path = path;
    this.onEntry = onEntry;
    this.onStatus = onStatus;
    this.resume = resume;
    this.maxDelayMs = maxDelayMs;
    this.lastSeq = after;
    this.delayMs = 250;
    this.socket = null;
    this.stopped = false;
    this.reconnects = 0;
  }

  start() {
    this.stopped = false;
    this._open();
    return this;
  }

  stop() {
    this.stopped = true;
    if (this.socket) this.socket.close(1000);
  }

  // For tests and the "reconnect" link: drop the socket as a network blip would.
  drop() {
    if (this.socket) this.socket.close(4000);
  }

  _open() {
    this.onStatus("connecting");
    const socket = new WebSocket(wsUrl(this.path));
    this.socket = socket;
    socket.addEventListener("open", () => {
      this.delayMs = 250;
      if (this.resume) {
        this.onStatus("backlog");
        socket.send(JSON.stringify({ type: "subscribe", after: this.lastSeq }));
      } else {
        this.onStatus("live");
      }
    });
    socket.addEventListener("message", (event) => this._receive(JSON.parse(event.data)));
    socket.addEventListener("close", (event) => {
      if (socket !== this.socket || this.stopped) return;
      if (DENIED_CODES.has(event.code)) {
        this.onStatus("denied");
        return;
      }
      this.onStatus("reconnecting");
      this.reconnects += 1;
      setTimeout(() => this._open(), this.delayMs);
      this.delayMs = Math.min(this.delayMs * 2, this.maxDelayMs);
    });
  }

  _receive(msg) {
    if (msg.type === "live") {
      this.onStatus("live");
      return;
    }
    if (typeof msg.seq === "number") {
      if (msg.seq <= this.lastSeq) return; // already shown
      this.lastSeq = msg.seq;
    }
    this.onEntry(msg);
  }
}

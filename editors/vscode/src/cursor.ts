// fimble/cursor (lsp_server/PROTOCOL.md): tell the server where the cursor rests, so it pre-warms its KV
// cache for a completion there and the first completion after a jump elsewhere in a file is fast.
//
// Selection changes come in bursts (every keystroke, every arrow key, a mouse drag): report only once the
// cursor has rested `delayMs`, and never the same place (document version and position) twice in a row.
//
// Pure: no `vscode` import, so it is unit-tested directly.

export const CURSOR_METHOD = 'fimble/cursor';

export interface CursorParams {
  textDocument: { uri: string };
  position: { line: number; character: number };
}

/** setTimeout / clearTimeout, replaceable in tests. */
export interface Timers {
  set(fn: () => void, ms: number): unknown;
  clear(handle: unknown): void;
}

const realTimers: Timers = {
  set: (fn, ms) => setTimeout(fn, ms),
  clear: (handle) => clearTimeout(handle as ReturnType<typeof setTimeout>),
};

/** Debounces cursor movements into `fimble/cursor` notifications (`send`). */
export class CursorReporter {
  private timer: unknown;
  private pending: { params: CursorParams; key: string } | undefined;
  private lastKey: string | undefined;
  /** Notifications sent (for tests and the log). */
  sent = 0;

  constructor(
    private readonly send: (params: CursorParams) => void,
    readonly delayMs = 150,
    private readonly timers: Timers = realTimers,
  ) {}

  /** The cursor is now at `position` (protocol units) of `uri` at document `version`. Cheap: every movement calls it. */
  moved(uri: string, version: number, position: { line: number; character: number }): void {
    const key = `${version} ${position.line}:${position.character} ${uri}`;
    this.cancel();
    if (key === this.lastKey) return; // back where it was reported last: nothing new to pre-warm
    this.pending = { params: { textDocument: { uri }, position: { line: position.line, character: position.character } }, key };
    this.timer = this.timers.set(() => this.flush(), this.delayMs);
  }

  /** Send the pending report now (the debounce fired). */
  flush(): void {
    const pending = this.pending;
    this.cancel();
    if (!pending) return;
    this.lastKey = pending.key;
    this.sent += 1;
    this.send(pending.params);
  }

  /** Drop the pending report, if any. */
  cancel(): void {
    if (this.timer !== undefined) this.timers.clear(this.timer);
    this.timer = undefined;
    this.pending = undefined;
  }

  /** Drop the pending report and forget the last one (a new server, a closed document): the next one goes out. */
  reset(): void {
    this.cancel();
    this.lastKey = undefined;
  }
}

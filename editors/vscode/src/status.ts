// The engine's state for the status bar: "loading model" until the model is loaded, then ready, or an
// error with its reason (a user must see why nothing completes).
//
// The server reports it with `fimble/status` notifications (lsp_server/PROTOCOL.md) when it has them;
// otherwise (an older server, or until the first notification) the watcher polls `fimble/stats`
// (`engine.state`, `engine.error`) until the engine is ready or has failed. Either way the listener hears
// each state once.
//
// Pure: no `vscode` import, so it is unit-tested directly.

export const STATUS_METHOD = 'fimble/status';

export type EngineState = 'starting' | 'ready' | 'error' | 'stopped';

export interface EngineStatus {
  state: EngineState;
  error?: string | null;
  /** The first completion's latency since the engine became ready (fimble/status `firstLatencyMs`). */
  firstLatencyMs?: number | null;
}

/**
 * An engine state from a `fimble/status` notification (`{state, message, firstLatencyMs, ...}`, state
 * `stopped` / `loading` / `ready` / `error`) or a `fimble/stats` answer (`{engine: {state, error}}`, state
 * `starting` while loading).
 */
export function parseStatus(p: unknown): EngineStatus | undefined {
  if (!p || typeof p !== 'object') return undefined;
  const obj = p as Record<string, unknown>;
  const fromStats = !!obj.engine && typeof obj.engine === 'object';
  const src = (fromStats ? obj.engine : obj) as Record<string, unknown>;
  const raw = typeof src.state === 'string' ? src.state : undefined;
  const state = raw === 'loading' ? 'starting' : raw;
  if (state !== 'starting' && state !== 'ready' && state !== 'error' && state !== 'stopped') return undefined;
  const reason = fromStats ? src.error : state === 'error' ? (src.message ?? src.error) : src.error;
  const first = src.firstLatencyMs;
  return {
    state,
    error: typeof reason === 'string' ? reason : null,
    firstLatencyMs: typeof first === 'number' && Number.isFinite(first) ? first : null,
  };
}

export class StatusWatcher {
  private last: string | undefined;
  private polling = false;
  private notifiedOnce = false;
  private polls = 0;
  private generation = 0;

  constructor(
    private readonly stats: () => PromiseLike<unknown>,
    private readonly listener: (s: EngineStatus) => void,
    private readonly later: (fn: () => void, ms: number) => unknown,
    readonly intervalMs = 500,
    readonly maxPolls = 1200, // ten minutes of loading at most
  ) {}

  /** Start (or restart) polling until the engine is ready or failed, unless the server notifies. */
  start(): void {
    this.generation++;
    this.polls = 0;
    this.polling = true;
    void this.poll(this.generation);
  }

  stop(): void {
    this.generation++;
    this.polling = false;
  }

  /** A `fimble/status` notification: it is the source from now on. */
  notified(p: unknown): void {
    const s = parseStatus(p);
    if (!s) return;
    this.notifiedOnce = true;
    this.emit(s);
  }

  private emit(s: EngineStatus): void {
    const key = `${s.state}\u0000${s.error ?? ''}\u0000${s.firstLatencyMs ?? ''}`;
    if (key === this.last) return;
    this.last = key;
    this.listener(s);
  }

  private async poll(gen: number): Promise<void> {
    if (!this.polling || gen !== this.generation || this.notifiedOnce) return;
    let s: EngineStatus | undefined;
    try {
      s = parseStatus(await this.stats());
    } catch {
      s = undefined; // the server is going away or too old: try again later
    }
    if (gen !== this.generation || this.notifiedOnce) return;
    if (s) this.emit(s);
    this.polls++;
    if (s && (s.state === 'ready' || s.state === 'error')) {
      this.polling = false;
      return;
    }
    if (this.polls < this.maxPolls) this.later(() => void this.poll(gen), this.intervalMs);
  }
}

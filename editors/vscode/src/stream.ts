// Streaming ghost text for VS Code: fimble/completionDelta notifications -> a growing inline suggestion.
//
// VS Code has no API to change a shown inline suggestion, so when a delta changes the text for the
// cursor the user is still at, the extension re-triggers inline suggestions
// (`editor.action.inlineSuggest.trigger`) and the middleware answers that request locally from the
// delta (no new server request, so the server's stream keeps going). Anything that no longer
// matches the document (another version, another cursor, typed text that disagrees) is dropped.
//
// VS Code may drop a re-trigger: it does not ask the provider again when the suggestion it shows
// came from an explicit request at the same cursor and document version (VS Code 1.100's
// InlineCompletionsSource: a new request is "satisfied" by the old one). So a re-trigger after an
// explicitly requested answer is forced (`force`: hide, then trigger), and a re-trigger that the
// provider never saw within RETRY_MS is retried forced, so the shown text always ends as the
// server's final text (its `done` delta, which may also be shorter: validation cut it).
//
// Every item keeps the server's replace range: its end may lie past the cursor, over auto-paired
// closers the text re-types (`sqrt(|)` + `1.0) / 2.0` replaces the `)`), so nothing is doubled; its start
// may lie before the cursor on an indentation-only line (`replaceStart`: a dedent replaces the indentation).
//
// Pure: no `vscode` import; the editor is reached through `StreamHost`, so this is unit-tested.

/** How long a re-trigger may go unanswered before it is retried (forced). */
export const RETRY_MS = 250;
/** Retries per spot: a re-trigger VS Code keeps dropping (an unfocused editor) is not retried forever. */
export const MAX_RETRIES = 3;

export interface Pos {
  line: number;
  character: number;
}

/** The params of `fimble/completionDelta` (lsp_server/PROTOCOL.md). */
export interface CompletionDelta {
  requestId: number | string;
  token?: unknown;
  completionId?: string;
  uri: string;
  version: number;
  position: Pos;
  text: string;
  done: boolean;
  finishReason?: string | null;
  cached?: boolean;
  /** End of what `text` replaces (client units): past the cursor over auto-paired closers it re-types. */
  replaceEnd?: Pos | null;
  /** Start of what `text` replaces, where it is not `position`: the line's start (a dedent). */
  replaceStart?: Pos | null;
}

/** The parts of a `vscode.TextDocument` used here. */
export interface DocLike {
  uri: { toString(): string };
  version: number;
  lineAt(line: number): { text: string };
}

/** The parts of a `vscode.CancellationToken` used here. */
export interface TokenLike {
  isCancellationRequested: boolean;
}

/** What the streamer needs from the editor. */
export interface StreamHost<Item> {
  /** A `vscode.InlineCompletionItem` inserting `text` over [start, end), carrying `like`'s command. */
  makeItem(text: string, start: Pos, end: Pos, like?: Item): Item;
  /** The text of an item from the server (undefined for snippets and other shapes). */
  itemText(item: Item): string | undefined;
  /** The end of an item's range, if it has one. */
  itemRangeEnd(item: Item): Pos | undefined;
  /** The start of an item's range, if it has one. */
  itemRangeStart?(item: Item): Pos | undefined;
  /** Ask VS Code for inline suggestions again (it calls the provider, which answers locally).
   *  `force`: hide the current suggestion first, so VS Code cannot consider the request already served. */
  retrigger(force: boolean): void;
  /** setTimeout (replaceable in tests). */
  later(fn: () => void, ms: number): void;
  /** The document version and cursor of the active editor showing `uri`, if any. */
  cursorOf(uri: string): { version: number; position: Pos } | undefined;
  /** Status bar / log updates. */
  onState?(state: 'busy' | 'idle', latencyMs?: number): void;
  now(): number;
}

type ItemsResult<Item> = Item[] | { items: Item[] } | null | undefined;
export type Next<Item> = () => PromiseLike<ItemsResult<Item>> | ItemsResult<Item>;

export function samePos(a: Pos, b: Pos): boolean {
  return a.line === b.line && a.character === b.character;
}

/** Where a delta's text starts replacing: its `replaceStart` (a dedent, same line, before the cursor) or its position. */
export function startOf(d: CompletionDelta): Pos {
  const s = d.replaceStart;
  return s && s.line === d.position.line && s.character < d.position.character ? s : d.position;
}

/**
 * What is left to insert of `text` (suggested at `anchor`) when the cursor is at `cursor` on a line
 * that now reads `lineText`; undefined when the typed characters disagree with the suggestion.
 */
export function remainder(text: string, anchor: Pos, cursor: Pos, lineText: string): string | undefined {
  if (cursor.line !== anchor.line || cursor.character < anchor.character) return undefined;
  if (lineText.length < cursor.character) return undefined;
  const typed = lineText.slice(anchor.character, cursor.character);
  return text.startsWith(typed) ? text.slice(typed.length) : undefined;
}

interface Shown<Item> {
  version: number;
  position: Pos;
  text: string;
  replaceEnd: Pos;
  start: Pos; // the item's range start: the position, or the line's start (a dedent)
  template?: Item;
  explicit: boolean; // answered to an explicit request: VS Code will not ask again here unless forced
}

interface Pending {
  uri: string;
  at: number;
  retries: number;
  key: string; // version and cursor it was for
}

function spotKey(version: number, p: Pos): string {
  return `${version}:${p.line}:${p.character}`;
}

export class DeltaStreamer<Item> {
  /** uri -> the latest stream's text, for the version and position it applies to. */
  private readonly live = new Map<string, CompletionDelta>();
  /** uri -> what VS Code was last given. */
  private readonly shown = new Map<string, Shown<Item>>();
  /** The re-trigger sent and not yet seen by the provider. */
  private pending: Pending | undefined;
  /** uri -> the spot a server request is out for (its answer will pick up the deltas itself). */
  private readonly inflight = new Map<string, { version: number; position: Pos }>();
  enabled = true;
  /** Counters for tests and the log. */
  readonly counts = {
    deltas: 0, dropped: 0, retriggers: 0, forced: 0, retried: 0, local: 0, server: 0, staleDropped: 0,
  };

  constructor(private readonly host: StreamHost<Item>) {}

  /** Handler for `fimble/completionDelta`. */
  onDelta(d: CompletionDelta): void {
    this.counts.deltas++;
    if (!d || typeof d.uri !== 'string' || typeof d.text !== 'string') return;
    const cur = this.host.cursorOf(d.uri);
    if (!cur || cur.version !== d.version || !samePos(cur.position, d.position)) {
      // The user has moved on: this text no longer applies anywhere.
      this.counts.dropped++;
      const prev = this.live.get(d.uri);
      if (prev && prev.requestId === d.requestId) this.live.delete(d.uri);
      return;
    }
    const prev = this.live.get(d.uri);
    if (
      prev && prev.requestId !== d.requestId && prev.version === d.version && samePos(prev.position, d.position) &&
      prev.text.length > d.text.length
    ) {
      return; // an older, longer stream for the same spot (a superseded request's last word)
    }
    this.live.set(d.uri, d);
    const out = this.inflight.get(d.uri);
    const awaited = out !== undefined && out.version === d.version && samePos(out.position, d.position);
    if (this.enabled && !awaited && this.stale(d.uri, d)) this.requestRetrigger(d.uri, d);
  }

  /** Whether VS Code shows something else than `d` says for its spot. */
  private stale(uri: string, d: CompletionDelta): boolean {
    const shown = this.shown.get(uri);
    if (!shown || shown.version !== d.version || !samePos(shown.position, d.position)) return d.text.length > 0;
    return (
      shown.text !== d.text ||
      !samePos(shown.replaceEnd, d.replaceEnd ?? shown.replaceEnd) ||
      !samePos(shown.start, startOf(d))
    );
  }

  private requestRetrigger(uri: string, d: CompletionDelta, retry = false): void {
    const key = spotKey(d.version, d.position);
    const pending = this.pending;
    if (!retry && pending && pending.uri === uri && pending.key === key) return; // one at a time: recheck() follows up
    const shown = this.shown.get(uri);
    const explicitHere = !!shown && shown.explicit && shown.version === d.version && samePos(shown.position, d.position);
    const force = retry || explicitHere;
    const retries = retry && pending ? pending.retries + 1 : 0;
    this.pending = { uri, at: this.host.now(), retries, key };
    this.counts.retriggers++;
    if (force) this.counts.forced++;
    if (retry) this.counts.retried++;
    this.host.retrigger(force);
    this.host.later(() => this.recheck(uri, key), RETRY_MS);
  }

  /** RETRY_MS after a re-trigger: if the provider never saw it, VS Code dropped it; retry, forced. */
  private recheck(uri: string, key: string): void {
    const pending = this.pending;
    if (!pending || pending.uri !== uri || pending.key !== key) return; // answered (or superseded)
    const d = this.live.get(uri);
    const cur = this.host.cursorOf(uri);
    const here = d && cur && cur.version === d.version && samePos(cur.position, d.position);
    if (!this.enabled || !d || !here || !this.stale(uri, d) || pending.retries >= MAX_RETRIES) {
      this.pending = undefined;
      return;
    }
    this.requestRetrigger(uri, d, true);
  }

  /** Whether a re-trigger is waiting for the provider (tests). */
  get retriggerPending(): boolean {
    return this.pending !== undefined;
  }

  /** What is known for exactly this document version and cursor, if anything. */
  liveFor(uri: string, version: number, position: Pos): CompletionDelta | undefined {
    const d = this.live.get(uri);
    return d && d.version === version && samePos(d.position, position) ? d : undefined;
  }

  /**
   * The inline-completion middleware: `next` sends the request to the server. `explicit`: VS Code's
   * trigger kind was Invoke (our own re-triggers are).
   */
  async provide(
    doc: DocLike,
    position: Pos,
    next: Next<Item>,
    token: TokenLike = { isCancellationRequested: false },
    explicit = false,
  ): Promise<Item[]> {
    const uri = doc.uri.toString();
    if (this.pending && this.pending.uri === uri) this.pending = undefined;
    if (!this.enabled) return [];
    const version = doc.version;
    const pos = { line: position.line, character: position.character };
    const shown = this.shown.get(uri);
    const live = this.liveFor(uri, version, pos);
    if (live && shown && shown.version === version && samePos(shown.position, pos)) {
      // A re-trigger for a stream we already answered here: answer from the stream, no server request.
      this.counts.local++;
      return this.present(
        uri, version, pos, live.text, live.replaceEnd ?? shown.replaceEnd, shown.template, explicit, token, startOf(live),
      );
    }
    this.counts.server++;
    const lineBefore = doc.lineAt(pos.line).text;
    const t0 = this.host.now();
    this.host.onState?.('busy');
    const ticket = { version, position: pos };
    this.inflight.set(uri, ticket);
    let result: ItemsResult<Item>;
    try {
      result = await next();
    } finally {
      if (this.inflight.get(uri) === ticket) this.inflight.delete(uri);
      this.host.onState?.('idle', this.host.now() - t0);
    }
    const items = Array.isArray(result) ? result : result?.items ?? [];
    if (token.isCancellationRequested || items.length === 0) return items;
    const first = items[0];
    let text = this.host.itemText(first);
    if (text === undefined) return items;
    const end = this.host.itemRangeEnd(first);
    let replaceEnd = end && end.line === pos.line && end.character >= pos.character ? end : pos;
    const begin = this.host.itemRangeStart?.(first);
    let start = begin && begin.line === pos.line && begin.character < pos.character ? begin : pos;
    let at = pos;
    if (doc.version !== version && !samePos(start, pos)) {
      this.counts.staleDropped++; // a dedent over a line that has changed since
      return [];
    }
    if (doc.version !== version) {
      // The document changed while the request was out: keep the answer only if the cursor is
      // still on the suggestion (the user typed along it) and the rest of the line is as it was
      // (an auto-inserted closer changes it: then the answer's replace range no longer fits).
      const cur = this.host.cursorOf(uri);
      const line = cur && cur.version === doc.version ? doc.lineAt(cur.position.line).text : undefined;
      const rest =
        cur && line !== undefined && line.slice(cur.position.character) === lineBefore.slice(pos.character)
          ? remainder(text, pos, cur.position, line)
          : undefined;
      if (rest === undefined) {
        this.counts.staleDropped++;
        return [];
      }
      text = rest;
      at = cur!.position;
      start = at;
      replaceEnd = { line: at.line, character: at.character + (replaceEnd.character - pos.character) };
    }
    const d = this.liveFor(uri, doc.version, at);
    if (d && d.text !== text && (d.text.startsWith(text) || (d.done && text.startsWith(d.text)))) {
      text = d.text; // the stream got further (or ended shorter: validation cut it) while the answer travelled
      replaceEnd = d.replaceEnd ?? replaceEnd;
      start = startOf(d);
    }
    return this.present(uri, doc.version, at, text, replaceEnd, first, explicit, token, start);
  }

  private present(
    uri: string, version: number, pos: Pos, text: string, replaceEnd: Pos, template: Item | undefined,
    explicit: boolean, token: TokenLike, start: Pos = pos,
  ): Item[] {
    // A cancelled request's answer is not shown by VS Code: keep the record of what is.
    if (!token.isCancellationRequested) {
      this.shown.set(uri, { version, position: pos, text, replaceEnd, start, template, explicit });
    }
    return text ? [this.host.makeItem(text, start, replaceEnd, template)] : [];
  }

  /** Forget a document (closed) or everything (disabled, restarted). */
  forget(uri?: string): void {
    if (uri === undefined) {
      this.live.clear();
      this.shown.clear();
      this.inflight.clear();
      this.pending = undefined;
    } else {
      this.live.delete(uri);
      this.shown.delete(uri);
      this.inflight.delete(uri);
      if (this.pending?.uri === uri) this.pending = undefined;
    }
  }
}

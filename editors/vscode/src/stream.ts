// Streaming ghost text for VS Code: fimble/completionDelta notifications -> a growing inline suggestion.
//
// VS Code has no API to change a shown inline suggestion, so when a delta grows the text for the
// cursor the user is still at, the extension re-triggers inline suggestions
// (`editor.action.inlineSuggest.trigger`) and the middleware answers that request locally from the
// delta (no new server request, so the server's stream keeps going). Anything that no longer
// matches the document (another version, another cursor, typed text that disagrees) is dropped.
//
// Pure: no `vscode` import; the editor is reached through `StreamHost`, so this is unit-tested.

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
}

/** The parts of a `vscode.TextDocument` used here. */
export interface DocLike {
  uri: { toString(): string };
  version: number;
  lineAt(line: number): { text: string };
}

/** What the streamer needs from the editor. */
export interface StreamHost<Item> {
  /** A `vscode.InlineCompletionItem` inserting `text` at `pos`, carrying `like`'s command. */
  makeItem(text: string, pos: Pos, like?: Item): Item;
  /** The text of an item from the server (undefined for snippets and other shapes). */
  itemText(item: Item): string | undefined;
  /** Ask VS Code for inline suggestions again (it calls the provider, which answers locally). */
  retrigger(): void;
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
  template?: Item;
}

export class DeltaStreamer<Item> {
  /** uri -> the latest stream's text, for the version and position it applies to. */
  private readonly live = new Map<string, CompletionDelta>();
  /** uri -> what VS Code was last given. */
  private readonly shown = new Map<string, Shown<Item>>();
  private retriggerPending = false;
  /** uri -> the spot a server request is out for (its answer will pick up the deltas itself). */
  private readonly inflight = new Map<string, { version: number; position: Pos }>();
  enabled = true;
  /** Counters for tests and the log. */
  readonly counts = { deltas: 0, dropped: 0, retriggers: 0, local: 0, server: 0, staleDropped: 0 };

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
    if (prev && prev.version === d.version && samePos(prev.position, d.position) && prev.text.length > d.text.length) {
      return; // an older, shorter stream for the same spot (e.g. a superseded request's last word)
    }
    this.live.set(d.uri, d);
    const shown = this.shown.get(d.uri);
    const grows =
      !shown ||
      shown.version !== d.version ||
      !samePos(shown.position, d.position) ||
      (d.text.length > shown.text.length && d.text.startsWith(shown.text));
    const out = this.inflight.get(d.uri);
    const awaited = out !== undefined && out.version === d.version && samePos(out.position, d.position);
    if (this.enabled && grows && !awaited && d.text.length > 0 && !this.retriggerPending) {
      this.retriggerPending = true;
      this.counts.retriggers++;
      this.host.retrigger();
    }
  }

  /** What is known for exactly this document version and cursor, if anything. */
  liveFor(uri: string, version: number, position: Pos): CompletionDelta | undefined {
    const d = this.live.get(uri);
    return d && d.version === version && samePos(d.position, position) ? d : undefined;
  }

  /** The inline-completion middleware: `next` sends the request to the server. */
  async provide(doc: DocLike, position: Pos, next: Next<Item>, cancelled: () => boolean = () => false): Promise<Item[]> {
    this.retriggerPending = false;
    if (!this.enabled) return [];
    const uri = doc.uri.toString();
    const version = doc.version;
    const pos = { line: position.line, character: position.character };
    const shown = this.shown.get(uri);
    const live = this.liveFor(uri, version, pos);
    if (live && shown && shown.version === version && samePos(shown.position, pos) && live.text.startsWith(shown.text)) {
      // A re-trigger for a stream we already asked for: answer from the stream, no server request.
      this.counts.local++;
      return this.present(uri, version, pos, live.text, shown.template);
    }
    this.counts.server++;
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
    if (cancelled() || items.length === 0) return items;
    const first = items[0];
    let text = this.host.itemText(first);
    if (text === undefined) return items;
    let at = pos;
    if (doc.version !== version) {
      // The document changed while the request was out: keep the answer only if the cursor is
      // still on the suggestion (the user typed along it); otherwise it is stale.
      const cur = this.host.cursorOf(uri);
      const rest = cur && cur.version === doc.version ? remainder(text, pos, cur.position, doc.lineAt(cur.position.line).text) : undefined;
      if (rest === undefined) {
        this.counts.staleDropped++;
        return [];
      }
      text = rest;
      at = cur!.position;
    }
    const d = this.liveFor(uri, doc.version, at);
    if (d && d.text.length > text.length && d.text.startsWith(text)) text = d.text;
    return this.present(uri, doc.version, at, text, first);
  }

  private present(uri: string, version: number, pos: Pos, text: string, template?: Item): Item[] {
    this.shown.set(uri, { version, position: pos, text, template });
    return text ? [this.host.makeItem(text, pos, template)] : [];
  }

  /** Forget a document (closed) or everything (disabled, restarted). */
  forget(uri?: string): void {
    if (uri === undefined) {
      this.live.clear();
      this.shown.clear();
      this.inflight.clear();
    } else {
      this.live.delete(uri);
      this.shown.delete(uri);
      this.inflight.delete(uri);
    }
    this.retriggerPending = false;
  }
}

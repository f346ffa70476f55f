// fimble for VS Code: starts `fimble lsp` over stdio and shows its inline completions as ghost text.
//
// vscode-languageclient (>= 10.1) maps LSP `textDocument/inlineCompletion` to VS Code's inline
// completion provider; the middleware below adds streaming (fimble/completionDelta, see stream.ts),
// the on/off switch and the status bar; cursor.ts reports where the cursor rests (fimble/cursor), so the
// server pre-warms its cache there. Accepting all / the next word / the next line is VS Code's
// own (Tab, Ctrl+Right, and the keybinding this package contributes for the next line).

import * as vscode from 'vscode';
import {
  LanguageClient,
  LanguageClientOptions,
  ServerCapabilities,
  ServerOptions,
  State,
  StaticFeature,
  TransportKind,
} from 'vscode-languageclient/node';
import { CompletionDelta, DeltaStreamer, Pos } from './stream';
import { CURSOR_METHOD, CursorParams, CursorReporter } from './cursor';
import { ConfigReader, ServerLaunch, clientKey, needsRestart, serverLaunch, wireSettings } from './settings';
import { DocumentFilterLike, documentSelector, enabledLanguages, modelLanguages, userLanguages } from './languages';
import { EngineStatus, STATUS_METHOD, StatusWatcher } from './status';

export { wireSettings, serverLaunch, needsRestart, clientKey, userValue, LAUNCH_SETTINGS } from './settings';
export { DeltaStreamer, remainder, startOf, RETRY_MS, MAX_RETRIES } from './stream';
export { CursorReporter, CURSOR_METHOD } from './cursor';
export { SOURCE_LANGUAGES, enabledLanguages, languageEnabled, documentSelector, modelLanguages } from './languages';
export { StatusWatcher, STATUS_METHOD, parseStatus } from './status';

export const DELTA_METHOD = 'fimble/completionDelta';
export const SECTION = 'fimble';
/** How long a stop (restart, settings change) waits for the server's shutdown before it is killed. */
export const STOP_TIMEOUT_MS = 10000;

/**
 * Advertise `experimental.fimble.completionDelta` so the server streams even if `streaming` is unset, and
 * `replaceStart`: VS Code shows an item whose range starts before the cursor on its line (a dedent over the
 * auto-indentation, lsp_server/line_start.py), so the server may decode an indentation-only line from its start;
 * adapt the client to the server's answer before any feature starts (`preInitialize` runs first):
 * - the documents synced are the source files of the enabled languages (the model's, from the
 *   InitializeResult, and the user's `fimble.languages`), written into the shared selector in place;
 * - the server's `textDocument/completion` fallback is for clients without inline completions: in VS Code
 *   it would put a competing entry into the suggest widget (which hides the ghost text), so it is not
 *   registered.
 */
export class FimbleFeature implements StaticFeature {
  constructor(
    private readonly selector: DocumentFilterLike[],
    private readonly userLangs: () => Record<string, boolean>,
    private readonly onLanguages: (languages: string[], model: string[] | null) => void,
  ) {}
  fillClientCapabilities(capabilities: { experimental?: unknown }): void {
    const exp = (capabilities.experimental ?? {}) as Record<string, unknown>;
    const fimble = (exp.fimble ?? {}) as Record<string, unknown>;
    capabilities.experimental = { ...exp, fimble: { ...fimble, completionDelta: true, status: true, replaceStart: true } };
  }
  fillInitializeParams(): void {}
  preInitialize(capabilities: ServerCapabilities): void {
    const model = modelLanguages(capabilities);
    const langs = enabledLanguages(model, this.userLangs());
    this.selector.splice(0, this.selector.length, ...documentSelector(langs));
    delete (capabilities as { completionProvider?: unknown }).completionProvider;
    this.onLanguages(langs, model);
  }
  initialize(): void {}
  getState(): { kind: 'static' } {
    return { kind: 'static' };
  }
  clear(): void {}
}

type UiState = 'starting' | 'loading' | 'ready' | 'busy' | 'off' | 'stopped' | 'error';

/** The extension's running state (one per activation); exported for tests. */
export class Fimble {
  client: LanguageClient | undefined;
  readonly output: vscode.LogOutputChannel;
  readonly status: vscode.StatusBarItem;
  readonly streamer: DeltaStreamer<vscode.InlineCompletionItem>;
  readonly cursor: CursorReporter;
  /** The documents the client syncs (and reports the cursor of): rewritten when a server starts. */
  readonly selector: DocumentFilterLike[] = [];
  languages: string[] = [];
  private key: ServerLaunch | undefined;
  private prewarm = true; // the server's `prewarm` setting: off, no fimble/cursor either
  private state: UiState = 'starting';
  private engine: StatusWatcher | undefined;
  private reason = ''; // why the state is "error" or "stopped"
  private queue: Promise<void> = Promise.resolve(); // start / stop / restart, one at a time
  lastLatencyMs: number | undefined;
  firstLatencyMs: number | undefined; // the server's (fimble/status): the user's first wait after a start

  constructor(private readonly context: vscode.ExtensionContext) {
    this.output = vscode.window.createOutputChannel('fimble', { log: true });
    this.status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
    this.status.command = 'fimble.toggle';
    this.status.show();
    this.streamer = new DeltaStreamer<vscode.InlineCompletionItem>({
      makeItem: (text, start, end, like) =>
        new vscode.InlineCompletionItem(text, new vscode.Range(toVs(start), toVs(end)), like?.command),
      itemText: (item) => (typeof item.insertText === 'string' ? item.insertText : undefined),
      itemRangeEnd: (item) => (item.range ? { line: item.range.end.line, character: item.range.end.character } : undefined),
      itemRangeStart: (item) =>
        item.range ? { line: item.range.start.line, character: item.range.start.character } : undefined,
      retrigger: (force) => void this.retrigger(force),
      later: (fn, ms) => void setTimeout(fn, ms),
      cursorOf: (uri) => {
        const editor = vscode.window.activeTextEditor;
        if (!editor || editor.document.uri.toString() !== uri) return undefined;
        const p = editor.selection.active;
        return { version: editor.document.version, position: { line: p.line, character: p.character } };
      },
      onState: (s, ms) => {
        if (ms !== undefined && s === 'idle') this.lastLatencyMs = Math.round(ms);
        if (this.state === 'ready' || this.state === 'busy') this.setState(s === 'busy' ? 'busy' : 'ready');
      },
      now: () => Date.now(),
    });
    this.cursor = new CursorReporter((params) => this.sendCursor(params));
    this.streamer.enabled = this.config().get<boolean>('enable') !== false;
    context.subscriptions.push(this.output, this.status);
    this.setState(this.streamer.enabled ? 'starting' : 'off');
  }

  config(): vscode.WorkspaceConfiguration {
    return vscode.workspace.getConfiguration(SECTION);
  }

  private async retrigger(force: boolean): Promise<void> {
    if (force) await vscode.commands.executeCommand('editor.action.inlineSuggest.hide');
    await vscode.commands.executeCommand('editor.action.inlineSuggest.trigger');
  }

  setState(state: UiState, reason?: string): void {
    this.state = state;
    if (reason !== undefined) this.reason = reason;
    const latest = this.lastLatencyMs ?? this.firstLatencyMs;
    const ms = latest !== undefined ? ` ${latest} ms` : '';
    const first = this.firstLatencyMs !== undefined ? `first completion ${this.firstLatencyMs} ms` : '';
    const last = this.lastLatencyMs !== undefined ? `last ${this.lastLatencyMs} ms` : '';
    const timings = [first, last].filter(Boolean).join(', ');
    const view: Record<UiState, [string, string]> = {
      starting: ['$(loading~spin) fimble: starting', 'starting the server'],
      loading: ['$(loading~spin) fimble: loading model', 'loading the model: no completions until it is ready'],
      ready: [`$(sparkle) fimble${ms}`, timings ? `ready (${timings})` : 'ready'],
      busy: [`$(sync~spin) fimble${ms}`, 'completing'],
      off: ['$(circle-slash) fimble', 'off'],
      stopped: ['$(debug-stop) fimble: stopped', `stopped${this.reason ? `: ${this.reason}` : ''}`],
      error: ['$(error) fimble: error', `error: ${this.reason || 'unknown'}`],
    };
    const [text, tip] = view[state];
    this.status.text = text;
    this.status.tooltip = `fimble: ${tip}. Click to turn ${state === 'off' ? 'on' : 'off'}.`;
  }

  getState(): UiState {
    return this.state;
  }

  /** The engine's state changed (fimble/status, or polled): loading model / ready / error. */
  private engineChanged(s: EngineStatus): void {
    if (typeof s.firstLatencyMs === 'number') this.firstLatencyMs = Math.round(s.firstLatencyMs);
    if (!this.streamer.enabled || this.state === 'off') return;
    if (s.state === 'error') {
      const first = this.state !== 'error';
      this.setState('error', s.error ?? 'the model could not be loaded');
      this.output.error(`fimble: engine error: ${this.reason}`);
      if (first) void vscode.window.showErrorMessage(`fimble: ${this.reason}`);
    } else if (s.state === 'starting') {
      this.setState('loading');
    } else if (this.state !== 'busy') {
      this.setState('ready'); // "ready", or "stopped" with preload off: the model loads at the first request
    }
  }

  /** A selection change or another active editor: report the cursor once it rests (fimble/cursor). */
  cursorMoved(editor: vscode.TextEditor | undefined): void {
    const client = this.client;
    if (!editor || !client || !this.prewarm || !this.streamer.enabled) return;
    const doc = editor.document;
    if (this.selector.length === 0 || vscode.languages.match(this.selector, doc) <= 0) return;
    const c2p = client.code2ProtocolConverter;
    this.cursor.moved(c2p.asUri(doc.uri), doc.version, c2p.asPosition(editor.selection.active));
  }

  private sendCursor(params: CursorParams): void {
    const client = this.client;
    if (!client || client.state !== State.Running || !this.prewarm || !this.streamer.enabled) return;
    client.sendNotification(CURSOR_METHOD, params).catch((err: unknown) => {
      this.output.debug(`fimble: ${CURSOR_METHOD} not sent: ${String(err)}`);
    });
  }

  /** Run start / stop / restart one after another (a restart while starting waits for the start). */
  private serial(job: () => Promise<void>): Promise<void> {
    const run = this.queue.then(job, job);
    this.queue = run.catch(() => undefined);
    return run;
  }

  start(): Promise<void> {
    return this.serial(() => this.doStart());
  }

  stop(): Promise<void> {
    return this.serial(() => this.doStop());
  }

  /** Stop (however long the old server takes: it is killed past STOP_TIMEOUT_MS), then always start again. */
  restart(): Promise<void> {
    return this.serial(async () => {
      if (this.streamer.enabled) this.setState('starting');
      await this.doStop();
      await this.doStart();
    });
  }

  private async doStart(): Promise<void> {
    const cfg = this.config();
    const launch = serverLaunch(cfg as ConfigReader);
    this.key = clientKey(cfg as ConfigReader);
    this.firstLatencyMs = undefined;
    this.lastLatencyMs = undefined;
    this.prewarm = cfg.get<boolean>('prewarm') !== false;
    this.cursor.reset();
    if (this.streamer.enabled) this.setState('starting', '');
    const run = {
      command: launch.command,
      args: launch.args,
      transport: TransportKind.stdio,
      options: { env: { ...process.env, ...launch.env } },
    };
    const serverOptions: ServerOptions = { run, debug: run };
    this.selector.splice(0, this.selector.length); // nothing synced until the server said which languages
    const clientOptions: LanguageClientOptions = {
      documentSelector: this.selector,
      initializationOptions: wireSettings(cfg as ConfigReader),
      outputChannel: this.output,
      middleware: {
        provideInlineCompletionItems: (document, position, context, token, next) =>
          this.streamer.provide(
            document,
            position,
            () => next(document, position, context, token),
            token,
            context.triggerKind === vscode.InlineCompletionTriggerKind.Invoke,
          ),
      },
    };
    const client = new LanguageClient('fimble', 'fimble', serverOptions, clientOptions);
    const userLangs = () => userLanguages(this.config().get<unknown>('languages'));
    client.registerFeature(
      new FimbleFeature(this.selector, userLangs, (langs, model) => {
        this.languages = langs;
        this.output.info(`fimble: completing ${langs.join(', ') || 'no languages'} (model: ${model ? model.join(', ') : 'any language'})`);
      }),
    );
    this.client = client;
    client.onDidChangeState((e) => {
      if (this.client !== client) return; // an old client stopping
      if (e.newState === State.Stopped) this.setState(this.streamer.enabled ? 'stopped' : 'off', 'the server exited');
    });
    const engine = new StatusWatcher(
      () => client.sendRequest('fimble/stats', {}),
      (s) => {
        if (this.client === client) this.engineChanged(s);
      },
      (fn, ms) => setTimeout(fn, ms),
    );
    this.engine = engine;
    client.onNotification(STATUS_METHOD, (p: unknown) => engine.notified(p));
    client.onNotification(DELTA_METHOD, (d: CompletionDelta) => this.streamer.onDelta(d));
    try {
      await client.start();
      this.output.info(`fimble: started ${launch.command} ${launch.args.join(' ')}`);
      if (this.streamer.enabled) this.setState('loading');
      engine.start();
    } catch (err) {
      this.setState('error', `could not start "${launch.command}"`);
      this.output.error(`fimble: could not start ${launch.command}: ${String(err)}`);
      void vscode.window.showErrorMessage(
        `fimble: could not start "${launch.command}". Set fimble.server.command (user settings) to the fimble executable.`,
      );
    }
  }

  private async doStop(): Promise<void> {
    const client = this.client;
    this.client = undefined;
    this.engine?.stop();
    this.engine = undefined;
    this.streamer.forget();
    this.cursor.reset();
    if (!client) return;
    try {
      if (client.state === State.Running) await client.stop(STOP_TIMEOUT_MS);
      else if (client.state === State.Starting) await client.dispose(STOP_TIMEOUT_MS);
    } catch (err) {
      // Timed out or failed: the language client kills the process; the next start must not depend on it.
      this.output.warn(`fimble: the server did not stop cleanly (${String(err)}); it is ended`);
    }
  }

  toggle(): boolean {
    this.streamer.enabled = !this.streamer.enabled;
    this.streamer.forget();
    if (this.streamer.enabled) {
      this.setState(this.client ? 'ready' : 'stopped');
      this.engine?.start(); // re-read the engine's state
    } else {
      this.setState('off');
    }
    if (!this.streamer.enabled) void vscode.commands.executeCommand('editor.action.inlineSuggest.hide');
    return this.streamer.enabled;
  }

  async configurationChanged(): Promise<void> {
    const cfg = this.config();
    const key = clientKey(cfg as ConfigReader);
    if (!this.key || needsRestart(this.key, key)) {
      await this.restart();
      return;
    }
    this.prewarm = cfg.get<boolean>('prewarm') !== false;
    await this.client?.sendNotification('workspace/didChangeConfiguration', {
      settings: { fimble: wireSettings(cfg as ConfigReader) },
    });
  }
}

function toVs(p: Pos): vscode.Position {
  return new vscode.Position(p.line, p.character);
}

let instance: Fimble | undefined;

export async function activate(context: vscode.ExtensionContext): Promise<Fimble> {
  const fimble = new Fimble(context);
  instance = fimble;
  context.subscriptions.push(
    vscode.commands.registerCommand('fimble.toggle', () => fimble.toggle()),
    vscode.commands.registerCommand('fimble.showLogs', () => fimble.output.show(true)),
    vscode.commands.registerCommand('fimble.restart', () => fimble.restart()),
    vscode.workspace.onDidChangeConfiguration((e) => {
      if (e.affectsConfiguration(SECTION)) void fimble.configurationChanged();
    }),
    vscode.workspace.onDidCloseTextDocument((doc) => {
      fimble.streamer.forget(doc.uri.toString());
      fimble.cursor.reset(); // reopened, its versions start again
    }),
    vscode.window.onDidChangeTextEditorSelection((e) => fimble.cursorMoved(e.textEditor)),
    vscode.window.onDidChangeActiveTextEditor((editor) => fimble.cursorMoved(editor)),
  );
  await fimble.start();
  return fimble;
}

export async function deactivate(): Promise<void> {
  const fimble = instance;
  instance = undefined;
  await fimble?.stop();
}

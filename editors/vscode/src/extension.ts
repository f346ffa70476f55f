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
  ServerOptions,
  State,
  StaticFeature,
  TransportKind,
} from 'vscode-languageclient/node';
import { CompletionDelta, DeltaStreamer, Pos } from './stream';
import { CURSOR_METHOD, CursorParams, CursorReporter } from './cursor';
import { ConfigReader, ServerLaunch, needsRestart, serverLaunch, wireSettings } from './settings';

export { wireSettings, serverLaunch, needsRestart } from './settings';
export { DeltaStreamer, remainder } from './stream';
export { CursorReporter, CURSOR_METHOD } from './cursor';

export const DELTA_METHOD = 'fimble/completionDelta';
export const SECTION = 'fimble';
/** The documents the client syncs to the server (and reports the cursor of). */
export const DOCUMENT_SELECTOR = [{ scheme: 'file' }, { scheme: 'untitled' }];

/** Advertise `experimental.fimble.completionDelta` so the server streams even if `streaming` is unset. */
export class CompletionDeltaFeature implements StaticFeature {
  fillClientCapabilities(capabilities: { experimental?: unknown }): void {
    const exp = (capabilities.experimental ?? {}) as Record<string, unknown>;
    const fimble = (exp.fimble ?? {}) as Record<string, unknown>;
    capabilities.experimental = { ...exp, fimble: { ...fimble, completionDelta: true } };
  }
  fillInitializeParams(): void {}
  initialize(): void {}
  getState(): { kind: 'static' } {
    return { kind: 'static' };
  }
  clear(): void {}
}

type UiState = 'starting' | 'ready' | 'busy' | 'off' | 'stopped' | 'error';

/** The extension's running state (one per activation); exported for tests. */
export class Fimble {
  client: LanguageClient | undefined;
  readonly output: vscode.LogOutputChannel;
  readonly status: vscode.StatusBarItem;
  readonly streamer: DeltaStreamer<vscode.InlineCompletionItem>;
  readonly cursor: CursorReporter;
  private launch: ServerLaunch | undefined;
  private prewarm = true; // the server's `prewarm` setting: off, no fimble/cursor either
  private state: UiState = 'starting';
  lastLatencyMs: number | undefined;

  constructor(private readonly context: vscode.ExtensionContext) {
    this.output = vscode.window.createOutputChannel('fimble', { log: true });
    this.status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
    this.status.command = 'fimble.toggle';
    this.status.show();
    this.streamer = new DeltaStreamer<vscode.InlineCompletionItem>({
      makeItem: (text, pos, like) =>
        new vscode.InlineCompletionItem(text, new vscode.Range(toVs(pos), toVs(pos)), like?.command),
      itemText: (item) => (typeof item.insertText === 'string' ? item.insertText : undefined),
      retrigger: () => void vscode.commands.executeCommand('editor.action.inlineSuggest.trigger'),
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

  setState(state: UiState): void {
    this.state = state;
    const ms = this.lastLatencyMs !== undefined ? ` ${this.lastLatencyMs} ms` : '';
    const icon: Record<UiState, string> = {
      starting: '$(loading~spin)',
      ready: '$(sparkle)',
      busy: '$(sync~spin)',
      off: '$(circle-slash)',
      stopped: '$(debug-stop)',
      error: '$(error)',
    };
    this.status.text = `${icon[state]} fimble${state === 'ready' || state === 'busy' ? ms : ''}`;
    this.status.tooltip = `fimble: ${state}${ms ? ` (last completion${ms})` : ''}. Click to turn ${
      state === 'off' ? 'on' : 'off'
    }.`;
  }

  getState(): UiState {
    return this.state;
  }

  /** A selection change or another active editor: report the cursor once it rests (fimble/cursor). */
  cursorMoved(editor: vscode.TextEditor | undefined): void {
    const client = this.client;
    if (!editor || !client || !this.prewarm || !this.streamer.enabled) return;
    const doc = editor.document;
    if (vscode.languages.match(DOCUMENT_SELECTOR, doc) <= 0) return;
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

  async start(): Promise<void> {
    const cfg = this.config();
    this.launch = serverLaunch(cfg as ConfigReader);
    this.prewarm = cfg.get<boolean>('prewarm') !== false;
    this.cursor.reset();
    const run = {
      command: this.launch.command,
      args: this.launch.args,
      transport: TransportKind.stdio,
      options: { env: { ...process.env, ...this.launch.env } },
    };
    const serverOptions: ServerOptions = { run, debug: run };
    const clientOptions: LanguageClientOptions = {
      documentSelector: DOCUMENT_SELECTOR,
      initializationOptions: wireSettings(cfg as ConfigReader),
      outputChannel: this.output,
      middleware: {
        provideInlineCompletionItems: (document, position, _context, token, next) =>
          this.streamer.provide(document, position, () => next(document, position, _context, token), () => token.isCancellationRequested),
      },
    };
    const client = new LanguageClient('fimble', 'fimble', serverOptions, clientOptions);
    client.registerFeature(new CompletionDeltaFeature());
    this.client = client;
    client.onDidChangeState((e) => {
      if (e.newState === State.Running) this.setState(this.streamer.enabled ? 'ready' : 'off');
      else if (e.newState === State.Stopped) this.setState('stopped');
    });
    try {
      await client.start();
      client.onNotification(DELTA_METHOD, (d: CompletionDelta) => this.streamer.onDelta(d));
      this.output.info(`fimble: started ${this.launch.command} ${this.launch.args.join(' ')}`);
      this.setState(this.streamer.enabled ? 'ready' : 'off');
    } catch (err) {
      this.setState('error');
      this.output.error(`fimble: could not start ${this.launch.command}: ${String(err)}`);
      void vscode.window.showErrorMessage(
        `fimble: could not start "${this.launch.command}". Set fimble.server.command to the fimble executable.`,
      );
    }
  }

  async stop(): Promise<void> {
    const client = this.client;
    this.client = undefined;
    this.streamer.forget();
    this.cursor.reset();
    if (client && client.state !== State.Stopped) await client.stop();
  }

  async restart(): Promise<void> {
    await this.stop();
    await this.start();
  }

  toggle(): boolean {
    this.streamer.enabled = !this.streamer.enabled;
    this.streamer.forget();
    this.setState(this.streamer.enabled ? (this.client ? 'ready' : 'stopped') : 'off');
    if (!this.streamer.enabled) void vscode.commands.executeCommand('editor.action.inlineSuggest.hide');
    return this.streamer.enabled;
  }

  async configurationChanged(): Promise<void> {
    const cfg = this.config();
    const launch = serverLaunch(cfg as ConfigReader);
    if (!this.launch || needsRestart(this.launch, launch)) {
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

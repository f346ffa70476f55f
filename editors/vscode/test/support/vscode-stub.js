// A stub of the `vscode` module, enough for the extension and vscode-languageclient to load, activate,
// start a server and serve inline completions under `node --test` (VS Code itself cannot run here).
// Members the tests do not care about are "auto" values: callable, constructible, and returning
// disposables, so the language client's many registrations succeed without doing anything.
'use strict';

const calls = { commands: [], executed: [], providers: [], completionProviders: [], messages: [], statusItems: [], outputs: [] };
// config: resolved values by full key; configLayers: full key -> { defaultValue, globalValue, workspaceValue }
// (what `inspect` returns; a key there resolves workspace > global > default, as VS Code does).
const state = { config: {}, configLayers: {}, activeTextEditor: undefined, textDocuments: [], onExecute: {}, isTrusted: true };

function auto(name = 'auto') {
  const fn = function () {};
  return new Proxy(fn, {
    get(target, prop) {
      if (prop === 'then' || typeof prop === 'symbol') return undefined; // never look like a promise
      if (prop === 'dispose') return () => {};
      if (prop === 'toString') return () => `[stub ${name}]`;
      if (!(prop in target)) target[prop] = auto(`${name}.${String(prop)}`);
      return target[prop];
    },
    apply() {
      return auto(`${name}()`);
    },
    construct() {
      return auto(`new ${name}`);
    },
  });
}

function withAuto(obj, name) {
  return new Proxy(obj, {
    get(target, prop) {
      if (prop in target || typeof prop === 'symbol' || prop === 'then') return target[prop];
      target[prop] = auto(`${name}.${String(prop)}`);
      return target[prop];
    },
  });
}

class Disposable {
  constructor(fn) {
    this._fn = fn;
  }
  static from(...items) {
    return new Disposable(() => items.forEach((d) => d && d.dispose && d.dispose()));
  }
  dispose() {
    if (this._fn) this._fn();
    this._fn = undefined;
  }
}

class EventEmitter {
  constructor() {
    this._listeners = new Set();
    this.event = (listener, thisArg) => {
      const l = thisArg ? listener.bind(thisArg) : listener;
      this._listeners.add(l);
      return new Disposable(() => this._listeners.delete(l));
    };
  }
  fire(value) {
    for (const l of [...this._listeners]) l(value);
  }
  dispose() {
    this._listeners.clear();
  }
}

class Position {
  constructor(line, character) {
    this.line = line;
    this.character = character;
  }
  isEqual(o) {
    return o.line === this.line && o.character === this.character;
  }
}

class Range {
  constructor(a, b, c, d) {
    if (typeof a === 'number') {
      this.start = new Position(a, b);
      this.end = new Position(c, d);
    } else {
      this.start = a;
      this.end = b;
    }
  }
}

class Selection extends Range {
  constructor(anchor, active) {
    super(anchor, active);
    this.anchor = anchor;
    this.active = active;
  }
}

class InlineCompletionItem {
  constructor(insertText, range, command) {
    this.insertText = insertText;
    this.range = range;
    this.command = command;
  }
}

class InlineCompletionList {
  constructor(items) {
    this.items = items;
  }
}

class Uri {
  constructor(scheme, path) {
    this.scheme = scheme;
    this.path = path;
    this.fsPath = path;
  }
  static parse(s) {
    const m = /^([a-z][\w+.-]*):(?:\/\/)?(.*)$/i.exec(s);
    return m ? new Uri(m[1], m[2].startsWith('/') ? m[2] : `/${m[2]}`) : new Uri('file', s);
  }
  static file(p) {
    return new Uri('file', p);
  }
  toString() {
    return `${this.scheme}://${this.path}`;
  }
  with() {
    return this;
  }
}

class CancellationTokenSource {
  constructor() {
    const emitter = new EventEmitter();
    this.token = { isCancellationRequested: false, onCancellationRequested: emitter.event };
    this._emitter = emitter;
  }
  cancel() {
    this.token.isCancellationRequested = true;
    this._emitter.fire();
  }
  dispose() {}
}

class CancellationError extends Error {}

/** A text document from lines; `edit` replaces its text and bumps the version. */
class StubDocument {
  constructor(uri, text, languageId = 'python', version = 1) {
    this.uri = Uri.parse(uri);
    this.languageId = languageId;
    this.version = version;
    this._text = text;
    this.isClosed = false;
    this.isUntitled = false;
    this.eol = 1;
  }
  getText() {
    return this._text;
  }
  get lineCount() {
    return this._text.split('\n').length;
  }
  lineAt(line) {
    const text = this._text.split('\n')[typeof line === 'number' ? line : line.line];
    return { text, lineNumber: line };
  }
  edit(text) {
    this._text = text;
    this.version += 1;
  }
}

function config(section) {
  const full = (key) => (section ? `${section}.${key}` : key);
  const get = (key, dflt) => {
    const layers = state.configLayers[full(key)];
    if (layers) {
      for (const v of [layers.workspaceValue, layers.globalValue, layers.defaultValue]) if (v !== undefined) return v;
      return dflt;
    }
    return Object.prototype.hasOwnProperty.call(state.config, full(key)) ? state.config[full(key)] : dflt;
  };
  const inspect = (key) => {
    const layers = state.configLayers[full(key)];
    return layers ? { key: full(key), ...layers } : undefined;
  };
  return { get, has: (k) => get(k) !== undefined, inspect, update: async () => {} };
}

const configChanged = new EventEmitter();
const selectionChanged = new EventEmitter(); // fire({ textEditor }) for window.onDidChangeTextEditorSelection

const workspace = withAuto(
  {
    getConfiguration: config,
    onDidChangeConfiguration: configChanged.event,
    get textDocuments() {
      return state.textDocuments;
    },
    workspaceFolders: undefined,
    get isTrusted() {
      return state.isTrusted;
    },
    onDidOpenTextDocument: new EventEmitter().event,
    onDidCloseTextDocument: new EventEmitter().event,
    onDidChangeTextDocument: new EventEmitter().event,
    onDidSaveTextDocument: new EventEmitter().event,
    onWillSaveTextDocument: new EventEmitter().event,
    onDidChangeWorkspaceFolders: new EventEmitter().event,
  },
  'workspace',
);

function outputChannel(name) {
  const lines = [];
  const ch = withAuto(
    {
      name,
      lines,
      shown: 0,
      logLevel: 2,
      onDidChangeLogLevel: new EventEmitter().event,
      append: (s) => lines.push(s),
      appendLine: (s) => lines.push(s),
      show() {
        ch.shown += 1;
      },
      dispose() {},
    },
    'output',
  );
  for (const level of ['trace', 'debug', 'info', 'warn', 'error']) ch[level] = (...a) => lines.push(`[${level}] ${a.join(' ')}`);
  calls.outputs.push(ch);
  return ch;
}

const window = withAuto(
  {
    get activeTextEditor() {
      return state.activeTextEditor;
    },
    get visibleTextEditors() {
      return state.activeTextEditor ? [state.activeTextEditor] : [];
    },
    onDidChangeActiveTextEditor: new EventEmitter().event,
    tabGroups: { all: [], onDidChangeTabs: new EventEmitter().event, onDidChangeTabGroups: new EventEmitter().event },
    onDidChangeTextEditorSelection: selectionChanged.event,
    onDidChangeVisibleTextEditors: new EventEmitter().event,
    createOutputChannel: outputChannel,
    createStatusBarItem(alignment, priority) {
      const item = { alignment, priority, text: '', tooltip: '', command: undefined, visible: false };
      item.show = () => (item.visible = true);
      item.hide = () => (item.visible = false);
      item.dispose = () => {};
      calls.statusItems.push(item);
      return item;
    },
    showErrorMessage: async (m) => (calls.messages.push(['error', m]), undefined),
    showWarningMessage: async (m) => (calls.messages.push(['warning', m]), undefined),
    showInformationMessage: async (m) => (calls.messages.push(['info', m]), undefined),
  },
  'window',
);

const commands = withAuto(
  {
    registerCommand(name, fn) {
      calls.commands.push(name);
      state.onExecute[name] = fn;
      return new Disposable(() => delete state.onExecute[name]);
    },
    async executeCommand(name, ...args) {
      calls.executed.push(name);
      const fn = state.onExecute[name];
      return fn ? fn(...args) : undefined;
    },
  },
  'commands',
);

const languages = withAuto(
  {
    registerInlineCompletionItemProvider(selector, provider) {
      const entry = { selector, provider };
      calls.providers.push(entry);
      return new Disposable(() => calls.providers.splice(calls.providers.indexOf(entry), 1));
    },
    registerCompletionItemProvider(selector, provider) {
      const entry = { selector, provider };
      calls.completionProviders.push(entry);
      return new Disposable(() => calls.completionProviders.splice(calls.completionProviders.indexOf(entry), 1));
    },
    /** VS Code's score, simplified: 10 if a filter's scheme and language (where given) both match. */
    match(selector, doc) {
      const filters = Array.isArray(selector) ? selector : [selector];
      let best = 0;
      for (const f of filters) {
        if (typeof f === 'string') {
          if (f === doc.languageId || f === '*') best = Math.max(best, 10);
          continue;
        }
        if (f.scheme && f.scheme !== doc.uri.scheme) continue;
        if (f.language && f.language !== doc.languageId && f.language !== '*') continue;
        if (f.pattern) continue; // not needed by the extension
        best = Math.max(best, 10);
      }
      return best;
    },
  },
  'languages',
);

const stub = {
  calls,
  state,
  configChanged,
  selectionChanged,
  StubDocument,
  version: '1.91.0',
  Disposable,
  EventEmitter,
  Position,
  Range,
  Selection,
  InlineCompletionItem,
  InlineCompletionList,
  InlineCompletionTriggerKind: { Invoke: 0, Automatic: 1 },
  Uri,
  CancellationTokenSource,
  CancellationError,
  StatusBarAlignment: { Left: 1, Right: 2 },
  ConfigurationTarget: { Global: 1, Workspace: 2, WorkspaceFolder: 3 },
  LogLevel: { Off: 0, Trace: 1, Debug: 2, Info: 3, Warning: 4, Error: 5 },
  workspace,
  window,
  commands,
  languages,
  env: withAuto({ language: 'en', appName: 'stub', machineId: 'stub', uriScheme: 'vscode' }, 'env'),
  extensions: withAuto({ all: [], getExtension: () => undefined }, 'extensions'),
};

module.exports = withAuto(stub, 'vscode');

// VS Code settings (the `fimble.*` section) -> fimble's wire settings (lsp_server/PROTOCOL.md, "Settings").
// Pure: no `vscode` import, so it is unit-tested directly.

/** What the extension needs from a `WorkspaceConfiguration`. */
export interface ConfigReader {
  get<T>(section: string): T | undefined;
  /** Where a value comes from (`WorkspaceConfiguration.inspect`). */
  inspect?<T>(section: string): { defaultValue?: T; globalValue?: T } | undefined;
}

/**
 * Settings that decide which process runs (or what it loads): `machine` scope in package.json, and read
 * from the user's own settings only, never from a workspace's (a cloned repository's
 * .vscode/settings.json must not choose the command the extension runs). Machine scope makes
 * VS Code ignore workspace values already; reading `globalValue` keeps that true in an untrusted
 * workspace and in hosts that do not apply scopes.
 */
export const LAUNCH_SETTINGS = ['server.command', 'server.args', 'server.env', 'model', 'draft'] as const;

/** `key` from the user's (or the default) settings, ignoring workspace and folder values. */
export function userValue<T>(cfg: ConfigReader, key: string): T | undefined {
  if (typeof cfg.inspect !== 'function') return cfg.get<T>(key);
  const info = cfg.inspect<T>(key);
  if (info === undefined) return cfg.get<T>(key); // not a contributed setting (tests' plain readers)
  return info.globalValue !== undefined ? info.globalValue : info.defaultValue;
}

/** Settings passed through unchanged (same name in VS Code and on the wire), with their type. */
const PASS_THROUGH: Readonly<Record<string, 'bool' | 'int' | 'string'>> = {
  noDraft: 'bool',
  device: 'string',
  engineThreads: 'int',
  drafter: 'string',
  maxLines: 'int',
  maxTokens: 'int',
  debounceMs: 'int',
  earlyAnswerMs: 'int',
  answerAt: 'string',
  prefetch: 'bool',
  tokenHealing: 'bool',
  prefixChars: 'int',
  suffixChars: 'int',
  preload: 'bool',
  kvCacheMB: 'int',
  kvShiftReuse: 'bool',
  prewarm: 'bool',
  prewarmDelayMs: 'int',
};

function fits(kind: 'bool' | 'int' | 'string', v: unknown): boolean {
  if (kind === 'bool') return typeof v === 'boolean';
  if (kind === 'string') return typeof v === 'string';
  return typeof v === 'number' && Number.isInteger(v) && v >= 0;
}

export interface ServerLaunch {
  command: string;
  args: string[];
  env: Record<string, string>;
  /** Not part of the command line, but a new model can know other languages: a new client reads them. */
  model?: string;
  languages?: Record<string, boolean>;
}

/** How to start the server: `fimble.server.command` / `.args` / `.env`. */
export function serverLaunch(cfg: ConfigReader): ServerLaunch {
  const command = (userValue<string>(cfg, 'server.command') || 'fimble').trim() || 'fimble';
  const rawArgs = userValue<unknown>(cfg, 'server.args');
  const args = Array.isArray(rawArgs) && rawArgs.every((a) => typeof a === 'string') ? (rawArgs as string[]) : ['lsp'];
  const rawEnv = userValue<unknown>(cfg, 'server.env');
  const env: Record<string, string> = {};
  if (rawEnv && typeof rawEnv === 'object') {
    for (const [k, v] of Object.entries(rawEnv as Record<string, unknown>)) {
      if (typeof v === 'string') env[k] = v;
    }
  }
  return { command, args, env };
}

/** What a running client depends on: the launch, the model (its languages) and `fimble.languages`. */
export function clientKey(cfg: ConfigReader): ServerLaunch {
  const model = userValue<unknown>(cfg, 'model');
  const langs = cfg.get<unknown>('languages');
  return {
    ...serverLaunch(cfg),
    model: typeof model === 'string' ? model.trim() : '',
    languages: langs && typeof langs === 'object' && !Array.isArray(langs) ? (langs as Record<string, boolean>) : {},
  };
}

/**
 * The `initializationOptions` / `didChangeConfiguration` object.
 *
 * - `model` / `draft` are sent only when set (an empty string would reset a server started
 *   with `--model` or `$FIMBLE_MODEL` to the embedded model).
 * - `streaming` is on unless the user turned it off: ghost text grows with `fimble/completionDelta`.
 * - `languages` (languageId -> boolean, `"*"` the rest) becomes the server's `enable`; `"*": true` also
 *   sends `languages: ["*"]` (every language, not only the model's: PROTOCOL.md "Languages").
 * - Values of the wrong type are left out (the server would ignore them with a warning anyway).
 */
export function wireSettings(cfg: ConfigReader): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const key of ['model', 'draft']) {
    const v = userValue<unknown>(cfg, key);
    if (typeof v === 'string' && v.trim() !== '') out[key] = v.trim();
  }
  for (const [key, kind] of Object.entries(PASS_THROUGH)) {
    const v = cfg.get<unknown>(key);
    if (fits(kind, v)) out[key] = v;
  }
  const langs = cfg.get<unknown>('languages');
  if (langs && typeof langs === 'object' && !Array.isArray(langs)) {
    const enable: Record<string, boolean> = {};
    for (const [lang, on] of Object.entries(langs as Record<string, unknown>)) {
      if (typeof on === 'boolean') enable[lang] = on;
    }
    if (Object.keys(enable).length) out.enable = enable;
    if (enable['*'] === true) out.languages = ['*'];
  }
  out.streaming = cfg.get<boolean>('streaming') !== false;
  return out;
}

/** Settings whose change needs a new server process (the rest go by didChangeConfiguration). */
export function needsRestart(before: ServerLaunch, after: ServerLaunch): boolean {
  return JSON.stringify(before) !== JSON.stringify(after);
}

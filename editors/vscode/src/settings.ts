// VS Code settings (the `fimble.*` section) -> fimble's wire settings (lsp_server/PROTOCOL.md, "Settings").
// Pure: no `vscode` import, so it is unit-tested directly.

/** What the extension needs from a `WorkspaceConfiguration`. */
export interface ConfigReader {
  get<T>(section: string): T | undefined;
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
}

/** How to start the server: `fimble.server.command` / `.args` / `.env`. */
export function serverLaunch(cfg: ConfigReader): ServerLaunch {
  const command = (cfg.get<string>('server.command') || 'fimble').trim() || 'fimble';
  const rawArgs = cfg.get<unknown>('server.args');
  const args = Array.isArray(rawArgs) && rawArgs.every((a) => typeof a === 'string') ? (rawArgs as string[]) : ['lsp'];
  const rawEnv = cfg.get<unknown>('server.env');
  const env: Record<string, string> = {};
  if (rawEnv && typeof rawEnv === 'object') {
    for (const [k, v] of Object.entries(rawEnv as Record<string, unknown>)) {
      if (typeof v === 'string') env[k] = v;
    }
  }
  return { command, args, env };
}

/**
 * The `initializationOptions` / `didChangeConfiguration` object.
 *
 * - `model` / `draft` are sent only when set (an empty string would reset a server started
 *   with `--model` or `$FIMBLE_MODEL` to the embedded model).
 * - `streaming` is on unless the user turned it off: ghost text grows with `fimble/completionDelta`.
 * - `languages` (languageId -> boolean, `"*"` the default) becomes the server's `enable`.
 * - Values of the wrong type are left out (the server would ignore them with a warning anyway).
 */
export function wireSettings(cfg: ConfigReader): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const key of ['model', 'draft']) {
    const v = cfg.get<unknown>(key);
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
  }
  out.streaming = cfg.get<boolean>('streaming') !== false;
  return out;
}

/** Settings whose change needs a new server process (the rest go by didChangeConfiguration). */
export function needsRestart(before: ServerLaunch, after: ServerLaunch): boolean {
  return JSON.stringify(before) !== JSON.stringify(after);
}

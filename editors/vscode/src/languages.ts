// Which documents the extension syncs to the server and asks completions for: only real source files
// (never settings or Markdown), only the languages the model knows.
//
// The server says which languages its model was trained on: InitializeResult
// `capabilities.experimental.fimble.languages`, a list of LSP language ids, or null for "unknown: all"
// (lsp_server/PROTOCOL.md, "Languages"). The user's `fimble.languages` ({languageId: boolean}, "*" the
// rest) overrides it: `{"javascript": true}` adds a language, `{"python": false}` drops one, `{"*": true}`
// takes every source language. Only `file:` and `untitled:` documents of those languages are synced:
// never settings.json, output panes, git views, and no plain text, Markdown or JSON unless asked for.
//
// Pure: no `vscode` import, so it is unit-tested directly.

/** Programming languages (VS Code language ids) taken when the model's list is unknown or `"*"` is on. */
export const SOURCE_LANGUAGES: readonly string[] = [
  'bat', 'c', 'clojure', 'coffeescript', 'cpp', 'csharp', 'css', 'cuda-cpp', 'dart', 'dockerfile', 'elixir',
  'erlang', 'fsharp', 'go', 'groovy', 'haskell', 'html', 'java', 'javascript', 'javascriptreact', 'julia',
  'kotlin', 'less', 'lua', 'makefile', 'nim', 'objective-c', 'objective-cpp', 'ocaml', 'perl', 'php',
  'powershell', 'python', 'r', 'ruby', 'rust', 'scala', 'scss', 'shellscript', 'sql', 'svelte', 'swift',
  'typescript', 'typescriptreact', 'vue', 'zig',
];

/** The schemes of documents a user edits (not output, git, settings, search editors...). */
export const SCHEMES: readonly string[] = ['file', 'untitled'];

export interface DocumentFilterLike {
  scheme: string;
  language: string;
}

/** The user's `fimble.languages` map, with anything that is not a boolean left out. */
export function userLanguages(raw: unknown): Record<string, boolean> {
  const out: Record<string, boolean> = {};
  if (raw && typeof raw === 'object' && !Array.isArray(raw)) {
    for (const [lang, on] of Object.entries(raw as Record<string, unknown>)) {
      if (typeof on === 'boolean' && lang.length > 0 && lang.length <= 64) out[lang] = on;
    }
  }
  return out;
}

/** The model's languages from the InitializeResult's capabilities (undefined/null: unknown, all). */
export function modelLanguages(capabilities: unknown): string[] | null {
  const exp = (capabilities as { experimental?: { fimble?: { languages?: unknown } } } | undefined)?.experimental;
  const langs = exp?.fimble?.languages;
  return Array.isArray(langs) && langs.every((l) => typeof l === 'string') ? (langs as string[]) : null;
}

/** Whether `language` gets completions: the user's entry, else the model's list, else the user's "*". */
export function languageEnabled(language: string, model: readonly string[] | null, user: Record<string, boolean>): boolean {
  if (language in user) return user[language];
  if (user['*'] === true) return true;
  if (model !== null && !model.includes(language)) return false;
  if (user['*'] === false) return false;
  return model !== null || SOURCE_LANGUAGES.includes(language);
}

/** The language ids to sync, sorted. */
export function enabledLanguages(model: readonly string[] | null, user: Record<string, boolean>): string[] {
  const candidates = new Set<string>([...SOURCE_LANGUAGES, ...(model ?? []), ...Object.keys(user)]);
  candidates.delete('*');
  return [...candidates].filter((l) => languageEnabled(l, model, user)).sort();
}

/** The language client's document selector for those languages. */
export function documentSelector(languages: readonly string[]): DocumentFilterLike[] {
  return languages.flatMap((language) => SCHEMES.map((scheme) => ({ scheme, language })));
}

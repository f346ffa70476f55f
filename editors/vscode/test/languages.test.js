'use strict';
// Which documents are synced (languages.ts): the model's languages, the user's overrides, source files only.
const test = require('node:test');
const assert = require('node:assert/strict');
const { ext } = require('./support/load');

test('the model decides by default; the user adds, drops or takes all', () => {
  assert.deepEqual(ext.enabledLanguages(['python'], {}), ['python']);
  assert.deepEqual(ext.enabledLanguages(['python'], { javascript: true }), ['javascript', 'python']);
  assert.deepEqual(ext.enabledLanguages(['python'], { python: false }), []);
  const all = ext.enabledLanguages(['python'], { '*': true, go: false });
  assert.ok(all.includes('javascript') && all.includes('python') && !all.includes('go'));
});

test('an unknown model: source languages only, never settings, Markdown or plain text unless asked', () => {
  const langs = ext.enabledLanguages(null, {});
  for (const l of ['python', 'typescript', 'go', 'rust']) assert.ok(langs.includes(l), l);
  for (const l of ['json', 'jsonc', 'markdown', 'plaintext', 'log']) assert.ok(!langs.includes(l), l);
  assert.ok(ext.enabledLanguages(null, { markdown: true }).includes('markdown'));
  assert.deepEqual(ext.enabledLanguages(null, { '*': false, python: true }), ['python']);
});

test('the selector names file and untitled documents of each language, nothing else', () => {
  assert.deepEqual(ext.documentSelector(['python']), [{ scheme: 'file', language: 'python' }, { scheme: 'untitled', language: 'python' }]);
  assert.deepEqual(ext.modelLanguages({ experimental: { fimble: { languages: ['python'] } } }), ['python']);
  assert.equal(ext.modelLanguages({ experimental: { fimble: { languages: null } } }), null);
  assert.equal(ext.modelLanguages({}), null);
});

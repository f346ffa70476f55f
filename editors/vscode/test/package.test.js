'use strict';
// What package.json declares (VS Code reads it before any code runs): the languages, no completion fallback,
// and settings that only the user's own configuration may set.
const test = require('node:test');
const assert = require('node:assert/strict');
const pkg = require('../package.json');

const props = pkg.contributes.configuration.properties;

test('fimble.trace.server is declared (VS Code greyed it out)', () => {
  const t = props['fimble.trace.server'];
  assert.ok(t, 'declared');
  assert.deepEqual(t.enum, ['off', 'messages', 'verbose']);
  assert.equal(t.default, 'off');
});

test('process-launching settings are machine-scoped; untrusted workspaces are supported, limited', () => {
  for (const key of ['fimble.server.command', 'fimble.server.args', 'fimble.server.env', 'fimble.model', 'fimble.draft']) {
    assert.ok(['machine', 'application'].includes(props[key].scope), `${key} scope ${props[key].scope}`);
  }
  const trust = pkg.capabilities && pkg.capabilities.untrustedWorkspaces;
  assert.equal(trust.supported, 'limited');
  assert.deepEqual(
    [...trust.restrictedConfigurations].sort(),
    ['fimble.draft', 'fimble.model', 'fimble.server.args', 'fimble.server.command', 'fimble.server.env'],
  );
});

test('by default the model decides the languages; Python gets ghost text without the word-based suggest widget', () => {
  assert.deepEqual(props['fimble.languages'].default, {});
  const py = pkg.contributes.configurationDefaults['[python]'];
  assert.equal(py['editor.wordBasedSuggestions'], 'off');
  assert.equal(py['editor.inlineSuggest.suppressSuggestions'], true);
});

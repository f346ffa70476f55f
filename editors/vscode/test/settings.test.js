'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { ext } = require('./support/load');

const reader = (values) => ({ get: (k) => values[k] });

test('defaults: streaming on, nothing else forced', () => {
  assert.deepEqual(ext.wireSettings(reader({})), { streaming: true });
});

test('VS Code settings map to the wire names of PROTOCOL.md', () => {
  const wire = ext.wireSettings(
    reader({
      model: ' /models/qwen ', draft: '', noDraft: true, device: 'cuda', engineThreads: 2, drafter: 'ngram',
      maxLines: 3, maxTokens: 48, debounceMs: 20, earlyAnswerMs: 100, answerAt: 'end', prefetch: false,
      tokenHealing: true, prefixChars: 2000, suffixChars: 500, preload: false, streaming: false,
      languages: { '*': true, markdown: false, bogus: 'yes' },
    }),
  );
  assert.deepEqual(wire, {
    model: '/models/qwen', noDraft: true, device: 'cuda', engineThreads: 2, drafter: 'ngram', maxLines: 3,
    maxTokens: 48, debounceMs: 20, earlyAnswerMs: 100, answerAt: 'end', prefetch: false, tokenHealing: true,
    prefixChars: 2000, suffixChars: 500, preload: false, streaming: false, enable: { '*': true, markdown: false },
    languages: ['*'],
  });
});

test('values of the wrong type are left out; empty model/draft are not sent', () => {
  const wire = ext.wireSettings(reader({ model: '', draft: '  ', maxLines: -1, maxTokens: 2.5, noDraft: 'yes', languages: [] }));
  assert.deepEqual(wire, { streaming: true });
});

test('server launch: command, args, env; restart only when they change', () => {
  const a = ext.serverLaunch(reader({}));
  assert.deepEqual(a, { command: 'fimble', args: ['lsp'], env: {} });
  const b = ext.serverLaunch(reader({ 'server.command': '/venv/bin/fimble', 'server.args': ['lsp', '--stdio'], 'server.env': { FIMBLE_LOG: 'debug', n: 1 } }));
  assert.deepEqual(b, { command: '/venv/bin/fimble', args: ['lsp', '--stdio'], env: { FIMBLE_LOG: 'debug' } });
  assert.equal(ext.needsRestart(a, a), false);
  assert.equal(ext.needsRestart(a, b), true);
  assert.deepEqual(ext.serverLaunch(reader({ 'server.args': [1] })).args, ['lsp']);
});

test('launch settings come from the user, never from the workspace', () => {
  const layered = (layers) => ({
    get: (k) => {
      const l = layers[k];
      return l ? l.workspaceValue ?? l.globalValue ?? l.defaultValue : undefined;
    },
    inspect: (k) => layers[k],
  });
  const cfg = layered({
    'server.command': { defaultValue: 'fimble', workspaceValue: '/bin/sh' },
    'server.args': { defaultValue: ['lsp'], globalValue: ['lsp', '--stdio'], workspaceValue: ['-c', 'evil'] },
    'server.env': { defaultValue: {}, workspaceValue: { LD_PRELOAD: '/tmp/x.so' } },
    model: { defaultValue: '', workspaceValue: '/tmp/evil' },
    draft: { defaultValue: '', globalValue: '/models/draft' },
  });
  assert.deepEqual(ext.serverLaunch(cfg), { command: 'fimble', args: ['lsp', '--stdio'], env: {} });
  const wire = ext.wireSettings(cfg);
  assert.equal(wire.model, undefined);
  assert.equal(wire.draft, '/models/draft');
});

'use strict';
// Restart under load and workspace trust, through the real vscode-languageclient with the stub `vscode`
// module and the fake server (support/fake-server.js).
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { vscode, ext } = require('./support/load');

const FAKE = path.join(__dirname, 'support', 'fake-server.js');

async function waitFor(pred, what, ms = 15000) {
  const t0 = Date.now();
  while (!pred()) {
    if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

const context = () => ({ subscriptions: [], extensionPath: path.join(__dirname, '..'), extensionUri: vscode.Uri.file('/x') });

// The server's shutdown took 3.2 s under load, the client's stop timed out at 2 s and
// restart() never started the new server: no message, status "stopped" for good.
test('restart when the old server takes 3.2 s to shut down: a new server runs, status recovers', async (t) => {
  vscode.state.configLayers = {};
  vscode.state.config = {
    'fimble.server.command': process.execPath,
    'fimble.server.args': [FAKE, '--languages=["python"]', '--status', '--ready-ms=50', '--shutdown-ms=3200'],
  };
  const fimble = await ext.activate(context());
  t.after(() => ext.deactivate());
  await waitFor(() => fimble.getState() === 'ready', 'the first server');
  const before = (await fimble.client.sendRequest('fake/received')).pid;
  await vscode.commands.executeCommand('fimble.restart');
  assert.ok(fimble.client, 'a client after the restart');
  const after = (await fimble.client.sendRequest('fake/received')).pid;
  assert.notEqual(after, before, 'a new server process');
  await waitFor(() => fimble.getState() === 'ready', 'the new server to be ready');
  assert.doesNotMatch(vscode.calls.statusItems.at(-1).text, /stopped|error/);
  // The old process is gone (it answered shutdown late, then got exit).
  await waitFor(() => {
    try {
      process.kill(before, 0);
      return false;
    } catch {
      return true;
    }
  }, 'the old server to exit');
});

// A cloned repository's .vscode/settings.json must not choose the command that runs.
test('an untrusted workspace cannot choose the server command, its arguments or environment', async (t) => {
  vscode.state.isTrusted = false;
  vscode.state.config = {};
  vscode.state.configLayers = {
    'fimble.server.command': { defaultValue: 'fimble', globalValue: process.execPath, workspaceValue: '/bin/sh' },
    'fimble.server.args': { defaultValue: ['lsp'], globalValue: [FAKE, '--status'], workspaceValue: ['-c', 'touch /tmp/pwned'] },
    'fimble.server.env': { defaultValue: {}, workspaceValue: { NODE_OPTIONS: '--require /tmp/evil.js' } },
    'fimble.model': { defaultValue: '', workspaceValue: '/tmp/evil-model' },
  };
  const fimble = await ext.activate(context());
  t.after(() => ext.deactivate());
  const got = await fimble.client.sendRequest('fake/received');
  assert.ok(got.argv.includes(FAKE), 'the user\'s command and arguments ran');
  assert.equal(got.env.NODE_OPTIONS, undefined, 'no environment from the workspace');
  assert.equal(got.initialize.initializationOptions.model, undefined, 'no model from the workspace');
});

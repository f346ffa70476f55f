'use strict';
// Activation through the real vscode-languageclient, with the stub `vscode` module and a fake server
// (support/fake-server.js) that streams fimble/completionDelta like `fimble lsp`.
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { vscode, ext } = require('./support/load');

const FAKE = path.join(__dirname, 'support', 'fake-server.js');
const URI = 'file:///work/demo.py';

async function waitFor(pred, what, ms = 10000) {
  const t0 = Date.now();
  while (!pred()) {
    if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

test('activate, stream ghost text, drop stale answers, toggle, deactivate', async (t) => {
  Object.assign(vscode.state.config, {
    'fimble.server.command': process.execPath,
    'fimble.server.args': [FAKE, '--languages=["python"]', '--status', '--ready-ms=300'],
    'fimble.model': '/models/m',
    'fimble.maxLines': 3,
    'fimble.languages': { markdown: false },
  });
  // Open before activation: a Python file, the user's settings.json and a Markdown file.
  vscode.state.textDocuments.push(
    new vscode.StubDocument('file:///work/open.py', 'x = 1\n', 'python', 1),
    new vscode.StubDocument('file:///work/.vscode/settings.json', '{}', 'jsonc', 1),
    new vscode.StubDocument('file:///work/README.md', '# hi', 'markdown', 1),
  );
  const context = { subscriptions: [], extensionPath: path.join(__dirname, '..'), extensionUri: vscode.Uri.file('/x') };
  const fimble = await ext.activate(context);
  t.after(() => ext.deactivate());

  // Activation: commands, status bar, the server started with the mapped settings.
  for (const c of ['fimble.toggle', 'fimble.showLogs', 'fimble.restart']) assert.ok(vscode.calls.commands.includes(c), c);
  const status = vscode.calls.statusItems[0];
  assert.ok(status.visible);
  // Loading state: "loading model" until the server's fimble/status says the engine is ready.
  assert.equal(fimble.getState(), 'loading');
  assert.match(status.text, /loading model/);
  await waitFor(() => fimble.getState() === 'ready', 'the engine to be ready');
  assert.doesNotMatch(status.text, /loading/);
  const got = await fimble.client.sendRequest('fake/received');
  assert.deepEqual(got.initialize.initializationOptions, { model: '/models/m', maxLines: 3, enable: { markdown: false }, streaming: true });
  // Only source files of the model's languages are synced: not settings.json, not Markdown.
  assert.deepEqual(fimble.selector, [{ scheme: 'file', language: 'python' }, { scheme: 'untitled', language: 'python' }]);
  assert.deepEqual(got.opened, [{ uri: 'file:///work/open.py', languageId: 'python' }]);
  // The server's textDocument/completion fallback is not registered (it duplicated the ghost text).
  assert.equal(vscode.calls.completionProviders.length, 0);
  assert.equal(got.initialize.capabilities.experimental.fimble.completionDelta, true);
  assert.equal(got.initialize.capabilities.experimental.fimble.replaceStart, true, 'it shows a dedent over the indentation');
  assert.ok(got.initialize.capabilities.textDocument.inlineCompletion, 'the client advertises inline completion');
  await waitFor(() => vscode.calls.providers.length > 0, 'the inline completion provider');
  const { provider } = vscode.calls.providers[0];

  // A document at version 5, cursor at the end of "    " on line 1; VS Code's re-trigger calls the provider.
  const doc = new vscode.StubDocument(URI, 'def f():\n    ', 'python', 5);
  const pos = new vscode.Position(1, 4);
  vscode.state.activeTextEditor = { document: doc, selection: new vscode.Selection(pos, pos) };
  await fimble.client.sendRequest('fake/configure', { versions: { [URI]: 5 }, delayMs: 30 });
  const shown = [];
  const token = () => new vscode.CancellationTokenSource().token;
  const ask = async () => {
    const r = await provider.provideInlineCompletionItems(doc, vscode.state.activeTextEditor.selection.active, { triggerKind: 1 }, token());
    const items = Array.isArray(r) ? r : (r && r.items) || [];
    shown.push(items.length ? items[0].insertText : null);
    return items;
  };
  vscode.state.onExecute['editor.action.inlineSuggest.trigger'] = () => ask();

  const first = await ask();
  assert.equal(first[0].insertText, 'x = ', 'the early answer');
  assert.equal(first[0].command.command, 'fimble.acceptCompletion');
  await waitFor(() => shown[shown.length - 1] === 'x = compute(1)\nprint(x)', 'the ghost text to grow to the full stream');
  assert.deepEqual(shown, ['x = ', 'x = compute(1)\n', 'x = compute(1)\nprint(x)']);
  const requests = (await fimble.client.sendRequest('fake/received')).methods.filter((m) => m === 'textDocument/inlineCompletion');
  assert.equal(requests.length, 1, 're-triggers are answered from the stream, not by new requests');
  assert.match(status.text, /fimble \d+ ms/, 'the status bar shows the last latency');

  // Elsewhere (version 6), the user types "zz" while the request is out: its answer and its deltas
  // no longer match the document and are dropped.
  doc.edit('def f():\n    y');
  const at = (c) => ({ document: doc, selection: new vscode.Selection(new vscode.Position(1, c), new vscode.Position(1, c)) });
  vscode.state.activeTextEditor = at(5);
  await fimble.client.sendRequest('fake/configure', { versions: { [URI]: 6 } });
  shown.length = 0;
  const dropped = fimble.streamer.counts.dropped;
  const pending = ask();
  doc.edit('def f():\n    yzz');
  vscode.state.activeTextEditor = at(7);
  assert.deepEqual(await pending, []);
  assert.equal(fimble.streamer.counts.staleDropped, 1);
  await waitFor(() => fimble.streamer.counts.dropped >= dropped + 3, 'the rest of the stream to be dropped');
  assert.deepEqual(shown, [null], 'nothing from the stale stream was shown');

  // The cursor comes to rest elsewhere: after a burst of selection changes, one fimble/cursor for the last.
  const at3 = (line, c) => ({ document: doc, selection: new vscode.Selection(new vscode.Position(line, c), new vscode.Position(line, c)) });
  for (const c of [1, 2, 3]) vscode.selectionChanged.fire({ textEditor: at3(0, c) });
  await waitFor(() => fimble.cursor.sent === 1, 'the cursor report');
  const cursorParams = async () => (await fimble.client.sendRequest('fake/received')).cursor;
  assert.deepEqual(await cursorParams(), [{ textDocument: { uri: URI }, position: { line: 0, character: 3 } }]);
  vscode.selectionChanged.fire({ textEditor: at3(0, 3) }); // the same place: not sent again
  await new Promise((r) => setTimeout(r, fimble.cursor.delayMs + 50));
  assert.equal((await cursorParams()).length, 1);

  // Toggle off: no suggestions, status says off; toggle on again.
  assert.equal(await vscode.commands.executeCommand('fimble.toggle'), false);
  assert.match(status.text, /circle-slash/);
  assert.deepEqual(await ask(), []);
  assert.equal(await vscode.commands.executeCommand('fimble.toggle'), true);
  await vscode.commands.executeCommand('fimble.showLogs');
  assert.equal(fimble.output.shown, 1);

  // A settings change that is not about the launch goes out as didChangeConfiguration.
  vscode.state.config['fimble.maxTokens'] = 12;
  vscode.configChanged.fire({ affectsConfiguration: (s) => s === 'fimble' });
  const after = await fimble.client.sendRequest('fake/received');
  assert.ok(after.methods.includes('workspace/didChangeConfiguration'));
});

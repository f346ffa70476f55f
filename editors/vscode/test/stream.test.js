'use strict';
// The streaming logic (stream.ts) with a fake editor: deltas grow the ghost text, and anything that no
// longer matches the document is dropped.
const test = require('node:test');
const assert = require('node:assert/strict');
const { ext } = require('./support/load');

const URI = 'file:///a.py';

function setup() {
  const editor = { version: 3, position: { line: 1, character: 4 }, lines: ['def f(x):', '    '] };
  const host = {
    retriggers: 0,
    makeItem: (text, pos, like) => ({ insertText: text, pos, command: like && like.command }),
    itemText: (item) => (typeof item.insertText === 'string' ? item.insertText : undefined),
    retrigger: () => (host.retriggers += 1),
    cursorOf: (uri) => (uri === URI ? { version: editor.version, position: { ...editor.position } } : undefined),
    now: () => 0,
  };
  const doc = {
    uri: { toString: () => URI },
    get version() {
      return editor.version;
    },
    lineAt: (i) => ({ text: editor.lines[i] }),
  };
  const s = new ext.DeltaStreamer(host);
  const delta = (text, extra = {}) => ({
    requestId: 1, uri: URI, version: editor.version, position: { ...editor.position }, text, done: false, ...extra,
  });
  return { editor, host, doc, s, delta };
}

const serverAnswer = (text) => () => Promise.resolve({ items: [{ insertText: text, command: { command: 'fimble.acceptCompletion', arguments: ['c1'] } }] });

test('remainder: typed text that agrees keeps the rest; disagreement drops it', () => {
  const at = { line: 0, character: 4 };
  assert.equal(ext.remainder('return x', at, { line: 0, character: 7 }, '    ret'), 'urn x');
  assert.equal(ext.remainder('return x', at, { line: 0, character: 7 }, '    rex'), undefined);
  assert.equal(ext.remainder('return x', at, { line: 0, character: 3 }, '    '), undefined);
  assert.equal(ext.remainder('return x', at, { line: 1, character: 4 }, '    '), undefined);
  assert.equal(ext.remainder('return x', at, at, '    '), 'return x');
});

test('deltas after the answer grow the suggestion through a local re-trigger', async () => {
  const { host, doc, s, delta, editor } = setup();
  let serverCalls = 0;
  const next = () => (serverCalls++, serverAnswer('return x')());
  s.onDelta(delta('ret')); // arrives while the request is not out yet: asks VS Code to show it
  assert.equal(host.retriggers, 1);
  const first = await s.provide(doc, editor.position, next);
  assert.equal(serverCalls, 1);
  assert.equal(first[0].insertText, 'return x');
  assert.deepEqual(first[0].command, { command: 'fimble.acceptCompletion', arguments: ['c1'] });
  s.onDelta(delta('return x'));
  assert.equal(host.retriggers, 1, 'no re-trigger when the text does not grow');
  s.onDelta(delta('return x * 2\n'));
  assert.equal(host.retriggers, 2);
  s.onDelta(delta('return x * 2\n\n'));
  assert.equal(host.retriggers, 2, 'one re-trigger pending at a time');
  const second = await s.provide(doc, editor.position, next);
  assert.equal(serverCalls, 1, 'the re-trigger is answered locally, the stream keeps going');
  assert.equal(second[0].insertText, 'return x * 2\n\n');
  assert.deepEqual(second[0].command, first[0].command, 'the accept command (telemetry) is kept');
  assert.equal(s.counts.local, 1);
});

test('deltas that arrive while the request is out are merged into its answer', async () => {
  const { host, doc, s, delta, editor } = setup();
  const next = () => {
    s.onDelta(delta('return x + 1'));
    s.onDelta(delta('return x + 1\n'));
    return serverAnswer('return x + 1')();
  };
  const items = await s.provide(doc, editor.position, next);
  assert.equal(items[0].insertText, 'return x + 1\n');
  assert.equal(host.retriggers, 0, 'no re-trigger for a request still out');
});

test('a delta for another version or cursor is dropped', async () => {
  const { host, doc, s, delta, editor } = setup();
  await s.provide(doc, editor.position, serverAnswer('return x'));
  s.onDelta(delta('return x + 1', { version: editor.version - 1 }));
  s.onDelta(delta('return x + 2', { position: { line: 1, character: 2 } }));
  assert.equal(host.retriggers, 0);
  assert.equal(s.counts.dropped, 2);
  assert.equal(s.liveFor(URI, editor.version, editor.position), undefined);
  // After an edit, a late delta of the old stream is dropped and never shown.
  s.onDelta(delta('return x * 3'));
  editor.version += 1;
  editor.lines[1] = '    z';
  editor.position = { line: 1, character: 5 };
  s.onDelta(delta('return x * 3 + 1', { version: editor.version - 1, position: { line: 1, character: 4 } }));
  let called = 0;
  const items = await s.provide(doc, editor.position, () => (called++, Promise.resolve({ items: [] })));
  assert.equal(called, 1, 'a new spot asks the server');
  assert.deepEqual(items, []);
});

test('an answer that no longer matches the document is dropped; one typed along is re-based', async () => {
  const { doc, s, editor } = setup();
  // The user types "zz" while the request is out: the answer "return x" no longer applies.
  const stale = await s.provide(doc, { line: 1, character: 4 }, () => {
    editor.version += 1;
    editor.lines[1] = '    zz';
    editor.position = { line: 1, character: 6 };
    return serverAnswer('return x')();
  });
  assert.deepEqual(stale, []);
  assert.equal(s.counts.staleDropped, 1);
  // The user types "re" (agreeing): the rest "turn x" is shown at the new cursor.
  editor.lines[1] = '    ';
  editor.position = { line: 1, character: 4 };
  const rebased = await s.provide(doc, { line: 1, character: 4 }, () => {
    editor.version += 1;
    editor.lines[1] = '    re';
    editor.position = { line: 1, character: 6 };
    return serverAnswer('return x')();
  });
  assert.equal(rebased[0].insertText, 'turn x');
  assert.deepEqual(rebased[0].pos, { line: 1, character: 6 });
});

test('disabled: no requests, no re-triggers', async () => {
  const { host, doc, s, delta, editor } = setup();
  s.enabled = false;
  let called = 0;
  assert.deepEqual(await s.provide(doc, editor.position, () => (called++, [])), []);
  s.onDelta(delta('return 1'));
  assert.equal(called, 0);
  assert.equal(host.retriggers, 0);
});

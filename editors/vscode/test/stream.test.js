'use strict';
// The streaming logic (stream.ts) with a fake editor: deltas grow the ghost text, and anything that no
// longer matches the document is dropped.
const test = require('node:test');
const assert = require('node:assert/strict');
const { ext } = require('./support/load');

const URI = 'file:///a.py';

function setup() {
  const editor = { version: 3, position: { line: 1, character: 4 }, lines: ['def f(x):', '    '] };
  const timers = [];
  const host = {
    retriggers: 0,
    forced: 0,
    makeItem: (text, start, end, like) => ({ insertText: text, pos: start, range: { start, end }, command: like && like.command }),
    itemText: (item) => (typeof item.insertText === 'string' ? item.insertText : undefined),
    itemRangeEnd: (item) => (item.range ? item.range.end : undefined),
    itemRangeStart: (item) => (item.range ? item.range.start : undefined),
    retrigger: (force) => {
      host.retriggers += 1;
      if (force) host.forced += 1;
      if (host.onRetrigger) host.onRetrigger(force);
    },
    later: (fn, ms) => timers.push({ fn, ms }),
    cursorOf: (uri) => (uri === URI ? { version: editor.version, position: { ...editor.position } } : undefined),
    now: () => 0,
  };
  /** Run the timers due (the streamer's re-trigger checks). */
  const tick = () => {
    const due = timers.splice(0, timers.length);
    for (const t of due) t.fn();
    return due.length;
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
  return { editor, host, doc, s, delta, tick, timers };
}

const serverAnswer = (text, range) => () =>
  Promise.resolve({ items: [{ insertText: text, range, command: { command: 'fimble.acceptCompletion', arguments: ['c1'] } }] });

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

test('a dedent keeps its range from the line start, from the answer and from the stream', async () => {
  const { host, doc, s, delta, editor } = setup();
  editor.lines = ['def f(x):', '    if x:', '        return 1', '        '];
  editor.position = { line: 3, character: 8 };
  const lineStart = { line: 3, character: 0 };
  const items = await s.provide(doc, editor.position, serverAnswer('    return 0', { start: lineStart, end: { line: 3, character: 8 } }));
  assert.equal(items[0].insertText, '    return 0');
  assert.deepEqual(items[0].range, { start: lineStart, end: { line: 3, character: 8 } });
  // The stream ends with more: the local re-trigger keeps the range over the indentation.
  s.onDelta(delta('    return 0\n    return 2', { done: true, replaceStart: lineStart, replaceEnd: editor.position }));
  assert.equal(host.retriggers, 1);
  const grown = await s.provide(doc, editor.position, () => assert.fail('answered locally'));
  assert.equal(grown[0].insertText, '    return 0\n    return 2');
  assert.deepEqual(grown[0].range.start, lineStart);
  // A replaceStart that is not before the cursor on its line is ignored: the item starts at the cursor.
  assert.deepEqual(ext.startOf(delta('x', { replaceStart: { line: 2, character: 0 } })), editor.position);
});

test('a dedent answer for a line that changed while it travelled is dropped', async () => {
  const { doc, s, editor } = setup();
  editor.lines = ['def f(x):', '    if x:', '        return 1', '        '];
  editor.position = { line: 3, character: 8 };
  const items = await s.provide(doc, { line: 3, character: 8 }, () => {
    editor.version += 1;
    editor.lines[3] = '        r';
    editor.position = { line: 3, character: 9 };
    return serverAnswer('    return 0', { start: { line: 3, character: 0 }, end: { line: 3, character: 8 } })();
  });
  assert.deepEqual(items, []);
  assert.equal(s.counts.staleDropped, 1);
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

// VS Code drops a re-trigger (it does not ask again at the same cursor and version
// after an explicitly requested answer). Before: the pending flag stayed set, the ghost text froze at a
// cut-off text and Tab inserted it. Now: a re-trigger after an explicit answer is forced, and one the
// provider never saw is retried (forced), so what is shown ends as the server's final text.
test('a dropped re-trigger is retried until the final text is shown', async () => {
  const { host, doc, s, delta, editor, tick } = setup();
  const shown = [];
  // VS Code model: it calls the provider on a re-trigger only if forced or if what it shows came from an
  // automatic request (VS Code 1.100's "satisfies" rule); otherwise it drops it.
  let lastExplicit = false;
  const ask = async (explicit) => {
    const items = await s.provide(doc, editor.position, serverAnswer("(path, 'rb') as f:"), undefined, explicit);
    lastExplicit = explicit;
    shown.push(items.length ? items[0].insertText : null);
  };
  host.onRetrigger = (force) => {
    if (force || !lastExplicit) void ask(true);
  };
  await ask(false); // automatic request: the server's first answer
  s.onDelta(delta("(path, '"));
  await new Promise((r) => setImmediate(r));
  s.onDelta(delta("(path, 'rb"));
  await new Promise((r) => setImmediate(r));
  s.onDelta(delta("(path, 'rb') as f:", { done: true, finishReason: 'stop' }));
  await new Promise((r) => setImmediate(r));
  for (let i = 0; i < 5 && tick(); i++) await new Promise((r) => setImmediate(r));
  assert.equal(shown[shown.length - 1], "(path, 'rb') as f:", `shown: ${JSON.stringify(shown)}`);
  assert.equal(s.retriggerPending, false);
  assert.ok(host.forced >= 1, 'a re-trigger after an explicit answer is forced');
});

test('a re-trigger VS Code never answers is retried, forced, a bounded number of times', async () => {
  const { host, s, delta, tick } = setup();
  host.onRetrigger = () => {}; // dropped every time (e.g. the editor lost focus)
  s.onDelta(delta('return x'));
  assert.equal(host.retriggers, 1);
  for (let i = 0; i < 10; i++) tick();
  assert.equal(host.retriggers, 1 + ext.MAX_RETRIES);
  assert.equal(host.forced, ext.MAX_RETRIES);
  assert.equal(s.retriggerPending, false, 'gives up: the next delta starts again');
  s.onDelta(delta('return x + 1'));
  assert.equal(host.retriggers, 2 + ext.MAX_RETRIES);
});

test('a final text shorter than the shown one (validation cut it) replaces it', async () => {
  const { host, doc, s, delta, editor } = setup();
  await s.provide(doc, editor.position, serverAnswer('x = 1'));
  s.onDelta(delta('x = 1\nif y:'));
  assert.equal(host.retriggers, 1);
  const longer = await s.provide(doc, editor.position, () => assert.fail('answered locally'), undefined, true);
  assert.equal(longer[0].insertText, 'x = 1\nif y:');
  s.onDelta(delta('x = 1\n', { done: true, finishReason: 'stop' }));
  assert.equal(host.retriggers, 2);
  assert.equal(host.forced, 1, 'after an explicit (re-triggered) answer the re-trigger is forced');
  const final = await s.provide(doc, editor.position, () => assert.fail('answered locally'), undefined, true);
  assert.equal(final[0].insertText, 'x = 1\n');
});

test('an empty final text (validation cut all of it) takes the streamed ghost text away', async () => {
  const { host, doc, s, delta, editor } = setup();
  await s.provide(doc, editor.position, serverAnswer("path, 'rb') as f:"));
  s.onDelta(delta('', { done: true, finishReason: 'stop' }));
  assert.equal(host.retriggers, 1);
  const final = await s.provide(doc, editor.position, () => assert.fail('answered locally'), undefined, true);
  assert.deepEqual(final, [], 'nothing is shown, so Tab inserts nothing of it');
});

// A suggestion of several lines (the default model's docstring, then the body): an early answer with the
// first line, then the stream's lines; what VS Code is given at the end is the whole final text.
test('a multi-line final text after a first-line answer is given whole', async () => {
  const { host, doc, s, delta, editor } = setup();
  const first = await s.provide(doc, editor.position, serverAnswer('"""The area."""'));
  assert.equal(first[0].insertText, '"""The area."""');
  s.onDelta(delta('"""The area."""\n    return'));
  s.onDelta(delta('"""The area."""\n    return 3.14 * r ** 2', { done: true, finishReason: 'stop' }));
  assert.equal(host.retriggers, 1, 'one re-trigger pending at a time');
  const final = await s.provide(doc, editor.position, () => assert.fail('answered locally'), undefined, true);
  assert.equal(final[0].insertText, '"""The area."""\n    return 3.14 * r ** 2');
});

// The server's range covers the auto-paired closer its text re-types; items built by
// the extension kept only the cursor, so `math.sqrt(|)` + `1.0) / 2.0` gave `math.sqrt(1.0) / 2.0)`.
test('items keep the range past auto-paired closers, from the answer and from deltas', async () => {
  const { doc, s, delta, editor } = setup();
  editor.lines[1] = '    return math.sqrt()';
  editor.position = { line: 1, character: 21 };
  const at = { ...editor.position };
  const past = { line: 1, character: 22 };
  const first = await s.provide(doc, at, serverAnswer('1.0) / 2.0', { start: at, end: past }));
  assert.deepEqual(first[0].range, { start: at, end: past });
  s.onDelta(delta('1.0) / 2.0 + 3', { replaceEnd: past }));
  const grown = await s.provide(doc, at, () => assert.fail('answered locally'), undefined, true);
  assert.equal(grown[0].insertText, '1.0) / 2.0 + 3');
  assert.deepEqual(grown[0].range, { start: at, end: past });
  // Accepting replaces the `)`: one closer, not two.
  const line = editor.lines[1];
  const accepted = line.slice(0, at.character) + grown[0].insertText + line.slice(past.character);
  assert.equal(accepted, '    return math.sqrt(1.0) / 2.0 + 3');
});

test('an answer from before an auto-closed bracket is not re-based across it', async () => {
  const { doc, s, editor } = setup();
  // `with open|`: the answer `(path, 'rb') as f:` comes back after the user typed `(`, which VS Code
  // auto-closed: `with open(|)`. Re-basing it would show `path, 'rb') as f:` before the `)` without a range.
  editor.lines[1] = '    with open';
  editor.position = { line: 1, character: 13 };
  const items = await s.provide(doc, { line: 1, character: 13 }, () => {
    editor.version += 1;
    editor.lines[1] = '    with open()';
    editor.position = { line: 1, character: 14 };
    return serverAnswer("(path, 'rb') as f:")();
  });
  assert.deepEqual(items, []);
  assert.equal(s.counts.staleDropped, 1);
});

'use strict';
// The fimble/cursor debounce (cursor.ts) with a fake clock: a burst of movements is one report, for where
// the cursor came to rest; the same place is not reported twice.
const test = require('node:test');
const assert = require('node:assert/strict');
const { ext } = require('./support/load');

function setup(delayMs = 150) {
  const clock = { now: 0, timers: [] };
  const timers = {
    set: (fn, ms) => {
      const t = { at: clock.now + ms, fn };
      clock.timers.push(t);
      return t;
    },
    clear: (t) => (clock.timers = clock.timers.filter((x) => x !== t)),
  };
  const advance = (ms) => {
    clock.now += ms;
    for (const t of clock.timers.filter((x) => x.at <= clock.now)) {
      clock.timers = clock.timers.filter((x) => x !== t);
      t.fn();
    }
  };
  const sent = [];
  const r = new ext.CursorReporter((p) => sent.push(p), delayMs, timers);
  return { r, sent, advance, clock };
}

const URI = 'file:///a.py';
const pos = (line, character) => ({ line, character });

test('a burst of movements sends one report, for the last position, once the cursor rests', () => {
  const { r, sent, advance } = setup();
  assert.equal(ext.CURSOR_METHOD, 'fimble/cursor');
  for (let c = 0; c < 5; c++) {
    r.moved(URI, 1, pos(10, c));
    advance(100); // each movement restarts the wait
  }
  assert.equal(sent.length, 0);
  advance(50);
  assert.deepEqual(sent, [{ textDocument: { uri: URI }, position: { line: 10, character: 4 } }]);
  assert.equal(r.sent, 1);
});

test('the same place is not reported twice; a new version or position is', () => {
  const { r, sent, advance } = setup();
  r.moved(URI, 1, pos(3, 0));
  advance(150);
  r.moved(URI, 1, pos(3, 0));
  advance(500);
  assert.equal(sent.length, 1);
  r.moved(URI, 2, pos(3, 0)); // typed: the document changed
  advance(150);
  r.moved(URI, 2, pos(40, 2)); // moved away, then back before it rested: nothing new
  advance(100);
  r.moved(URI, 2, pos(3, 0));
  advance(500);
  assert.deepEqual(sent.map((p) => p.position), [pos(3, 0), pos(3, 0)]);
  r.moved('file:///b.py', 2, pos(3, 0));
  advance(150);
  assert.equal(sent.length, 3);
});

test('cancel drops the pending report; reset also forgets the last one', () => {
  const { r, sent, advance } = setup();
  r.moved(URI, 1, pos(1, 1));
  r.cancel();
  advance(1000);
  assert.equal(sent.length, 0);
  r.moved(URI, 1, pos(1, 1));
  r.flush(); // at once
  assert.equal(sent.length, 1);
  r.reset();
  r.moved(URI, 1, pos(1, 1)); // a new server: the same place goes out again
  advance(150);
  assert.equal(sent.length, 2);
});

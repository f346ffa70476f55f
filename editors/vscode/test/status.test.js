'use strict';
// The engine's state for the status bar (status.ts): fimble/status notifications, or polling fimble/stats
// for servers that do not send them; "loading model" until ready, the error's reason when it fails.
const test = require('node:test');
const assert = require('node:assert/strict');
const { ext } = require('./support/load');

test('fimble/status and fimble/stats shapes', () => {
  assert.deepEqual(ext.parseStatus({ state: 'loading', message: 'loading model m', model: 'm', languages: ['python'], firstLatencyMs: null }),
    { state: 'starting', error: null, firstLatencyMs: null });
  assert.deepEqual(ext.parseStatus({ state: 'ready', message: 'model m ready', firstLatencyMs: 7117 }),
    { state: 'ready', error: null, firstLatencyMs: 7117 });
  assert.deepEqual(ext.parseStatus({ state: 'error', message: 'no config.json in /m' }),
    { state: 'error', error: 'no config.json in /m', firstLatencyMs: null });
  assert.deepEqual(ext.parseStatus({ engine: { state: 'starting', error: null } }), { state: 'starting', error: null, firstLatencyMs: null });
  assert.equal(ext.parseStatus({ state: 'bogus' }), undefined);
  assert.equal(ext.parseStatus(null), undefined);
});

test('polls fimble/stats until ready; a notification takes over; each state heard once', async () => {
  const answers = [{ engine: { state: 'starting' } }, { engine: { state: 'starting' } }, { engine: { state: 'ready' } }];
  const heard = [];
  const timers = [];
  let asked = 0;
  const w = new ext.StatusWatcher(async () => answers[Math.min(asked++, answers.length - 1)], (s) => heard.push(s.state), (fn) => timers.push(fn));
  w.start();
  for (let i = 0; i < 10; i++) {
    await new Promise((r) => setImmediate(r));
    const fn = timers.shift();
    if (fn) fn();
  }
  assert.deepEqual(heard, ['starting', 'ready']);
  assert.equal(asked, 3, 'no polling once ready');
  w.notified({ state: 'error', message: 'engine died' });
  assert.deepEqual(heard, ['starting', 'ready', 'error']);
  w.start();
  await new Promise((r) => setImmediate(r));
  assert.equal(asked, 3, 'a server that notifies is not polled');
});

// A tiny LSP server standing in for `fimble lsp` in the activation test: it records what the client
// sent, and answers textDocument/inlineCompletion the way fimble does with streaming on: an early answer
// (the first line) and fimble/completionDelta notifications whose `text` grows, then `done`.
'use strict';

const received = {
  initialize: null, methods: [], cursor: [], opened: [], pid: process.pid, argv: process.argv.slice(1),
  env: { NODE_OPTIONS: process.env.NODE_OPTIONS },
};
// Command-line knobs: --languages=JSON (InitializeResult experimental.fimble.languages),
// --shutdown-ms=N (answer `shutdown` after N ms, like a loaded server closing its engine),
// --status (send fimble/status: starting at `initialized`, ready --ready-ms=N later).
const arg = (name) => {
  const hit = process.argv.find((a) => a === `--${name}` || a.startsWith(`--${name}=`));
  return hit === undefined ? undefined : hit.includes('=') ? hit.slice(hit.indexOf('=') + 1) : true;
};
const LANGUAGES = arg('languages') !== undefined ? JSON.parse(arg('languages')) : undefined;
const SHUTDOWN_MS = Number(arg('shutdown-ms') || 0);
const STATUS = arg('status') !== undefined;
const READY_MS = Number(arg('ready-ms') || 200);
let buffer = Buffer.alloc(0);

function send(msg) {
  const body = Buffer.from(JSON.stringify({ jsonrpc: '2.0', ...msg }), 'utf8');
  process.stdout.write(`Content-Length: ${body.length}\r\n\r\n`);
  process.stdout.write(body);
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
// Test knobs (sent with fake/configure): the stream's steps and when the answer goes out.
let script = { steps: ['x = ', 'x = compute(1)\n', 'x = compute(1)\nprint(x)'], answerAfter: 1, delayMs: 5 };

async function inline(msg) {
  const { textDocument, position } = msg.params;
  const version = received.versions[textDocument.uri] ?? 0;
  const delta = (text, done) =>
    send({
      method: 'fimble/completionDelta',
      params: {
        requestId: msg.id, token: null, completionId: `fake-${msg.id}`, uri: textDocument.uri, version, position,
        text, done, finishReason: done ? 'stop' : null, cached: false,
      },
    });
  for (let i = 0; i < script.steps.length; i++) {
    await sleep(script.delayMs);
    delta(script.steps[i], false);
    if (i + 1 === script.answerAfter) {
      const text = script.steps[i];
      send({
        id: msg.id,
        result: {
          items: [
            {
              insertText: text,
              range: { start: position, end: position },
              command: { title: 'Accept completion', command: 'fimble.acceptCompletion', arguments: [`fake-${msg.id}`] },
            },
          ],
        },
      });
    }
  }
  await sleep(script.delayMs);
  delta(script.steps[script.steps.length - 1], true);
}

received.versions = {};

function handle(msg) {
  if (msg.method) received.methods.push(msg.method);
  switch (msg.method) {
    case 'initialize':
      received.initialize = msg.params;
      send({
        id: msg.id,
        result: {
          capabilities: {
            textDocumentSync: { openClose: true, change: 2 },
            inlineCompletionProvider: {},
            completionProvider: {},
            executeCommandProvider: { commands: ['fimble.acceptCompletion'] },
            ...(LANGUAGES !== undefined ? { experimental: { fimble: { languages: LANGUAGES } } } : {}),
          },
          serverInfo: { name: 'fake-fimble', version: '0' },
        },
      });
      break;
    case 'initialized':
      if (STATUS) {
        const status = (state, message, firstLatencyMs = null) =>
          send({ method: 'fimble/status', params: { state, message, model: 'fake', languages: LANGUAGES ?? null, firstLatencyMs } });
        status('loading', 'loading model fake');
        setTimeout(() => status('ready', 'model fake ready'), READY_MS);
        if (arg('fail')) setTimeout(() => status('error', 'fake: config.json is missing'), READY_MS * 2);
      }
      break;
    case 'fimble/stats':
      send({ id: msg.id, result: { engine: { state: 'ready', error: null } } });
      break;
    case 'textDocument/didOpen':
      received.versions[msg.params.textDocument.uri] = msg.params.textDocument.version;
      received.opened.push({ uri: msg.params.textDocument.uri, languageId: msg.params.textDocument.languageId });
      break;
    case 'textDocument/didChange':
      received.versions[msg.params.textDocument.uri] = msg.params.textDocument.version;
      break;
    case 'fimble/cursor':
      received.cursor.push(msg.params);
      break;
    case 'textDocument/inlineCompletion':
      void inline(msg);
      break;
    case 'fake/received':
      send({ id: msg.id, result: received });
      break;
    case 'fake/configure':
      script = { ...script, ...msg.params };
      if (msg.params.versions) received.versions = { ...received.versions, ...msg.params.versions };
      send({ id: msg.id, result: null });
      break;
    case 'shutdown':
      setTimeout(() => send({ id: msg.id, result: null }), SHUTDOWN_MS);
      break;
    case 'exit':
      process.exit(0);
      break;
    default:
      if (msg.id !== undefined && msg.method) send({ id: msg.id, result: null });
  }
}

process.stdin.on('data', (chunk) => {
  buffer = Buffer.concat([buffer, chunk]);
  for (;;) {
    const sep = buffer.indexOf('\r\n\r\n');
    if (sep < 0) return;
    const header = buffer.slice(0, sep).toString('ascii');
    const m = /Content-Length: *(\d+)/i.exec(header);
    const len = m ? Number(m[1]) : 0;
    if (buffer.length < sep + 4 + len) return;
    const body = buffer.slice(sep + 4, sep + 4 + len).toString('utf8');
    buffer = buffer.slice(sep + 4 + len);
    handle(JSON.parse(body));
  }
});

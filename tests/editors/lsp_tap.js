#!/usr/bin/env node
// A transparent stdio proxy between an editor and `fimble lsp`, for the VS Code end-to-end test
// (vscode_e2e_driver.js): it passes every byte through unchanged and writes a JSON line per message of
// interest to $FIMBLE_TAP_LOG, with the document text it tracks from didOpen / didChange (what the
// server has): the server's final text of each completion (the `done` fimble/completionDelta and the
// inlineCompletion answers), so the test can compare what VS Code shows and inserts with what the
// server sent.
//
//   FIMBLE_TAP_LOG=/tmp/tap.jsonl node lsp_tap.js /path/to/fimble lsp
'use strict';

const { spawn } = require('node:child_process');
const fs = require('node:fs');

const [cmd, ...args] = process.argv.slice(2);
const logPath = process.env.FIMBLE_TAP_LOG;
const log = logPath ? fs.openSync(logPath, 'a') : undefined;
const t0 = Date.now();
const docs = new Map(); // uri -> { version, text }

function write(entry) {
  if (log !== undefined) fs.writeSync(log, JSON.stringify({ t: Date.now() - t0, ...entry }) + '\n');
}

/** Offset of an LSP position (UTF-16 units, as JS strings) in `text`. */
function offsetAt(text, pos) {
  let line = 0;
  let i = 0;
  while (line < pos.line) {
    const nl = text.indexOf('\n', i);
    if (nl < 0) return text.length;
    i = nl + 1;
    line++;
  }
  const end = text.indexOf('\n', i);
  return Math.min(i + pos.character, end < 0 ? text.length : end);
}

function fromEditor(msg) {
  const p = msg.params;
  switch (msg.method) {
    case 'textDocument/didOpen':
      docs.set(p.textDocument.uri, { version: p.textDocument.version, text: p.textDocument.text });
      write({ dir: 'in', method: msg.method, uri: p.textDocument.uri, languageId: p.textDocument.languageId, version: p.textDocument.version });
      break;
    case 'textDocument/didChange': {
      const doc = docs.get(p.textDocument.uri);
      if (!doc) break;
      for (const c of p.contentChanges) {
        if (!c.range) doc.text = c.text;
        else doc.text = doc.text.slice(0, offsetAt(doc.text, c.range.start)) + c.text + doc.text.slice(offsetAt(doc.text, c.range.end));
      }
      doc.version = p.textDocument.version;
      write({ dir: 'in', method: msg.method, uri: p.textDocument.uri, version: doc.version, changes: p.contentChanges });
      break;
    }
    case 'textDocument/didClose':
      docs.delete(p.textDocument.uri);
      break;
    case 'textDocument/inlineCompletion': {
      const doc = docs.get(p.textDocument.uri);
      pending.set(msg.id, { uri: p.textDocument.uri, version: doc && doc.version, position: p.position });
      write({ dir: 'in', method: msg.method, id: msg.id, uri: p.textDocument.uri, version: doc && doc.version, position: p.position, context: p.context });
      break;
    }
    default:
      if (msg.method) write({ dir: 'in', method: msg.method, id: msg.id });
  }
}

const pending = new Map();

function fromServer(msg) {
  if (msg.method === 'fimble/completionDelta') {
    const p = msg.params;
    const doc = docs.get(p.uri);
    const entry = { dir: 'out', method: msg.method, uri: p.uri, requestId: p.requestId, version: p.version, position: p.position, text: p.text, done: p.done, finishReason: p.finishReason, replaceEnd: p.replaceEnd };
    if (p.done && doc && doc.version === p.version) entry.docText = doc.text;
    write(entry);
  } else if (msg.method) {
    write({ dir: 'out', method: msg.method, params: msg.method === 'window/showMessage' || msg.method === 'fimble/status' ? msg.params : undefined });
  } else if (pending.has(msg.id)) {
    const req = pending.get(msg.id);
    pending.delete(msg.id);
    const items = msg.result ? (Array.isArray(msg.result) ? msg.result : msg.result.items) || [] : [];
    write({ dir: 'out', method: 'answer', id: msg.id, uri: req.uri, version: req.version, position: req.position, items: items.map((i) => ({ insertText: i.insertText, range: i.range })), error: msg.error });
  }
}

/** Splits a Content-Length framed byte stream into messages, calling `onMessage` for each. */
function framer(onMessage) {
  let buf = Buffer.alloc(0);
  return (chunk) => {
    buf = Buffer.concat([buf, chunk]);
    for (;;) {
      const sep = buf.indexOf('\r\n\r\n');
      if (sep < 0) return;
      const m = /Content-Length: *(\d+)/i.exec(buf.slice(0, sep).toString('ascii'));
      const len = m ? Number(m[1]) : 0;
      if (buf.length < sep + 4 + len) return;
      const body = buf.slice(sep + 4, sep + 4 + len).toString('utf8');
      buf = buf.slice(sep + 4 + len);
      try {
        onMessage(JSON.parse(body));
      } catch (err) {
        write({ error: String(err) });
      }
    }
  };
}

const child = spawn(cmd, args, { stdio: ['pipe', 'pipe', 'inherit'] });
write({ event: 'spawn', pid: child.pid, cmd, args });
const inbound = framer(fromEditor);
const outbound = framer(fromServer);
process.stdin.on('data', (chunk) => {
  child.stdin.write(chunk);
  inbound(chunk);
});
process.stdin.on('end', () => child.stdin.end());
child.stdout.on('data', (chunk) => {
  process.stdout.write(chunk);
  outbound(chunk);
});
child.on('exit', (code, signal) => {
  write({ event: 'exit', code, signal });
  process.exit(code ?? 1);
});
for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => child.kill(sig));

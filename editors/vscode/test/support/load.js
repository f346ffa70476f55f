// Load the bundled extension (dist/extension.js) with `require('vscode')` resolved to the stub.
'use strict';
const Module = require('node:module');
const path = require('node:path');

const STUB = path.join(__dirname, 'vscode-stub.js');
const original = Module._resolveFilename;
Module._resolveFilename = function (request, ...rest) {
  return request === 'vscode' ? STUB : original.call(this, request, ...rest);
};

const vscode = require(STUB);
const ext = require(path.join(__dirname, '..', '..', 'dist', 'extension.js'));

module.exports = { vscode, ext };

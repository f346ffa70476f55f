-- fimble for Neovim: ghost-text completions from `fimble lsp`, streamed as the model decodes.
--
-- Works from Neovim 0.7.2 to 0.12 (see compat.lua): the client is started with vim.lsp.start (0.8+) or
-- vim.lsp.start_client; ghost text is an extmark, inline virtual text on 0.10+, an overlay (plus
-- virt_lines for further lines) before that. On 0.12, `native = true` hands the display to
-- vim.lsp.inline_completion instead (editors/README.md).
--
-- Languages: by default the plugin attaches only to buffers whose filetype is among the languages the
-- server's model was trained on (the server advertises them at initialize, lsp_server/PROTOCOL.md
-- "Languages"); `filetypes` overrides that list, and is sent to the server as its `languages`.
-- The status line shows "loading model" until the server's engine is ready (fimble/status), then the
-- latency of the latest completion, or the engine's error.
--
-- One suggestion at a time: it is anchored where its request was made (row, byte column, and the line's
-- text before it). It is shown only while the buffer between the anchor and the cursor equals the start
-- of the suggestion (the user typed along it); anything else hides it at once, so a stale suggestion
-- is never shown or inserted.
--
-- What is shown is what <Tab> inserts: both are the suggestion's text. While the model streams, the text
-- only grows (an early answer shorter than the stream so far changes nothing); once the decode has
-- ended, the server's final text (the `done` delta, PROTOCOL.md) replaces it, also when validation cut
-- it shorter, and no later answer changes it. (A trailing line break is inserted but not drawn.)
local compat = require("fimble.compat")

local M = {}

local ns = vim.api.nvim_create_namespace("fimble")
M.ns = ns

local defaults = {
  cmd = { "fimble", "lsp" },
  cmd_env = nil,
  root_dir = nil, -- default: the working directory at setup()
  filetypes = nil, -- nil: the languages the server's model was trained on; or a list, e.g. { "python", "lua" }
  exclude_filetypes = { "help", "gitcommit", "gitrebase", "TelescopePrompt", "NvimTree", "neo-tree", "lazy", "qf" },
  settings = {}, -- initializationOptions, keys of lsp_server/PROTOCOL.md ("maxLines", "model", ...)
  debounce_ms = 60, -- wait after a keystroke before asking (the server prefetches meanwhile)
  auto_trigger = true, -- ask while typing; false: only require("fimble").request()
  native = false, -- Neovim 0.12+: use vim.lsp.inline_completion for display and accept
  cursor_prewarm = true, -- tell the server where the cursor rests (fimble/cursor): it pre-warms its cache there
  cursor_prewarm_ms = 150, -- how long the cursor must rest before that
  hl_group = "FimbleGhostText", -- grey italic unless defined (`:highlight FimbleGhostText guifg=...`)
  keymaps = {
    accept = "<Tab>", -- falls through to a plain <Tab> when nothing is shown
    accept_word = "<M-Right>",
    accept_line = "<M-C-Right>",
    dismiss = "<C-]>",
  },
}

local config = nil
local S = {
  client_id = nil,
  enabled = true,
  req = nil, -- the latest request: { id, bufnr, row, col, prefix, text, done, command, t0 }
  sugg = nil, -- the request whose text is the suggestion
  shown = nil, -- { bufnr, row, col, text }: what the extmark shows
  timer = nil,
  cursor_timer = nil, -- debounces fimble/cursor (one timer: there is one cursor)
  cursor_sent = nil, -- { bufnr, tick, row, col } of the last fimble/cursor
  tick_seen = nil,
  start_error = nil,
  exit_reason = nil, -- why the server stopped, if it did
  status = nil, -- the server's latest fimble/status: { state, message, model, languages, firstLatencyMs }
  languages = nil, -- the filetypes the server serves (nil: every one); known once languages_known
  languages_known = false,
  pending = {}, -- buffers waiting for the server's language list (bufnr -> true)
  insert_tick = nil, -- the buffer's changedtick at InsertEnter: a request needs an edit since
  last_latency_ms = nil,
  counters = { requests = 0, cancelled = 0, responses = 0, deltas = 0, stale = 0, shown = 0, accepted = 0, partial = 0, cursor = 0 },
}
local log_lines = {}

local function log(fmt, ...)
  local line = string.format("%s " .. fmt, os.date("%H:%M:%S"), ...)
  log_lines[#log_lines + 1] = line
  if #log_lines > 200 then
    table.remove(log_lines, 1)
  end
end

local function now_ms()
  return compat.uv.hrtime() / 1e6
end

local function in_insert()
  local m = vim.api.nvim_get_mode().mode
  return m:sub(1, 1) == "i"
end

local function get_line(bufnr, row)
  return vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ""
end

local function cursor()
  local pos = vim.api.nvim_win_get_cursor(0)
  return pos[1] - 1, pos[2]
end

local function split(text)
  return vim.split(text, "\n", { plain = true })
end

local function client()
  local c = compat.get_client(S.client_id)
  if c and compat.is_stopped(c) then
    return nil
  end
  return c
end

local function attached(bufnr)
  local c = client()
  if not c then
    return nil
  end
  return compat.is_attached(bufnr, c.id) and c or nil
end

-- Text of the buffer from (r1, c1) to (r2, c2) (bytes, 0-based), or nil if (r2, c2) is before it.
local function text_between(bufnr, r1, c1, r2, c2)
  if r2 < r1 or (r2 == r1 and c2 < c1) or r2 - r1 > 100 then
    return nil
  end
  local lines = vim.api.nvim_buf_get_lines(bufnr, r1, r2 + 1, false)
  if #lines ~= r2 - r1 + 1 then
    return nil
  end
  if r1 == r2 then
    return lines[1]:sub(c1 + 1, c2)
  end
  lines[1] = lines[1]:sub(c1 + 1)
  lines[#lines] = lines[#lines]:sub(1, c2)
  return table.concat(lines, "\n")
end

-- What is left of the suggestion at the cursor, or nil when the buffer no longer agrees with it.
local function remainder()
  local sug = S.sugg
  if not sug or sug.text == "" or not in_insert() then
    return nil
  end
  local bufnr = vim.api.nvim_get_current_buf()
  if bufnr ~= sug.bufnr then
    return nil
  end
  if get_line(bufnr, sug.row):sub(1, sug.col) ~= sug.prefix then
    return nil
  end
  local row, col = cursor()
  local typed = text_between(bufnr, sug.row, sug.col, row, col)
  if not typed or sug.text:sub(1, #typed) ~= typed then
    return nil
  end
  return sug.text:sub(#typed + 1), bufnr, row, col
end

local function clear_marks()
  if S.shown and vim.api.nvim_buf_is_valid(S.shown.bufnr) then
    vim.api.nvim_buf_clear_namespace(S.shown.bufnr, ns, 0, -1)
  end
  S.shown = nil
end

local function draw(bufnr, row, col, text)
  local hl = config.hl_group
  local lines = split(text)
  -- A suggestion that ends in a line break ends in an empty line: as a virtual line it would show
  -- as a blank phantom line under the cursor. The break itself is inserted on accept all the same.
  while #lines > 1 and lines[#lines] == "" do
    table.remove(lines)
  end
  local first = lines[1]
  local after = get_line(bufnr, row):sub(col + 1)
  local virt_lines = {}
  for i = 2, #lines do
    virt_lines[#virt_lines + 1] = { { lines[i], hl } }
  end
  local opts = { hl_mode = "combine", priority = 1000 }
  if compat.has_inline_virt_text then
    if first ~= "" then
      opts.virt_text = { { first, hl } }
      opts.virt_text_pos = "inline"
    end
  elseif after == "" then
    if first ~= "" then
      opts.virt_text = { { first, hl } }
      opts.virt_text_pos = "overlay"
    end
  elseif #lines == 1 then
    -- No inline virtual text before 0.10: draw the suggestion and then the rest of the line over it.
    opts.virt_text = { { first, hl }, { after, "Normal" } }
    opts.virt_text_pos = "overlay"
  else
    -- The rest of the line would end up after the last suggested line: show it there.
    opts.virt_text = { { first, hl }, { string.rep(" ", vim.fn.strdisplaywidth(after)), "Normal" } }
    opts.virt_text_pos = "overlay"
    table.insert(virt_lines[#virt_lines], { after, "Normal" })
  end
  if #virt_lines > 0 then
    opts.virt_lines = virt_lines
  end
  vim.api.nvim_buf_set_extmark(bufnr, ns, row, col, opts)
end

-- Show what is left of the suggestion at the cursor, or nothing.
local function render()
  local rest, bufnr, row, col = remainder()
  if S.shown and rest and S.shown.bufnr == bufnr and S.shown.row == row and S.shown.col == col and S.shown.text == rest then
    return -- unchanged
  end
  clear_marks()
  if not rest or rest == "" then
    return
  end
  draw(bufnr, row, col, rest)
  local sug = S.sugg
  if not sug.was_shown then
    sug.was_shown = true
    S.counters.shown = S.counters.shown + 1
  end
  if sug.item and not sug.show_sent then
    sug.show_sent = true -- telemetry (PROTOCOL.md): once per answer, when it is on screen
    local c = client()
    if c then
      compat.notify(c, "textDocument/didShowCompletion", { item = sug.item })
    end
  end
  S.shown = { bufnr = bufnr, row = row, col = col, text = rest }
end

local function cancel_pending()
  local req = S.req
  if req and not req.answered and not req.cancelled and req.id then
    req.cancelled = true -- once: a keystroke reaches here from several autocmds
    local c = client()
    if c then
      compat.cancel(c, req.id)
    end
    S.counters.cancelled = S.counters.cancelled + 1
    log("cancel request %s", tostring(req.id))
  end
end

--- Hide the suggestion and forget it; cancel a request still out.
function M.dismiss()
  if S.timer then
    S.timer:stop()
  end
  cancel_pending()
  S.req = nil
  S.sugg = nil
  clear_marks()
end

-- New text for a request (from its answer or a delta): it becomes the suggestion if it grows, or if it
-- is the decode's final text (`final`: the server's last word, which may be shorter).
local function update_text(req, text, final)
  if type(text) == "string" and final and text ~= req.text then
    req.text = text
    S.sugg = req
    render()
    return
  end
  if type(text) ~= "string" or #text <= #req.text or req.final then
    if S.sugg ~= req and req.text ~= "" then
      S.sugg = req
      render()
    end
    return
  end
  req.text = text
  S.sugg = req
  render()
end

local function on_response(req, err, result)
  if S.req ~= req then
    S.counters.stale = S.counters.stale + 1
    return -- superseded, cancelled or dismissed: never shown
  end
  req.answered = true
  S.counters.responses = S.counters.responses + 1
  S.last_latency_ms = math.floor(now_ms() - req.t0 + 0.5)
  if err then
    log("request %s: %s", tostring(req.id), vim.inspect(err))
    return
  end
  local items = result and (result.items or result) or {}
  local item = items[1]
  if type(item) ~= "table" then
    log("request %s: no suggestion (%d ms)", tostring(req.id), S.last_latency_ms)
    return
  end
  local text = item.insertText
  if type(text) == "table" then
    text = text.value
  end
  if type(text) ~= "string" then
    return
  end
  local c = client()
  if item.range and c then
    -- The server re-bases an answer to a later cursor if the user typed along it meanwhile.
    local srow = item.range.start.line
    local scol = compat.to_bytes(get_line(req.bufnr, srow), item.range.start.character, compat.client_encoding(c))
    if srow ~= req.row or scol ~= req.col then
      local typed = text_between(req.bufnr, req.row, req.col, srow, scol)
      if not typed then
        S.counters.stale = S.counters.stale + 1
        return
      end
      text = typed .. text
    end
  end
  req.command = item.command or req.command
  req.item = item
  log("request %s: %d chars in %d ms", tostring(req.id), #text, S.last_latency_ms)
  update_text(req, text)
end

-- A `done` delta whose decode ended (not cut short by an edit, a newer request or a cancel: those
-- repeat the text already sent) carries the final text.
local decode_ends = { stop = true, eos = true, length = true, context = true, error = true }

local function on_delta(_, params, ctx)
  S.counters.deltas = S.counters.deltas + 1
  local req = S.req
  if type(params) ~= "table" or not req or params.requestId ~= req.id then
    return -- another request's stream: never shown
  end
  if type(ctx) == "table" and ctx.client_id and ctx.client_id ~= S.client_id then
    return -- a server being stopped (a restart): request ids are per server
  end
  if not req.command and params.completionId then
    req.command = { title = "Accept completion", command = "fimble.acceptCompletion", arguments = { params.completionId } }
  end
  local final = false
  if params.done then
    req.done = true
    req.finish = params.finishReason
    final = decode_ends[params.finishReason] == true and type(params.text) == "string"
  end
  update_text(req, params.text, final)
  if final then
    req.final = true
  end
end

--- Ask the server for a suggestion at the cursor (the typing autocmds call this after the debounce).
function M.request()
  local bufnr = vim.api.nvim_get_current_buf()
  local c = attached(bufnr)
  if not c or not S.enabled or not in_insert() then
    return
  end
  cancel_pending()
  local row, col = cursor()
  local line = get_line(bufnr, row)
  local params = {
    textDocument = { uri = vim.uri_from_bufnr(bufnr) },
    position = { line = row, character = compat.to_units(line, col, compat.client_encoding(c)) },
    context = { triggerKind = 2 }, -- Automatic
  }
  local req = { bufnr = bufnr, row = row, col = col, prefix = line:sub(1, col), text = "", t0 = now_ms() }
  local ok, id = compat.request(c, "textDocument/inlineCompletion", params, function(err, result)
    on_response(req, err, result)
  end, bufnr)
  if not ok then
    return
  end
  req.id = id
  S.req = req
  S.counters.requests = S.counters.requests + 1
end

-- (Re)start the one-shot timer S[key]: ``fn`` runs on the main loop once ``ms`` pass without another call.
local function debounce(key, ms, fn)
  if not S[key] then
    S[key] = compat.uv.new_timer()
  end
  S[key]:stop()
  S[key]:start(ms, 0, vim.schedule_wrap(fn))
end

local function schedule_request()
  if not (config.auto_trigger and S.enabled) then
    return
  end
  debounce("timer", config.debounce_ms, M.request)
end

local function on_text_changed()
  local bufnr = vim.api.nvim_get_current_buf()
  if not attached(bufnr) then
    return
  end
  S.tick_seen = vim.api.nvim_buf_get_changedtick(bufnr)
  render()
  if not S.shown then
    cancel_pending() -- its answer cannot apply to this text
    S.sugg = nil
  end
  schedule_request()
end

local function on_cursor_moved()
  local bufnr = vim.api.nvim_get_current_buf()
  if not attached(bufnr) then
    return
  end
  if vim.api.nvim_buf_get_changedtick(bufnr) ~= S.tick_seen then
    return on_text_changed() -- typing (CursorMovedI may come before TextChangedI)
  end
  -- Moved without typing: keep the suggestion only if the cursor is still where it is shown.
  local row, col = cursor()
  if not (S.shown and S.shown.row == row and S.shown.col == col) then
    local req = S.req
    if req and not (req.row == row and req.col == col) then
      M.dismiss()
    else
      render()
    end
  end
end

--- Tell the server where the cursor is now (fimble/cursor, lsp_server/PROTOCOL.md): it pre-warms its KV cache
--- for a completion there, so the first one after a jump is fast. Returns true if sent (not for the same
--- buffer, text and cursor as last time). The CursorMoved autocmds call it once the cursor rests.
function M.notify_cursor()
  local bufnr = vim.api.nvim_get_current_buf()
  local c = attached(bufnr)
  if not c or not S.enabled then
    return false
  end
  local row, col = cursor()
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local last = S.cursor_sent
  if last and last.bufnr == bufnr and last.tick == tick and last.row == row and last.col == col then
    return false
  end
  local ok = compat.notify(c, "fimble/cursor", {
    textDocument = { uri = vim.uri_from_bufnr(bufnr) },
    position = { line = row, character = compat.to_units(get_line(bufnr, row), col, compat.client_encoding(c)) },
  })
  if ok == false then
    return false
  end
  S.cursor_sent = { bufnr = bufnr, tick = tick, row = row, col = col }
  S.counters.cursor = S.counters.cursor + 1
  return true
end

-- Restart the fimble/cursor debounce (every cursor movement: keep it cheap).
local function schedule_cursor()
  if not S.enabled or not S.client_id then
    return
  end
  debounce("cursor_timer", config.cursor_prewarm_ms, M.notify_cursor)
end

local function next_word(text)
  if text:sub(1, 1) == "\n" then
    return text:match("^\n[ \t]*")
  end
  return text:match("^[ \t]*[%w_]+") or text:match("^[ \t]*[^%w_%s]+") or text:match("^[ \t]+") or text
end

local function next_line(text)
  if text:sub(1, 1) == "\n" then
    return "\n" .. (text:sub(2):match("^[^\n]*") or "")
  end
  return text:match("^[^\n]*")
end

--- Accept the suggestion: kind "all" (default), "word" or "line". Returns true if something was inserted.
function M.accept(kind)
  kind = kind or "all"
  local rest, bufnr, row, col = remainder()
  if not rest or rest == "" then
    return false
  end
  local piece = rest
  if kind == "word" then
    piece = next_word(rest)
  elseif kind == "line" then
    piece = next_line(rest)
  end
  local sug = S.sugg
  local c = client()
  local lines = split(piece)
  vim.api.nvim_buf_set_text(bufnr, row, col, row, col, lines)
  local new_row = row + #lines - 1
  local new_col = #lines == 1 and col + #lines[1] or #lines[#lines]
  vim.api.nvim_win_set_cursor(0, { new_row + 1, new_col })
  S.tick_seen = vim.api.nvim_buf_get_changedtick(bufnr)
  if piece == rest then
    S.counters.accepted = S.counters.accepted + 1
    if c and sug.command then
      compat.request(c, "workspace/executeCommand", { command = sug.command.command, arguments = sug.command.arguments }, function() end, bufnr)
    end
    if S.timer then
      S.timer:stop()
    end
    S.req = nil
    S.sugg = nil
    clear_marks()
    schedule_request() -- a continuation from the new cursor
  else
    S.counters.partial = S.counters.partial + 1
    if c and sug.item then
      compat.notify(c, "textDocument/didPartiallyAcceptCompletion", { item = sug.item, acceptedLength = #piece })
    end
    render() -- the rest stays on screen
  end
  log("accept %s: %d chars", kind, #piece)
  return true
end

--- The text the ghost text shows now (nil if none).
function M.visible_text()
  local rest = remainder()
  if rest and rest ~= "" then
    return rest
  end
  return nil
end

function M.is_visible()
  return M.visible_text() ~= nil
end

-- Capabilities: the defaults plus inline completion and fimble's streaming notification.
local function capabilities()
  local caps = vim.lsp.protocol.make_client_capabilities()
  caps.textDocument = caps.textDocument or {}
  caps.textDocument.inlineCompletion = { dynamicRegistration = false }
  if not config.native then
    caps.experimental = vim.tbl_deep_extend("force", caps.experimental or {}, { fimble = { completionDelta = true } })
  end
  return caps
end

local function redraw_status()
  vim.schedule(function()
    pcall(vim.cmd, "redrawstatus")
  end)
end

-- Attach every loaded buffer the plugin wants (after the server's language list arrived or changed).
local function attach_all()
  for _, b in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(b) then
      M.attach(b)
    end
  end
end

-- The server's language list (capabilities.experimental.fimble.languages or fimble/status): a list of
-- language ids, or nil for every language (JSON null, or a server that does not say).
local function parse_languages(value)
  if type(value) ~= "table" then
    return nil
  end
  return vim.tbl_filter(function(v)
    return type(v) == "string"
  end, value)
end

-- fimble/status (PROTOCOL.md): the engine's state, the model's languages and the first latency.
local function on_status(_, params, ctx)
  if type(params) ~= "table" then
    return
  end
  if type(ctx) == "table" and ctx.client_id and ctx.client_id ~= S.client_id then
    return -- a server being stopped (a restart)
  end
  local old = S.status
  S.status = params
  if not old or old.state ~= params.state then
    log("server: %s", tostring(params.message ~= vim.NIL and params.message or params.state))
  end
  local langs = parse_languages(params.languages)
  if S.languages_known and not vim.deep_equal(langs, S.languages) then
    S.languages = langs
    vim.schedule(attach_all)
  end
  redraw_status()
end

local function on_init(_, result)
  local caps = type(result) == "table" and result.capabilities or {}
  local exp = type(caps) == "table" and caps.experimental or nil
  local fimble = type(exp) == "table" and exp.fimble or nil
  S.languages = parse_languages(type(fimble) == "table" and fimble.languages or nil)
  S.languages_known = true
  log("server serves %s", S.languages and table.concat(S.languages, ", ") or "every language")
  vim.schedule(function()
    local pending = S.pending
    S.pending = {}
    for b in pairs(pending) do
      if vim.api.nvim_buf_is_valid(b) and vim.api.nvim_buf_is_loaded(b) then
        M.attach(b)
      end
    end
  end)
end

local function client_config()
  local init = vim.tbl_deep_extend("force", {}, config.settings or {})
  init.streaming = not config.native
  if config.filetypes and init.languages == nil then
    init.languages = config.filetypes -- the user's list: the server serves these whatever the model says
  end
  return {
    name = "fimble",
    cmd = config.cmd,
    cmd_env = config.cmd_env,
    root_dir = config.root_dir,
    capabilities = capabilities(),
    init_options = init,
    handlers = { ["fimble/completionDelta"] = on_delta, ["fimble/status"] = on_status },
    on_init = on_init,
    flags = { debounce_text_changes = 0 }, -- the server prefetches on each keystroke
    on_attach = function(_, bufnr)
      -- Typed while the server was starting: ask now rather than at the next keystroke.
      if not config.native and bufnr == vim.api.nvim_get_current_buf() and in_insert()
        and S.insert_tick and vim.api.nvim_buf_get_changedtick(bufnr) ~= S.insert_tick then
        schedule_request()
      end
    end,
    on_exit = function(code, signal, client_id)
      log("server exited: code %s, signal %s", tostring(code), tostring(signal))
      vim.schedule(function()
        if client_id ~= nil and S.client_id ~= nil and client_id ~= S.client_id then
          return -- the server a restart stopped: its successor runs
        end
        M.dismiss()
        S.client_id = nil
        S.status = nil
        S.languages_known = false
        S.exit_reason = string.format("server exited (code %s)", tostring(code))
        redraw_status()
      end)
    end,
  }
end

local function wanted(bufnr)
  if not vim.api.nvim_buf_is_valid(bufnr) or vim.bo[bufnr].buftype ~= "" then
    return false
  end
  local ft = vim.bo[bufnr].filetype
  if ft == "" or vim.api.nvim_buf_get_name(bufnr) == "" then
    return false
  end
  if vim.tbl_contains(config.exclude_filetypes or {}, ft) then
    return false
  end
  return config.filetypes == nil or vim.tbl_contains(config.filetypes, ft)
end

-- Whether the server completes the buffer's filetype: the user's `filetypes`, else the server's list.
local function serves(bufnr)
  if config.filetypes then
    return true -- (wanted() checked the list)
  end
  return S.languages == nil or vim.tbl_contains(S.languages, vim.bo[bufnr].filetype)
end

-- Start the server (not attached to any buffer yet); false if it cannot start.
local function ensure_started()
  if client() then
    return true
  end
  if vim.fn.executable(config.cmd[1]) ~= 1 then
    if not S.start_error then
      S.start_error = "not executable: " .. config.cmd[1]
      vim.notify("fimble: " .. S.start_error .. " (set cmd in require('fimble').setup)", vim.log.levels.ERROR)
    end
    return false
  end
  S.languages_known = false
  local ok, id = pcall(compat.start_client, client_config())
  if not ok or not id then
    S.start_error = tostring(id)
    log("start failed: %s", S.start_error)
    return false
  end
  S.client_id, S.start_error, S.exit_reason, S.status = id, nil, nil, nil
  redraw_status()
  return true
end

--- Start the server if needed and attach it to the buffer, if the server serves its filetype. Also
--- after `:e!`, a reload of a file changed on disk or an unloaded buffer shown again: Neovim then
--- detaches the client (didClose) and never re-attaches it by itself.
function M.attach(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if not wanted(bufnr) or attached(bufnr) or not ensure_started() then
    return
  end
  if not S.languages_known then
    S.pending[bufnr] = true -- attached once the server has said which languages it serves (on_init)
    return
  end
  if not serves(bufnr) then
    return
  end
  vim.lsp.buf_attach_client(bufnr, S.client_id)
  if config.native and compat.has_native_inline then
    vim.lsp.inline_completion.enable(true, { bufnr = bufnr })
  end
end

local fallback_keys = {}

--- What a mapped key does: accept / dismiss if a suggestion is shown now, else the key's own meaning.
--- Decided when the key runs, not when the mapping is expanded: with typeahead (fast typing, a paste)
--- Neovim expands a mapping before the characters typed just before it are in the buffer.
function M._key(kind)
  local done
  if kind == "dismiss" then
    done = M.is_visible()
    if done then
      M.dismiss()
    end
  else
    done = M.accept(kind)
  end
  if not done and fallback_keys[kind] then
    vim.api.nvim_feedkeys(vim.api.nvim_replace_termcodes(fallback_keys[kind], true, false, true), "in", false)
  end
end

local function expr_map(lhs, kind)
  if not lhs or lhs == "" then
    return
  end
  fallback_keys[kind] = lhs
  vim.keymap.set("i", lhs, function()
    if M.is_visible() then
      return "<Cmd>lua require('fimble')._key('" .. kind .. "')<CR>"
    end
    return lhs -- nothing shown: the key does what it did before
  end, { expr = true, silent = true, desc = "fimble: " .. kind })
end

local function native_maps()
  local lhs = config.keymaps.accept
  if lhs and lhs ~= "" then
    vim.keymap.set("i", lhs, function()
      if not vim.lsp.inline_completion.get() then
        return lhs
      end
    end, { expr = true, silent = true, desc = "fimble: accept (native)" })
  end
end

--- Status lines (also :FimbleStatus).
function M.status()
  local c = client()
  local out = {}
  local state
  if c then
    state = string.format("running (client %d)", c.id)
  elseif S.start_error then
    state = "not started: " .. S.start_error
  elseif S.exit_reason then
    state = S.exit_reason
  else
    state = "not started (no matching buffer yet)"
  end
  local buf = vim.api.nvim_get_current_buf()
  local here = "attached to this buffer"
  if not attached(buf) then
    local ft = vim.bo[buf].filetype
    here = "not attached to this buffer"
    if c and S.languages_known and wanted(buf) and not serves(buf) then
      here = here .. string.format(" (filetype %s is not among the model's languages; set filetypes to add it)", ft)
    end
  end
  out[#out + 1] = string.format(
    "fimble: %s; %s; %s; Neovim %s, %s ghost text, %s",
    state,
    S.enabled and "enabled" or "disabled",
    here,
    tostring(vim.version().major .. "." .. vim.version().minor .. "." .. vim.version().patch),
    config.native and compat.has_native_inline and "native" or (compat.has_inline_virt_text and "inline" or "overlay"),
    compat.start_unattached and "vim.lsp.start" or "vim.lsp.start_client"
  )
  if c then
    local st = S.status
    local engine
    if not st then
      engine = "starting the server"
    elseif st.state == "error" then
      engine = "error: " .. tostring(st.message)
    else
      engine = tostring(st.message ~= vim.NIL and st.message or st.state)
      if type(st.firstLatencyMs) == "number" then
        engine = engine .. string.format("; first completion %d ms", st.firstLatencyMs)
      end
    end
    local langs = S.languages_known and (S.languages and table.concat(S.languages, ", ") or "every language") or "?"
    out[#out + 1] = string.format("engine: %s; languages: %s%s", engine, langs,
      config.filetypes and " (filetypes setting)" or " (the model's)")
  end
  local k = S.counters
  out[#out + 1] = string.format(
    "last latency: %s; requests %d, cancelled %d, stale %d, deltas %d, shown %d, accepted %d, partial %d",
    S.last_latency_ms and (S.last_latency_ms .. " ms") or "-",
    k.requests, k.cancelled, k.stale, k.deltas, k.shown, k.accepted, k.partial
  )
  if c then
    local ok, res = pcall(compat.request_sync, c, "fimble/stats", vim.NIL, 1000, vim.api.nvim_get_current_buf())
    local stats = ok and res and res.result
    if type(stats) == "table" then
      local eng = stats.engine or {}
      local ft = (stats.latency_ms or {}).first_token or {}
      out[#out + 1] = string.format(
        "server: engine %s%s; first token p50 %s ms, p95 %s ms (%s samples)",
        tostring(eng.state),
        eng.error ~= nil and eng.error ~= vim.NIL and (" (" .. tostring(eng.error) .. ")") or "",
        tostring(ft.p50 or "-"), tostring(ft.p95 or "-"), tostring(ft.count or 0)
      )
    end
  end
  return out
end

--- For the status line: "fimble: loading model" until the engine is ready, then the latest completion's
--- latency ("fimble 120 ms"; "fimble ready" before the first), "fimble: error (...)" if it failed.
function M.statusline()
  if not client() then
    if S.start_error then
      return "fimble: not started"
    end
    return S.exit_reason and "fimble: stopped" or ""
  end
  if not S.enabled then
    return "fimble off"
  end
  local st = S.status
  if not st or st.state == "loading" then
    return "fimble: loading model"
  end
  if st.state == "error" then
    local msg = tostring(st.message ~= vim.NIL and st.message or "")
    return "fimble: error (" .. (#msg > 40 and (msg:sub(1, 39) .. "…") or msg) .. ")"
  end
  if S.last_latency_ms then
    return string.format("fimble %d ms", S.last_latency_ms)
  end
  -- No answer of ours has arrived yet (streamed ghost text, or a superseded request): the server's
  -- measure of the first completion still tells the user how fast it is.
  if type(st.firstLatencyMs) == "number" then
    return string.format("fimble %d ms", st.firstLatencyMs)
  end
  return st.state == "ready" and "fimble ready" or "fimble"
end

--- Stop the server and start a new one (:FimbleRestart): the buffers are attached to it again once it has
--- said which languages it serves. The old server gets the LSP shutdown; past `timeout_ms` (10 s) it is killed.
function M.restart(timeout_ms)
  local old = client()
  M.dismiss()
  S.client_id, S.status, S.languages_known, S.exit_reason, S.start_error = nil, nil, false, nil, nil
  S.last_latency_ms = nil
  S.cursor_sent = nil
  log("restarting the server")
  local function start()
    attach_all()
    redraw_status()
  end
  if not old then
    return start()
  end
  vim.lsp.stop_client(old.id)
  local waited = 0
  local timer = compat.uv.new_timer()
  timer:start(50, 50, vim.schedule_wrap(function()
    waited = waited + 50
    if not compat.is_stopped(old) and waited < (timeout_ms or 10000) then
      return
    end
    timer:stop()
    timer:close()
    if not compat.is_stopped(old) then
      vim.lsp.stop_client(old.id, true)
    end
    start()
  end))
end

function M.toggle(on)
  if on == nil then
    on = not S.enabled
  end
  S.enabled = on
  if not on then
    M.dismiss()
  end
  return S.enabled
end

--- Internal state for tests and bug reports.
function M.debug()
  local sug = S.sugg
  return {
    client_id = S.client_id,
    attached = attached(vim.api.nvim_get_current_buf()) ~= nil,
    enabled = S.enabled,
    request_id = S.req and S.req.id or nil,
    timer_pending = S.timer ~= nil and S.timer:is_active() == true,
    answered = S.req ~= nil and S.req.answered == true,
    suggestion = sug and { row = sug.row, col = sug.col, text = sug.text, done = sug.done == true } or nil,
    shown = S.shown,
    counters = vim.deepcopy(S.counters),
    cursor_sent = S.cursor_sent and vim.deepcopy(S.cursor_sent) or nil,
    last_latency_ms = S.last_latency_ms,
    status = S.status and vim.deepcopy(S.status) or nil,
    languages = S.languages and vim.deepcopy(S.languages) or nil,
    languages_known = S.languages_known,
    log = vim.deepcopy(log_lines),
  }
end

-- `default`: a user's (or colour scheme's) own FimbleGhostText wins. Not Comment: in 0.7.2's default
-- colours that is bright cyan and upright, and ghost text must not look like real code.
local function define_highlights()
  vim.cmd("highlight default FimbleGhostText ctermfg=244 guifg=#808080 cterm=italic gui=italic")
end

function M.setup(opts)
  config = vim.tbl_deep_extend("force", vim.deepcopy(defaults), opts or {})
  if opts and opts.keymaps == false then
    config.keymaps = {}
  end
  if opts and opts.filetypes then
    config.filetypes = opts.filetypes
  end
  config.root_dir = config.root_dir or vim.fn.getcwd()
  if config.native and not compat.has_native_inline then
    vim.notify("fimble: native = true needs Neovim 0.12 (vim.lsp.inline_completion); using fimble's ghost text", vim.log.levels.WARN)
    config.native = false
  end
  define_highlights()

  local group = vim.api.nvim_create_augroup("fimble", { clear = true })
  local function au(events, fn)
    vim.api.nvim_create_autocmd(events, { group = group, callback = function(args) fn(args) end })
  end
  -- BufReadPost: `:e!` and reloads of files changed on disk detach the client (see M.attach).
  au({ "FileType", "BufEnter", "BufReadPost" }, function(args)
    M.attach(args.buf)
  end)
  au("ColorScheme", define_highlights) -- `:colorscheme` clears the highlight groups first
  if not config.native then
    au("InsertEnter", function()
      -- No request here: a suggestion comes after an edit in insert mode (or require("fimble").request()).
      S.tick_seen = vim.api.nvim_buf_get_changedtick(0)
      S.insert_tick = S.tick_seen
    end)
    au({ "TextChangedI", "TextChangedP" }, on_text_changed)
    au("CursorMovedI", on_cursor_moved)
    au({ "InsertLeave", "BufLeave" }, M.dismiss)
    local km = config.keymaps or {}
    expr_map(km.accept, "all")
    expr_map(km.accept_word, "word")
    expr_map(km.accept_line, "line")
    expr_map(km.dismiss, "dismiss")
  else
    native_maps()
  end
  if config.cursor_prewarm then
    au({ "CursorMoved", "CursorMovedI", "BufEnter" }, schedule_cursor)
  end

  vim.api.nvim_create_user_command("FimbleStatus", function()
    for _, line in ipairs(M.status()) do
      print(line)
    end
  end, { desc = "fimble: server state, latency and counters" })
  vim.api.nvim_create_user_command("FimbleRestart", function()
    M.restart()
  end, { desc = "fimble: restart the server" })
  vim.api.nvim_create_user_command("FimbleToggle", function()
    print("fimble " .. (M.toggle() and "enabled" or "disabled"))
  end, { desc = "fimble: turn suggestions on or off" })
  vim.api.nvim_create_user_command("FimbleLog", function()
    -- One message: each line once (separate prints are re-shown as the message area scrolls).
    vim.api.nvim_echo({ { #log_lines > 0 and table.concat(log_lines, "\n") or "fimble: the log is empty" } }, false, {})
  end, { desc = "fimble: the plugin's recent log" })

  attach_all()
end

return M

-- Feature detection, so one plugin runs on Neovim 0.7.2 (Debian 12) through 0.12.
local M = {}

local function has(v)
  return vim.fn.has("nvim-" .. v) == 1
end

M.uv = vim.uv or vim.loop
M.start_unattached = has("0.11") -- vim.lsp.start(config, { attach = false }); vim.lsp.start_client before
M.has_inline_virt_text = has("0.10") -- virt_text_pos = "inline"
M.has_native_inline = vim.lsp.inline_completion ~= nil and type(vim.lsp.inline_completion.enable) == "function" -- 0.12
M.method_calls = has("0.11") -- client:request(...) instead of client.request(...)
M.new_str_index = has("0.11") -- vim.str_utfindex(s, encoding, index) / vim.str_byteindex(s, encoding, index)

--- Start the client without attaching any buffer (the plugin attaches once it knows the server's
--- languages). 0.11 deprecates vim.lsp.start_client for vim.lsp.start(config, { attach = false }).
function M.start_client(config)
  if M.start_unattached then
    return vim.lsp.start(config, { attach = false })
  end
  return vim.lsp.start_client(config)
end

--- Whether the client is attached to the buffer now. Not client.attached_buffers: 0.7.2 leaves the
--- buffer there after `:e!` or an unload detached it (and sent didClose).
function M.is_attached(bufnr, client_id)
  return vim.lsp.buf_is_attached(bufnr, client_id)
end

function M.get_client(id)
  return id and vim.lsp.get_client_by_id(id) or nil
end

--- client.request / client:request. Returns ok, request_id.
function M.request(client, method, params, handler, bufnr)
  if M.method_calls then
    return client:request(method, params, handler, bufnr)
  end
  return client.request(method, params, handler, bufnr)
end

function M.request_sync(client, method, params, timeout_ms, bufnr)
  if M.method_calls then
    return client:request_sync(method, params, timeout_ms, bufnr)
  end
  return client.request_sync(method, params, timeout_ms, bufnr)
end

function M.cancel(client, id)
  if M.method_calls then
    return client:cancel_request(id)
  end
  return client.cancel_request(id)
end

function M.notify(client, method, params)
  if M.method_calls then
    return client:notify(method, params)
  end
  return client.notify(method, params)
end

function M.is_stopped(client)
  if M.method_calls then
    return client:is_stopped()
  end
  return client.is_stopped()
end

--- Byte column -> the client's units (utf-8 / utf-16 / utf-32) within `line`.
function M.to_units(line, byte_col, encoding)
  byte_col = math.min(byte_col, #line)
  if encoding == "utf-8" then
    return byte_col
  end
  if M.new_str_index then
    return vim.str_utfindex(line, encoding, byte_col, false)
  end
  local utf32, utf16 = vim.str_utfindex(line, byte_col)
  return encoding == "utf-32" and utf32 or utf16
end

--- The client's units -> byte column within `line`.
function M.to_bytes(line, units, encoding)
  if encoding == "utf-8" then
    return math.min(units, #line)
  end
  if M.new_str_index then
    return vim.str_byteindex(line, encoding, units, false)
  end
  local ok, b = pcall(vim.str_byteindex, line, units, encoding ~= "utf-32")
  return ok and b or #line
end

--- The buffer version the LSP client last sent (nil if unknown).
function M.buf_version(bufnr)
  local versions = vim.lsp.util.buf_versions
  local v = versions and versions[bufnr]
  if v == nil then
    v = vim.api.nvim_buf_get_changedtick(bufnr)
  end
  return v
end

function M.client_encoding(client)
  return (client and client.offset_encoding) or "utf-16"
end

return M

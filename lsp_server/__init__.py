"""The fimble language server: LSP in front of the local completion engine (see PROTOCOL.md)."""

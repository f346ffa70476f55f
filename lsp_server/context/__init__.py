"""Cross-file context: other files' code before the prompt. See service.py."""

from lsp_server.context.service import CrossFileContext

__all__ = ["CrossFileContext"]

"""Cross-file context: other files' code before the prompt (issue 26). See service.py."""

from lsp_server.context.service import CrossFileContext

__all__ = ["CrossFileContext"]

"""A session's settings and its model, and what the editor is told about the engine that runs it.

- Settings: the client's options merged onto the command line's defaults (``apply``); model settings a
  client may not have (a shared engine's, an unusable folder) stay as they were, with a message.
- ``fimble/status`` (PROTOCOL.md): the engine's state for the editor's status line, sent from
  ``initialized`` on whenever what it says changes.
- The engine's errors and the engine host's supervision notices, shown to the user: each distinct
  error once, a folder the client chose never named in detail (so that the server is no oracle of
  which paths exist on its machine; the details are in the log).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lsprotocol import types

from engine.model_info import read_model_info  # no torch
from lsp_server.engine_host import EngineHost
from lsp_server.protocol import plain
from lsp_server.settings import MODEL_UNUSABLE, Settings, usable_model_folder

STATUS_METHOD = "fimble/status"


class SessionModel:
    def __init__(
        self,
        defaults: Settings,
        host: EngineHost,
        *,
        shared_engine: bool,
        show: Callable[[types.MessageType, str], None],
        notify: Callable[[str, dict], None],
    ):
        self.defaults = defaults  # CLI flags / environment
        self.settings = defaults
        self.host = host
        self.shared_engine = shared_engine  # one engine for several sessions: its model is the command line's
        self._show, self._notify = show, notify  # window/showMessage, a notification
        self.model_name = ""
        self.status_live = False  # fimble/status is sent from `initialized` on
        self._status_sent: dict | None = None
        self.first_latency_ms: int | None = None
        self._reported_error: str | None = None

    def apply(self, options: Any) -> bool:
        """Merge wire options; a null model or draft means the server's default (CLI / environment).

        Each bad value keeps the previous one (or is clamped) and is shown to the user, named.
        Whether the languages served changed.
        """
        s, problems = self.settings.merge(plain(options))
        s = self._checked_engine_settings(s, problems)
        for line in problems:
            self._show(types.MessageType.Warning, f"fimble: setting {line}")
        model = s.model or self.defaults.model
        if s.engine_spec is not None:  # a server's model (--engine): its languages are not known here, so all
            self.model_name = getattr(s.engine_spec, "model", None) or "remote"
            s = dataclasses.replace(s, model_languages=None)
        elif model != self.settings.model or not self.model_name:
            info = read_model_info(model)  # the languages the model was trained on; no model load
            self.model_name = info.name
            s = dataclasses.replace(s, model_languages=info.languages)
        old_langs = self.settings.effective_languages
        self.settings = dataclasses.replace(s, model=model, draft=s.draft or self.defaults.draft)
        if self.settings.effective_languages == old_langs:
            return False
        self.publish_status()
        return True

    def experimental_capabilities(self) -> dict:
        """InitializeResult.capabilities.experimental (PROTOCOL.md, Capabilities)."""
        langs = self.settings.effective_languages
        return {"fimble": {"languages": None if langs is None else list(langs), "status": True}}

    def status(self) -> dict:
        """fimble/status's params: the engine's state for the editor's status line."""
        state = {"starting": "loading"}.get(self.host.state, self.host.state)
        error = (self.public_engine_error() or "unknown error").splitlines()[0][:300] if state == "error" else None
        message = {
            "loading": f"loading model {self.model_name}",
            "ready": f"model {self.model_name} ready",
            "stopped": "model not loaded yet",
            "error": error,
        }[state]
        langs = self.settings.effective_languages
        return {
            "state": state,
            "message": message,
            "model": self.model_name,
            "languages": None if langs is None else list(langs),
            "firstLatencyMs": self.first_latency_ms,
        }

    def publish_status(self) -> None:
        """Send fimble/status if the client is initialized and what it says changed."""
        if self.host.state == "starting":
            self.first_latency_ms = None  # a (re)start: the next first completion counts again
        if not self.status_live:
            return
        status = self.status()
        if status != self._status_sent:
            self._status_sent = status
            self._notify(STATUS_METHOD, status)

    def _checked_engine_settings(self, s: Settings, problems: list[str]) -> Settings:
        """Model settings a client may not have: back to the current ones, with a line in ``problems``.

        A shared engine runs the command line's model for every session. A model folder from
        the client gets one message whatever is wrong with it, so that the server is no
        oracle of which paths exist on its machine (the CLI's own messages stay specific).
        """
        if self.shared_engine and s.engine_key() != self.settings.engine_key():
            problems.append(
                "model, draft, noDraft, device, engineThreads, kvCacheMB: set by the server's "
                "command line while it serves several connections; keeping them"
            )
            return dataclasses.replace(
                s,
                **{
                    k: getattr(self.settings, k)
                    for k in ("model", "draft", "no_draft", "device", "engine_threads", "kv_cache_mb")
                },
            )
        for key, attr in (("model", "model"), ("draft", "draft")):
            path = getattr(s, attr)
            if (
                path
                and path != getattr(self.settings, attr)
                and path != getattr(self.defaults, attr)
                and not usable_model_folder(path)
            ):
                problems.append(f"{key}: {MODEL_UNUSABLE}")
                s = dataclasses.replace(s, **{attr: getattr(self.settings, attr)})
        return s

    def public_engine_error(self) -> str | None:
        """The engine's error as a client may see it (see _checked_engine_settings)."""
        if not self.host.error:
            return None
        if (self.settings.model or None) != (self.defaults.model or None) or (self.settings.draft or None) != (
            self.defaults.draft or None
        ):
            return MODEL_UNUSABLE  # a folder the client chose: the details are in the log
        return self.host.error

    def engine_notice(self, level: str, message: str) -> None:
        """The engine host's supervision news, shown as it happens (lsp_server/engine_host.py)."""
        kinds = {
            "error": types.MessageType.Error,
            "warning": types.MessageType.Warning,
            "rejected": types.MessageType.Error,
        }
        kind = kinds.get(level, types.MessageType.Info)
        if level == "rejected":
            message = self._rejected_settings(message)
        if level == "error":
            self._reported_error = self.host.error  # report_engine_error: already told
        self._show(kind, message)

    def _rejected_settings(self, reason: str) -> str:
        """New model settings did not load beside the working engine, which serves on: the message to show.

        The status and the languages served stay the running model's. The reason is shown where it names no
        path of the client's choosing (a device); a folder the client chose gets MODEL_UNUSABLE, as in
        _checked_engine_settings (the details are in the log)."""
        running = self.host.running_settings
        if running is not None and running.engine_spec is None:
            info = read_model_info(running.model or self.defaults.model)
            self.model_name = info.name
            self.settings = dataclasses.replace(self.settings, model_languages=info.languages)
            self.publish_status()
        chosen = (self.settings.model or None) != (self.defaults.model or None) or (self.settings.draft or None) != (
            self.defaults.draft or None
        )
        if chosen and not reason.startswith(("device ", "unknown device")):
            reason = MODEL_UNUSABLE
        return (
            f"fimble: the new model settings did not load ({reason.splitlines()[0][:300]}); "
            f"keeping the model that was running ({self.model_name})"
        )

    def report_engine_error(self) -> None:
        """Tell the user once per distinct engine error (every keystroke would be noise)."""
        error = self.public_engine_error()
        if error and self.host.error != self._reported_error:
            self._reported_error = self.host.error
            self._show(types.MessageType.Error, f"fimble: {error}")

"""A small OpenAI /v1/completions and llama.cpp /infill server on asyncio, for the remote backend's tests.

It records every request (path, headers, JSON body) and answers with a script: the text chunks
to stream, or a failure (an HTTP status, a malformed event, silence, a dropped connection).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from dataclasses import dataclass, field


@dataclass
class Script:
    chunks: list[str] = field(default_factory=lambda: ["def ", "add(a, b):", "\n    return a + b\n"])
    finish: str = "length"  # openai finish_reason / llama.cpp stop_type ("eos", "limit", "word")
    status: int = 200
    error_body: str = '{"error": {"message": "model not found"}}'
    malformed: bool = False  # send a non-JSON event after the first chunk
    stall_after: int | None = None  # stop sending (keep the connection open) after this many chunks
    drop_after: int | None = None  # close the connection after this many chunks
    delay_s: float = 0.0  # between chunks
    stream: bool = True  # False: one JSON answer whatever the request says
    done: bool = True  # openai: send "data: [DONE]"


class FakeServer:
    """Runs in its own thread and event loop; ``url`` is http://127.0.0.1:PORT (https with ``tls``)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.script = Script()
        self.requests: list[dict] = []
        self.disconnects = 0  # connections the client closed before the answer ended
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls))
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def shutdown() -> None:  # end the connections' handlers inside the loop, then stop it
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            self.disconnects += 1
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        req = {"method": method, "path": path, "headers": headers, "body": json.loads(body) if body else None}
        self.requests.append(req)
        s = self.script
        if method == "GET" and path.endswith("/models"):
            await self._send(writer, 200, "application/json", json.dumps({"data": [{"id": "fake-model"}]}).encode())
            return True
        if s.status != 200:
            await self._send(writer, s.status, "application/json", s.error_body.encode())
            return True
        infill = path.endswith("/infill")
        if not s.stream:
            text = "".join(s.chunks)
            answer = (
                {"content": text, "stop": True, "stop_type": s.finish}
                if infill
                else {"choices": [{"text": text, "finish_reason": s.finish}]}
            )
            await self._send(writer, 200, "application/json", json.dumps(answer).encode())
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i, chunk in enumerate(s.chunks):
            if s.stall_after is not None and i >= s.stall_after:
                await asyncio.sleep(3600)
            if s.drop_after is not None and i >= s.drop_after:
                writer.transport.abort()
                return False
            last = i == len(s.chunks) - 1
            if infill:
                event = {"content": chunk, "stop": False}
            else:
                event = {"choices": [{"text": chunk, "finish_reason": None}]}
            await self._event(writer, json.dumps(event))
            if s.malformed and i == 0:
                await self._event(writer, "{not json")
            if s.delay_s:
                await asyncio.sleep(s.delay_s)
            if last:
                if infill:
                    await self._event(writer, json.dumps({"content": "", "stop": True, "stop_type": s.finish}))
                else:
                    await self._event(writer, json.dumps({"choices": [{"text": "", "finish_reason": s.finish}]}))
                    if s.done:
                        await self._event(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def _event(self, writer: asyncio.StreamWriter, data: str) -> None:
        payload = f"data: {data}\n\n".encode()
        writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
        await writer.drain()

    async def _send(self, writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes) -> None:
        reason = {200: "OK", 401: "Unauthorized", 404: "Not Found", 500: "Internal Server Error"}.get(status, "Error")
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()


def self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, written to ``folder``: (cert path, key path)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fimble-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)

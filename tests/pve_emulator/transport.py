"""HTTP for the emulator: a threaded HTTPS server on 127.0.0.1 that parses a request as pve-http-server
does (query string, form or JSON body, repeated keys as arrays, multipart uploads streamed to disk)
and hands it to PveEmulator.handle; a connection fault (faults.py) drops or holds it first."""

from __future__ import annotations

import json
import os
import socket
import ssl
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

from multipart import MultipartParser, parse_options_header

if TYPE_CHECKING:
    from .server import PveEmulator


class RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "pve-api-daemon/3.0"
    timeout = 30

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        pairs = parse_qsl(url.query, keep_blank_values=True)
        ctype = self.headers.get("Content-Type", "")
        upload = None
        body = b""
        if ctype.startswith("multipart/form-data"):  # uploads: the file part streams to disk
            pairs, upload = self._multipart(ctype, length)
        elif length:
            body = self.rfile.read(length)
        if body and "application/json" in ctype:
            for k, v in json.loads(body).items():
                if isinstance(v, bool):
                    v = "1" if v else "0"  # JSON true/false are real booleans in a JSON body
                pairs.append((k, v if isinstance(v, list) else str(v)))
        elif body:
            pairs += parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
        params: dict[str, object] = {}
        for k, v in pairs:
            if k in params:  # repeated keys become arrays
                prev = params[k]
                params[k] = (prev if isinstance(prev, list) else [prev]) + [v]
            else:
                params[k] = v
        emu = self.server.emulator
        fault = emu.connection_fault(method, url.path)
        if fault is not None and fault.kind == "hang":
            emu._stopping.wait(fault.seconds)  # the client gives up meanwhile; the call still runs
        if fault is not None and fault.kind == "drop" and fault.when == "before":
            self._drop(upload)
            return
        status, reason, payload = emu.handle(method, url.path, params, self.headers, upload)
        if upload is not None:
            Path(upload[0]).unlink(missing_ok=True)  # not taken by a successful upload task
        if fault is not None and fault.kind == "drop":  # carried out, but the answer is lost
            self._drop(None)
            return
        data = json.dumps(payload).encode()
        self.send_response(status, reason)
        self.send_header("Content-Type", "application/json;charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "max-age=0")
        self.end_headers()
        self.wfile.write(data)

    def _drop(self, upload) -> None:
        """Close the connection without an answer (the client reads EOF: connection lost)."""
        if upload is not None:
            Path(upload[0]).unlink(missing_ok=True)
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _multipart(self, ctype: str, length: int) -> tuple[list[tuple[str, str]], tuple[str, int] | None]:
        boundary = parse_options_header(ctype)[1].get("boundary", "")
        pairs: list[tuple[str, str]] = []
        upload = None
        spool = self.server.emulator._data_dir
        for part in MultipartParser(self.rfile, boundary, length, spool_limit=1024 * 1024, memory_limit=1024 * 1024):
            if part.filename:  # PVE takes the file's name as the `filename` parameter
                fd, tmp = tempfile.mkstemp(prefix="upload-", dir=spool)
                os.close(fd)
                part.save_as(tmp)
                upload = (tmp, part.size)
                pairs.append((part.name, part.filename))
            else:
                pairs.append((part.name, part.value))
            part.close()
        return pairs, upload


class Server(ThreadingMixIn, HTTPServer):
    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, addr, emulator: PveEmulator, ctx: ssl.SSLContext):
        self.emulator, self.ctx = emulator, ctx
        self._conns: set = set()
        self._conns_lock = threading.Lock()
        super().__init__(addr, RequestHandler)

    def finish_request(self, request, client_address) -> None:
        request.settimeout(10)
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and body are 2 writes
        try:
            tls = self.ctx.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return  # e.g. the client does not trust our CA
        with self._conns_lock:
            self._conns.add(tls)
        try:
            self.RequestHandlerClass(tls, client_address, self)
        except (OSError, ssl.SSLError):
            pass
        finally:
            with self._conns_lock:
                self._conns.discard(tls)
            try:
                tls.close()
            except OSError:
                pass

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request, client_address) -> None:
        pass

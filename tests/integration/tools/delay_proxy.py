#!/usr/bin/env python3
"""A TCP proxy on loopback that holds back what a server sends, for the
tests of retries: every connection's client-to-server bytes go through at
once; server-to-client bytes are held DELAY_MS during a window of WINDOW_MS
in every PERIOD_MS, from 3 s on (in order, so the stream stays valid), so that replies
arrive after the callers' deadlines. With --cut, each window also ends with
every connection closed (the replies in flight are lost). With --requests,
client-to-server bytes are held instead (requests reach the server late;
replies go through at once). With --min-bytes N, only a read of at least N
bytes starts a hold (what follows it on that connection waits behind it):
large messages are late, small ones on other connections are not. Stops by
itself after DURATION seconds.

  delay_proxy.py LISTEN_PORT TARGET_HOST:PORT DELAY_MS PERIOD_MS WINDOW_MS DURATION
                 [--cut] [--requests] [--min-bytes N]

Prints one line per window, and the counts at the end."""
import asyncio, sys, time

listen, target = int(sys.argv[1]), sys.argv[2]
delay, period, window = (int(x) / 1000 for x in sys.argv[3:6])
duration = float(sys.argv[6])
cut = "--cut" in sys.argv[7:]
requests = "--requests" in sys.argv[7:]
min_bytes = 0
if "--min-bytes" in sys.argv[7:]:
    min_bytes = int(sys.argv[sys.argv.index("--min-bytes") + 1])
GRACE = 3.0
t0 = time.monotonic()
stats = {"connections": 0, "held": 0, "cut": 0}
conns = set()

def in_window(t):
    # the end of every period, after GRACE seconds (the clients register)
    return t - t0 >= GRACE and (t - t0) % period >= period - window

async def pump(reader, writer, hold):
    last = 0.0
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if hold:
                now = time.monotonic()
                late = in_window(now) and len(data) >= min_bytes
                release = max(now + (delay if late else 0.0), last)
                if release > now:
                    stats["held"] += 1
                    await asyncio.sleep(release - now)
                last = release
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError, OSError):
        pass
    finally:
        try:
            writer.close()
        except Exception:
            pass

async def handle(creader, cwriter):
    host, port = target.rsplit(":", 1)
    try:
        sreader, swriter = await asyncio.open_connection(host, int(port))
    except OSError:
        cwriter.close()
        return
    stats["connections"] += 1
    pair = (cwriter, swriter)
    conns.add(pair)
    await asyncio.gather(pump(creader, swriter, requests), pump(sreader, cwriter, not requests))
    conns.discard(pair)

async def cutter():
    was = False
    while True:
        await asyncio.sleep(0.05)
        now = in_window(time.monotonic())
        if was and not now and cut:
            for c, s in list(conns):
                c.close()
                s.close()
                stats["cut"] += 1
        if now and not was:
            print(f"delay_proxy: holding replies {delay * 1000:.0f} ms from t={time.monotonic() - t0:.1f} s", flush=True)
        was = now

async def main():
    # connections still open at the end are cancelled: nothing to report
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: None)
    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    task = asyncio.ensure_future(cutter())
    await asyncio.sleep(duration)
    task.cancel()
    server.close()
    print(f"delay_proxy: {stats['connections']} connection(s), {stats['held']} reads held, "
          f"{stats['cut']} connection(s) cut", flush=True)

asyncio.run(main())

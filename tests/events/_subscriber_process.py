"""A router process for test_processes.py: runs mokv's subscriber and index against
manager processes and reports, as JSON, the index it rebuilt.

stdin, one JSON line each:
  {"page_size": 4, "sources": [[server, endpoint, replay_endpoint], ...]}
      subscribe; prints "ready" once every socket is connected;
  {"until": {"<server>/<replica>": last_seq, ...}}
      keep applying batches (replaying gaps) until each source's last applied seq is
      that one, or 60 s passed; then print one JSON line
      {"last_seq": {source: seq}, "hashes": {source: [...]}, "num_restarts": n,
       "num_lost_gaps": n}
and it exits. Between the two it polls continuously, as a router does.
"""

import json
import queue
import sys
import threading
import time

from mokv.events import EventSubscriber, PrefixRouterIndex

config = json.loads(sys.stdin.readline())
index = PrefixRouterIndex(page_size=config["page_size"])
sub = EventSubscriber(index)
for server, endpoint, replay in config["sources"]:
    sub.add_source(server, endpoint, replay)
print("ready", flush=True)

commands: queue.Queue = queue.Queue()
threading.Thread(target=lambda: commands.put(sys.stdin.readline()), daemon=True).start()
while commands.empty():
    sub.poll(20)
until = {tuple(k.rsplit("/", 1)): v for k, v in json.loads(commands.get())["until"].items()}
sources = [(server, int(replica)) for server, replica in until]
deadline = time.monotonic() + 60
while time.monotonic() < deadline and any(
    sub.last_seq(s) != until[(s[0], str(s[1]))] for s in sources
):
    sub.poll(20)
    if any(sub.last_seq(s) is None for s in sources):
        sub.sync()
print(json.dumps({
    "last_seq": {f"{s}/{r}": sub.last_seq((s, r)) for s, r in sources},
    "hashes": {f"{s}/{r}": sorted(index.hashes((s, r))) for s, r in sources},
    "num_restarts": sub.num_restarts,
    "num_lost_gaps": sub.num_lost_gaps,
}), flush=True)
sub.close()

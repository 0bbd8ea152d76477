"""Lends a Mooncake segment for objects to live in, as a long-lived store node does, with Mooncake's official Python
client: clients that lend nothing (`global_segment_size` 0) put their objects here, so the objects outlive them.

Arguments: the master's address, the segment size in bytes, and optionally the address the client serves its segment
on (default 127.0.0.1; a host's address when the readers are on other hosts). Prints `ready` once mounted, and keeps
the segment until stdin closes.
"""

import sys

from mooncake.store import MooncakeDistributedStore


def main():
    master, size = sys.argv[1], int(sys.argv[2])
    hostname = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    store = MooncakeDistributedStore()
    status = store.setup(hostname, "P2PHANDSHAKE", size, 16 << 20, "tcp", "", master)
    if status != 0:
        sys.exit(f"setup failed: {status}")
    print("ready", flush=True)
    sys.stdin.read()


main()

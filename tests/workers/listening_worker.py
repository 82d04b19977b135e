"""A stand-in gRPC worker for launcher isolation tests (no TensorFlow).

Listens on its `TF_CONFIG` port on every interface, as TensorFlow's server does,
connects to every peer over loopback, records "<pid> <port>" in --pid_dir, and
stays up until --release_file exists, so the test can inspect its sockets.
"""

import argparse
import json
import os
import socket
import time

parser = argparse.ArgumentParser()
parser.add_argument("--pid_dir", required=True)
parser.add_argument("--release_file", required=True)
args = parser.parse_args()

config = json.loads(os.environ["TF_CONFIG"])
rank = config["task"]["index"]
addresses = config["cluster"]["worker"]
port = int(addresses[rank].rpartition(":")[2])
server = socket.socket(socket.AF_INET6)
server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
server.bind(("::", port))
server.listen()
for address in addresses:
    host, _, peer_port = address.rpartition(":")
    while True:  # a peer may not be listening yet
        try:
            socket.create_connection((host, int(peer_port)), timeout=5).close()
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
print(f"worker {rank} reached all {len(addresses)} workers")
with open(os.path.join(args.pid_dir, f"{rank}"), "w") as file:
    file.write(f"{os.getpid()} {port}")
while not os.path.exists(args.release_file):
    time.sleep(0.05)
server.close()

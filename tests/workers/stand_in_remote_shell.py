"""A stand-in for `ssh HOST LINE` in tests: runs LINE with `sh -c` as another host would.

Like sshd, it runs the line in a session of its own (signals to this process do not reach
it), in a login's bare environment (the caller's variables do not reach it), and relays
this process's standard input to it through a pipe of its own, so the line sees end of
input when the launcher closes it or when this process dies (a dropped connection); it
exits with the line's status. Hosts named in $STAND_IN_DOWN_HOSTS (comma-separated) are
down: it fails as ssh does (status 255). It records each host it was asked for in
$STAND_IN_HOSTS_LOG, if set, one a line.
"""

import os
import shutil
import subprocess
import sys
import threading

host, line = sys.argv[1], sys.argv[2]
log = os.environ.get("STAND_IN_HOSTS_LOG")
if log:
    with open(log, "a") as handle:
        handle.write(f"{host}\n")
if host in os.environ.get("STAND_IN_DOWN_HOSTS", "").split(","):
    sys.stderr.write(f"ssh: connect to host {host} port 22: Connection refused\n")
    sys.exit(255)
bare = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
process = subprocess.Popen(
    ["sh", "-c", line], env=bare, stdin=subprocess.PIPE, bufsize=0, start_new_session=True
)


def relay_input() -> None:
    try:
        shutil.copyfileobj(sys.stdin.buffer.raw, process.stdin, length=1)
        process.stdin.close()
    except OSError:
        pass


threading.Thread(target=relay_input, daemon=True).start()
returncode = process.wait()
sys.exit(returncode if returncode >= 0 else 128 - returncode)

"""A stand-in for `ssh HOST LINE` in tests: runs LINE with `sh -c` as another host would.

Like sshd, it runs the line in a session of its own (signals to this process do not reach
it), in a login's bare environment (the caller's variables do not reach it), with this
process's standard input, so the line sees end of input when the launcher closes it;
and it exits with the line's status. It records each host it was asked for in
$STAND_IN_HOSTS_LOG, if set, one a line.
"""

import os
import subprocess
import sys

host, line = sys.argv[1], sys.argv[2]
log = os.environ.get("STAND_IN_HOSTS_LOG")
if log:
    with open(log, "a") as handle:
        handle.write(f"{host}\n")
bare = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
process = subprocess.Popen(["sh", "-c", line], env=bare, start_new_session=True)
returncode = process.wait()
sys.exit(returncode if returncode >= 0 else 128 - returncode)

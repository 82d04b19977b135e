"""`--callbacks=slow_worker_exit:callbacks`: every non-chief worker ends after the chief.

When training ends, a non-chief worker adds an exit handler (run before tfmulti's own, which
ends the process) that waits until the chief's process has gone (its server's port refuses
connections), then until TensorFlow's threads that wait on the chief's coordination service
have ended (`PeerTerminationWatcher-*`), each wait at most `WAIT_SECONDS`. A thread still
waiting on the chief then fails as soon as the chief has gone, every time, not only when a
loaded machine makes the worker slow.
"""

import atexit
import json
import os
import socket
import threading
import time

import keras

WAIT_SECONDS = 60
WATCHER_THREAD_PREFIX = "PeerTerminationWatcher"


class EndAfterTheChief(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        tf_config = json.loads(os.environ["TF_CONFIG"])
        if tf_config["task"]["index"] != 0:
            host, port = tf_config["cluster"]["worker"][0].rsplit(":", 1)
            atexit.register(_wait_for_the_chief_then_its_watchers, host, int(port))


def _wait_for_the_chief_then_its_watchers(host: str, port: int) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline and _accepts_connections(host, port):
        time.sleep(0.1)
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline and _watcher_threads():
        time.sleep(0.1)
    print(f"Ended after the chief; watcher threads left: {_watcher_threads()}", flush=True)


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _watcher_threads() -> list[str]:
    return [
        thread.name
        for thread in threading.enumerate()
        if thread.name.startswith(WATCHER_THREAD_PREFIX) and thread.is_alive()
    ]


def callbacks():
    return [EndAfterTheChief()]

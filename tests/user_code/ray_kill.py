"""`--callbacks=ray_kill:callbacks`: Ray worker 1 kills itself (SIGKILL) once, mid-epoch.

The step is `RAY_KILL_STEP` (global, 1-based); `RAY_KILL_MARKER` is the file that says
the kill happened, so the restarted worker trains on.
"""

import json
import os
import signal

import keras


class KillOnce(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        marker = os.environ["RAY_KILL_MARKER"]
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        if task == 1 and self.step == int(os.environ["RAY_KILL_STEP"]):
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)


def callbacks():
    return [KillOnce()]

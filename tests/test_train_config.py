"""`TrainConfig` groups its settings, and every setting comes from its flag."""

import dataclasses
import json
import subprocess
import sys

import pytest

from tfmulti.config import TrainConfig, flat_keys
from tfmulti.names import STRATEGY_FLAGS, TRAIN_STRATEGY_NAMES

_PARSE = """
import json, sys
from tfmulti.flags.training_flags import FLAGS, config_from_flags, define_train_flags
define_train_flags()
FLAGS(["train.py", *sys.argv[1:]])
print(json.dumps(config_from_flags().to_dict()))
"""


def _config_from_command_line(*argv: str) -> TrainConfig:
    """The config `scripts/train.py` would build from `argv` (parsed in a fresh process)."""
    result = subprocess.run(
        [sys.executable, "-c", _PARSE, *argv], capture_output=True, text=True, check=True
    )
    values = json.loads(result.stdout.splitlines()[-1])
    for key in ("profile_steps", "trace_steps"):
        values[key] = tuple(values[key]) if values[key] else None
    return TrainConfig.from_flat(**values)


def test_every_setting_is_in_exactly_one_group():
    keys = flat_keys()
    assert len(keys) == len(set(keys))
    groups = [field.name for field in dataclasses.fields(TrainConfig)]
    assert groups == ["model", "data", "optimizer", "run", "distribution", "cluster", "pipeline"]


def test_flat_settings_reach_their_groups_and_come_back():
    config = TrainConfig.from_flat(model="mlp", batch_size=32, optimizer="sgd", num_stages=4)
    assert (config.model.name, config.data.batch_size) == ("mlp", 32)
    assert (config.optimizer.name, config.pipeline.num_stages) == ("sgd", 4)
    assert TrainConfig.from_flat(**config.to_dict()) == config


def test_an_unknown_setting_is_refused_by_name():
    with pytest.raises(TypeError, match="batchsize"):
        TrainConfig.from_flat(batchsize=32)


def test_every_setting_comes_from_a_flag_without_a_hand_copied_table():
    config = _config_from_command_line(
        "--strategy=pipeline",
        "--batch_size=48",
        "--microbatches=6",
        "--steps_per_epoch=0",
        "--trace_steps=2,3",
        "--model_option=width=3",
        "--learning_rate=0.5",
    )
    assert config.distribution.strategy == "pipeline"
    assert config.data.batch_size == 48
    assert config.pipeline.microbatches == 6
    assert config.run.steps_per_epoch is None  # 0 means one pass over the data
    assert config.pipeline.trace_steps == (2, 3)
    assert config.model.options == {"width": 3}
    # An optimizer flag on the command line replaces a compiled model's optimizer.
    assert config.optimizer.learning_rate == 0.5 and not config.optimizer.keep_compiled
    defaults = TrainConfig.from_flat(
        **{
            **TrainConfig().to_dict(),
            **{key: value for key, value in config.to_dict().items() if key in _GIVEN},
        }
    )
    assert config == defaults


_GIVEN = {
    "strategy",
    "batch_size",
    "microbatches",
    "steps_per_epoch",
    "trace_steps",
    "model_options",
    "learning_rate",
    "keep_compiled_optimizer",
}


def test_every_strategy_says_which_strategy_only_flags_it_takes():
    assert set(STRATEGY_FLAGS) == set(TRAIN_STRATEGY_NAMES)

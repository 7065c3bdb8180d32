"""Entry point: `python -m ba_jax.main --config=configs/default.py --workdir=DIR`.

Resumes automatically from DIR. Any config field can be overridden on the command line
(`--config.grpo.aggregation=token`); the config is locked, so a misspelled key is an
error rather than a silently ignored option. No logic lives here.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run folder (metrics, checkpoints, plots)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    from ba_jax import checkpoint, distributed, run_config, train

    distributed.maybe_initialize()  # several processes: join them before touching devices

    try:
        print(train.train_and_evaluate(_CONFIG.value, _WORKDIR.value))
    except (run_config.ConfigError, checkpoint.CheckpointError, FloatingPointError) as e:
        sys.exit(f"ba_jax: {e}")


if __name__ == "__main__":
    app.run(main)

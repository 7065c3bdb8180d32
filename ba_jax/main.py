"""Entry point: `python -m ba_jax.main --config=configs/default.py --workdir=DIR`.

Resumes automatically from DIR. Any config field can be overridden on the command line
(`--config.grpo.aggregation=token`); the config is locked, so a misspelled key is an
error rather than a silently ignored option. An error a user can act on is one line
(`ba_jax: ...`, cli.py); its traceback goes to DIR/error.log, or to the terminal with
`--verbose`. No logic lives here.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from ba_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run folder (metrics, checkpoints, plots)")
_VERBOSE = flags.DEFINE_bool("verbose", False, cli.VERBOSE_HELP)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    from ba_jax import checkpoint, distributed, plot, preemption, run_config, train

    distributed.maybe_initialize()  # several processes: join them before touching devices

    try:
        print(train.run_training(_CONFIG.value, _WORKDIR.value))
    except preemption.Stopped as e:  # SIGTERM/SIGINT: saved, and the way to resume said
        print(f"ba_jax: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except (run_config.ConfigError, checkpoint.CheckpointError, FloatingPointError) as e:
        cli.fail("ba_jax", e, verbose=_VERBOSE.value, log_dir=_WORKDIR.value)
    except OSError as e:  # a write to the workdir failed during the run (disk full, ...)
        cli.fail("ba_jax", cli.resume_hint(e, _WORKDIR.value), verbose=_VERBOSE.value,
                 log_dir=_WORKDIR.value)
    if distributed.is_primary():
        plot.plot_finished(_WORKDIR.value)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.absl_flags_parser("ba_jax"))

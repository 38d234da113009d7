"""``tapas train``: train ``--model`` under a tensor-parallel strategy
(``tapas.execution.api.train`` on the model ``tapas.cli.train_models`` resolves).

In:  the model, devices, steps, strategy, optimizer and training-job flags (FLAG_NAMES).
Out: the report ``tapas.execution.api.train.train`` returns (it writes ``--json_out`` itself).
Raises: ``absl.app.UsageError`` for a flag train does not take; a failed run (a bad option
     found before it starts, a lost worker, verify failed) prints ``tapas train: <why>`` and
     exits 1.
"""

from __future__ import annotations

import sys
from typing import Any

from absl import app, flags

from tapas.cli.common import FLAGS

flags.DEFINE_integer("steps", 3, "train: optimizer steps.")
flags.DEFINE_string("strategy", None, "train: a Strategy JSON (`tapas search --out`), or "
                    "'random:SEED' for a random valid plan; default: search on --cluster.")
flags.DEFINE_boolean("verify", False, "train: run the single-device Keras model side by side "
                     "and report the largest differences.")
flags.DEFINE_integer("devices_per_worker", 1, "train --workers: local devices of each worker "
                     "(logical CPU devices on a host without GPUs; with GPUs, the number "
                     "each worker sees), e.g. --workers=2 --devices_per_worker=2 "
                     "--mesh=2x2 puts one mesh row in each process.", lower_bound=1)
flags.DEFINE_string("optimizer", None, "train: a Keras optimizer name (sgd, adam, adamw, "
                    "rmsprop, lion, ...) or a JSON file of its config "
                    "(keras.optimizers.serialize); default: the model's compiled optimizer.")
flags.DEFINE_enum("graph_optimization", "lean", ["lean", "default"], "train: Grappler's "
                  "options for the step functions: lean (one round of passes; on CPUs without "
                  "the layout and memory optimizers: a faster first step) or TensorFlow's "
                  "default.")
flags.DEFINE_float("learning_rate", None, "train: learning rate (default: Keras's).")
flags.DEFINE_string("data", None, "train: an .npz of training data: one array per model "
                    "input, named by input name (x for a one-input model), and the targets "
                    "y, the first axis counting examples; or .tfrecord file(s) (a glob or a "
                    "comma-separated list) of tf.train.Example records with the same "
                    "features, each flattened (tapas.execution.api.train.save_tfrecord writes "
                    "them); trained with ParallelModel.fit in global batches of "
                    "--batch_size (default: the model's synthetic batch).")
flags.DEFINE_integer("epochs", None, "train: epochs (passes over --data; with the synthetic "
                     "batch, --steps steps each). Default 1 when a training job is asked for.")
flags.DEFINE_string("checkpoint_dir", None, "train: write checkpoints here (ckpt-<step>, "
                    "atomic, each file's SHA-256 recorded, the newest 3 kept) at each epoch "
                    "end and every --checkpoint_every steps; refused before the first step "
                    "if it cannot be written; a save that fails later (the directory gone "
                    "or read-only) is skipped with a warning while training goes on.")
flags.DEFINE_integer("checkpoint_every", None, "train: also checkpoint after every K steps.")
flags.DEFINE_boolean("resume", False, "train: continue from the newest whole checkpoint "
                     "in --checkpoint_dir (damaged newer ones are skipped, each named with "
                     "why; start afresh when there is none): run the same command again "
                     "after a failure. The checkpoint's learning rate is kept (a "
                     "--learning_rate given with it is reported, not used).")
flags.DEFINE_boolean("elastic", False, "train: with --workers=K and --checkpoint_dir, a "
                     "worker lost (killed, its machine gone) restarts the job on the workers "
                     "that remain, from the newest checkpoint resharded for them, with a plan "
                     "searched again (--strategy=random:S: drawn again), until it reaches "
                     "its step count or one worker is left.")
flags.DEFINE_float("elastic_wait_s", None, "train: with --elastic, after a worker is lost "
                   "first wait up to this many seconds for a replacement worker (announced "
                   "by creating a file in CHECKPOINT_DIR/replacements); one that joins "
                   "keeps the worker count, else the job goes on with the others.")
flags.DEFINE_string("tensorboard", None, "train: write TensorBoard scalars (loss, step time, "
                    "examples/s, learning rate) to this log directory.")

SUMMARY = 'train a model on N devices under a searched, given or random strategy'
USAGE = ('tapas train --model=NAME --devices=N --steps=K [--strategy=s.json|random:SEED] '
         '[--verify] [--data=file.npz --epochs=E] [--checkpoint_dir=DIR [--checkpoint_every=K]'
         ' [--resume]]')
#: the flags this command reads, in the order its help lists them
FLAG_NAMES = ('model', 'devices', 'steps', 'strategy', 'verify', 'batch_size', 'training',
              'optimizer', 'learning_rate', 'data', 'epochs', 'checkpoint_dir',
              'checkpoint_every', 'resume', 'elastic', 'elastic_wait_s', 'tensorboard',
              'workers', 'devices_per_worker',
              'mesh', 'cluster', 'memory_budget_gib', 'compute_scale', 'kernel_times',
              'communication_scale', 'graph_optimization', 'json_out')


def cmd_train() -> dict[str, Any]:
    from tapas.cli import train_models
    from tapas.execution.api import train
    if FLAGS.elementwise_scale is not None:
        raise app.UsageError(f"--elementwise_scale={FLAGS.elementwise_scale} prices `tapas "
                             "search` only: search with it (--out=s.json) and train that "
                             "plan with --strategy=s.json")
    opts = train.TrainOptions(model=FLAGS.model, devices=FLAGS.devices, steps=FLAGS.steps,
                              strategy=FLAGS.strategy, verify=FLAGS.verify,
                              workers=FLAGS.workers, optimizer=FLAGS.optimizer,
                              devices_per_worker=FLAGS.devices_per_worker,
                              learning_rate=FLAGS.learning_rate, batch_size=FLAGS.batch_size,
                              cluster=FLAGS.cluster, json_out=FLAGS.json_out,
                              memory_budget_gib=FLAGS.memory_budget_gib,
                              training=FLAGS.training, data=FLAGS.data,
                              epochs=FLAGS.epochs, checkpoint_dir=FLAGS.checkpoint_dir,
                              checkpoint_every=FLAGS.checkpoint_every, resume=FLAGS.resume,
                              elastic=FLAGS.elastic, elastic_wait_s=FLAGS.elastic_wait_s,
                              tensorboard=FLAGS.tensorboard, mesh=FLAGS.mesh,
                              graph_optimization=FLAGS.graph_optimization,
                              compute_scale=FLAGS.compute_scale,
                              kernel_times=FLAGS.kernel_times,
                              communication_scale=FLAGS.communication_scale)
    from absl import logging
    logging.set_verbosity(logging.WARNING)   # tf.distribute logs every collective at INFO
    try:
        return train.train(opts, train_models.model_source(opts.model))
    except train.TrainError as e:
        # a failed run (a worker lost, verify failed), not a usage mistake: no flag listing
        print(f"tapas train: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None

"""`make bench`: speed and memory tables, each against a baseline run in the same process,
outside the library (nothing in bertjax or data_pipeline imports them).

  accelerator.py         train and predict steps beside transformers on the device JAX finds
                         (gpu_check.sh runs it on a GPU machine without bertjax's install)
  embedding.py           sentence vectors against sentence-transformers' encode; the
                         contrastive train step with global negatives on 4 CPU devices;
                         packed texts against unpacked rows and sentence-transformers' step
  inference.py           sequences/s of the prediction engine against transformers
  model.py               train-step throughput and memory of the model's options
  pretraining_input.py   data creation and the tf.data readers (plain and packed rows)
  squad_features.py      SQuAD window-feature conversion
  tokenization.py        tokens/s of the WordPiece paths against HF tokenizers
"""

import time
from collections.abc import Callable

import numpy as np


def interleaved_median_seconds(steps: dict[str, Callable[[], object]], repeats: int,
                               first: dict[str, float] | None = None) -> dict[str, float]:
    """Median seconds per call of each step, calling them in turn (a round-robin), after a
    first call of each (compiles, warm-up) whose seconds go into `first` if given.

    The machine's speed drifts from minute to minute; interleaving gives every variant the same
    conditions, so their ratios hold even when the absolute figures move.
    """
    for name, step in steps.items():
        start = time.perf_counter()
        step()
        if first is not None:
            first[name] = time.perf_counter() - start
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}

"""Pre-training (paper Sec. 3.1, Appendix A.2) as a job of the shared loop:
  rules.py       the phase plan, the objective (MLM + NSP, MLM, left-to-right LM), packing
  checks.py      what a run checks before step 0: vocabulary, every phase's data, checkpoint
  objective.py   batch shapes, the losses, evaluation sums
  input.py       each phase's input: TFRecords in one global order, plain or packed rows
  job.py         PretrainingJob: phases, held-out evaluation, the final export; train()
`train(config, workdir)` runs it (python -m bertjax.pretrain).
"""

from bertjax.tasks.pretraining.input import make_input_fn, masking_mix
from bertjax.tasks.pretraining.job import PretrainingJob, load_init_params, make_job, train
from bertjax.tasks.pretraining.objective import (
    batch_spec,
    eval_metrics,
    eval_sums,
    init_params,
    loss_and_metrics,
    loss_denominators,
    loss_fn,
    model_outputs,
    next_token_targets,
    step_fns,
)

__all__ = ["PretrainingJob", "batch_spec", "eval_metrics", "eval_sums", "init_params",
           "load_init_params", "loss_and_metrics", "loss_denominators", "loss_fn",
           "make_input_fn", "make_job", "masking_mix", "model_outputs", "next_token_targets",
           "step_fns", "train"]

r"""The paper's Figure 5 (Sec. C.1): fine-tuning accuracy against pre-training steps, masked LM
against a left-to-right LM.

  python -m bertjax.ablations steps --scale=demo --workdir=runs/steps

Each pre-training run is exported at `export_steps` and at its end; every export is
fine-tuned. The paper plots MNLI dev accuracy of BERT-base at 200k ... 1M steps (no table of
numbers: none are printed beside ours). W/accuracy_vs_steps.png draws the curves.
"""

from experiments.ablations import common

LABELS = {"mlm_nsp": "Masked LM", "ltr": "Left-to-right"}


def get_config(scale: str = "demo"):
    common.check_scale(scale, "steps")
    config = common.grid("steps", "Figure 5: fine-tuning accuracy vs pre-training steps", scale)
    config.row_header = "Pre-training @ steps"
    config.pretrainings = dict(mlm_nsp=dict(objective="mlm_nsp"), ltr=dict(objective="ltr"))
    total = config.pretrain.train.num_train_steps
    points = {"paper": 5, "small": 4, "demo": 4, "test": 2}[scale]
    config.export_steps = [total * i // points for i in range(1, points)]
    # The model's own held-out LM accuracy at each point (the masked or the next token), from
    # the last phase-1 evaluation at or before it.
    config.pretrain_columns = [dict(name="LM acc (%)", metric="mlm_accuracy", scale=100.0,
                                    seq_len=config.pretrain.phases.phase1.seq_len)]
    config.rows = [dict(name=f"{LABELS[name]} @ {step}", pretraining=name,
                        step=step if step < total else 0, finetune={})
                   for name in LABELS for step in [*config.export_steps, total]]
    if scale == "paper":
        common.set_tasks(config, mnli=common.glue_task("mnli", "MNLI-m (acc)"))
    else:
        common.set_demo_tasks(config, scale, "rotten_tomatoes")
    return config

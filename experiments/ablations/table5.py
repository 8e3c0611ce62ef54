r"""Table 5 of the paper: ablation over the pre-training tasks.

  python -m bertjax.ablations table5 --scale=demo --workdir=runs/table5

Rows: BERT (masked LM + next sentence prediction); No NSP (masked LM on packed
single-segment rows); LTR & No NSP (a left-to-right LM: causal attention, every next token
predicted, no masking); + BiLSTM (the LTR model fine-tuned with a randomly initialised BiLSTM
between the encoder and the task head). Columns: paper scale MNLI-m, QNLI, MRPC, SST-2 (dev
accuracy) and SQuAD v1.1 (dev F1); demo and small scales the demo tasks: Rotten Tomatoes
sentiment, ROPES extractive QA, POS tagging.
"""

from experiments.ablations import common

# Devlin et al., 2018 (arXiv:1810.04805), Table 5: BERT-base, dev sets.
PAPER = {
    "BERT (MLM + NSP)": {"MNLI-m (acc)": 84.4, "QNLI (acc)": 88.4, "MRPC (acc)": 86.7,
                         "SST-2 (acc)": 92.7, "SQuAD (F1)": 88.5},
    "No NSP": {"MNLI-m (acc)": 83.9, "QNLI (acc)": 84.9, "MRPC (acc)": 86.5,
               "SST-2 (acc)": 92.6, "SQuAD (F1)": 87.9},
    "LTR & No NSP": {"MNLI-m (acc)": 82.1, "QNLI (acc)": 84.3, "MRPC (acc)": 77.5,
                     "SST-2 (acc)": 92.1, "SQuAD (F1)": 77.8},
    "+ BiLSTM": {"MNLI-m (acc)": 82.1, "QNLI (acc)": 84.1, "MRPC (acc)": 75.7,
                 "SST-2 (acc)": 91.6, "SQuAD (F1)": 84.9},
}
BILSTM_UNITS = {"paper": 768, "small": 256, "demo": 128, "test": 8}  # per direction


def get_config(scale: str = "demo"):
    common.check_scale(scale, "table5")
    config = common.grid("table5", "Table 5: ablation over the pre-training tasks", scale)
    config.row_header = "Pre-training"
    config.pretrainings = dict(mlm_nsp=dict(objective="mlm_nsp"), mlm=dict(objective="mlm"),
                               ltr=dict(objective="ltr"))
    bilstm = dict(task=dict(bilstm_units=BILSTM_UNITS[scale]))
    config.rows = [dict(name="BERT (MLM + NSP)", pretraining="mlm_nsp", finetune={}),
                   dict(name="No NSP", pretraining="mlm", finetune={}),
                   dict(name="LTR & No NSP", pretraining="ltr", finetune={}),
                   dict(name="+ BiLSTM", pretraining="ltr", finetune=bilstm)]
    if scale == "paper":
        common.set_tasks(config, mnli=common.glue_task("mnli", "MNLI-m (acc)"),
                            qnli=common.glue_task("qnli", "QNLI (acc)"),
                            mrpc=common.glue_task("mrpc", "MRPC (acc)"),
                            sst2=common.glue_task("sst2", "SST-2 (acc)"),
                            squad=common.squad_v1())
        config.paper = PAPER
    else:
        common.set_demo_tasks(config, scale, "rotten_tomatoes", "ropes", "pos")
    return config

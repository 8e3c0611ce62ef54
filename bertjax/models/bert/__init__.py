"""BERT (Devlin et al., 2018): `BertConfig` (config.py), the encoder's modules (modules.py), the
pre-training model and loss (pretraining.py) and its FLOPs (flops.py)."""

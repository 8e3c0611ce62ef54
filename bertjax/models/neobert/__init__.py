"""A NeoBERT-style encoder (Le Breton et al., 2025): `NeoConfig` (config.py), the encoder and
its masked-LM model (modules.py), its FLOPs and record (architecture.py)."""

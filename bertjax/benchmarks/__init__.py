"""`make bench`: speed and memory tables, each against a baseline run in the same process,
outside the library (nothing in bertjax or data_pipeline imports them).

  model.py               train-step throughput and memory of the model's options
  pretraining_input.py   data creation and the tf.data readers (plain and packed rows)
  squad_features.py      SQuAD window-feature conversion
  tokenization.py        tokens/s of the WordPiece paths against HF tokenizers
"""

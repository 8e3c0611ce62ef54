"""Serving a trained model: a finished fine-tuning run or its export restored (`runs`), the
jitted task forward over a mesh or devices in turn (`engine`), `Predictor` (records of Python
values, files, and files larger than memory a chunk at a time), `FillMask` (the MLM head of a
pre-trained checkpoint), contextual features (`extraction`) and the inference step's compiled
cost (`cost`). No file here names a task family: each family's state, input chunks and records
are methods of its `Task` (bertjax/tasks/base.py). Nothing here imports TensorFlow."""

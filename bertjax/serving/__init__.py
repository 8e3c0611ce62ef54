"""Serving a trained model: a finished fine-tuning run or its export restored (`runs`), the
jitted task forward over a mesh or devices in turn (`engine`), `Predictor` (records of Python
values, files, and files larger than memory a chunk at a time), `FillMask` (the MLM head of a
pre-trained checkpoint), `Embedder` (sentence vectors of an embedding run or any checkpoint,
and exact search), `Reranker` (cross-encoder scores of a reranking run or a converted
CrossEncoder), contextual features (`extraction`). Serving otherwise names no task
family: each family's state, input chunks and records are methods of its `Task`
(bertjax/tasks/base.py). Nothing here imports TensorFlow."""

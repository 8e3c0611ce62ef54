"""The cached large-batch mode (GradCache, Gao et al. 2021): the vectors of a batch larger
than the activations memory allows, with the gradients of the whole batch's loss.

Forward: every chunk of `chunk_rows` rows is encoded without keeping its activations. The loss
is then computed on all the vectors at once (every row's negatives are the whole batch), and
its gradient with respect to the vectors is what the encoder's backward pass needs: each chunk
is encoded again and back-propagated alone, its parameter gradients summed. The loss and the
gradients are those of the full batch; the activations held are one chunk's.

A chunk is every n-th row of the batch (n = the number of chunks), so that on a data-parallel
mesh each device holds its share of every chunk and no row moves between devices. Packed rows
(config.data.pack) hold each chunk's texts in every n-th row (packed.py), chunked alike.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
# encode(params, *inputs, rng) -> [rows, columns, hidden], of one chunk's inputs (input_ids,
# segment_ids, input_mask; packed rows: and packing_ids, example_starts, text_slots).
Encode = Callable[..., Array]


def _to_chunks(x: Array, chunks: int) -> Array:
    """[batch, ...] → [chunks, batch / chunks, ...], chunk i = rows i, i + chunks, ..."""
    return jnp.swapaxes(x.reshape(x.shape[0] // chunks, chunks, *x.shape[1:]), 0, 1)


def _from_chunks(x: Array) -> Array:
    """The inverse of `_to_chunks`."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def cached_vectors(encode: Encode, params, inputs: tuple[Array, ...], rng: Array | None,
                   chunks: int) -> Array:
    """encode(params, *inputs, key) of the whole batch → [batch, columns, hidden], in `chunks`
    chunks (`_to_chunks` of every input: [batch, columns, seq] rows, or packed rows and their
    text slots), whose gradient recomputes each chunk in turn (module docstring). Every
    input's leading axis must be a multiple of chunks; chunk c's dropout key is
    fold_in(rng, c)."""
    for x in inputs:
        if x.shape[0] % chunks:
            raise ValueError(f"an input of {x.shape[0]} rows does not split into {chunks} "
                             "chunks")
    inputs = tuple(_to_chunks(x, chunks) for x in inputs)
    keys = None if rng is None else jax.vmap(lambda c: jax.random.fold_in(rng, c))(
        jnp.arange(chunks))

    def encode_chunk(params, chunk):
        *chunk_inputs, key = chunk
        return encode(params, *chunk_inputs, key)

    @jax.custom_vjp
    def vectors(params, inputs, keys):
        return jax.lax.map(lambda chunk: encode_chunk(params, chunk), (*inputs, keys))

    def forward(params, inputs, keys):
        return vectors(params, inputs, keys), (params, inputs, keys)

    def backward(residuals, cotangent):
        params, inputs, keys = residuals

        def accumulate(total, chunk):
            *chunk, g = chunk
            _, pullback = jax.vjp(lambda p: encode_chunk(p, chunk), params)
            (grads,) = pullback(g)
            return jax.tree.map(jnp.add, total, grads), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = jax.lax.scan(accumulate, zeros, (*inputs, keys, cotangent))
        return grads, None, None

    vectors.defvjp(forward, backward)
    return _from_chunks(vectors(params, inputs, keys))

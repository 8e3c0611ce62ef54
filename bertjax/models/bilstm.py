"""A bidirectional LSTM over token vectors: the feature-based approach's tagger (paper Sec. 5.3)
and the "+ BiLSTM" fine-tuning head of the paper's Table 5 (a randomly initialised BiLSTM
between the encoder and a task head).

Parameters carry logical axis names (`lstm_in` [input width], `lstm_hidden` [the recurrent
state], `lstm` [gate outputs]); no rule maps them onto the mesh, so they are replicated — they
are small next to the encoder.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def _cell(units: int, name: str, initializer_range: float | None) -> nn.OptimizedLSTMCell:
    kernel = (nn.initializers.lecun_normal() if initializer_range is None
              else nn.initializers.truncated_normal(initializer_range))
    return nn.OptimizedLSTMCell(
        units,
        kernel_init=nn.with_logical_partitioning(kernel, ("lstm_in", "lstm")),
        recurrent_kernel_init=nn.with_logical_partitioning(nn.initializers.orthogonal(),
                                                           ("lstm_hidden", "lstm")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("lstm",)),
        name=name)


def bidirectional_lstm(x: Array, lengths: Array, *, units: int, num_layers: int = 1,
                       dropout: float = 0.0, deterministic: bool = True,
                       initializer_range: float | None = None) -> Array:
    """Stacked BiLSTM, called inside a parent module's `@nn.compact` method: its params are
    the parent's `lstm_<i>_forward` / `lstm_<i>_backward` (layer i).

    x: [batch, seq, width] with each row's `lengths[b]` real vectors first (padding after);
    lengths: [batch] int. Returns [batch, seq, 2 * units] float32: per position the forward
    state (left context) then the backward state (right context), dropout after each layer.
    Padding positions are not read by the backward direction.
    """
    x = x.astype(jnp.float32)
    for i in range(num_layers):
        forward = _cell(units, f"lstm_{i}_forward", initializer_range)
        backward = _cell(units, f"lstm_{i}_backward", initializer_range)
        x = nn.Bidirectional(nn.RNN(forward), nn.RNN(backward), name=f"bilstm_{i}")(
            x, seq_lengths=lengths)
        if dropout:
            x = nn.Dropout(dropout)(x, deterministic=deterministic)
    return x


def final_states(outputs: Array, lengths: Array) -> Array:
    """A sequence summary of `bidirectional_lstm` outputs [batch, seq, 2u] → [batch, 2u]: the
    forward state at each row's last real position and the backward state at position 0
    (each direction's state after reading the whole sequence)."""
    units = outputs.shape[-1] // 2
    last = jnp.maximum(lengths - 1, 0)[:, None, None]
    forward = jnp.take_along_axis(outputs[..., :units], last, axis=1)[:, 0]
    return jnp.concatenate([forward, outputs[:, 0, units:]], axis=-1)


class BiLSTMHead(nn.Module):
    """The "+ BiLSTM" adapter: encoder sequence output → a randomly initialised one-layer
    BiLSTM → [batch, seq, 2 * units] (the task head reads it instead of the encoder output).

    Initialised like the task heads (truncated normal, `initializer_range`)."""

    units: int
    initializer_range: float = 0.02
    dtype: str = "float32"
    summarize: bool = False  # True: `final_states` [batch, 2 * units] (sequence-level heads)

    @nn.compact
    def __call__(self, sequence: Array, input_mask: Array | None) -> Array:
        """sequence: [batch, seq, hidden]; input_mask: [batch, seq] (None: all real)."""
        if input_mask is None:
            lengths = jnp.full(sequence.shape[:1], sequence.shape[1], jnp.int32)
        else:
            lengths = jnp.sum(input_mask, axis=-1).astype(jnp.int32)
        out = bidirectional_lstm(sequence, lengths, units=self.units,
                                 initializer_range=self.initializer_range)
        if self.summarize:
            return final_states(out, lengths).astype(self.dtype)
        return nn.with_logical_constraint(out.astype(self.dtype), ("batch", "length", None))

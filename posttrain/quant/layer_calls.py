"""What each decoder layer is called with on the calibration set: GPTQ and AWQ both calibrate one layer at a time,
each on the outputs of the layers before it once quantized, so each replays the recorded calls of its layer."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def capture_layer_calls(decoder: nn.Module, layers: nn.ModuleList, calib_ids: torch.Tensor, batch_size: int,
                        device: torch.device) -> tuple[list[torch.Tensor], list[list[tuple[tuple, dict]]]]:
    """Run the float decoder (no lm_head) once over calib_ids [n, seq] in batches, recording each layer's call.

    Returns the inputs of layer 0 (hidden states [b, seq, hidden], one per batch) and, for every layer, a list per
    batch of (extra positional args, kwargs) as the decoder passed them: masks and rotary embeddings can differ per
    layer (sliding-window layers), so each layer replays its own.
    """
    first_inputs: list[torch.Tensor] = []
    calls: list[list[tuple[tuple, dict]]] = [[] for _ in layers]

    def recorder(index):
        def hook(module, args, kwargs):
            kwargs = dict(kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            if index == 0:
                first_inputs.append(hidden)
            calls[index].append((tuple(args[1:]), kwargs))

        return hook

    handles = [layer.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for batch in calib_ids.split(batch_size):
            decoder(input_ids=batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return first_inputs, calls


def layer_output(output):
    # Decoder layers return the hidden states (transformers 5) or a tuple starting with them (older versions).
    return output[0] if isinstance(output, tuple) else output

"""`reward_model.train_top_layers`: only the top N decoder layers, the final norm and the head train, and the
backward pass stops where the frozen layers begin."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.freezing import freeze_below_top_layers


def classifier(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0,
                         tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(config) if tied else LlamaForSequenceClassification(config)


def test_the_top_layers_norm_and_head_train_and_the_rest_gets_no_gradient():
    model = classifier()
    report = freeze_below_top_layers(model, 1)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name for name, _ in model.named_parameters()
                         if name.startswith(("model.layers.3.", "model.norm.", "score."))}
    assert report["layers"] == 4 and report["trained_layers"] == 1
    assert report["trainable_params"] == sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    assert report["trainable_params"] + report["frozen_params"] == sum(p.numel() for p in model.parameters())

    # The backward pass reaches the top layer and the head only, and a step moves only them.
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids).logits.sum().backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad == trainable
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and moved <= trainable and "model.embed_tokens.weight" not in moved


def test_an_output_head_tied_to_the_frozen_embeddings_stays_frozen():
    model = classifier(tied=True)
    freeze_below_top_layers(model, 2)
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.requires_grad
    assert model.model.layers[2].self_attn.q_proj.weight.requires_grad
    assert not model.model.layers[1].self_attn.q_proj.weight.requires_grad


@pytest.mark.parametrize("n", [0, 5])
def test_a_layer_count_outside_the_model_is_refused(n):
    with pytest.raises(ValueError, match=rf"train_top_layers={n}: LlamaForSequenceClassification has 4 decoder layers"):
        freeze_below_top_layers(classifier(), n)


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="Linear has no `layers` ModuleList"):
        freeze_below_top_layers(torch.nn.Linear(3, 3), 1)

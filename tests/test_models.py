"""``ds_z3native.models``: the LoRA models the demo, the benchmarks and the tests build from
configs (random weights, nothing downloaded)."""

from __future__ import annotations

import pytest

from ds_z3native.models import FAMILIES, MODEL_SIZES, build_lora_model

TINY = MODEL_SIZES["tiny"]


def _trainable(model):  # type: ignore[no-untyped-def]
    return [n for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_listed_family_marks_its_adapters_and_the_params_it_names_trainable(family: str) -> None:
    model, counts = build_lora_model(TINY, family)
    base = model.get_base_model()
    assert base.config.model_type == family
    assert base.config.num_hidden_layers == TINY.layers
    trainable = _trainable(model)
    trained = FAMILIES[family].get("trained", ())
    in_full = [n for n in trainable if "lora_" not in n]
    assert all(n.endswith(tuple(trained)) for n in in_full) and len(in_full) == \
        (TINY.layers * len(trained))
    assert any("lora_A" in n for n in trainable) and counts["trainable"] < counts["params"]


def test_another_model_type_gets_llamas_shape_and_lora_on_every_linear_layer() -> None:
    # Falcon's config has no head_dim argument (a read-only property): not passed to it.
    model, _ = build_lora_model(TINY, "falcon")
    config = model.get_base_model().config
    assert (config.hidden_size, config.num_hidden_layers) == (TINY.hidden, TINY.layers)
    assert config.head_dim == TINY.hidden // TINY.heads
    assert model.peft_config["default"].target_modules  # "all-linear", resolved by PEFT
    assert all("lora_" in n for n in _trainable(model))


def test_the_same_seed_builds_the_same_weights() -> None:
    a, _ = build_lora_model(TINY, "gpt2", seed=3)
    b, _ = build_lora_model(TINY, "gpt2", seed=3)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert x.equal(y), name


def test_an_unknown_model_type_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'no-such-model' is not a model type"):
        build_lora_model(TINY, "no-such-model")

"""kvserve.models.hf_config reads plain configs as transformers does, and hands the rest to transformers;
engine.input_processor.load_tokenizer's short cut gives what AutoTokenizer gives."""

import json

import pytest
import transformers

from kvserve.engine.input_processor import _names_generic_fast_tokenizer, load_tokenizer
from kvserve.models.hf_config import FAMILY_DEFAULTS, CheckpointConfig, load_hf_config
from kvserve.models.layers import rope_parameters
from kvserve.models.llama import head_dim_of, sliding_window_for_layer
from kvserve.models.loader import get_eos_token_ids, get_max_model_len

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}

# Every attribute kvserve's models and engine read from a config (`rope_scaling`, transformers
# 5's alias of `rope_parameters`, is read only when that is missing: rope_parameters() compares it).
ATTRIBUTES = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "rope_parameters",
    "n_embd",
    "n_head",
    "n_layer",
    "n_positions",
    "n_inner",
    "activation_function",
    "layer_norm_epsilon",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SMALL = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4
)
DECODER_VARIANTS = [
    {},
    SMALL,
    dict(SMALL, num_key_value_heads=2, head_dim=32, rope_theta=500000.0, tie_word_embeddings=True),
    dict(
        SMALL,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        eos_token_id=[5, 7],
        bos_token_id=3,
    ),
    dict(SMALL, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="gelu", pad_token_id=0),
    dict(SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    dict(SMALL, use_sliding_window=False, sliding_window=16),
    dict(SMALL, sliding_window=None, attention_bias=True, mlp_bias=True),
    dict(SMALL, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    dict(SMALL, rope_scaling={"type": "linear", "factor": 2.0}),
    dict(SMALL, rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0}),
]
GPT2_VARIANTS = [
    {},
    dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    dict(
        n_inner=100,
        activation_function="gelu",
        layer_norm_epsilon=1e-6,
        scale_attn_by_inverse_layer_idx=True,
        tie_word_embeddings=False,
        eos_token_id=3,
    ),
]
CASES = [
    (family, v) for family in ("llama", "mistral", "qwen2", "qwen3") for v in DECODER_VARIANTS
] + [("gpt2", v) for v in GPT2_VARIANTS]


def write_config(path, family: str, values: dict) -> None:
    raw = {"architectures": [ARCHITECTURES[family]], "model_type": family, **values}
    (path / "config.json").write_text(json.dumps(raw))


def test_every_family_has_defaults():
    assert set(FAMILY_DEFAULTS) == set(ARCHITECTURES)


@pytest.mark.parametrize("family,values", CASES)
def test_plain_configs_read_as_transformers_reads_them(tmp_path, family, values):
    write_config(tmp_path, family, values)
    ours, ref = load_hf_config(tmp_path), transformers.AutoConfig.from_pretrained(tmp_path)
    assert isinstance(ours, CheckpointConfig)
    for name in ATTRIBUTES:
        assert hasattr(ours, name) == hasattr(ref, name), name
        if hasattr(ref, name):
            assert getattr(ours, name) == getattr(ref, name), name
    if family != "gpt2":
        assert rope_parameters(ours) == rope_parameters(ref)
        assert head_dim_of(ours) == head_dim_of(ref)
        layers = range(ref.num_hidden_layers)
        assert [sliding_window_for_layer(ours, i) for i in layers] == [
            sliding_window_for_layer(ref, i) for i in layers
        ]
    assert get_max_model_len(ours) == get_max_model_len(ref)
    assert get_eos_token_ids(str(tmp_path), ours) == get_eos_token_ids(str(tmp_path), ref)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_configs_saved_by_transformers_read_the_same(tmp_path, family):
    cls = type(transformers.AutoConfig.for_model(family))
    kwargs = {"n_embd": 64, "n_head": 4, "n_layer": 2} if family == "gpt2" else SMALL
    cls(architectures=[ARCHITECTURES[family]], **kwargs).save_pretrained(tmp_path)
    ours, ref = load_hf_config(tmp_path), transformers.AutoConfig.from_pretrained(tmp_path)
    assert isinstance(ours, CheckpointConfig)
    for name in ATTRIBUTES:
        if hasattr(ref, name):
            assert getattr(ours, name) == getattr(ref, name), name


@pytest.mark.parametrize(
    "values",
    [
        {
            "model_type": "qwen2",
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        },
        {
            "model_type": "llama",
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
        },
        {"model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
        {"model_type": "phi3"},
    ],
)
def test_other_configs_go_to_transformers(tmp_path, values):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], **SMALL, **values}))
    assert isinstance(load_hf_config(tmp_path), transformers.PretrainedConfig)


def test_the_view_is_read_only(tmp_path):
    write_config(tmp_path, "llama", SMALL)
    config = load_hf_config(tmp_path)
    with pytest.raises(AttributeError):
        config.hidden_size = 1
    with pytest.raises(AttributeError, match="no attribute"):
        config.not_a_field  # noqa: B018


def test_a_missing_config_gets_transformers_error(tmp_path):
    with pytest.raises((OSError, ValueError)):
        load_hf_config(tmp_path)


@pytest.fixture(scope="module")
def tokenizer_dirs(checkpoint_dirs) -> dict[str, str]:
    from kvserve.models import ensure_default_model

    return {**checkpoint_dirs, "default": ensure_default_model()}


@pytest.mark.parametrize("name", ["default", "llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_load_tokenizer_gives_what_autotokenizer_gives(tokenizer_dirs, name):
    path = tokenizer_dirs[name]
    assert _names_generic_fast_tokenizer(path) == (
        name != "qwen2"
    )  # qwen2: AutoTokenizer's own class
    ours, ref = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(ref)
    assert ours.init_kwargs == ref.init_kwargs
    assert ours.all_special_ids == ref.all_special_ids and ours.eos_token_id == ref.eos_token_id
    text = "Hello, world! <|im_start|> tabs\tand ünïcode 🙂 1234"
    assert ours.encode(text) == ref.encode(text)
    ids = ref.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.chat_template == ref.chat_template
    if ref.chat_template:
        messages = [{"role": "user", "content": text}]
        assert ours.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(
            messages, tokenize=False
        )

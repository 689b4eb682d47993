"""GGUF files of the qwen2, qwen3, gemma2, gemma3 and phi3 architectures, written here the way
llama.cpp's converter writes them from a tiny random transformers model: its metadata keys, tensor
names from the `gguf` package's own name map (not our loader's table), its transforms (Gemma's
1 + w norms, Phi-3's fused tensors and rope factor tensors) and a small tokenizer trained here
(byte-level BPE with merges for Qwen, sentencepiece-style tokens, scores and types for Gemma and
Phi-3). pagedserve then loads each file: the config's key fields equal the original's, the
tokenizer round-trips text with its specials, chat template, bos and eos, and greedy tokens equal
transformers' greedy on the original model (float32, CPU)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pagedserve.models import gguf_file
from pagedserve.models.loader import load_model
from pagedserve.models.registry import supported_architectures
from tests.utils.paged import generate_greedy, hf_greedy

CPU = torch.device("cpu")
WEIGHT_STD = 0.15  # wide logits: greedy tokens are far from ties
NUM_NEW = 8
PROMPT_LENS = (5, 11, 19)
CORPUS = ["the cat sat on the mat and the dog sat on the log",
          "hello world, hello there; the quick brown fox jumps over the lazy dog",
          "a model reads tokens and writes tokens, one at a time, 0123456789"] * 4
TEXT = "hello world, the cat sat on the log. h\u00e9llo 42!"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_CHAT = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
              "{{ m['content'] }}<end_of_turn>\n{% endfor %}")
PHI3_CHAT = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
_TYPE = gguf.TokenType


# --- tokenizers, as llama.cpp stores them ---------------------------------------------------

@dataclass
class Vocab:
    """What the file's tokenizer.ggml.* keys hold."""

    model: str  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    chat_template: str
    special: dict[str, int]  # bos / eos / eot / pad / unk -> id
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)


def _train_bpe(pre_tokenizer: Any, vocab_size: int, **kwargs: Any) -> tuple[list[str], list[str]]:
    """Tokens in id order and merges ('a b') of a BPE trained on CORPUS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size,
                                                        show_progress=False, **kwargs))
    vocab = tok.get_vocab()
    merges = json.loads(tok.to_str())["model"]["merges"]
    return sorted(vocab, key=vocab.__getitem__), [" ".join(m) for m in merges]


def qwen_vocab() -> Vocab:
    """Byte-level BPE (tokenizer.ggml.model 'gpt2', pre 'qwen2'); the specials come last, marked
    control, as in Qwen's files."""
    tokens, merges = _train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), 340,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [_TYPE.NORMAL] * len(tokens) + [_TYPE.CONTROL] * len(specials)
    tokens += specials
    end = tokens.index("<|endoftext|>")
    return Vocab("gpt2", tokens, types, CHATML, merges=merges, pre="qwen2",
                 special={"bos": end, "eos": tokens.index("<|im_end|>"), "pad": end})


def spm_vocab(front: list[str], back: list[str], chat_template: str,
              special: dict[str, str]) -> Vocab:
    """Sentencepiece-style ('llama'): control tokens `front` first, the 256 byte tokens, pieces
    scored best first, control tokens `back` last; `special` names each role's token."""
    pieces, _ = _train_bpe(pre_tokenizers.Metaspace(), 200)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = front + byte_tokens + pieces + back
    types = ([_TYPE.CONTROL] * len(front) + [_TYPE.BYTE] * 256 + [_TYPE.NORMAL] * len(pieces)
             + [_TYPE.CONTROL] * len(back))
    types[tokens.index(special["unk"])] = _TYPE.UNKNOWN
    scores = [0.0] * (len(front) + 256) + [-float(i) for i in range(len(pieces))] \
        + [0.0] * len(back)
    return Vocab("llama", tokens, types, chat_template, scores=scores,
                 special={role: tokens.index(tok) for role, tok in special.items()})


def gemma_vocab() -> Vocab:
    return spm_vocab(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], [],
                     GEMMA_CHAT, {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>", "unk": "<unk>",
                                  "eot": "<end_of_turn>"})


def phi3_vocab() -> Vocab:
    return spm_vocab(["<unk>", "<s>", "</s>"], ["<|endoftext|>", "<|user|>", "<|assistant|>",
                                                "<|end|>"], PHI3_CHAT,
                     {"unk": "<unk>", "bos": "<s>", "eos": "<|endoftext|>", "eot": "<|end|>",
                      "pad": "<|endoftext|>"})


def write_vocab(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
              "eot": writer.add_eot_token_id, "pad": writer.add_pad_token_id,
              "unk": writer.add_unk_token_id}
    for role, token_id in vocab.special.items():
        adders[role](token_id)
    writer.add_add_bos_token(vocab.model == "llama")
    writer.add_chat_template(vocab.chat_template)


# --- models and their GGUF metadata, as llama.cpp's converter writes them ---------------------

def _base_metadata(writer: gguf.GGUFWriter, cfg: transformers.PretrainedConfig) -> None:
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _qwen_metadata(writer: gguf.GGUFWriter, cfg: transformers.PretrainedConfig) -> None:
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None)  # Qwen2 has none: hidden / heads
    if head_dim is not None and head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _gemma2_metadata(writer: gguf.GGUFWriter, cfg: transformers.PretrainedConfig) -> None:
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _gemma3_metadata(writer: gguf.GGUFWriter, cfg: transformers.PretrainedConfig) -> None:
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    full = cfg.rope_parameters["full_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    if full["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])


def _phi3_metadata(writer: gguf.GGUFWriter, cfg: transformers.PretrainedConfig) -> None:
    rope = cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    writer.add_sliding_window(cfg.sliding_window or 0)
    scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
    writer.add_rope_scaling_attn_factors(
        float(np.sqrt(1 + np.log(scale) / np.log(cfg.original_max_position_embeddings))))
    for kind, key in ((gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"),
                      (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, "short_factor")):
        writer.add_tensor(gguf.TENSOR_NAMES[kind] + ".weight",
                          np.array(rope[key], dtype=np.float32))


@dataclass
class Family:
    arch: str  # general.architecture
    make_config: Callable[[int], transformers.PretrainedConfig]  # vocab size -> config
    make_vocab: Callable[[], Vocab]
    metadata: Callable[[gguf.GGUFWriter, transformers.PretrainedConfig], None]
    checked: tuple[str, ...] = ()  # config fields compared beyond the common ones
    norm_shift: float = 0.0  # the converter stores RMSNorm weights as shift + w
    special_text: str = ""  # a control token the tokenizer must keep whole


_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def _qwen2(vocab: int) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(vocab_size=vocab, **_SHAPE, tie_word_embeddings=True,
                                    rope_theta=10000.0)


def _qwen3(vocab: int) -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(vocab_size=vocab, **_SHAPE, head_dim=32,
                                    tie_word_embeddings=False, rope_theta=1e6)


def _gemma2(vocab: int) -> transformers.PretrainedConfig:
    return transformers.Gemma2Config(vocab_size=vocab, **_SHAPE, head_dim=16,
                                     query_pre_attn_scalar=16, sliding_window=8,
                                     attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                                     pad_token_id=0, bos_token_id=2, eos_token_id=1)


def _gemma3(vocab: int) -> transformers.PretrainedConfig:
    # Six layers: the sixth is global, the others slide.
    return transformers.Gemma3TextConfig(
        vocab_size=vocab, **{**_SHAPE, "num_hidden_layers": 6}, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=8, architectures=["Gemma3ForCausalLM"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        pad_token_id=0, bos_token_id=2, eos_token_id=1)


def _phi3(vocab: int) -> transformers.PretrainedConfig:
    g = torch.Generator().manual_seed(7)
    factors = {k: (1 + 3 * torch.rand(8, generator=g)).tolist()
               for k in ("long_factor", "short_factor")}
    return transformers.Phi3Config(
        vocab_size=vocab, **_SHAPE, original_max_position_embeddings=64, sliding_window=128,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **factors},
        bos_token_id=1, eos_token_id=vocab - 4, pad_token_id=vocab - 4)


FAMILIES = {
    "qwen2": Family("qwen2", _qwen2, qwen_vocab, _qwen_metadata, special_text="<|im_end|>"),
    "qwen3": Family("qwen3", _qwen3, qwen_vocab, _qwen_metadata, ("head_dim",),
                    special_text="<|im_end|>"),
    "gemma2": Family("gemma2", _gemma2, gemma_vocab, _gemma2_metadata,
                     ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
                      "attn_logit_softcapping", "final_logit_softcapping"),
                     norm_shift=1.0, special_text="<end_of_turn>"),
    "gemma3": Family("gemma3", _gemma3, gemma_vocab, _gemma3_metadata,
                     ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
                      "rope_parameters"), norm_shift=1.0, special_text="<end_of_turn>"),
    "phi3": Family("phi3", _phi3, phi3_vocab, _phi3_metadata,
                   ("sliding_window", "original_max_position_embeddings", "rope_parameters"),
                   special_text="<|end|>"),
}
_COMMON_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "rms_norm_eps", "tie_word_embeddings")


def random_model(config: transformers.PretrainedConfig, gemma_norms: bool,
                 seed: int = 0) -> torch.nn.Module:
    """transformers' model with every weight normal(0, WEIGHT_STD); norm weights around 1
    (Gemma's around 0: it scales by 1 + w)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, WEIGHT_STD)
            if "norm" in name and not gemma_norms:
                param.add_(1.0)
    return model


def write_gguf(path: Path, family: Family, model: torch.nn.Module, vocab: Vocab) -> None:
    """The file llama.cpp's converter would write for `model` (float32 tensors)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), family.arch)
    _base_metadata(writer, cfg)
    family.metadata(writer, cfg)
    write_vocab(writer, vocab)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.arch)
    name_map = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the converter writes only the embedding
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf has no name for {name}"
        array = tensor.detach().float().numpy()
        if family.norm_shift and name.endswith("norm.weight"):
            array = array + family.norm_shift
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass
class Built:
    family: Family
    path: Path
    model: torch.nn.Module  # transformers' original
    vocab: Vocab


@pytest.fixture(scope="module", autouse=True)
def no_tokenizer_cache():
    """Convert every tokenizer afresh and leave nothing in the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE_DIR", "")
        yield


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory) -> Built:
    family = FAMILIES[request.param]
    vocab = family.make_vocab()
    model = random_model(family.make_config(len(vocab.tokens)), family.norm_shift != 0.0)
    path = tmp_path_factory.mktemp(family.arch) / f"tiny-{family.arch}.gguf"
    write_gguf(path, family, model, vocab)
    return Built(family, path, model, vocab)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _require_model_class(architecture: str) -> None:
    if architecture not in supported_architectures():
        pytest.skip(f"{architecture} is not registered in pagedserve.models.registry yet")


# --- the tests ------------------------------------------------------------------------------

def test_config_matches_original(built):
    config = gguf_file.gguf_config(gguf_file.open_gguf(str(built.path)))
    original = built.model.config
    assert type(config) is type(original)
    assert config.architectures == [type(built.model).__name__]
    for name in _COMMON_FIELDS + built.family.checked:
        _assert_same(getattr(config, name), getattr(original, name), name)


def _assert_same(ours: Any, theirs: Any, where: str) -> None:
    """Equal, floats to float32 precision (GGUF stores them so); our rope may also carry the
    attention factor llama.cpp writes, which transformers derives."""
    if isinstance(theirs, dict):
        assert set(ours) - set(theirs) <= {"attention_factor"}, where
        if "attention_factor" in ours:
            assert ours["attention_factor"] == pytest.approx(_longrope_attention_factor(theirs))
        for key in theirs:
            _assert_same(ours.get(key), theirs[key], f"{where}.{key}")
    elif isinstance(theirs, float):
        assert ours == pytest.approx(theirs, rel=1e-6), where
    elif isinstance(theirs, list) and theirs and isinstance(theirs[0], float):
        assert ours == pytest.approx(theirs, rel=1e-6), where
    else:
        assert ours == theirs, where


def _longrope_attention_factor(rope: dict[str, Any]) -> float:
    scale = _SHAPE["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return float(np.sqrt(1 + np.log(scale) / np.log(rope["original_max_position_embeddings"])))


def test_tokenizer_from_file(built):
    tokenizer = gguf_file.gguf_tokenizer(built.path)
    vocab = built.vocab
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == TEXT
    assert max(ids) < len(vocab.tokens)
    special = built.family.special_text
    assert tokenizer(special, add_special_tokens=False).input_ids == [vocab.id_of(special)]
    assert tokenizer.bos_token_id == vocab.special["bos"]
    adds_bos = tokenizer(TEXT).input_ids[0] == vocab.special["bos"]
    assert adds_bos == (vocab.model == "llama")  # as the file's add_bos_token says
    assert tokenizer.eos_token_id == vocab.special["eos"]
    assert tokenizer.chat_template == vocab.chat_template
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert vocab.id_of(special) in tokenizer(chat, add_special_tokens=False).input_ids


def test_tokenizer_cache_round_trip(built, tmp_path, monkeypatch):
    """The converted tokenizer saved in the cache reads back the same (the cache's reload goes
    through tokenizer_config.json, not the file)."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    converted = gguf_file.gguf_tokenizer(built.path)
    cached = gguf_file.gguf_tokenizer(built.path)
    assert len(list((tmp_path / "gguf-tokenizers").iterdir())) == 1
    for text in (TEXT, "  two  spaces " + built.family.special_text):
        assert cached(text).input_ids == converted(text).input_ids
        assert cached.decode(cached(text).input_ids) == converted.decode(converted(text).input_ids)
    assert (cached.bos_token_id, cached.eos_token_id) == (converted.bos_token_id,
                                                          converted.eos_token_id)
    assert cached.chat_template == converted.chat_template


def test_greedy_matches_transformers(built):
    architecture = type(built.model).__name__
    _require_model_class(architecture)
    # LongRoPE (Phi-3): serve within the original context, where transformers uses the short
    # factors for every sequence (the engine picks one factor set by max_model_len).
    max_len = getattr(built.model.config, "original_max_position_embeddings", None)
    loaded = load_model(str(built.path), torch.float32, CPU, max_len)
    assert loaded.hf_config.architectures == [architecture]
    vocab = built.vocab
    expected_eos = [vocab.special["eos"]] + ([vocab.special["eot"]] if "eot" in vocab.special
                                             else [])
    assert loaded.eos_token_ids == expected_eos
    assert loaded.chat_template == vocab.chat_template
    prompts = _prompts(len(vocab.tokens))
    tokens, _ = generate_greedy(loaded.model, prompts, NUM_NEW)
    assert tokens == [hf_greedy(built.model, p, NUM_NEW) for p in prompts]


@pytest.mark.parametrize("built", ["gemma3"], indirect=True)
def test_engine_chat_through_the_file_tokenizer(built, make_llm):
    """The engine takes a chat through the file's template and tokenizer: Gemma's prompt starts
    with <bos>, then <start_of_turn>; the answer decodes."""
    _require_model_class("Gemma3ForCausalLM")
    from pagedserve import SamplingParams

    llm = make_llm(model=str(built.path), dtype="float32", device="cpu", kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "hello world"}], params, use_tqdm=False)[0]
    assert out.prompt_token_ids[:2] == [built.vocab.special["bos"],
                                        built.vocab.id_of("<start_of_turn>")]
    assert len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].text == llm.engine.tokenizer.decode(out.outputs[0].token_ids)


# --- errors ---------------------------------------------------------------------------------

def _rewrite(src: Path, dst: Path, arch: str | None = None, drop: str | None = None,
             as_int8: str | None = None, extra: tuple[str, ...] = ()) -> Path:
    """A copy of a qwen2 GGUF with its architecture renamed, a tensor dropped, one stored as I8,
    or `extra` tensors (float32 ones of the hidden size) added."""
    reader = gguf_file.open_gguf(str(src))
    writer = gguf.GGUFWriter(str(dst), arch or "qwen2")
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        array = fld.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key.replace("qwen2.", f"{arch}.") if arch else key, fld.contents(),
                             fld.types[0], sub_type=fld.types[-1] if array else None)
    for tensor in reader.tensors:
        if tensor.name != drop:
            data = np.array(tensor.data)
            writer.add_tensor(tensor.name, np.zeros_like(data, dtype=np.int8)
                              if tensor.name == as_int8 else data)
    for name in extra:
        writer.add_tensor(name, np.ones(_SHAPE["hidden_size"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory) -> Path:
    family = FAMILIES["qwen2"]
    vocab = family.make_vocab()
    model = random_model(family.make_config(len(vocab.tokens)), False)
    path = tmp_path_factory.mktemp("errors") / "tiny-qwen2.gguf"
    write_gguf(path, family, model, vocab)
    return path


def test_unknown_architecture_is_named(qwen2_file, tmp_path):
    path = _rewrite(qwen2_file, tmp_path / "x.gguf", arch="qwen9")
    with pytest.raises(ValueError, match="GGUF architecture 'qwen9' is not supported"):
        load_model(str(path), torch.float32, CPU)


def test_missing_tensor_is_named(qwen2_file, tmp_path):
    _require_model_class("Qwen2ForCausalLM")
    path = _rewrite(qwen2_file, tmp_path / "x.gguf", drop="blk.1.ffn_down.weight")
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.1\.mlp\.down_proj"):
        load_model(str(path), torch.float32, CPU)


def test_unsupported_tensor_type_is_named(qwen2_file, tmp_path):
    path = _rewrite(qwen2_file, tmp_path / "x.gguf", as_int8="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight' is stored as I8"):
        load_model(str(path), torch.float32, CPU)


def test_tensor_foreign_to_the_architecture_is_named(qwen2_file, tmp_path):
    """Qwen3's q norm has no place in a qwen2 file."""
    path = _rewrite(qwen2_file, tmp_path / "x.gguf", extra=("blk.0.attn_q_norm.weight",))
    with pytest.raises(ValueError, match="unknown tensor 'blk.0.attn_q_norm.weight' in a GGUF of "
                                         "architecture 'qwen2'"):
        load_model(str(path), torch.float32, CPU)

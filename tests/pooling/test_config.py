"""Where a pooling model's settings come from: sentence-transformers' files in both of their
formats, the flags over them, `--runner auto`, and the modules we refuse by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedserve.pooling.config import resolve_pooler
from pagedserve.pooling.st_files import read_sentence_transformer


def st_dir(path, pooling_config, modules=("Transformer", "Pooling", "Normalize"),
           architectures=("Qwen3ForCausalLM",)):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": list(architectures),
                                                  "hidden_size": 32}))
    entries = [{"idx": i, "name": str(i), "path": {"Pooling": "1_Pooling"}.get(kind, ""),
                "type": f"sentence_transformers.models.{kind}"}
               for i, kind in enumerate(modules)]
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return path


def model(path, **flags):
    return SimpleNamespace(model=str(path), **{"runner": "auto", "pooling_type": None,
                                               "pooling_normalize": None, **flags})


def test_both_pooling_config_formats(tmp_path):
    new = st_dir(tmp_path / "new", {"embedding_dimension": 32, "pooling_mode": "mean"},
                 modules=("Transformer", "Pooling"))
    assert read_sentence_transformer(new).method == "mean"
    assert not read_sentence_transformer(new).normalize
    legacy = st_dir(tmp_path / "legacy", {"word_embedding_dimension": 32,
                                          "pooling_mode_cls_token": True,
                                          "pooling_mode_mean_tokens": False})
    found = read_sentence_transformer(legacy)
    assert (found.method, found.normalize) == ("cls", True)
    assert read_sentence_transformer(tmp_path) is None  # no modules.json


@pytest.mark.parametrize(("config", "modules", "match"), [
    ({"pooling_mode": "max"}, ("Transformer", "Pooling"), r"pooling mode \['max'\]"),
    ({"pooling_mode": ["mean", "cls"]}, ("Transformer", "Pooling"), "not supported"),
    ({"pooling_mode": "mean", "include_prompt": False}, ("Transformer", "Pooling"),
     "include_prompt=false"),
    ({"pooling_mode": "mean"}, ("Transformer", "Pooling", "Dense"), "module 'Dense'"),
])
def test_unsupported_modules_refused_by_name(tmp_path, config, modules, match):
    with pytest.raises(ValueError, match=match):
        read_sentence_transformer(st_dir(tmp_path / "m", config, modules))


def test_runner_auto_files_and_flags(tmp_path):
    st = st_dir(tmp_path / "st", {"pooling_mode": "lasttoken"})
    pooler = resolve_pooler(model(st))
    assert (pooler.method, pooler.normalize, pooler.hidden_size) == ("last", True, 32)
    assert "sentence-transformers" in pooler.source
    flagged = resolve_pooler(model(st, pooling_type="mean", pooling_normalize=False))
    assert (flagged.method, flagged.normalize) == ("mean", False)
    assert resolve_pooler(model(st, runner="generate")) is None
    # A bare checkpoint pools; a causal one generates unless told.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"architectures": ["Qwen3Model"],
                                                  "hidden_size": 48}))
    assert resolve_pooler(model(bare)) == resolve_pooler(model(bare, runner="pooling"))
    assert resolve_pooler(model(bare)).method == "last"
    assert resolve_pooler(model(bare)).source == "the defaults"  # no flag given: not "flags"
    assert resolve_pooler(model(bare, pooling_type="mean")).source == "flags"
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                    "hidden_size": 48}))
    assert resolve_pooler(model(causal)) is None
    assert resolve_pooler(model(causal, runner="pooling", pooling_type="cls")).method == "cls"
    with pytest.raises(ValueError, match="apply to a pooling model only: add --runner "
                                         "pooling"):
        resolve_pooler(model(causal, pooling_type="mean"))


def test_pooling_the_bundled_model_names_it():
    """`serve --runner pooling` with no model said "model None"."""
    bundled = SimpleNamespace(model=None, runner="pooling", pooling_type=None,
                              pooling_normalize=None)
    with pytest.raises(ValueError, match="^model the bundled SmolLM2 .gguf: a pooling model "
                                         "must be a Hugging Face directory"):
        resolve_pooler(bundled)


def test_cross_encoder_files(tmp_path):
    path = st_dir(tmp_path / "ce", {}, modules=("Transformer",))
    entries = json.loads((path / "modules.json").read_text())
    entries.append({"idx": 1, "name": "1", "path": "1_LogitScore",
                    "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"})
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "1_LogitScore").mkdir()
    score_config = path / "1_LogitScore" / "config.json"
    score_config.write_text(json.dumps({"true_token_id": 7, "false_token_id": 9}))
    pooler = resolve_pooler(model(path))
    assert (pooler.task, pooler.score_tokens, pooler.activation) == ("score", (7, 9), "sigmoid")
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"activation_fn": "torch.nn.modules.linear.Identity"}))
    assert resolve_pooler(model(path)).activation == "identity"
    with pytest.raises(ValueError, match="pooling_type and pooling_normalize do not apply"):
        resolve_pooler(model(path, pooling_type="mean"))
    score_config.write_text(json.dumps({"true_token_id": 7, "module_input_name": "x"}))
    with pytest.raises(ValueError, match="only the causal model's logits"):
        resolve_pooler(model(path))


def test_step_token_budget_defaults(tmp_path):
    """A pooling model on CUDA steps max(16384, its context) tokens by default, so that any
    input fits its one step; the CPU, a generating model and a flag keep theirs."""
    from pagedserve.config import DEFAULT_STEP_TOKENS, EngineConfig

    st = st_dir(tmp_path / "st", {"pooling_mode": "lasttoken"})
    long = tmp_path / "long"
    long.mkdir()
    (long / "config.json").write_text(json.dumps(
        {"architectures": ["BertModel"], "hidden_size": 32, "max_position_embeddings": 32768}))

    def budget(path, device, **flags):
        return EngineConfig.from_kwargs(model=str(path), device=device,
                                        **flags).scheduler.max_num_batched_tokens

    assert budget(st, "cuda") == 16384
    assert budget(long, "cuda") == 32768
    assert budget(long, "cuda", max_model_len=40000) == 40000
    assert budget(st, "cpu") == DEFAULT_STEP_TOKENS == 2048
    assert budget(st, "cuda", max_num_batched_tokens=4096) == 4096
    assert budget(st, "cuda", runner="generate") == DEFAULT_STEP_TOKENS
    assert budget("random:tiny", "cuda") == DEFAULT_STEP_TOKENS

"""PEFT adapter import: the module set, ranks and scales PEFT itself derives, and every refusal.

The reference is PEFT: each adapter is saved by `get_peft_model(...).save_pretrained` and loaded back
with `PeftModel.from_pretrained`; for every module PEFT wrapped, `scale * B @ A` from the importer
must equal that module's `get_delta_weight`, and no other module may carry weights.
"""

from __future__ import annotations

import copy
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from helpers.tiny_models import ARCHS, build_hf_model, make_peft_adapter
from safetensors.torch import load_file, save_file

from loraplex.adapters.peft_import import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterImportError,
    ImportedAdapter,
    base_module_names,
    import_peft_adapter,
)
from loraplex.adapters.revision import adapter_revision
from loraplex.config import ModelConfig
from loraplex.lora.layout import HF_MODULE_NAMES, TARGETS

ALL_SEVEN = [HF_MODULE_NAMES[t].rsplit(".", 1)[1] for t in TARGETS]
MAX_RANK = 64
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"  # tensor-key stem of layer 0's q_proj


# --- helpers -------------------------------------------------------------------------------------


def model_config_of(model: transformers.PreTrainedModel) -> ModelConfig:
    return ModelConfig.from_hf_dict({**model.config.to_dict(), "architectures": [type(model).__name__]})


def peft_reference(base: transformers.PreTrainedModel, path: Path) -> Any:
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()


def assert_matches_peft(imported: ImportedAdapter, peft_model: Any) -> None:
    from peft.tuners.lora import LoraLayer

    hf = peft_model.base_model.model
    wrapped = {name for name, module in hf.named_modules() if isinstance(module, LoraLayer)}
    pairs = imported.weights.pairs
    assert {f"model.layers.{layer}.{HF_MODULE_NAMES[t]}" for layer, t in pairs} == wrapped
    for (layer, target), pair in pairs.items():
        module = hf.get_submodule(f"model.layers.{layer}.{HF_MODULE_NAMES[target]}")
        assert pair.a.dtype == pair.b.dtype == torch.float32
        assert pair.a.is_contiguous() and pair.b.is_contiguous() and pair.a.device.type == "cpu"
        assert pair.scale == pytest.approx(module.scaling["default"], rel=1e-12)
        with torch.no_grad():
            ours = pair.scale * (pair.b @ pair.a)
            torch.testing.assert_close(ours, module.get_delta_weight("default"), atol=1e-6, rtol=0)


def edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / CONFIG_FILE).read_text())
    config.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(config))


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bases() -> dict[str, transformers.PreTrainedModel]:
    return {arch: build_hf_model(arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def llama(bases: dict[str, transformers.PreTrainedModel]) -> transformers.PreTrainedModel:
    return bases["llama"]


@pytest.fixture(scope="module")
def llama_config(llama: transformers.PreTrainedModel) -> ModelConfig:
    return model_config_of(llama)


@pytest.fixture(scope="module")
def saved_adapter(llama: transformers.PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain r=4 q/v adapter on the tiny Llama; tests copy it before editing."""
    return make_peft_adapter(
        llama, tmp_path_factory.mktemp("qv"), r=4, target_modules=["q_proj", "v_proj"], seed=1
    )


@pytest.fixture
def adapter(saved_adapter: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved_adapter, tmp_path / "adapter"))


# --- agreement with PEFT -------------------------------------------------------------------------

CASES = {
    "list": ("llama", 4, ["q_proj", "v_proj"], {}),
    "regex": ("llama", 4, r".*\.(k_proj|down_proj)", {}),
    "rank_and_alpha_patterns": (
        "llama",
        8,
        ["q_proj", "o_proj", "up_proj"],
        {
            "rank_pattern": {"layers.1.self_attn.q_proj": 2, "o_proj": 6},
            "alpha_pattern": {r"model\.layers\.0\..*": 3},
        },
    ),
    "rslora": (
        "llama",
        8,
        ["gate_proj", "down_proj"],
        {"use_rslora": True, "rank_pattern": {"down_proj": 4}},
    ),
    "layers_to_transform_with_pattern": (
        "llama",
        4,
        ["q_proj", "up_proj"],
        {"layers_to_transform": [1], "layers_pattern": "layers"},
    ),
    "layers_to_transform_int": ("llama", 4, ["v_proj", "o_proj"], {"layers_to_transform": 0}),
    # A module named in full is adapted whatever layers_to_transform says (PEFT's exact-match branch).
    "full_name_bypasses_layers": (
        "llama",
        4,
        ["model.layers.1.self_attn.k_proj", "gate_proj"],
        {"layers_to_transform": [0]},
    ),
    "exclude_list": ("llama", 4, ["q_proj", "up_proj"], {"exclude_modules": ["model.layers.0.mlp.up_proj"]}),
    "exclude_regex": ("llama", 4, ALL_SEVEN, {"exclude_modules": r".*\.1\.mlp\..*"}),
    "llama_all_seven": ("llama", 4, ALL_SEVEN, {}),
    "qwen2_gqa_all_seven": ("qwen2", 8, ALL_SEVEN, {}),
    "mistral_mqa_head_dim": ("mistral", 4, ALL_SEVEN, {"lora_alpha": 3}),
    "qwen3_subset": ("qwen3", 4, ["q_proj", "k_proj", "o_proj"], {}),
    "qwen2_single_target": ("qwen2", 16, ["down_proj"], {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_peft_delta_weights(
    case: str, bases: dict[str, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    arch, r, targets, kwargs = CASES[case]
    path = make_peft_adapter(bases[arch], tmp_path, r=r, target_modules=targets, seed=7, **kwargs)
    imported = import_peft_adapter(path, model_config_of(bases[arch]), MAX_RANK)
    assert_matches_peft(imported, peft_reference(bases[arch], path))


@pytest.mark.parametrize("targets", [None, "all-linear"])
def test_config_written_by_hand_is_read_like_peft(
    targets: str | None, llama: transformers.PreTrainedModel, llama_config: ModelConfig, tmp_path: Path
) -> None:
    # PEFT saves target_modules expanded; a hand-written config may leave them unset (PEFT's
    # per-architecture default) or say "all-linear".
    path = make_peft_adapter(llama, tmp_path, r=4, target_modules=ALL_SEVEN, seed=3)
    if targets is None:
        edit_tensors(path, lambda t: [t.pop(k) for k in list(t) if not ("q_proj" in k or "v_proj" in k)])
    edit_config(path, target_modules=targets)
    imported = import_peft_adapter(path, llama_config, MAX_RANK)
    assert_matches_peft(imported, peft_reference(llama, path))


def test_manifest_describes_the_adapter(llama: transformers.PreTrainedModel, tmp_path: Path) -> None:
    path = make_peft_adapter(
        llama, tmp_path, r=8, target_modules=["q_proj", "down_proj"], seed=2, rank_pattern={"down_proj": 2}
    )
    config = model_config_of(llama)
    imported = import_peft_adapter(path, config, MAX_RANK)
    manifest = json.loads(json.dumps(imported.manifest))  # JSON-serialisable, unchanged by a round trip
    assert manifest == imported.manifest
    assert manifest["peft_type"] == "LORA" and manifest["base_architecture"] == "LlamaForCausalLM"
    assert manifest["targets"] == ["q", "down"] and manifest["source_dtypes"] == ["float32"]
    assert manifest["max_rank"] == 8 == imported.weights.max_rank
    by_key = {(m["layer"], m["target"]): m for m in manifest["modules"]}
    assert set(by_key) == set(imported.weights.pairs)
    h, i = config.hidden_size, config.intermediate_size
    assert by_key[(1, "down")] == {
        "layer": 1,
        "target": "down",
        "rank": 2,
        "alpha": 16.0,
        "scale": 8.0,
        "a_shape": [2, i],
        "b_shape": [h, 2],
    }
    assert by_key[(0, "q")]["scale"] == 2.0 and by_key[(0, "q")]["a_shape"] == [8, h]


def test_keys_with_an_adapter_name_segment(adapter: Path, llama_config: ModelConfig) -> None:
    plain = import_peft_adapter(adapter, llama_config, MAX_RANK)

    def add_name(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            tensors[key.replace(".weight", ".default.weight")] = tensors.pop(key)

    edit_tensors(adapter, add_name)
    named = import_peft_adapter(adapter, llama_config, MAX_RANK)
    assert adapter_revision(named) == adapter_revision(plain)


def test_half_precision_source_is_widened_to_float32(adapter: Path, llama_config: ModelConfig) -> None:
    def to_bf16(tensors: dict[str, torch.Tensor]) -> None:
        for key in tensors:
            tensors[key] = tensors[key].to(torch.bfloat16)

    edit_tensors(adapter, to_bf16)
    imported = import_peft_adapter(adapter, llama_config, MAX_RANK)
    assert imported.manifest["source_dtypes"] == ["bfloat16"]
    a = load_file(str(adapter / WEIGHTS_FILE))[f"{Q0}.lora_A.weight"]
    assert torch.equal(imported.weights.pairs[(0, "q")].a, a.float())


@pytest.mark.parametrize("arch", ARCHS)
def test_base_module_names_are_the_hf_module_names(
    arch: str, bases: dict[str, transformers.PreTrainedModel]
) -> None:
    model = bases[arch]
    assert base_module_names(model_config_of(model)) == [name for name, _ in model.named_modules()]


# --- refusals: the directory ---------------------------------------------------------------------


def test_refuses_missing_directory(tmp_path: Path, llama_config: ModelConfig) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        import_peft_adapter(tmp_path / "absent", llama_config, MAX_RANK)


def test_refuses_a_file_as_directory(adapter: Path, llama_config: ModelConfig) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        import_peft_adapter(adapter / CONFIG_FILE, llama_config, MAX_RANK)


def test_refuses_missing_config(adapter: Path, llama_config: ModelConfig) -> None:
    (adapter / CONFIG_FILE).unlink()
    with pytest.raises(AdapterImportError, match="adapter_config.json not found"):
        import_peft_adapter(adapter, llama_config, MAX_RANK)


def test_refuses_missing_weights(adapter: Path, llama_config: ModelConfig) -> None:
    (adapter / WEIGHTS_FILE).unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors not found"):
        import_peft_adapter(adapter, llama_config, MAX_RANK)


class _WritesWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("name", ["adapter_model.bin", "adapter.pt"])
def test_refuses_pickled_weights_without_unpickling(
    name: str, adapter: Path, llama_config: ModelConfig, tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"
    (adapter / WEIGHTS_FILE).unlink()
    (adapter / name).write_bytes(pickle.dumps(_WritesWhenUnpickled(marker)))
    with pytest.raises(ValueError, match=f"pickled weights are not loaded.*{name}|{name}.*pickled weights"):
        import_peft_adapter(adapter, llama_config, MAX_RANK)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "malformed JSON"),
        ('{"peft_type": "LORA", "r": NaN}', "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_refuses_malformed_config(text: str, match: str, adapter: Path, llama_config: ModelConfig) -> None:
    (adapter / CONFIG_FILE).write_text(text)
    with pytest.raises(ValueError, match=match):
        import_peft_adapter(adapter, llama_config, MAX_RANK)


# --- refusals: adapter_config.json ---------------------------------------------------------------

CONFIG_REFUSALS = {
    "peft_type": ({"peft_type": "ADALORA"}, "peft_type is 'ADALORA'; only LORA"),
    "use_dora": ({"use_dora": True}, "DoRA"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "bias": ({"bias": "all"}, "bias='all' is not supported"),
    "lora_bias": ({"lora_bias": True}, "lora_bias"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    "layer_replication": ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    "trainable_token_indices": ({"trainable_token_indices": [3, 4]}, "trainable_token_indices"),
    "target_parameters": ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters"),
    "alora": ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    "use_qalora": ({"use_qalora": True}, "use_qalora"),
    "megatron_config": ({"megatron_config": {"tensor_model_parallel_size": 2}}, "megatron_config"),
    "kasa_defaults": ({"kasa_config": {}}, "KaSA"),  # PEFT enables a variant given an empty sub-config
    "modules_to_save_empty": ({"modules_to_save": []}, None),
    "velora": ({"velora_config": {"num_groups": 4}}, "VeLoRA"),
    "bdlora": ({"use_bdlora": {"nblocks": 2}}, "use_bdlora"),
    "arrow": ({"arrow_config": {"top_k": 2}}, "arrow_config"),
    "monteclora": ({"monteclora_config": {"num_samples": 2}}, "monteclora_config"),
    "pissa": ({"init_lora_weights": "pissa_niter_4"}, "rewritten base weights"),
    "olora": ({"init_lora_weights": "olora"}, "rewritten base weights"),
    "loftq": ({"init_lora_weights": "loftq"}, "rewritten base weights"),
    "corda": ({"init_lora_weights": "corda"}, "rewritten base weights"),
    "unknown_init": ({"init_lora_weights": "sparkle"}, "unknown init_lora_weights"),
    "unknown_field": ({"lora_future_trick": 2}, "unknown config field lora_future_trick"),
    "embed_tokens": ({"target_modules": ["embed_tokens", "q_proj"]}, "embed_tokens.*not supported yet"),
    "lm_head": ({"target_modules": ["lm_head"]}, "lm_head.*not supported yet"),
    "norm_by_regex": ({"target_modules": r".*layernorm"}, "input_layernorm.*not supported yet"),
    "c_attn": ({"target_modules": ["c_attn"]}, "'c_attn' matches no module of the LlamaForCausalLM"),
    "c_attn_among_others": ({"target_modules": ["q_proj", "v_proj", "c_attn"]}, "'c_attn' matches no module"),
    "regex_matches_nothing": ({"target_modules": r".*\.c_attn"}, "match no module"),
    "empty_targets": ({"target_modules": []}, "match no module"),
    "all_excluded": ({"exclude_modules": ["q_proj", "v_proj"]}, "match no module"),
    "bad_regex": ({"target_modules": "(q_proj"}, "target_modules pattern '\\(q_proj' is not a valid regex"),
    "bad_rank_pattern_regex": (
        {"rank_pattern": {"(?i)q_proj": 4}},
        "rank_pattern pattern .* is not a valid regex",
    ),
    "bad_layers_pattern": (
        {"layers_to_transform": [0], "layers_pattern": "(?P<idx>layers)"},
        "layers_pattern pattern .* is not a valid regex",
    ),
    "r_zero": ({"r": 0}, "r must be a positive integer"),
    "r_string": ({"r": "4"}, "r must be a positive integer"),
    "alpha_string": ({"lora_alpha": "8"}, "lora_alpha must be a finite number"),
    "rank_pattern_zero": ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\] must be a positive"),
    "rslora_string": ({"use_rslora": "yes"}, "use_rslora must be true or false"),
    "layers_to_transform_string": ({"layers_to_transform": "0"}, "layers_to_transform must be"),
    "layers_with_regex": (
        {"target_modules": r".*q_proj", "layers_to_transform": [0]},
        "regex target_modules",
    ),
    "pattern_without_layers": ({"layers_pattern": "layers"}, "layers_pattern is set but"),
    "rank_from_config": ({"r": 2}, "has rank 4 but the config .* gives rank 2"),
    "rank_from_pattern": (
        {"rank_pattern": {"v_proj": 8}},
        "v_proj.lora_A.weight' has rank 4 but .* gives rank 8",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_refuses_config(case: str, adapter: Path, llama_config: ModelConfig) -> None:
    changes, match = CONFIG_REFUSALS[case]
    edit_config(adapter, **changes)
    if match is None:
        import_peft_adapter(adapter, llama_config, MAX_RANK)
        return
    with pytest.raises(ValueError, match=match):
        import_peft_adapter(adapter, llama_config, MAX_RANK)


def test_refuses_rank_above_max_rank(adapter: Path, llama_config: ModelConfig) -> None:
    with pytest.raises(ValueError, match="rank 4 of model.layers.0.self_attn.q_proj exceeds max_rank 2"):
        import_peft_adapter(adapter, llama_config, max_rank=2)


def test_refuses_adapter_for_another_base(
    adapter: Path, bases: dict[str, transformers.PreTrainedModel]
) -> None:
    # Same module names, different widths (Qwen3 has head_dim 32, so q is 128 wide, not 64).
    with pytest.raises(ValueError, match="does not fit the base model"):
        import_peft_adapter(adapter, model_config_of(bases["qwen3"]), MAX_RANK)


# --- refusals: adapter_model.safetensors ---------------------------------------------------------


def _set(key: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__setitem__(key, value)


def _drop(*keys: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: [tensors.pop(k) for k in keys]


def _poison(key: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = value

    return edit


def _rename_one(old: str, new: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__setitem__(new, tensors.pop(old))


K0 = "base_model.model.model.layers.0.self_attn.k_proj"
TENSOR_REFUSALS = {
    "wrong_d_in": (_set(f"{Q0}.lora_A.weight", torch.zeros(4, 32)), "does not fit the base model.*d_in"),
    "wrong_d_out": (_set(f"{Q0}.lora_B.weight", torch.zeros(31, 4)), "does not fit the base model.*d_out"),
    "rank_mismatch": (_set(f"{Q0}.lora_A.weight", torch.zeros(2, 64)), "has rank 2 but the config"),
    "three_dims": (_set(f"{Q0}.lora_A.weight", torch.zeros(4, 64, 1)), r"shape \[4, 64, 1\]"),
    "nan": (_poison(f"{Q0}.lora_A.weight", float("nan")), "NaN or Inf"),
    "inf": (_poison(f"{Q0}.lora_B.weight", float("inf")), "NaN or Inf"),
    "int_tensor": (_set(f"{Q0}.lora_A.weight", torch.zeros(4, 64, dtype=torch.int64)), "I64.*floating point"),
    "no_weights_for_target": (
        _drop(f"{Q0}.lora_A.weight", f"{Q0}.lora_B.weight"),
        "targets model.layers.0.self_attn.q_proj but adapter_model.safetensors has no weights",
    ),
    "missing_b": (_drop(f"{Q0}.lora_B.weight"), "q_proj has no lora_B weight"),
    "untargeted_module": (
        _set(f"{K0}.lora_A.weight", torch.zeros(4, 64)),
        "k_proj, which the adapter config does not",
    ),
    "module_not_in_base": (
        _set("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", torch.zeros(4, 64)),
        "layers.7.self_attn.q_proj, which does not exist in the LlamaForCausalLM base",
    ),
    "embedding_module": (
        _set("base_model.model.model.embed_tokens.lora_A.weight", torch.zeros(4, 97)),
        "embed_tokens: LoRA on this module is not supported yet",
    ),
    "lora_embedding": (
        _set("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 97)),
        "embedding LoRA weights are not supported",
    ),
    "dora_magnitude": (
        _set(f"{Q0}.lora_magnitude_vector", torch.ones(64)),
        "lora_magnitude_vector.*DoRA",
    ),
    "modules_to_save": (
        _set("base_model.model.lm_head.modules_to_save.default.weight", torch.zeros(97, 64)),
        "modules_to_save weights",
    ),
    "lora_b_bias": (_set(f"{Q0}.lora_B.bias", torch.zeros(64)), "no bias"),
    "stray_key": (_set("something.else", torch.zeros(1)), "unexpected tensor key 'something.else'"),
    "unprefixed_key": (
        _rename_one(f"{Q0}.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_A.weight"),
        "unexpected tensor key 'model.layers.0",
    ),
    "two_adapter_names": (
        _rename_one(f"{Q0}.lora_A.weight", f"{Q0}.lora_A.other.weight"),
        "name several adapters",
    ),
}


@pytest.mark.parametrize("case", list(TENSOR_REFUSALS))
def test_refuses_tensors(case: str, adapter: Path, llama_config: ModelConfig) -> None:
    edit, match = TENSOR_REFUSALS[case]
    edit_tensors(adapter, edit)
    with pytest.raises(ValueError, match=match):
        import_peft_adapter(adapter, llama_config, MAX_RANK)


def test_refuses_oversized_weights_file_before_parsing(adapter: Path, llama_config: ModelConfig) -> None:
    with open(adapter / WEIGHTS_FILE, "ab") as f:
        f.write(bytes(4 << 20))
    with pytest.raises(ValueError, match="more than the .* bytes the configured modules and ranks can need"):
        import_peft_adapter(adapter, llama_config, MAX_RANK)


def test_refuses_a_file_that_is_not_safetensors(adapter: Path, llama_config: ModelConfig) -> None:
    (adapter / WEIGHTS_FILE).write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        import_peft_adapter(adapter, llama_config, MAX_RANK)


# --- revisions -----------------------------------------------------------------------------------


def test_revision_is_content_identity(
    saved_adapter: Path, llama: transformers.PreTrainedModel, llama_config: ModelConfig, tmp_path: Path
) -> None:
    revision = adapter_revision(import_peft_adapter(saved_adapter, llama_config, MAX_RANK))
    assert len(revision) == 64 and int(revision, 16) >= 0

    copied = shutil.copytree(saved_adapter, tmp_path / "copied")
    assert adapter_revision(import_peft_adapter(copied, llama_config, MAX_RANK)) == revision

    # The same training state saved again elsewhere (PEFT writes the same content).
    again = make_peft_adapter(llama, tmp_path / "again", r=4, target_modules=["q_proj", "v_proj"], seed=1)
    assert adapter_revision(import_peft_adapter(again, llama_config, MAX_RANK)) == revision


def test_revision_changes_with_weights_and_scale(
    saved_adapter: Path, llama_config: ModelConfig, tmp_path: Path
) -> None:
    revision = adapter_revision(import_peft_adapter(saved_adapter, llama_config, MAX_RANK))

    nudged = Path(shutil.copytree(saved_adapter, tmp_path / "nudged"))
    key = f"{Q0}.lora_B.weight"
    edit_tensors(nudged, lambda t: t.__setitem__(key, t[key] + torch.eye(64, 4) * 1e-3))
    assert adapter_revision(import_peft_adapter(nudged, llama_config, MAX_RANK)) != revision

    rescaled = Path(shutil.copytree(saved_adapter, tmp_path / "rescaled"))
    edit_config(rescaled, lora_alpha=16)
    assert adapter_revision(import_peft_adapter(rescaled, llama_config, MAX_RANK)) != revision


def test_revision_refuses_a_manifest_that_does_not_describe_the_weights(
    saved_adapter: Path, llama_config: ModelConfig
) -> None:
    imported = import_peft_adapter(saved_adapter, llama_config, MAX_RANK)
    forged = ImportedAdapter(
        imported.weights, {**imported.manifest, "modules": imported.manifest["modules"][1:]}
    )
    with pytest.raises(ValueError, match="does not describe its weights"):
        adapter_revision(forged)

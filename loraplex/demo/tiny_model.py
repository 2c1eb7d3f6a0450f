"""Build a tiny random Llama with the character tokenizer: a model the engine can load anywhere."""

from __future__ import annotations

from pathlib import Path

import torch

from loraplex.demo.char_tokenizer import VOCAB_SIZE, save_char_tokenizer


def build_tiny_model(path: str | Path, seed: int = 0, num_layers: int = 2, hidden: int = 64) -> Path:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(path))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_char_tokenizer(path)
    return path

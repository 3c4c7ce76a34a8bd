"""``system_fingerprint``: one value for one set of token-producing inputs, another when any of
them changes (:mod:`worker.contract.fingerprint`); the router's envelope carries the serving
worker's, and the OpenAPI document types it as OpenAI's does (a string)."""

from __future__ import annotations

import re

from openai.types.chat import ChatCompletion

from launcher.config import DeployConfig
from router.openapi import build_openapi
from router.shaping import Shaper
from worker.contract.fingerprint import SAMPLED_BYTES, system_fingerprint
from worker.contract.protocol import KernelChoice, KernelPick
from worker.contract.settings import ModelConfig

TABLE = [KernelChoice(576, 576, "Q4_1/g32", 30, [KernelPick(1, "gemv_q4", 0.02), KernelPick(64, "dequant_mm", 0.5)])]


def model_folder(tmp_path, weights: bytes):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(weights)
    return tmp_path


def test_the_same_inputs_give_the_same_fingerprint_and_each_input_changes_it(tmp_path):
    weights = bytes(range(256)) * (3 * SAMPLED_BYTES // 256)
    folder = model_folder(tmp_path, weights)
    model = ModelConfig(quantization="auto")

    def fp(**change):
        args = {"model": model, "dtype": "torch.float32", "device_kind": "cpu", "world": 1, "kernels": TABLE}
        return system_fingerprint(folder, **{**args, **change})

    first = fp()
    assert re.fullmatch(r"fp_[0-9a-f]{12}", first) and fp() == first
    # the measured times are not choices: a replica that timed its kernels differently agrees
    timed = [KernelChoice(576, 576, "Q4_1/g32", 30, [KernelPick(1, "gemv_q4", 9.0), KernelPick(64, "dequant_mm", 1)])]
    assert fp(kernels=timed) == first
    other_pick = [KernelChoice(576, 576, "Q4_1/g32", 30, [KernelPick(1, "gemv_q4"), KernelPick(64, "gemv_q4")])]
    changed = [
        fp(dtype="torch.bfloat16"),
        fp(model=ModelConfig(quantization="int8")),
        fp(device_kind="cuda"),
        fp(world=2),
        fp(kernels=other_pick),
    ]
    (folder / "model.safetensors").write_bytes(b"\xff" + weights[1:])  # a new head (the tensors' header)
    changed.append(fp())
    (folder / "model.safetensors").write_bytes(weights[:-1] + b"\x00")  # new trailing tensors
    changed.append(fp())
    (folder / "model.safetensors").write_bytes(weights + b"\x00")  # another size
    changed.append(fp())
    assert len({first, *changed}) == len(changed) + 1, " ".join([first, *changed])


def test_the_envelope_carries_the_serving_workers_fingerprint():
    shaper = Shaper("abc", "m", chat=True, fingerprint="fp_aaaaaaaaaaaa")
    assert shaper.chunk([])["system_fingerprint"] == "fp_aaaaaaaaaaaa"
    shaper.served_by("fp_bbbbbbbbbbbb")
    shaper.served_by("")  # a worker that reported none leaves the value as it was
    body = shaper.whole([], {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1})
    assert ChatCompletion.model_validate(body).system_fingerprint == "fp_bbbbbbbbbbbb"


def test_openapi_types_system_fingerprint_as_a_string_like_openai():
    doc = build_openapi(DeployConfig(model={"max_model_len": 2048}).router_settings())
    for path, name in (
        ("/v1/chat/completions", "CreateChatCompletionResponse"),
        ("/v1/completions", "CreateCompletionResponse"),
    ):
        answer = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert answer == {"$ref": f"#/components/schemas/{name}"}
        schema = doc["components"]["schemas"][name]
        assert schema["properties"]["system_fingerprint"]["type"] == "string"
        assert "system_fingerprint" in schema["required"]
    assert ChatCompletion.model_fields["system_fingerprint"].annotation == str | None  # the SDK's own type

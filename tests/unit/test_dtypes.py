"""``model.dtype: auto`` on forced GPU capabilities and CPU flags (worker.contract.dtypes)."""

from __future__ import annotations

import pytest

from worker.contract.dtypes import auto_dtype, cpu_auto_dtype, cpu_flags, describe, resolve, warning

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16
processor\t: 1
"""


@pytest.mark.parametrize(
    "capability, dtype",
    [
        ((7, 0), "float16"),
        ((7, 5), "float16"),
        ((8, 0), "bfloat16"),
        ((8, 6), "bfloat16"),
        ((9, 0), "bfloat16"),
        ((10, 0), "bfloat16"),
        ((12, 0), "bfloat16"),
    ],
)
def test_gpu_auto_is_bfloat16_from_ampere(capability, dtype):
    assert auto_dtype(capability) == dtype


def test_cpu_auto_is_bfloat16_only_with_native_bf16():
    assert cpu_auto_dtype({"avx2", "avx512f"}) == "float32"
    assert cpu_auto_dtype({"avx512_bf16"}) == "bfloat16"
    assert cpu_auto_dtype({"amx_bf16"}) == "bfloat16"
    assert cpu_auto_dtype(set()) == "float32"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    assert {"avx512_bf16", "amx_bf16"} <= cpu_flags(CPUINFO)
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    assert cpu_flags(tmp_path / "cpuinfo") == cpu_flags(CPUINFO)
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert isinstance(cpu_flags(), frozenset)  # this machine's, whatever they are


def test_resolve_takes_the_weakest_gpu_and_honours_explicit_settings():
    assert resolve("auto", "cuda", [(9, 0), (7, 5)]) == "float16"
    assert resolve("auto", "cuda", []) == "bfloat16"
    assert resolve("auto", "cpu", flags={"avx2"}) == "float32"
    assert resolve("float32", "cuda", [(9, 0)]) == "float32"
    with pytest.raises(ValueError):
        resolve("int8", "cpu")


def test_describe_says_why_and_warns_on_a_poor_explicit_choice():
    assert describe("auto", "cuda", [(7, 5)]) == "auto → float16 (GPU compute capability 7.5 < 8.0)"
    assert describe("auto", "cpu", flags={"avx512_bf16"}) == "auto → bfloat16 (CPU has avx512_bf16)"
    line = describe("bfloat16", "cuda", [(7, 0)])
    assert line.startswith("bfloat16 (set in model.dtype)") and "no bf16 tensor cores" in line
    assert warning("bfloat16", "cpu", flags={"avx2"}) and not warning("float16", "cuda", [(7, 5)])


def test_float16_on_a_cpu_without_amx_fp16_is_warned():
    from worker.contract.dtypes import warning

    assert "emulated" in warning("float16", "cpu", flags={"avx512_bf16", "amx_bf16"})
    assert warning("float16", "cpu", flags={"amx_fp16"}) == ""
    assert warning("float32", "cpu", flags=set()) == ""

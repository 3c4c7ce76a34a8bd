"""Placeholder until the GPU-hardening change lands: float32 on CPU, bfloat16 on GPU."""


def auto_dtype_for(kind: str) -> str:
    return "float32" if kind == "cpu" else "bfloat16"
